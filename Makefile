# `make run` and `make test` are the two commands the README documents.
# Both create .venv when missing and install the pinned dependencies once
# (a stamp file records that requirements did not change since).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= config.yaml
PYTEST_ARGS ?=

.PHONY: install run test lint format bench clean

$(STAMP): requirements.txt requirements-nodeps.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in the same command as transformers (requirements.txt) to avoid a CUDA download
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m orchestrator run-default --config $(CONFIG)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
