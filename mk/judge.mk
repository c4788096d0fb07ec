# `make judge`: drafters trained by SpecForge on hsdump's records, measured against SpecForge's
# own data path and negative controls (judge/, docs/judge.md). JUDGE_ARGS passes flags
# (`make judge JUDGE_ARGS=--help` lists them).
JUDGE_ARGS ?=

judge: $(STAMP) $(SPECFORGE_DIR) ## The judge: train EAGLE-3 drafters on hsdump's records, measure them (~40 min)
	HSDUMP_SPECFORGE_PATH=$(abspath $(SPECFORGE_DIR)) $(PY) -m judge $(JUDGE_ARGS)

.PHONY: judge
