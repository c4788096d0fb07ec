# Ansible tooling lives in its own venv so it never touches SGLang's .venv.
ANSIBLE_VENV ?= .venv-ansible
ANSIBLE_STAMP := $(ANSIBLE_VENV)/.hsdump-installed
ANSIBLE_BIN := $(abspath $(ANSIBLE_VENV))/bin

$(ANSIBLE_STAMP): ansible/requirements-dev.txt
	$(PYTHON) -m venv $(ANSIBLE_VENV)
	$(ANSIBLE_VENV)/bin/python -m pip install -q --upgrade pip
	$(ANSIBLE_VENV)/bin/python -m pip install -q -r ansible/requirements-dev.txt
	touch $@

ansible-venv: $(ANSIBLE_STAMP) ## Install ansible + ansible-lint into .venv-ansible

ansible-lint: $(ANSIBLE_STAMP) ## ansible-lint (production profile, offline) and --syntax-check
	cd ansible && $(ANSIBLE_BIN)/ansible-lint
	cd ansible && $(ANSIBLE_BIN)/ansible-playbook --syntax-check deploy.yml teardown.yml extract.yml verify.yml upgrade.yml

.PHONY: ansible-venv ansible-lint
