# syntax=docker/dockerfile:1
# soakd container image: `docker build -t soakd:0.1.0 .` (from the repository root).
#
# Two stages: the build stage installs soakd and its dependencies into a virtualenv at
# /opt/soakd; the runtime stage copies only that virtualenv onto a slim Python, so no compiler,
# pip cache or source tree ships. It runs as the unprivileged user soakd (10001:10001), keeps
# its state (SQLite store, reports) in the volume /var/lib/soakd, and works with a read-only
# root filesystem (docker run --read-only --tmpfs /tmp; Kubernetes readOnlyRootFilesystem).
#
#   docker run --rm -p 9400:9400 -v soakd-state:/var/lib/soakd soakd:0.1.0 \
#       run --target http://vllm:8000/v1 --api-key-env OPENAI_API_KEY
#   docker run --rm -p 8000:8000 soakd:0.1.0 sim --host 0.0.0.0 --port 8000
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
WORKDIR /src
RUN python -m venv /opt/soakd
# Metadata first, then the package: pyproject.toml names README.md as the long description.
COPY pyproject.toml README.md ./
COPY soakd ./soakd
RUN /opt/soakd/bin/pip install --no-cache-dir . \
    && /opt/soakd/bin/soakd --version

FROM ${PYTHON_IMAGE}
ARG SOAKD_UID=10001
LABEL org.opencontainers.image.title="soakd" \
      org.opencontainers.image.description="Soak-test daemon for OpenAI-compatible LLM inference servers" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN groupadd --system --gid "${SOAKD_UID}" soakd \
    && useradd --system --uid "${SOAKD_UID}" --gid soakd --no-create-home \
       --home-dir /var/lib/soakd --shell /usr/sbin/nologin soakd \
    && mkdir -p /var/lib/soakd \
    && chown soakd:soakd /var/lib/soakd \
    && chmod 0750 /var/lib/soakd
COPY --from=build /opt/soakd /opt/soakd
# SOAKD_RUN__STATE_DIR: `soakd run` and `soakd report` use the volume unless told otherwise
# (--state-dir wins over it; a YAML file's run.state_dir does not: environment > file).
ENV PATH=/opt/soakd/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    SOAKD_RUN__STATE_DIR=/var/lib/soakd
USER ${SOAKD_UID}:${SOAKD_UID}
WORKDIR /var/lib/soakd
VOLUME ["/var/lib/soakd"]
# /metrics, /healthz, /readyz, /status
EXPOSE 9400
# Liveness of `soakd run` (no curl in a slim image: the standard library's urllib). It follows
# SOAKD_METRICS__PORT; a container running `soakd sim` needs its own check (compose overrides it).
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, sys, urllib.request; port = os.environ.get('SOAKD_METRICS__PORT', '9400'); sys.exit(0 if urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4).status == 200 else 1)"]
ENTRYPOINT ["soakd"]
CMD ["run"]
