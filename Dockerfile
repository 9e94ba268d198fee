# syntax=docker/dockerfile:1
# One image for every service of the control plane (docs/architecture.md, Services). The process is chosen per
# container: docker-compose.yml `command:` / Kubernetes `command:` name a console script
# (collect-now-api, dispatch-hub, dispatch-coordinator, outbox-pump, ingest-shard-workers,
# projection-worker, reconciler, monitorctl, desktop-sim). No HEALTHCHECK here: liveness and
# readiness are the orchestrator's job (/healthz, /readyz on each service's port).
ARG PYTHON_IMAGE=python:3.11-slim

# ---- build: a virtualenv with the pinned dependencies and the project --------------------------
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# Dependencies first (their own layer, reused while only the code changes).
COPY pyproject.toml constraints.txt ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt
COPY libs ./libs
COPY services ./services
COPY tools ./tools
RUN pip install -c constraints.txt . \
    && python -m compileall -q /opt/venv/lib

# ---- runtime: the virtualenv, the migrations, an unprivileged user -----------------------------
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="monitoring-dispatch" \
      org.opencontainers.image.description="Dispatch control plane for AI brand monitoring"
RUN groupadd --system --gid 10001 app \
    && useradd --system --uid 10001 --gid app --home-dir /app --no-create-home --shell /usr/sbin/nologin app
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
COPY migrations ./migrations
# The package is installed (not editable), so point `monitorctl migrate` at the SQL files.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MIGRATIONS_DIR=/app/migrations
# Numeric so Kubernetes `runAsNonRoot` can verify it.
USER 10001:10001
EXPOSE 8081 8082 9101 9102 9103 9104 9105
STOPSIGNAL SIGTERM
CMD ["monitorctl", "--help"]
