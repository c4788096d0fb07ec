# `make smoke`: the main job. Without SERVER it needs nothing but this repo: it sets up .venv,
# writes a tiny random Llama, starts a local CPU SGLang server with the capture patch, runs
# `hsdump smoke` against it and stops the server. SERVER=URL (and DUMP_DIR=the server's
# SGLANG_HS_DUMP_DIR, as seen from this machine) checks a running server instead.
SMOKE_DIR ?= .cache/smoke
SERVER ?=
DUMP_DIR ?=

smoke: $(STAMP) ## Main job: extract + validate on a local CPU server (SERVER=URL DUMP_DIR=DIR: a running one)
ifeq ($(strip $(SERVER)),)
	$(PY) scripts/smoke_local.py --work $(SMOKE_DIR)
else
	$(PY) -m hsdump_patch.cli smoke --server $(SERVER) $(if $(strip $(DUMP_DIR)),--dump-dir $(DUMP_DIR)) \
	  --report $(SMOKE_DIR)/report.json --no-progress
endif

.PHONY: smoke
