# hsdump: developer entry points. `make help` lists them.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hsdump-installed

.DEFAULT_GOAL := help

help: ## List the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | sort | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  %-14s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml requirements-test.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-test.txt
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(STAMP) ## Create .venv with SGLang 0.5.23, hsdump (editable) and the test tools

test: $(STAMP) ## Run the whole test suite (real CPU SGLang servers; sets itself up)
	$(PY) -m pytest -ra $(PYTEST_ARGS)

lint: $(STAMP) ## ruff over the package, tests and scripts
	$(VENV)/bin/ruff check hsdump_patch tests scripts

.PHONY: help venv test lint

-include mk/*.mk
