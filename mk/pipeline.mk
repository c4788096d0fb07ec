# `make regenerate-extract SERVER=URL DATASET=IN.jsonl OUT=DIR`: the served model writes the
# answers of the dataset (hsdump regenerate -> OUT/regenerated.jsonl), then the same server
# extracts their hidden states (hsdump extract -> OUT). Regeneration rids lack the dump prefix,
# so they dump nothing. Rerunning resumes both steps. DUMP_DIR as in `make smoke`.
DATASET ?=
OUT ?=
REGENERATE_ARGS ?=
EXTRACT_ARGS ?=

regenerate-extract: $(STAMP) ## Regenerate DATASET's answers, then extract them to OUT (SERVER=URL DATASET=F OUT=DIR)
	@test -n "$(SERVER)" -a -n "$(DATASET)" -a -n "$(OUT)" || { echo "usage: make regenerate-extract \
	  SERVER=URL DATASET=IN.jsonl OUT=DIR [DUMP_DIR=DIR] [REGENERATE_ARGS=...] [EXTRACT_ARGS=...]" >&2; exit 2; }
	@# exit 3 = finished with skipped or failed rows (listed in the report): extract the rest
	$(PY) -m hsdump_patch.cli regenerate --server $(SERVER) --dataset $(DATASET) \
	  --out $(OUT)/regenerated.jsonl --no-progress $(REGENERATE_ARGS) || test $$? -eq 3
	$(PY) -m hsdump_patch.cli extract --server $(SERVER) $(if $(strip $(DUMP_DIR)),--dump-dir $(DUMP_DIR)) \
	  --dataset $(OUT)/regenerated.jsonl --out $(OUT) --no-progress $(EXTRACT_ARGS)

.PHONY: regenerate-extract
