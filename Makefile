# `make run` and `make test` are the two commands the README documents.
# Both create .venv when missing and install the pinned dependencies once
# (a stamp file records that requirements did not change since).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= config.yaml
PYTEST_ARGS ?=

.PHONY: install run test test-stress lint format bench clean image gpu-rehearsal

$(STAMP): requirements.txt requirements-dev.txt requirements-nodeps.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch is pinned in the same command as transformers (requirements.txt) to avoid a CUDA download
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps -r requirements-nodeps.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

install: $(STAMP)

PORT ?= 8033
# only this machine can reach `make run` unless HOST says otherwise (HOST=0.0.0.0: every
# interface; set server.api_keys_env first): the default config has no API key
HOST ?= 127.0.0.1

run: $(STAMP)
	$(PY) -m generation prepare smollm2-135m
	@echo
	@echo "guardstream starts on $(HOST):$(PORT); it prints commands to try once it is ready."
	@echo
	$(PY) -m orchestrator serve --config $(CONFIG) --host $(HOST) --port $(PORT) --hint

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

# The same suite while a CPU hog spins on every core: a test that depends on timing fails here,
# not on a slow CI machine. The hog is stopped whatever pytest's outcome (and on Ctrl-C).
test-stress: $(STAMP)
	$(PY) -m ruff check .
	@$(PY) tests/cpu_hog.py & hog=$$!; \
	trap 'kill $$hog 2>/dev/null; wait $$hog 2>/dev/null' EXIT INT TERM; \
	$(PY) -m pytest $(PYTEST_ARGS); status=$$?; \
	exit $$status

# bench/gpu/check.sh rehearsed on this CPU before a lent GPU session (bench/gpu/README.md): every
# part's steps on tiny models, the test lanes collected; fails on any "REHEARSAL: step" line.
gpu-rehearsal: $(STAMP)
	CHECK_PYTHON=$(abspath $(PY)) bash bench/gpu/rehearse.sh

lint: $(STAMP)
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# The container image (Dockerfile), with whichever builder this machine has: docker (when its
# daemon answers), else podman, else buildah; CONTAINER_TOOL=podman (say) picks one.
#   make image                                   # guardstream:cpu
#   make image IMAGE=guardstream:cuda TORCH_VARIANT=cu128 \
#        BUILD_ARGS='--build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04'
IMAGE ?= guardstream:cpu
TORCH_VARIANT ?= cpu
# where the torch build for TORCH_VARIANT comes from (a mirror or local index when only the
# package registries are reachable); empty: download.pytorch.org/whl/$(TORCH_VARIANT)
TORCH_INDEX_URL ?=
BUILD_ARGS ?=
CONTAINER_TOOL ?=

image:
	@tool='$(CONTAINER_TOOL)'; \
	if [ -z "$$tool" ]; then \
	  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then tool=docker; \
	  elif command -v podman >/dev/null 2>&1; then tool=podman; \
	  elif command -v buildah >/dev/null 2>&1; then tool=buildah; \
	  else echo "make image: no container builder: install docker, podman or buildah" >&2; exit 1; fi; \
	fi; \
	case "$$tool" in buildah) build="buildah bud --layers";; *) build="$$tool build";; esac; \
	echo "make image: building $(IMAGE) with $$tool"; \
	$$build --build-arg TORCH_VARIANT=$(TORCH_VARIANT) \
	  $(if $(TORCH_INDEX_URL),--build-arg TORCH_INDEX_URL=$(TORCH_INDEX_URL)) \
	  $(BUILD_ARGS) -t $(IMAGE) -f Dockerfile .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache build *.egg-info
