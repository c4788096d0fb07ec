# Container image targets (included by the Makefile); see docs/image.md.
ENGINE ?= docker
BASE_IMAGE ?= lmsysorg/sglang:v0.5.23-cu130
SGLANG_VERSION ?= 0.5.23
HSDUMP_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
IMAGE_TAG ?= hsdump-sglang:$(HSDUMP_VERSION)
VCS_REF ?= $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
HSDUMP_SOURCE ?= $(or $(shell git config --get remote.origin.url 2>/dev/null),unknown)
# The base's registry digest when it was pulled (else its local image id), and the build time.
BASE_DIGEST ?= $(or $(shell $(ENGINE) image inspect --format '{{range .RepoDigests}}{{.}} {{end}}' $(BASE_IMAGE) 2>/dev/null | sed -n 's/^[^@]*@\(sha256:[0-9a-f]*\).*/\1/p'),$(shell $(ENGINE) image inspect --format '{{.Id}}' $(BASE_IMAGE) 2>/dev/null),unknown)
CREATED ?= $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
IMAGE_TARBALL ?= dist/hsdump-sglang-$(HSDUMP_VERSION).tar.gz
# podman's default OCI format drops HEALTHCHECK: build Docker-format images there.
ENGINE_BUILD_FLAGS := $(if $(findstring podman,$(ENGINE)),--format docker)
GZIP := $(shell command -v pigz 2>/dev/null || echo gzip)

image: ## Build hsdump-sglang:<version> (ENGINE=podman, BASE_IMAGE=lmsysorg/sglang@sha256:...)
	$(ENGINE) build $(ENGINE_BUILD_FLAGS) -t $(IMAGE_TAG) \
	  --build-arg BASE_IMAGE=$(BASE_IMAGE) \
	  --build-arg SGLANG_VERSION=$(SGLANG_VERSION) \
	  --build-arg HSDUMP_VERSION=$(HSDUMP_VERSION) \
	  --build-arg VCS_REF=$(VCS_REF) \
	  --build-arg HSDUMP_SOURCE=$(HSDUMP_SOURCE) \
	  --build-arg BASE_DIGEST=$(BASE_DIGEST) \
	  --build-arg CREATED=$(CREATED) .

image-save: image ## Write dist/hsdump-sglang-<version>.tar.gz for air-gapped hosts
	@mkdir -p $(dir $(IMAGE_TARBALL))
	$(ENGINE) save $(IMAGE_TAG) | $(GZIP) -1 > $(IMAGE_TARBALL).tmp
	mv $(IMAGE_TARBALL).tmp $(IMAGE_TARBALL)
	@ls -lh $(IMAGE_TARBALL)

.PHONY: image image-save
