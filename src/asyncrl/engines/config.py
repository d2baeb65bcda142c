"""The recipe's ``rollout.engine`` section: one class per inference backend, and each is
the config its engine is built from (the engine takes the section object itself).
Imports no torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from asyncrl.config.schema import Device, Section


class HFEngineConfig(Section):
    type: Literal["hf"] = "hf"
    """In-process transformers generation with batching of concurrent requests."""
    max_batch_size: int = Field(32, ge=1)
    """Most sequences decoded together."""
    device: Device = "auto"
    """``auto`` (the first CUDA device when there is one, else the CPU), ``cpu``, ``cuda``
    or ``cuda:N``: rollout and trainer may share a GPU or sit on different ones."""
    max_prefill_tokens: int = Field(8192, ge=1)
    """Most prompt tokens prefilled in one forward when requests join the batch (those
    the prefix cache holds are not counted)."""
    prefix_cache_mb: int = Field(512, ge=0)
    """MiB of the engine's device memory that keep the keys and values of finished
    sequences, so that a prompt extending one (an agent's next turn, a shared system
    prompt) prefills only its new tail; least recently used blocks go first, and all of
    it at every weight update. 0 turns the cache off."""
    cpu_kernel: bool = True
    """On the CPU in float32, a decode step's products of 4 to 32 rows by asyncrl's own
    kernel (:mod:`asyncrl.engines.cpu_linear`: AVX-512, compiled on first use with the
    system's C compiler; it reads a packed copy of each weight, made again after an
    update, so the linear weights take twice their memory), where it can run and
    ``max_batch_size`` is at most 32 (steps of more rows run faster on torch's products of
    column-major weights); else torch's, on column-major weights. ``false``: torch's
    always."""
    cpu_decode_layers: bool = True
    """With ``cpu_kernel``, a decode step of up to 32 rows computes each decoder layer in one
    call of the kernel's library (:mod:`asyncrl.engines.cpu_decode`: norms, rotary
    positions, attention and the activation in C beside the products) instead of some
    forty torch operations, for llama and qwen2 decoders; the same arithmetic up to the
    order of float sums. ``false``: through the model's own layers."""
    shared_prefix_attention: bool = True
    """Decode rows that hold the same cached prefix (a system prompt, a group's prompt)
    with cascade attention: their queries read one copy of the prefix's keys and values,
    each row's own columns only past it. Same results up to the order of float sums; text
    models under SDPA with the prefix cache on."""


class ServerEngineConfig(Section):
    """Keys shared by the engines that drive inference servers over HTTP."""

    command: list[str] = Field(default_factory=list)
    """The program that starts one server, with its leading arguments; the engine appends
    the model, host, port and its own flags, then ``args``. Empty: the engine's default."""
    args: list[str] = Field(default_factory=list)
    """Extra command-line arguments for every started server."""
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables for the started servers."""
    urls: list[str] = Field(default_factory=list)
    """Servers started elsewhere (``http://host:port``), all serving ``model.path``: nothing
    is started and requests are spread over these."""
    servers: int = Field(1, ge=1)
    """Servers each rollout actor starts (ignored when ``urls`` are given)."""
    host: str = "127.0.0.1"
    """Address the started servers listen on."""
    ports: tuple[int, int] = (31000, 31999)
    """Inclusive range of ports for the started servers; each takes a free one."""
    startup_timeout: float = Field(900.0, gt=0)
    """Seconds a server has to answer its health check before the actor fails (the error
    names the server's log under ``<run>/logs``)."""
    request_timeout: float = Field(1800.0, gt=0)
    """Seconds one HTTP request (a whole generation included) may take."""
    retries: int = Field(3, ge=0)
    """Retries of a request after a connection error (not after an HTTP error)."""
    retry_backoff: float = Field(0.5, ge=0)
    """Seconds before the first retry; doubled for each next one."""

    @model_validator(mode="after")
    def _check_servers(self) -> ServerEngineConfig:
        lo, hi = self.ports
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"ports must be an increasing pair within 1-65535, got {self.ports}")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"urls must start with http:// or https://, got {bad}")
        return self


class VLLMEngineConfig(ServerEngineConfig):
    type: Literal["vllm"] = "vllm"
    """vLLM servers (``make vllm`` installs vLLM's CPU build in ``.venv-vllm``)."""
    python: str = ".venv-vllm/bin/python"
    """Interpreter of the virtualenv holding vLLM; it runs asyncrl's launcher for ``vllm
    serve`` unless ``command`` is set. A relative path is looked up in the working
    directory, then in the project checkout."""
    cpu_kvcache_gib: int = Field(2, ge=1)
    """KV cache size in whole GiB on vLLM's CPU backend (``VLLM_CPU_KVCACHE_SPACE``)."""
    cpu_threads_bind: str = "auto"
    """Cores the CPU backend's OpenMP threads bind to (``VLLM_CPU_OMP_THREADS_BIND``):
    ``auto``, ``all`` or a list such as ``0-3``."""
    max_model_len: int = Field(0, ge=0)
    """Context length the servers allow; 0 keeps the model's (a smaller one needs less
    KV cache)."""


class SGLangEngineConfig(ServerEngineConfig):
    type: Literal["sglang"] = "sglang"
    """SGLang servers: on GPUs, or on the CPU with ``cpu = true`` (``make sglang`` installs
    SGLang in ``.venv-sglang``)."""
    python: str = ""
    """Interpreter of the virtualenv holding SGLang; it runs ``-m sglang.launch_server``
    unless ``command`` is set. Empty: the interpreter running asyncrl. A relative path is
    looked up in the working directory, then in the project checkout."""
    cpu: bool = False
    """Serve on the CPU: SGLang's CPU engine with plain-torch attention and sampling, no
    overlap scheduler, no grammar backend. Slow; for tests and small models."""
    max_total_tokens: int = Field(0, ge=0)
    """KV cache size in tokens (SGLang's ``--max-total-tokens``); 0 lets SGLang size it from
    ``mem_fraction_static`` (on the CPU, a fraction of the free host memory)."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """Fraction of GPU memory for weights and KV cache (SGLang's ``--mem-fraction-static``);
    None leaves SGLang's default. Lower it when a trainer shares the GPU."""


class InstantEngineConfig(Section):
    type: Literal["instant"] = "instant"
    """No model: instant, fixed-length responses (benchmarks and protocol tests of the
    actors around generation; ``bench/scale.py``). Nothing it trains on means anything."""
    response_tokens: int = Field(16, ge=1)
    """Tokens in every response (fewer when ``rollout.sampling.max_new_tokens`` is smaller)."""


EngineConfig = Annotated[
    HFEngineConfig | VLLMEngineConfig | SGLangEngineConfig | InstantEngineConfig,
    Field(discriminator="type"),
]
