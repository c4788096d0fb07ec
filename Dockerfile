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
ARG SGLANG_VERSION=0.5.23
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
    HSDUMP_PORT=30000 \
    HSDUMP_PROBE_HOST=127.0.0.1 \
    HSDUMP_NODE_RANK=0
# Node 0: /ready (not /health, which runs a real generation in SGLang 0.5.23) on
# $HSDUMP_PROBE_HOST; worker nodes (HSDUMP_NODE_RANK >= 1): the SGLang process runs.
# A Kimi-K2.5 load (600 GB) plus first-start autotuning takes up to an hour: failed probes in
# that window do not count, a passing one marks the container healthy at once.
HEALTHCHECK --start-period=3600s --interval=30s --timeout=10s --retries=3 \
    CMD ["python3", "-m", "hsdump_patch.ops.healthcheck"]
ENTRYPOINT ["hsdump", "serve"]

# Labels last, so a new build date or revision does not invalidate the layers above. All the
# org.opencontainers.image labels are this project's: the ones the base image sets (source,
# url, ref.name, ...) are overwritten, and the base is named by base.name and base.digest.
ARG BASE_IMAGE
ARG BASE_DIGEST=unknown
ARG HSDUMP_VERSION=0.0.0
ARG HSDUMP_SOURCE=unknown
ARG VCS_REF=unknown
ARG CREATED=unknown
LABEL org.opencontainers.image.title="hsdump-sglang" \
      org.opencontainers.image.description="SGLang with the hsdump hidden-state capture patch" \
      org.opencontainers.image.version="${HSDUMP_VERSION}" \
      org.opencontainers.image.ref.name="${HSDUMP_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.source="${HSDUMP_SOURCE}" \
      org.opencontainers.image.url="${HSDUMP_SOURCE}" \
      org.opencontainers.image.vendor="hsdump" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      org.opencontainers.image.base.digest="${BASE_DIGEST}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      hsdump.sglang.version="${SGLANG_VERSION}"
