# `make serve` and `make test` work from a clean clone: each runs `setup` first, which is a no-op once done.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
MODEL ?= qwen2.5-coder-0.5b-instruct
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: setup models serve test test-fast bench bench-compare clean

setup: $(VENV)/.installed models

# Reinstall only when the dependency list changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[convert,test]'
	touch $@

# The embedded default model and the second test architecture; fetched once, then a no-op.
models: $(VENV)/.installed
	$(PY) -m app fetch-model qwen2.5-coder-0.5b-instruct smollm2-135m-instruct

serve: setup
	$(PY) -m app serve --host $(HOST) --port $(PORT) --model $(MODEL)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

# Unit tests on the tiny in-test model only: seconds, no downloads.
test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not real_model and not server" $(PYTEST_ARGS)

bench: setup
	$(PY) -m app bench generate

# Ours next to `transformers serve` (with and without continuous batching), same weights and load: ~6 minutes.
bench-compare: setup
	$(PY) -m app bench compare

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
