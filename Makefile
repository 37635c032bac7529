# `make serve` and `make test` work from a clean clone: each runs `setup` first, which is a no-op once done.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000
MODEL ?= qwen2.5-coder-0.5b-instruct
HOST ?= 127.0.0.1
PYTEST_ARGS ?=
# Python caches each module it compiles (app/, tests/ and pytest's rewritten test files too) in __pycache__ beside it,
# unless PYTHONDONTWRITEBYTECODE is set, as on this project's machines: then every process of the suite (two workers,
# three more passes, each server a test starts) compiled them all again. Collecting the fast lane took 20 s with it
# set and 12 s without, on a Zen 3. Nothing here needs it set; the folders are git-ignored.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup models kernels chromium qemu serve batch test test-avx2 test-fast screenshot bench bench-compare bench-quality bench-shortcuts docs-figures gpu-check clean

setup: $(VENV)/.installed models kernels

# Reinstall only when the dependency list changes.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet --no-compile -e '.[convert,test,docs]'  # docs: the chart tests draw with matplotlib
	# instructor (a test client) caps jiter < 0.15 and rich < 15, which the openai SDK and schemathesis we pin have
	# outgrown; it runs fine on both (tests/real/test_anthropic_real.py), so it is installed without its caps. Its other
	# needs (docstring-parser, jinja2, tenacity) come with the test extra.
	$(PY) -m pip install --quiet --no-compile --no-deps 'instructor==1.17.0'
	# Byte-compiled here, as pip would have, but on every core (pip compiles one file at a time: 148 s against 84 s
	# with --no-compile, on 2 cores). Where PYTHONDONTWRITEBYTECODE is set, as on this project's machines and in many
	# images, nothing else would cache the compiled modules, and every process of the suite would compile torch and
	# transformers again. A file that is no Python 3 (some packages ship templates and test data as .py) fails here
	# as it is skipped by pip's own pass, so the exit status is not the install's.
	$(PY) -m compileall -q -j 0 $(VENV)/lib >/dev/null || true
	touch $@

# The embedded default model and the second test architecture; fetched once, then a no-op.
models: $(VENV)/.installed
	$(PY) -m app fetch-model qwen2.5-coder-0.5b-instruct smollm2-135m-instruct all-minilm-l6-v2

# Our C++ CPU kernels (decode attention, QUANT=int4's), compiled once per machine into ~/.cache/simple-serve/kernels/
# (about a minute here) so that no server start and no test pays for it; a no-op once built. Without a compiler
# this prints why, and the server runs torch's versions (its start log says so again).
kernels: $(VENV)/.installed
	@$(PY) -c "from app.models import decode_attention as a, int4_decode as b; \
		[print(f'kernels: {w}') for w in (a.extension()[1], b.extension()[1]) if w]"

# Debian's chromium, which the playground's browser tests drive with Playwright (Playwright's own browser download
# is not reachable here). apt runs only when chromium is missing.
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
chromium:
	@command -v chromium >/dev/null 2>&1 || { $(SUDO) apt-get update && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y chromium; }

serve: setup
	$(PY) -m app serve --host $(HOST) --port $(PORT) --model $(MODEL)

# A Batches API input file run offline (docs/batch.md): make batch INPUT=in.jsonl OUTPUT=out.jsonl [RESUME=1]
batch: setup
	$(PY) -m app batch $(INPUT) -o $(OUTPUT) --model $(MODEL) $(if $(RESUME),--resume)

