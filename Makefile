# The project's commands. Each target runs the idempotent set-up first, so on a fresh
# machine `make train` and `make test` are all a new user needs (see README.md).
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: setup train test lint bench-store bench-gui bench-sandbox bench-serving bench-leaderboard bench-swe

setup:
	bash scripts/setup.sh

# The main job on the embedded defaults; pass Hydra overrides with ARGS="model=tiny ...".
train: setup
	$(PY) -m trainers.run $(ARGS)

# mypy keeps its cache per user, beside the shared environments ($CLAWGYM_HOME), so a fresh
# clone re-checks only the modules whose sources differ from what was checked before (a clone
# of an unchanged tree: 5 s against 105 s here). Entries are validated by content hash.
MYPY_CACHE_DIR ?= $(or $(CLAWGYM_HOME),$(HOME)/.cache/clawgym)/mypy

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	MYPY_CACHE_DIR="$(MYPY_CACHE_DIR)" $(PY) -m mypy

# ruff, mypy, then pytest (the default run skips `slow`); pytest's exit 5, "no tests ran",
# fails the target like any other failure. pytest runs in TEST_WORKERS processes (xdist; one
# per core, at most 4): a file's tests stay together, and so do all the tests of a daemon
# one machine holds once (tests/conftest.py), and each worker's processes share its part of
# the cores (OMP_NUM_THREADS). TEST_WORKERS=0 runs it in one process.
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); [ $$n -gt 4 ] && n=4; echo $$n)
test: setup lint
	$(PY) -m pytest $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

bench-store: setup
	$(PY) -m benchmarks.perf.store

bench-gui: setup
	$(PY) -m benchmarks.perf.gui

bench-sandbox: setup
	$(PY) -m benchmarks.perf.sandbox

bench-serving: setup
	$(PY) -m benchmarks.perf.serving

# The leaderboard: pass Hydra overrides with ARGS="suite=full policy=[smollm2-135m]".
bench-leaderboard: setup
	$(PY) -m benchmarks.run $(if $(ARGS),$(ARGS),suite=smoke policy=tiny)

bench-swe: setup
	$(PY) -m benchmarks.perf.swe
