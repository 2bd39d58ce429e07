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

lint:
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# ruff, mypy, then pytest (the default run skips `slow`); pytest's exit 5, "no tests ran",
# fails the target like any other failure.
test: setup lint
	$(PY) -m pytest

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