# Two lanes, one folder each in tests/ (tests/README.md):
#   make test-fast: tests/fast/, the tiny in-test model and no model at all: no downloads, no apt, no server
#     process. It leaves out what tests/fast/ marks `full` (a few seconds each: worker processes, deadlines, long
#     decodes, many server starts) and its few `real_model` and `server` tests, which sit beside their tiny twins.
#   make test: everything, the fast lane included: tests/server/ (server processes), tests/real/ (the embedded
#     models, fetched by `make setup`), tests/browser/ (chromium), tests/tooling/ (benchmarks/), tests/gpu/
#     (skipped without CUDA), tests/compile/, then the AVX2 pass.
# torch.compile's state (dynamo's caches, counters, recompile limits) is process-wide, so the tests that compile
# (tests/compile/, marker `compile`) run in a process of their own, after the rest: neither side can leave state to
# the other. (Run beside the parallel pass instead, it slowed that pass from 13:36 to 16:43 here and took 6:39
# itself: the two workers keep both cores busy. Beside it under `nice -n 19`, it still slowed that pass from 13:57
# to 17:09, and had not finished one test when the pass ended.)
# Both lanes run on TEST_WORKERS pytest-xdist worker processes, a file per worker (a module's server starts once),
# each on one torch thread: most of the suite waits on one Python thread (imports, server starts, HTTP), so on two
# cores one pytest process left the second core mostly idle, and two torch threads per worker only spin against the
# other worker. The tests marked `alone` assert a latency under their own load (a /health p99, a first token's wait):
# they run after the parallel pass, one at a time, on torch's default threads. Time taken: docs/benchmarking.md.
# xdist would hand out files by their count of tests, which leaves the few-test, minutes-long real-model and server
# files for the end, where one worker runs them while the other has nothing left; tests/conftest.py orders those
# first instead (HeavyFilesFirst), and --no-loadscope-reorder keeps that order.
# --max-worker-restart 0: a worker that dies (the kernel's OOM killer stopped one on a 24 GB AVX2-only Zen 3)
# ends the pass, red, with its test named. xdist's default starts another, and under --dist loadfile the pass then
# waited forever with both workers idle.
TEST_WORKERS ?= 2
PARALLEL := OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	--max-worker-restart 0
FAST_LANE := tests/fast -m "not full and not real_model and not server and not alone"
LEAN := -p no:langsmith_plugin -p no:schemathesis  # plugins only some passes use: each costs seconds to load
# The files that mark a test `alone`: the alone pass collects these only (17 s against 33 s for every folder here).
ALONE_FILES := $(shell grep -rlE 'mark\.alone' tests --include='test_*.py')
test: setup chromium qemu
	$(PARALLEL) -m "not compile and not alone" $(PYTEST_ARGS) || [ $$? -eq 5 ]  # 5: PYTEST_ARGS picked none
	$(PY) -m pytest $(or $(PYTEST_ARGS),$(ALONE_FILES)) -m "alone and not compile" $(LEAN) || [ $$? -eq 5 ]
	$(PY) -m pytest $(or $(PYTEST_ARGS),tests/compile) -m compile $(LEAN) || [ $$? -eq 5 ]  # else only tests/compile/
	$(MAKE) --no-print-directory test-avx2

# The fast lane, without the pytest plugins it does not use: each costs seconds to load.
test-fast: $(VENV)/.installed
	$(PARALLEL) $(FAST_LANE) $(LEAN) $(PYTEST_ARGS)

# The AVX2-only path, run by `make test` too: the loading, dtype, prepack-fallback, logits and decode-loop tests
# again on an emulated AMD EPYC Rome (AVX2, no AVX-512, no AMX), under qemu's user-mode emulator, so CPUID, torch,
# MKL and oneDNN all see an AVX2-only CPU and an AVX-512 instruction would crash as it does on one (9:14 here, emulating on a Zen 3).
# Where qemu cannot be had (not x86-64 Linux, no apt), AVX-512 and AMX are hidden through torch's and oneDNN's
# own variables instead, which picks the same kernels but cannot catch a stray instruction.
# AMX cannot be emulated at all: qemu's TCG has no AMX (Debian's qemu 7.2 answers `-cpu max,+amx-tile` with "TCG
# doesn't support requested feature", and CPUID then shows none; it has no AVX-512 either). So every CPU class's
# choices (dtype, prepacking, int8 engine, llama.cpp's portable flags), AMX's included, are tested in the main pass
# from /proc/cpuinfo flags lines (tests/cpu_flags.py); AMX's kernels themselves run only on a real AMX CPU.
AVX2_ENV := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
AVX2_TESTS := tests/fast/test_loading.py tests/fast/test_prepack.py tests/fast/test_generate.py \
	tests/fast/test_logits.py
