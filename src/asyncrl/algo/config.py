"""The recipe's ``trainer.loss`` and ``trainer.shaping`` sections: what the math of
:mod:`asyncrl.algo` reads (the train engine holds them in its ``TrainerConfig``). Imports
no torch."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.schema import Section

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
"""How token losses become one number (:func:`asyncrl.algo.loss.aggregate`)."""
ImportanceLevel = Literal["token", "sequence"]
"""Where the policy ratio lives: per token (PPO) or one per sequence (GSPO)."""
KLType = Literal["k1", "k2", "k3"]
"""The per-token KL estimator (:func:`asyncrl.algo.loss.kl_penalty`)."""
KLPlacement = Literal["reward", "loss"]
"""Where the KL penalty acts: a per-token reward, or a term of the loss."""
PolicyObjective = Literal["ppo", "cispo"]
"""The per-token surrogate: PPO's clipped ratio, or CISPO's clipped, detached IS weight on
``log π`` (MiniMax-M1)."""


class LossConfig(Section):
    """Advantages and the clipped policy loss (:func:`asyncrl.algo.loss.policy_loss`)."""

    adv_std_level: Literal["group", "batch", "none"] = "group"
    """Advantage normalisation: GRPO (group), batch std, or Dr.GRPO (none)."""
    leave_one_out: bool = False
    """RLOO baseline."""
    eps_clip: float = Field(0.2, gt=0)
    """PPO clip range (low side, and high side unless eps_clip_high): ratio ≥ 1 − eps_clip."""
    eps_clip_high: float | None = Field(None, gt=0)
    """Clip-higher (DAPO) upper range, e.g. 0.28; None: ``eps_clip``."""
    c_clip: float | None = Field(None, gt=1)
    """Dual-clip bound for negative advantages (> 1, e.g. 3); None: off."""
    behav_imp_weight_cap: float | None = Field(5.0, gt=0)
    """Decoupled PPO: tokens whose exp(proximal − behaviour) exceeds this are masked;
    None: no cap."""
    icepop_band: float | None = Field(None, gt=1)
    """IcePop: tokens whose behaviour weight exp(proximal − behaviour) lies outside
    [1/icepop_band, icepop_band] carry no loss (> 1, e.g. 2); None: off. Needs
    ``proximal = "recompute"``."""
    seq_mask_band: float | None = Field(None, gt=1)
    """Sequence-masked IS: a sequence whose geometric-mean behaviour weight
    exp(mean over its tokens of (proximal − behaviour)) lies outside
    [1/seq_mask_band, seq_mask_band] carries no loss at all (> 1, e.g. 1.5); None: off.
    Needs ``proximal = "recompute"``."""
    policy_objective: PolicyObjective = "ppo"
    """``ppo``: the clipped surrogate (GRPO, DAPO, GSPO, decoupled PPO). ``cispo``
    (MiniMax-M1): −sg(clip(r, 1 − eps_clip, 1 + eps_clip_high)) · A · log π, which keeps
    every token's gradient and bounds only its weight; ``c_clip`` does not apply."""
    importance_sampling_level: ImportanceLevel = "token"
    """Token ratios (PPO) or sequence-level ratios (GSPO)."""
    loss_agg: LossAgg = "token-mean"
    """How token losses become one number: the mean over all loss tokens, or the mean over
    episodes of each episode's token mean (or token sum over ``norm_len``); an episode of
    several samples (agent code) weighs once (:func:`~asyncrl.algo.loss.aggregate`)."""
    proximal: Literal["recompute", "behaviour"] = "recompute"
    """Decoupled PPO's proximal policy: the weights before the update (with one minibatch,
    the training forward's own logprobs; with several, one forward before the first), or
    approximated by the behaviour logprobs (standard PPO on the sampled tokens)."""
    separate_proximal_forward: bool = False
    """With ``proximal = "recompute"`` and one minibatch, recompute the proximal logprobs in
    a no-grad forward of their own, although the training forward gives the same values
    for free (for checks and benchmarks)."""
    norm_len: float | None = Field(None, gt=0)
    """The constant divisor of ``seq-mean-token-sum-norm`` (Dr.GRPO); None: the generation
    budget, ``rollout.sampling.max_new_tokens`` (times ``rollout.max_turns`` for
    ``multi_turn``), which the recipe fills in. Other aggregations ignore it. (An engine
    built without a recipe divides by the longest loss span of each batch.)"""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the per-token KL penalty to a frozen copy of the initial policy; 0: off
    (above 0 the trainer holds that second model; with ``trainer.lora``, the reference is
    the base model, its adapters disabled, and no copy is made)."""
    kl_type: KLType = "k2"
    """KL estimator, with d = log π_ref − log π: k1 = −d, k2 = d²/2, k3 = exp(d) − 1 − d.
    The default, k2 in the loss, is the one placement whose expected gradient is exactly
    ∇KL(π ‖ π_ref) there."""
    kl_in: KLPlacement = "loss"
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

    @model_validator(mode="after")
    def _combinations(self) -> LossConfig:
        """Refuses settings that would silently do nothing, naming the keys."""
        if self.proximal == "behaviour":
            for key in ("icepop_band", "seq_mask_band"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f'trainer.loss.{key} with trainer.loss.proximal = "behaviour": the '
                        "band bounds exp(proximal − behaviour), which is 1 when the "
                        "behaviour logprobs stand in for the proximal ones; set proximal = "
                        f'"recompute", or leave {key} unset'
                    )
        if self.policy_objective == "cispo" and self.c_clip is not None:
            raise ValueError(
                f"trainer.loss.c_clip = {self.c_clip:g} with trainer.loss.policy_objective = "
                '"cispo": the dual clip bounds PPO\'s surrogate, CISPO has none to bound; '
                "leave c_clip unset"
            )
        return self


class ShapingConfig(Section):
    """Reward shaping, before advantages (the buffer applies it as it admits a group):
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
