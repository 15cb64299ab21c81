# mha-serve container image. One file, two variants, chosen by the VARIANT build argument:
#
#   docker build -t mha-serve:cpu .                            # VARIANT=cpu (default)
#   docker build --build-arg VARIANT=cuda -t mha-serve:cuda .  # CUDA
#
#   cpu:  python:3.11-slim-bookworm + torch's CPU wheel, which lives on PyTorch's own index
#         (https://download.pytorch.org/whl/cpu): PyPI's x86_64 Linux wheel is the CUDA build,
#         several GB of CUDA libraries a CPU image does not need.
#   cuda: nvidia/cuda "base" (the CUDA compat package and the NVIDIA_* variables the container
#         toolkit reads, no CUDA libraries) + torch from PyPI, whose wheel brings its own CUDA
#         runtime, cuDNN and NCCL as nvidia-* wheels. The host needs an NVIDIA driver new
#         enough for that CUDA release and the NVIDIA container toolkit
#         (`docker run --gpus device=0 ...`). Override CUDA_BASE to match your driver.
#
# No `# syntax=` line: it would make BuildKit pull a frontend image from a registry; the
# frontend built into Docker (BuildKit or the legacy builder) reads this file as it is.
#
# Where no registry or PyTorch index can be reached (tests/deploy does this; deploy/ci/docker.sh
# makes the base image): a local Debian image with python3 stands in for python:3.11-slim, and
# torch's CPU wheel comes from a local find-links URL, PyPI giving its dependencies:
#   docker build --network host --build-arg PYTHON_IMAGE=mha-serve-ci/python:3.11-bookworm \
#       --build-arg TORCH_INDEX_URL=https://pypi.org/simple \
#       --build-arg TORCH_FIND_LINKS=http://127.0.0.1:8765/ -t mha-serve:cpu .
#
# Run (the built-in demo model when no model is mounted):
#   docker run --rm -p 8000:8000 mha-serve:cpu
#   docker run --rm -p 8000:8000 -v "$PWD/models:/models:ro" -e MHA_MODEL_DIR=/models/attn \
#       mha-serve:cpu
#
# One container = one replica = one device (one engine thread, one copy of the weights).
# Scale with more containers behind a load balancer (docker-compose.yml, deploy/k8s/).

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_BASE=nvidia/cuda:12.8.1-base-ubuntu24.04

# ---- runtime bases: the OS + Python each variant runs on ---------------------------------------
FROM ${PYTHON_IMAGE} AS base-cpu
ENV DEFAULT_TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

FROM ${CUDA_BASE} AS base-cuda
# DL3008 (pin apt versions): Ubuntu replaces python3 on every security update, so a pinned
# version stops resolving within weeks; the base image tag is the pin.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
ENV DEFAULT_TORCH_INDEX_URL=https://pypi.org/simple

# DL3006 (tag the image): this is not an image but one of the two stages above, by name.
# hadolint ignore=DL3006
FROM base-${VARIANT} AS base

# ---- build: a virtualenv with torch and mha-serve, nothing else -------------------------------
FROM base AS build
# A C compiler for the engine's kernels (built at the end of this stage; not in the runtime).
# DL3008 (pin apt versions): the base image tag is the pin, as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
ARG TORCH_VERSION=2.13.0
# Where torch comes from: the variant's index unless TORCH_INDEX_URL says otherwise, plus
# TORCH_FIND_LINKS (a directory of wheels, as a URL) when set: a local `torch-X+cpu` wheel there
# outranks PyPI's CUDA build of the same version.
ARG TORCH_INDEX_URL=""
ARG TORCH_FIND_LINKS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1
# torch first, from the variant's index; `pip install .` then finds it already satisfied.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir \
    --index-url "${TORCH_INDEX_URL:-$DEFAULT_TORCH_INDEX_URL}" \
    ${TORCH_FIND_LINKS:+--find-links "$TORCH_FIND_LINKS"} "torch==${TORCH_VERSION}"
