# hsdump on top of an official SGLang image: the capture patch (a sglang.srt.plugins plugin), a
# build-time self-check that fails the build when the base image's SGLang drifted, and an
# entrypoint configured for extraction. Build with `make image`; see docs/image.md.
#
# The base image is a build argument so a pinned digest, a mirror in a private registry or
# (in the tests) a local CPU stand-in can be used:
#   make image BASE_IMAGE=lmsysorg/sglang@sha256:<digest>
# The SGLang images are CUDA 13 only from 0.5.20 on: the host driver must support CUDA 13.
ARG BASE_IMAGE=lmsysorg/sglang:v0.5.23-cu130

# Stage 1: the hsdump wheel, built by the base image's own Python and setuptools, offline.
FROM ${BASE_IMAGE} AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY hsdump_patch ./hsdump_patch
RUN python3 -m pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /dist .

# Stage 2: the base image plus the wheel, installed without dependencies so that SGLang's
# pinned torch, transformers, ... stay exactly as the base image ships them.
FROM ${BASE_IMAGE}
ARG BASE_IMAGE
ARG HSDUMP_VERSION=0.0.0
ARG SGLANG_VERSION=0.5.23
ARG VCS_REF=unknown
LABEL org.opencontainers.image.title="hsdump-sglang" \
      org.opencontainers.image.description="SGLang with the hsdump hidden-state capture patch" \
      org.opencontainers.image.version="${HSDUMP_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      hsdump.sglang.version="${SGLANG_VERSION}"
COPY --from=wheel /dist /tmp/hsdump-dist
# PIP_BREAK_SYSTEM_PACKAGES: SGLang lives in the system Python of these images.
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-deps --no-index --no-cache-dir \
        --root-user-action=ignore \
        /tmp/hsdump-dist/hsdump-*.whl \
    && rm -rf /tmp/hsdump-dist
# The self-check: a supported SGLang (the one the label names), the plugin entry point, and
# every capture point in the model code. A drifted base image fails here, not on the GPU host.
# Importing SGLang writes caches (e.g. FlashInfer's JIT log) under $HOME: keep them out.
RUN HOME=/tmp/hsdump-doctor PYTHONDONTWRITEBYTECODE=1 \
        hsdump doctor --expect-sglang "${SGLANG_VERSION}" \
    && rm -rf /tmp/hsdump-doctor

ENV SGLANG_HS_DUMP_DIR=/dev/shm/sglang_hs \
    HSDUMP_PORT=30000
# /ready, not /health: in SGLang 0.5.23 /health runs a real generation on every probe.
HEALTHCHECK --start-period=600s --interval=30s --timeout=10s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('HSDUMP_PORT', '30000') + '/ready', timeout=5)"]
ENTRYPOINT ["hsdump", "serve"]
