# Container image targets (included by the Makefile); see docs/image.md.
ENGINE ?= docker
BASE_IMAGE ?= lmsysorg/sglang:v0.5.23-cu130
SGLANG_VERSION ?= 0.5.23
HSDUMP_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= hsdump-sglang:$(HSDUMP_VERSION)
VCS_REF ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
IMAGE_TARBALL ?= dist/hsdump-sglang-$(HSDUMP_VERSION).tar.gz
# podman's default OCI format drops HEALTHCHECK: build Docker-format images there.
ENGINE_BUILD_FLAGS := $(if $(findstring podman,$(ENGINE)),--format docker)
GZIP := $(shell command -v pigz 2>/dev/null || echo gzip)

image: ## Build hsdump-sglang:<version> (ENGINE=podman, BASE_IMAGE=lmsysorg/sglang@sha256:...)
	$(ENGINE) build $(ENGINE_BUILD_FLAGS) -t $(IMAGE_TAG) \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg SGLANG_VERSION=$(SGLANG_VERSION) \
	  --build-arg HSDUMP_VERSION=$(HSDUMP_VERSION) \
	  --build-arg VCS_REF=$(VCS_REF) .

image-save: image ## Write dist/hsdump-sglang-<version>.tar.gz for air-gapped hosts
	@mkdir -p $(dir $(IMAGE_TARBALL))
	$(ENGINE) save $(IMAGE_TAG) | $(GZIP) -1 > $(IMAGE_TARBALL).tmp
	mv $(IMAGE_TARBALL).tmp $(IMAGE_TARBALL)
	@ls -lh $(IMAGE_TARBALL)

.PHONY: image image-save
