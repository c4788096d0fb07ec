# `make smoke`: the main job. Without SERVER it needs nothing but this repo: it sets up .venv,
# writes hsdump verify's tiny random DeepSeek-V3 (or serves SMOKE_MODEL=DIR), starts a local CPU
# SGLang server with the capture patch (scripts/smoke_local.py), runs `hsdump smoke` against it
# and stops the server. SERVER=URL (and DUMP_DIR=the server's SGLANG_HS_DUMP_DIR, as seen from
# this machine) checks a running server instead.
SMOKE_DIR ?= .cache/smoke
SERVER ?=
DUMP_DIR ?=
SMOKE_MODEL ?=

smoke: $(STAMP) ## Main job: extract + validate on a local CPU server (SERVER=URL DUMP_DIR=DIR: a running one)
ifeq ($(strip $(SERVER)),)
	$(PY) scripts/smoke_local.py --work $(SMOKE_DIR) $(if $(strip $(SMOKE_MODEL)),--model $(SMOKE_MODEL))
else
	$(PY) -m hsdump_patch.cli smoke --server $(SERVER) $(if $(strip $(DUMP_DIR)),--dump-dir $(DUMP_DIR)) \
	  --report $(SMOKE_DIR)/report.json --no-progress
endif

.PHONY: smoke
