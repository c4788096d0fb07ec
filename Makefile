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

# No pip or uv cache: a second copy of every wheel (GBs) on a disk that must also hold the test
# image. The requirements are installed by uv, which unpacks wheels in parallel (2026-12-03, this
# 2-core machine, requirements-test.txt into a fresh venv: ~2.5 min with pip, 42 s with uv, the
# same 216 packages), from where pip's own configuration points (scripts/uv_args.py: uv reads no
# pip.conf); pip stays for the editable install and SpecForge's files.
# Byte-code: PYTHONDONTWRITEBYTECODE=1 (CI) means Python never writes it later, and a cold SGLang
# import is ~3x a warm one, so site-packages is compiled here, on every core (compileall,
# workers=0) rather than by pip, which compiles each file in turn on one (~3 CPU minutes). Files
# that do not compile under this Python are skipped, as pip does; warnings are off, as in pip.
# Left out: four packages that nothing here imports (NOT_IMPORTED: 8.0k of the 35.2k files; checked
# 2026-12-03 in a CPU server, which imports 109 packages, and in a process importing SGLang,
# transformers and SpecForge as the tests do). All of site-packages: 1m47s on this 2-core
# machine (3m19s of CPU).
UV_VERSION := 0.13.9
NOT_IMPORTED := anthropic|modelscope|tilelang|numba

$(STAMP): export PIP_NO_CACHE_DIR = 1
$(STAMP): export UV_NO_CACHE = 1
$(STAMP): pyproject.toml requirements-test.txt scripts/uv_args.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip uv==$(UV_VERSION)
	$(VENV)/bin/uv pip install -q --python $(PY) -r requirements-test.txt $$($(PY) scripts/uv_args.py)
	$(PY) -m pip install -q --no-deps -e .
	$(PY) -W ignore -c 'import compileall, re, sysconfig; \
	  compileall.compile_dir(sysconfig.get_path("purelib"), quiet=2, workers=0, \
	                         rx=re.compile(r"/site-packages/($(NOT_IMPORTED))/"))'
	touch $@

venv: $(STAMP) ## Create .venv with SGLang 0.5.23, hsdump (editable) and the test tools

# SpecForge's own loading code, for the test that feeds it our records. Its wheel pins another
# SGLang and torch, so only its files are installed (no dependencies), beside the venv's own.
SPECFORGE_VERSION := 0.2.0
SPECFORGE_DIR := $(VENV)/specforge-$(SPECFORGE_VERSION)

$(SPECFORGE_DIR): $(STAMP)
	rm -rf $@.tmp
	$(PY) -m pip install -q --no-deps --target $@.tmp specforge==$(SPECFORGE_VERSION)
	mv $@.tmp $@

# The system packages the suite runs (Docker, debootstrap, ...): scripts/prereqs.txt, installed
# when missing (root), before the first test; a second run installs nothing.
prereqs: ## Install the system packages the tests need (scripts/prereqs.txt; root)
	bash scripts/prereqs.sh

disk: ## Check, in seconds, that the disk can hold what `make test` builds (scripts/check_disk.py)
	$(PYTHON) scripts/check_disk.py $(VENV)

# The suite in lanes (tests/<lane>/, docs/testing.md): each has its target; `make test` runs them
# all, the unit and server lanes in one pytest process beside the image and Ansible lanes (which
# mostly wait on containers) in another; TEST_JOBS=1 runs the two one after the other. The
# output of each comes in one block when it ends; make fails when either fails.
TEST_JOBS ?= 2
PYTEST := HSDUMP_SPECFORGE_PATH=$(abspath $(SPECFORGE_DIR)) $(PY) -m pytest -ra --durations=25

test: prereqs disk $(STAMP) $(SPECFORGE_DIR) ## Run every lane of the test suite (the CI command; sets itself up)
	$(MAKE) --no-print-directory -k -j$(TEST_JOBS) -Otarget lanes-host lanes-containers

test-unit: $(STAMP) ## The unit lane: no server, no container (under 2 minutes)
	$(PYTEST) tests/unit $(PYTEST_ARGS)

test-server: prereqs $(STAMP) $(SPECFORGE_DIR) ## The server lane: real CPU SGLang servers
	$(PYTEST) tests/server $(PYTEST_ARGS)

test-image: prereqs $(STAMP) ## The image lane: builds and runs the Docker image (stand-in base)
	$(PYTEST) tests/image $(PYTEST_ARGS)

test-ansible: prereqs $(STAMP) $(SPECFORGE_DIR) ## The Ansible lane: real ansible-playbook runs against containers
	$(PYTEST) tests/ansible $(PYTEST_ARGS)

# make test's two processes (set up by make test itself). Keep every server-lane file in the
# first: two CPU SGLang servers at once on 2 cores cost far more than one after the other (with
# numerics and make smoke moved to the second process, 2026-12-03: verify's CPU variant 429 ->
# 843 s, make smoke 76 -> 237 s, make test 48 -> 58 min). The unit lane in the second process
# did no better (2026-12-03: make test 46.5 -> 50.6 min; verify 412 -> 596 s beside the longer
# Ansible tail).
# Side by side, the two keep both cores busy: one OpenMP thread per process, as in the CPU test
# servers (tests/harness/cpu_shim/sitecustomize.py says why), for the HF references and `hsdump
# verify`'s own computing too.
lanes-host:
	OMP_NUM_THREADS=1 $(PYTEST) tests/unit tests/server $(PYTEST_ARGS)

lanes-containers:
	OMP_NUM_THREADS=1 $(PYTEST) tests/image tests/ansible $(PYTEST_ARGS)

lint: $(STAMP) ## ruff over the package, tests and scripts; the import contract (pyproject.toml)
	$(VENV)/bin/ruff check hsdump_patch tests scripts judge
	$(VENV)/bin/lint-imports

.PHONY: help venv prereqs disk test test-unit test-server test-image test-ansible lanes-host \
  lanes-containers lint

-include mk/*.mk
