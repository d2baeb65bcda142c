"""Configuration of the train engine and of its loss. Imports no torch, so a recipe can
embed it and still be parsed instantly."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DType = Literal["float32", "bfloat16", "float16"]


class LossConfig(BaseModel):
    """Hyperparameters of :func:`asyncrl.algo.policy_loss` and of the logprobs it consumes."""

    model_config = ConfigDict(extra="forbid")

    eps_clip: float = Field(0.2, gt=0, description="lower PPO clip ε: ratio ≥ 1 − eps_clip")
    eps_clip_high: float | None = Field(
        None, gt=0, description="upper clip ε (DAPO clip-higher, e.g. 0.28); None: eps_clip"
    )
    c_clip: float | None = Field(
        None, gt=1, description="dual-clip bound for negative advantages (e.g. 3); None: off"
    )
    behav_imp_weight_cap: float | None = Field(
        None,
        gt=0,
        description="decoupled PPO: tokens whose π_prox/π_behav exceeds this drop out; None: no cap",
    )
    importance_sampling_level: Literal["token", "sequence"] = Field(
        "token", description="token ratios (PPO/GRPO) or one ratio per sequence (GSPO)"
    )
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="how per-token losses reduce to the batch loss"
    )
    norm_len: float | None = Field(
        None,
        gt=0,
        description="the constant of seq-mean-token-sum-norm (generation budget); "
        "None: the longest loss span in the batch",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="weight of the KL penalty to the reference policy; 0: off. Above 0 the "
        "engine keeps a frozen copy of the initial weights and scores samples that carry no "
        "ref_logprobs with it",
    )
    kl_type: Literal["k1", "k2", "k3"] = Field("k2", description="KL estimator")
    kl_in: Literal["reward", "loss"] = Field(
        "loss",
        description="where the KL penalty goes: the loss (differentiated; exact "
        "∇KL(π‖π_ref) for k2, the reverse KL's gradient for k3) or the per-token reward "
        "(detached, as advantage still to come; exact for k1)",
    )
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="entropy bonus: loss −= entropy_coef · entropy of the sampled "
        "distribution, aggregated over the loss tokens like the policy loss; 0: off",
    )
    recompute_proximal: bool = Field(
        True,
        description="decoupled PPO: when a sample has no old_logprobs, train_step takes them "
        "from the current weights (with one minibatch, the training forward's own detached "
        "logprobs; with several, one no-grad forward before the first); False: plain PPO "
        "against the behaviour logprobs",
    )
    separate_proximal_forward: bool = Field(
        False,
        description="recompute the proximal logprobs in a no-grad forward even with one "
        "minibatch, where the training forward gives the same values for free (for checks "
        "and benchmarks)",
    )


class TrainConfig(BaseModel):
    """Everything :class:`asyncrl.train.TrainEngine` needs. Defaults suit a CPU test run."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    model: Any = Field(
        description="a local HF model directory or hub id, or a transformers "
        "PretrainedConfig (random init, for tests and benches)"
    )
    gguf_file: str | None = Field(
        None, description="a GGUF file inside `model` to load (dequantised) instead of weights"
    )
    tokenizer: str | None = Field(
        None, description="tokenizer to export beside the weights; None: `model` if it is a path"
    )
    seed: int = Field(0, description="seeds random init and the torch RNG of every rank")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda:LOCAL_RANK when CUDA is available, else cpu"
    )
    param_dtype: DType = Field(
        "float32",
        description="compute dtype of forward/backward; master weights and optimizer states "
        "stay float32",
    )
    reduce_dtype: DType = Field("float32", description="dtype of the gradient reduce-scatter")
    attn_implementation: str = Field(
        "asyncrl_varlen",
        description="attention backend: asyncrl_varlen (per-sequence causal attention over "
        "packed rows, no N² mask; plain causal models only), or any of transformers' (sdpa, "
        "eager, flash_attention_2, flex_attention, ...)",
    )
    gradient_checkpointing: bool = Field(
        False, description="recompute each decoder layer in backward"
    )
    reshard_after_forward: bool = Field(
        True, description="FSDP: free gathered layer weights after forward (ZeRO-3)"
    )
    max_tokens_per_microbatch: int = Field(
        8192,
        gt=0,
        description="token budget of one forward/backward (padding included when packing is "
        "off); a longer single sequence gets a micro-batch of its own",
    )
    packing: bool = Field(
        True, description="pack sequences end to end without padding; False: right-pad"
    )
    lm_head_chunk_tokens: int = Field(
        2048,
        gt=0,
        description="logits are materialised for this many tokens at a time (bounds the "
        "[tokens, vocab] activation)",
    )
    temperature: float = Field(
        1.0,
        gt=0,
        description="the sampler's temperature: logprobs are of softmax(logits / T), then "
        "cut by top_k/top_p",
    )
    top_k: int = Field(
        0,
        ge=0,
        description="the sampler's top-k: logprobs are of the distribution cut to the k "
        "likeliest tokens and renormalised, as sampled; 0: no cut",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the sampler's top-p: logprobs are of the distribution cut to the "
        "nucleus of this mass and renormalised, as sampled; 1: no cut",
    )
    lr: float = Field(1e-6, gt=0, description="peak learning rate of AdamW")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    adam_eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warmup from lr/warmup to lr")
    lr_schedule: Literal["constant", "cosine"] = Field(
        "constant", description="after warmup: constant, or cosine decay to min_lr_ratio·lr"
    )
    total_steps: int | None = Field(
        None, gt=0, description="steps of the cosine schedule (required for cosine)"
    )
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="cosine floor, as a fraction of lr")
    max_grad_norm: float | None = Field(
        1.0, gt=0, description="clip the global gradient norm to this; None: no clipping"
    )
    ppo_minibatches: int = Field(
        1,
        ge=1,
        description="optimizer steps per train_step: the batch is split into this many "
        "minibatches of whole sequences, each stepped in turn against the same proximal "
        "policy (PPO epochs of one pass); the version and the lr schedule advance once per "
        "train_step",
    )
    loss: LossConfig = Field(
        default_factory=lambda: LossConfig.model_validate({}), description="policy-loss settings"
    )

    @field_validator("model")
    @classmethod
    def _model_kind(cls, value: Any) -> Any:
        if isinstance(value, str) or hasattr(value, "to_dict"):
            return value
        raise ValueError("model must be a path / hub id or a transformers PretrainedConfig")

    @model_validator(mode="after")
    def _cosine_needs_total(self) -> TrainConfig:
        if self.lr_schedule == "cosine" and self.total_steps is None:
            raise ValueError("lr_schedule='cosine' needs total_steps")
        return self