# Kernels that choose by CPUID themselves (fbgemm's int8, xgrammar's mask, oneDNN's fp32 copies for batched rows)
# and the packed-row paths, on the tiny model only (~45 s; their real-model tests take many minutes emulated).
# fbgemm's AVX2 path was found here to saturate with full-range activations (app/models/quant.py).
# test_invariant_linears.py: whether a kernel computes a row the same way at any row count is the kernel's own
# (oneDNN, MKL and fbgemm pick theirs by CPUID), so BATCH_INVARIANT's check and its answers are held on both classes
# (~60 s of this pass, emulated on a busy Zen 2; 5 s natively).
# test_group8.py: a GGUF's 8-bit groups, where auto picks the AVX2 path and no VNNI one can run beside it.
AVX2_KERNEL_TESTS := tests/fast/test_quant.py tests/fast/test_constraints.py tests/fast/test_speculative.py \
	tests/fast/test_prefix_cache.py tests/fast/test_batch_rows.py tests/fast/test_invariant_linears.py \
	tests/fast/test_decode_attention_kernel.py tests/fast/test_group8.py
# One emulated process for both lists (conftest.py keeps real-model tests to AVX2_TESTS and fails the run unless torch
# sees an AVX2-only CPU), without the pytest plugins these files do not use: each costs seconds to load emulated.
AVX2_PYTEST_FLAGS := -p no:cacheprovider -p no:langsmith_plugin -p no:schemathesis -p no:hypothesispytest -p no:anyio
# On a CPU that is itself AVX2-only, the main pass has just run those paths natively, so nothing is emulated.
test-avx2: setup qemu
	@if cpu=$$($(PY) -c "from app.models.cpu import cpu_features as f; c = f(); print(c.describe()); \
			raise SystemExit(0 if c.aten_capability == 'AVX2' and not c.flags and not c.forced else 1)"); then \
		echo "test-avx2: this CPU is AVX2-only ($$cpu); the main pass ran its paths natively"; \
	elif command -v qemu-x86_64 >/dev/null 2>&1 && [ "$$(uname -m)" = x86_64 ]; then \
		cp scripts/python-avx2 $(VENV)/bin/python-avx2 && \
		TEST_EXPECT_AVX2_ONLY=1 TEST_REAL_MODEL_FILES="$(AVX2_TESTS)" \
			$(VENV)/bin/python-avx2 -m pytest $(AVX2_PYTEST_FLAGS) $(AVX2_TESTS) $(AVX2_KERNEL_TESTS) $(PYTEST_ARGS); \
	else \
		echo "test-avx2: qemu-x86_64 not available; hiding AVX-512 through $(AVX2_ENV)" && \
		$(AVX2_ENV) $(PY) -m pytest $(AVX2_TESTS) $(PYTEST_ARGS); \
	fi

# qemu's user-mode emulator for test-avx2, from Debian (x86-64 Linux with apt only; elsewhere test-avx2 falls back).
qemu:
	@command -v qemu-x86_64 >/dev/null 2>&1 || [ "$$(uname -m)" != x86_64 ] || ! command -v apt-get >/dev/null 2>&1 \
		|| { $(SUDO) apt-get update && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y qemu-user; }

# The README's picture of the playground (docs/playground.png), taken by its browser test.
screenshot: setup chromium
	UPDATE_SCREENSHOT=1 $(PY) -m pytest tests/browser/test_playground.py -k readme_picture $(PYTEST_ARGS)

bench: setup
	$(PY) -m benchmarks generate

# Ours next to `transformers serve` (with and without continuous batching), same weights and load: ~6 minutes.
bench-compare: setup
	$(PY) -m benchmarks compare

# Perplexity and greedy agreement of bf16 and QUANT=int8 against fp32 (benchmarks/quality.py): a few minutes.
bench-quality: setup
	$(PY) -m benchmarks quality

# What the prefix cache and n-gram speculation buy, through HTTP, each on and off (benchmarks/shortcuts.py).
bench-shortcuts: setup
	$(PY) -m benchmarks shortcuts

# The docs' generated tables (settings, benchmark figures) and PNG charts, from app/config.py and docs/results/*.json
# (docs/benchmarking.md). matplotlib comes from the `docs` extra, which `make setup` installs.
docs-figures: $(VENV)/.installed
	$(PY) -m benchmarks docs-figures

# On a CUDA machine, < 10 minutes: GPU-marked tests, bench generate, bench step (eager vs compiled + CUDA graphs against
# the HBM floor), bench serve on the compiled step, a summary. Stops at once without CUDA.
gpu-check: setup
	PY=$(PY) MODEL=$(MODEL) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