WORKDIR /src
# Optional extras of pyproject.toml, comma-separated: `embeddings` (tokenizers and jinja2, for
# /v1/embeddings on text models) and `tracing` (OpenTelemetry, for --otlp-endpoint) by
# default; add `debug` for PNG attention heatmaps (matplotlib), or pass EXTRAS="" for the
# tensor API alone.
ARG EXTRAS=embeddings,tracing
# The dependencies first, read from pyproject.toml alone: this layer is rebuilt only when they
# change, not on every source edit (the next one is, in seconds).
COPY pyproject.toml ./
RUN /opt/venv/bin/python -c "import sys, tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; extras = [e for e in sys.argv[1].split(',') if e]; print('\n'.join(p['dependencies'] + [d for e in extras for d in p['optional-dependencies'][e]]))" "$EXTRAS" > /tmp/requirements.txt \
    && /opt/venv/bin/pip install --no-cache-dir -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY mha_engine ./mha_engine
COPY service ./service
# Not editable: the package is copied into the venv, and /src stays behind in this stage.
# No build isolation: the build backend (setuptools) is already in the venv, as torch needs it,
# so nothing is downloaded here. `pip check`: the layer above brought every dependency.
RUN /opt/venv/bin/pip install --no-cache-dir --no-deps --no-build-isolation ".${EXTRAS:+[$EXTRAS]}" \
    && /opt/venv/bin/pip check \
    && /opt/venv/bin/python -c "import service, mha_engine"
# The engine's C kernels (int8 row passes, packed CPU attention), prebuilt into the installed
# package for each x86-64 level with the compiler installed above: the runtime image has none,
# and mha_engine/cbuild.py loads the build that matches the CPU it runs on.
COPY tools/build_kernels.py ./tools/
# (-I: the installed package, not the /src copy the working directory would put first)
RUN /opt/venv/bin/python tools/build_kernels.py \
    && /opt/venv/bin/python -I -c "from mha_engine import cpu_varlen, int8_rows; assert cpu_varlen.kernel_status().startswith('prebuilt') and int8_rows.kernel_status().startswith('prebuilt')"

# ---- loadtest: Locust workers/master for `docker compose --profile loadtest up` -----------------
FROM ${PYTHON_IMAGE} AS loadtest
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
RUN pip install --no-cache-dir "locust==2.47.0" "numpy==2.4.6" \
    && useradd --system --uid 10001 --user-group --no-create-home locust
WORKDIR /opt/mha
COPY loadtest ./loadtest
USER 10001:10001
EXPOSE 8089
ENTRYPOINT ["locust", "-f", "loadtest/locustfile.py"]

# ---- runtime: the image `docker build` produces by default (last stage) ------------------------
FROM base AS runtime
# A fixed numeric uid/gid, so Kubernetes' runAsNonRoot can verify it without a passwd lookup.
RUN groupadd --system --gid 10001 mha \
    && useradd --system --uid 10001 --gid mha --home-dir /home/mha --create-home \
       --shell /usr/sbin/nologin mha \
    && mkdir /models && chown mha:mha /models
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    MHA_HOST=0.0.0.0 \
    MHA_PORT=8000 \
    MHA_GRPC_PORT=8001
USER 10001:10001
WORKDIR /home/mha
# Mount a directory of models here and point MHA_MODEL_DIR at one of them; with MHA_MODEL_DIR
# unset the server builds its demo model and /models is not read.
VOLUME ["/models"]
EXPOSE 8000 8001
# Ready = model loaded and warmed up, and not draining. Python is the only HTTP client in the
# image; urlopen raises on the 503 of a loading or draining replica, so the exit code is 1.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MHA_PORT', '8000') + '/v2/health/ready', timeout=4)"]
# Exec form and no shell or init wrapper: mha-serve is PID 1 and gets SIGTERM itself, turns
# readiness off, finishes accepted requests (up to MHA_DRAIN_GRACE_S, default 30 s) and exits.
# Give `docker stop -t` / compose's stop_grace_period / Kubernetes' grace period more than that.
STOPSIGNAL SIGTERM
CMD ["mha-serve"]
