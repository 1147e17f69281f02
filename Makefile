# `make demo` and `make test` are the two set-up commands: each creates .venv if needed and installs.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.ember-installed

.PHONY: demo test test-slow test-compat lint bench clean

# setup.py and the C sources: an editable install builds the optional extensions in place
$(STAMP): pyproject.toml setup.py src/ember/shards/_speedups.c src/ember/csprng/_shuffle.c src/ember/csprng/_transforms.c src/ember/csprng/_buffers.h
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	# torch pinned for development and CI (a CPU wheel of exactly this version is on local disk)
	$(BIN)/python -m pip install "torch==2.13.0"
	$(BIN)/python -m pip install -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/ember demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

# the tests marked torch_compat on the oldest declared and the newest installable torch, one venv each
# (.venv-compat/torch-<version>); see ci/compat/test-compat.sh
test-compat:
	PYTHON=$(PYTHON) bash ci/compat/test-compat.sh

lint: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python bench/csprng.py

clean:
	rm -rf $(VENV) .venv-compat build dist src/*.egg-info
