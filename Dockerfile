# syntax=docker/dockerfile:1
# Image for every triggerflow process: the entry point is the `triggerflow` CLI and
# compose.yaml picks the subcommand (writer, consume --queue ..., db upgrade, ...).

FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/triggerflow
COPY . /src
RUN /opt/triggerflow/bin/pip install /src

FROM python:3.11-slim
ENV PATH=/opt/triggerflow/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/triggerflow /opt/triggerflow
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin triggerflow
USER triggerflow
WORKDIR /tmp
ENTRYPOINT ["triggerflow"]
CMD ["--help"]
