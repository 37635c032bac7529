# `make serve` and `make test` work from a clean clone: each runs `setup` first, which is a no-op once done.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
MODEL ?= qwen2.5-coder-0.5b-instruct
HOST ?= 127.0.0.1
PYTEST_ARGS ?=

.PHONY: setup models chromium serve test test-avx2 test-fast screenshot bench bench-compare bench-quality bench-shortcuts gpu-check clean

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

# Debian's chromium, which the playground's browser tests drive with Playwright (Playwright's own browser download
# is not reachable here). apt runs only when chromium is missing.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

serve: setup
	$(PY) -m app serve --host $(HOST) --port $(PORT) --model $(MODEL)

test: setup chromium
	$(PY) -m pytest $(PYTEST_ARGS)
	$(AVX2_ENV) $(PY) -m pytest $(AVX2_TESTS) $(PYTEST_ARGS)

# The AVX2-only path on any x86 CPU, run by `make test` too: the loading, dtype, prepack-fallback, logits and
# decode-loop tests again with AVX-512 and AMX hidden from ATen and oneDNN (fp32, plain layers, AVX2 kernels).
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/test_loading.py tests/test_prepack.py tests/test_generate.py tests/test_logits.py
test-avx2: setup
	$(AVX2_ENV) $(PY) -m pytest $(AVX2_TESTS) $(PYTEST_ARGS)

# Unit tests on the tiny in-test model only: seconds, no downloads (so no browser either).
test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not real_model and not server and not browser" $(PYTEST_ARGS)

# The README's picture of the playground (docs/playground.png), taken by its browser test.
screenshot: setup chromium
	UPDATE_SCREENSHOT=1 $(PY) -m pytest tests/test_playground.py -k readme_picture $(PYTEST_ARGS)

bench: setup
	$(PY) -m app bench generate

# Ours next to `transformers serve` (with and without continuous batching), same weights and load: ~6 minutes.
bench-compare: setup
	$(PY) -m app bench compare

# Perplexity and greedy agreement of bf16 and QUANT=int8 against fp32 (app/bench/quality.py): a few minutes.
bench-quality: setup
	$(PY) -m app bench quality

# What the prefix cache and n-gram speculation buy, through HTTP, each on and off (app/bench/shortcuts.py).
bench-shortcuts: setup
	$(PY) -m app bench shortcuts

# On a CUDA machine, < 10 minutes: GPU-marked tests, bench generate, bench serve, a summary. Stops at once without CUDA.
gpu-check: setup
	PY=$(PY) MODEL=$(MODEL) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
