{{/* Names and labels. */}}
{{- define "triggerflow.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "triggerflow.selectorLabels" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- with .team }}
triggerflow/queue: {{ include "triggerflow.queue" . }}
{{- end }}
{{- end -}}

{{- define "triggerflow.labels" -}}
{{ include "triggerflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end -}}

{{/* A team's queue: `queue`, else its name. */}}
{{- define "triggerflow.queue" -}}
{{- .queue | default .name -}}
{{- end -}}

{{- define "triggerflow.consumerName" -}}
{{- printf "%s-consumer-%s" (include "triggerflow.fullname" .root) .team.name -}}
{{- end -}}

{{- define "triggerflow.airflowMode" -}}
{{- if eq .Values.mode "airflow" }}true{{ end -}}
{{- end -}}

{{/* "true" when PodMonitor/PrometheusRule replace scrape annotations. */}}
{{- define "triggerflow.prometheusOperator" -}}
{{- $enabled := .Values.prometheusOperator.enabled -}}
{{- if eq (toString $enabled) "auto" -}}
{{- if .Capabilities.APIVersions.Has "monitoring.coreos.com/v1" }}true{{ end -}}
{{- else if $enabled }}true{{ end -}}
{{- end -}}

{{/* The image of a process: the team's override, else the mode's. */}}
{{- define "triggerflow.image" -}}
{{- $base := ternary .root.Values.airflow.image .root.Values.image (eq .root.Values.mode "airflow") -}}
{{- $image := merge (deepCopy (.override | default dict)) $base -}}
{{- printf "%s:%s" $image.repository (toString $image.tag) -}}
{{- end -}}

{{/* An env var read from a Secret: dict "name" ENV "ref" {name, key, optional}. */}}
{{- define "triggerflow.secretEnv" -}}
- name: {{ .name }}
  valueFrom:
    secretKeyRef:
      name: {{ required (printf "%s: a Secret name is required" .name) .ref.name }}
      key: {{ required (printf "%s: a Secret key is required" .name) .ref.key }}
      {{- if .ref.optional }}
      optional: true
      {{- end }}
{{- end -}}

{{/* What every long-running process needs: its own database and broker URLs, the mode's
     settings, the metrics port. dict "root" $ "database" REF "amqp" REF. */}}
{{- define "triggerflow.processEnv" -}}
{{- $v := .root.Values -}}
{{ include "triggerflow.secretEnv" (dict "name" "TRIGGERFLOW_DATABASE_URL" "ref" .database) }}
{{ include "triggerflow.secretEnv" (dict "name" "TRIGGERFLOW_AMQP_URL" "ref" .amqp) }}
- name: TRIGGERFLOW_METRICS_PORT
  value: {{ $v.metricsPort | quote }}
- name: TRIGGERFLOW_LOG_FORMAT
  value: {{ $v.logFormat | quote }}
{{- if include "triggerflow.airflowMode" .root }}
{{ include "triggerflow.airflowEnv" . }}
{{- if $v.airflow.defaultQueue }}
- name: TRIGGERFLOW_DEFAULT_QUEUE
  value: {{ $v.airflow.defaultQueue | quote }}
{{- end }}
{{- else if $v.kwargsKeySecret.name }}
{{ include "triggerflow.secretEnv" (dict "name" "TRIGGERFLOW_KWARGS_KEY" "ref" $v.kwargsKeySecret) }}
{{- end }}
{{- with $v.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* Airflow's configuration: AIRFLOW_HOME on the writable /tmp, its database = the
     process's own URL, the Fernet key from its Secret. dict "root" $ "database" REF. */}}
{{- define "triggerflow.airflowEnv" -}}
{{- $a := .root.Values.airflow -}}
- name: AIRFLOW_HOME
  value: /tmp/airflow
{{ include "triggerflow.secretEnv" (dict "name" "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN" "ref" .database) }}
{{ include "triggerflow.secretEnv" (dict "name" "AIRFLOW__CORE__FERNET_KEY" "ref" $a.fernetKeySecret) }}
{{- range $name, $value := $a.config }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end -}}

{{/* Pod Security "restricted". */}}
{{- define "triggerflow.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "triggerflow.containerSecurityContext" -}}
runAsNonRoot: true
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop: [ALL]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* What every pod spec shares: service account, security, scheduling, the writable /tmp. */}}
{{- define "triggerflow.podCommon" -}}
{{- $v := .root.Values -}}
serviceAccountName: {{ .serviceAccount | default (include "triggerflow.fullname" .root) }}
automountServiceAccountToken: false
securityContext:
  {{- include "triggerflow.podSecurityContext" . | nindent 2 }}
{{- with $v.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with $v.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
volumes:
  - name: tmp
    emptyDir: {sizeLimit: 256Mi}
{{- end -}}

{{/* The pod template of a long-running process (writer, a team's consumers).
     dict "root" $ "component" C "team" T-or-nil "args" LIST "env" YAML "image" IMAGE
     "resources" R "envFrom" bool. */}}
{{- define "triggerflow.podTemplate" -}}
{{- $v := .root.Values -}}
{{- $selector := include "triggerflow.selectorLabels" . -}}
metadata:
  labels:
    {{- include "triggerflow.labels" . | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $v.podAnnotations (not (include "triggerflow.prometheusOperator" .root)) }}
  annotations:
    {{- if not (include "triggerflow.prometheusOperator" .root) }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $v.metricsPort | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
spec:
  {{- include "triggerflow.podCommon" . | nindent 2 }}
  # SIGTERM: a consumer hands its triggers to its peers at once; a writer applies what it
  # has received (10 s at most). Killed earlier, a consumer counts as crashed.
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  affinity:
    podAntiAffinity:
      {{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (fromYaml $selector)) }}
      {{- if eq $v.podAntiAffinity "hard" }}
      requiredDuringSchedulingIgnoredDuringExecution:
        {{- toYaml (list $term) | nindent 8 }}
      {{- else }}
      preferredDuringSchedulingIgnoredDuringExecution:
        {{- toYaml (list (dict "weight" 100 "podAffinityTerm" $term)) | nindent 8 }}
      {{- end }}
  containers:
    - name: {{ .component }}
      image: {{ .image }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      args: {{ toJson .args }}
      env:
        {{- .env | nindent 8 }}
      {{- if and (include "triggerflow.airflowMode" .root) $v.airflow.configSecret }}
      envFrom:
        - secretRef: {name: {{ $v.airflow.configSecret }}}
      {{- end }}
      ports:
        - name: metrics
          containerPort: {{ $v.metricsPort }}
      securityContext:
        {{- include "triggerflow.containerSecurityContext" . | nindent 8 }}
      resources:
        {{- toYaml .resources | nindent 8 }}
      # Served by the process on its metrics port: /livez while the event loop answers,
      # /readyz while its lease, broker subscription and database work.
      startupProbe:
        httpGet: {path: /livez, port: metrics}
        periodSeconds: 2
        failureThreshold: 30
      readinessProbe:
        httpGet: {path: /readyz, port: metrics}
        periodSeconds: 10
        timeoutSeconds: 2
        failureThreshold: 2
      livenessProbe:
        httpGet: {path: /livez, port: metrics}
        periodSeconds: 10
        timeoutSeconds: 2
        failureThreshold: 3
      volumeMounts:
        - {name: tmp, mountPath: /tmp}
{{- end -}}

{{- define "triggerflow.pdb" -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ .name }}
  labels:
    {{- include "triggerflow.labels" . | nindent 4 }}
spec:
  # Drains take one pod of the Deployment at a time.
  maxUnavailable: 1
  selector:
    matchLabels:
      {{- include "triggerflow.selectorLabels" . | nindent 6 }}
{{- end -}}

{{/* Refuse values that would break isolation or scaling before anything is rendered. */}}
{{- define "triggerflow.validate" -}}
{{- $v := .Values -}}
{{- if not (has $v.mode (list "native" "airflow")) }}{{ fail "mode must be native or airflow" }}{{ end -}}
{{- $setupDb := printf "%s/%s" $v.setup.databaseUrlSecret.name $v.setup.databaseUrlSecret.key -}}
{{- $setupAmqp := printf "%s/%s" $v.setup.amqpUrlSecret.name $v.setup.amqpUrlSecret.key -}}
{{- $seen := dict -}}
{{- $dbs := dict (printf "%s/%s" $v.writer.databaseUrlSecret.name $v.writer.databaseUrlSecret.key) "the writer" -}}
{{- $amqps := dict -}}
{{- range $v.teams -}}
{{- if hasKey $seen .name }}{{ fail (printf "teams: %s is listed twice" .name) }}{{ end -}}
{{- $_ := set $seen .name true -}}
{{- if and (hasKey . "replicas") .keda }}{{ fail (printf "teams[%s]: give replicas or keda, not both (KEDA owns the count)" .name) }}{{ end -}}
{{- if and .airflowTeam (ne $v.mode "airflow") }}{{ fail (printf "teams[%s]: airflowTeam names an Airflow team: it needs mode: airflow" .name) }}{{ end -}}
{{- $db := printf "%s/%s" .databaseUrlSecret.name .databaseUrlSecret.key -}}
{{- $amqp := printf "%s/%s" .amqpUrlSecret.name .amqpUrlSecret.key -}}
{{- if eq $db $setupDb }}{{ fail (printf "teams[%s]: databaseUrlSecret is the setup's (the migration owner's URL bypasses row security); give the team its own role" .name) }}{{ end -}}
{{- if eq $amqp $setupAmqp }}{{ fail (printf "teams[%s]: amqpUrlSecret is the setup's admin broker user; give the team its own" .name) }}{{ end -}}
{{- if hasKey $dbs $db }}{{ fail (printf "teams[%s]: databaseUrlSecret %s is already %s's" .name $db (get $dbs $db)) }}{{ end -}}
{{- if hasKey $amqps $amqp }}{{ fail (printf "teams[%s]: amqpUrlSecret %s is already %s's" .name $amqp (get $amqps $amqp)) }}{{ end -}}
{{- $_ := set $dbs $db .name -}}
{{- $_ := set $amqps $amqp .name -}}
{{- end -}}
{{- if eq $setupDb (printf "%s/%s" $v.writer.databaseUrlSecret.name $v.writer.databaseUrlSecret.key) }}{{ fail "writer.databaseUrlSecret is the setup's: give the writer its own role" }}{{ end -}}
{{- end -}}
