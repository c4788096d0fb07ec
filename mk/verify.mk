# `make verify`: the acceptance run, `hsdump verify` (docs/operations.md, "GPU acceptance run").
# With a GPU (nvidia-smi lists one) it runs in the image, on every visible GPU; without one it
# runs the CPU variant (TP 1 and 2) from .venv, with the CPU stand-ins of tests/harness/cpu_shim on
# the servers' path (never on a GPU machine: they hide the real sgl_kernel).
VERIFY_DIR ?= .cache/verify
VERIFY_ARGS ?=
VERIFY_GPU := $(shell nvidia-smi -L 2>/dev/null | grep -c '^GPU')
VERIFY_CPU_ENV := SGLANG_USE_CPU_ENGINE=1 PYTHONPATH=$(abspath tests/harness/cpu_shim) \
  SGLANG_CPU_OMP_THREADS_BIND='0|1' SGLANG_NCCL_SO_PATH=/nonexistent/libnccl.so.2

ifeq ($(VERIFY_GPU),0)
verify: $(STAMP) ## Acceptance run (hsdump verify): CPU variant here, the image on a GPU host
	@mkdir -p $(VERIFY_DIR)
	$(VERIFY_CPU_ENV) $(PY) -m hsdump_patch.cli verify --work $(abspath $(VERIFY_DIR)) $(VERIFY_ARGS)
else
verify:
	@mkdir -p $(VERIFY_DIR)
	$(ENGINE) run --rm --gpus all --ipc=host --ulimit memlock=-1 --ulimit stack=67108864 \
	  -v $(abspath $(VERIFY_DIR)):/verify --entrypoint hsdump $(IMAGE_TAG) \
	  verify --work /verify $(VERIFY_ARGS)
endif

.PHONY: verify
