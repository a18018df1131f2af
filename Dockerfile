# syntax=docker/dockerfile:1
# Image for every triggerflow process: the entry point is the `triggerflow` CLI and
# compose.yaml / the Helm chart pick the subcommand (writer, consume --queue ..., db upgrade).
#
#   docker build -t triggerflow:local .                                       # native mode
#   docker build --build-arg EXTRAS=airflow -t triggerflow:local-airflow .    # Airflow mode
#
# EXTRAS names pyproject.toml extras (comma-separated); `airflow` adds apache-airflow and the
# standard provider, which `consume --airflow` imports trigger classes from.

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/triggerflow
ARG EXTRAS=""
COPY . /src
RUN /opt/triggerflow/bin/pip install "/src${EXTRAS:+[$EXTRAS]}"

FROM python:3.11-slim
ENV PATH=/opt/triggerflow/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/triggerflow /opt/triggerflow
# The uid the Helm chart's runAsUser names; the root filesystem may be read-only (only /tmp
# is written, and no .pyc).
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin triggerflow
USER triggerflow
WORKDIR /tmp
ENTRYPOINT ["triggerflow"]
CMD ["--help"]
