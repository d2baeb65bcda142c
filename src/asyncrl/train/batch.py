"""The unit of training data: one sequence with its loss inputs.

Alignment convention (shared by the sampler, :class:`Sample` and
``TrainEngine.compute_logprobs``): every per-token array has the length of ``input_ids``,
and the value at position ``t`` belongs to token ``t``. A logprob at ``t`` is
``log p(input_ids[t] | input_ids[:t])``; position 0 has no context, so its logprob is 0
and ``loss_mask[0]`` must be False. Where ``loss_mask`` is False (prompt, environment
tokens) logprobs are 0 by convention and never read.

:func:`build_samples` is the one place a step's batch of groups becomes samples: each
sample takes its advantage from the rewards its group was given at admission. Pure: the
same groups and loss config give the same batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.algo.advantages import episode_advantages, group_advantages
from asyncrl.algo.config import LossConfig
from asyncrl.wire.messages import Group, SampledWith, TrainSample


def _as_tensor(value: Any, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().to(device="cpu", dtype=dtype)
    # torch.tensor copies: numpy views of wire bytes are read-only, and torch warns on those.
    return torch.tensor(value, dtype=dtype)


@dataclass
class Sample:
    """One sequence (prompt + generated tokens) ready for the trainer.

    Attributes:
        input_ids: ``[L]`` int64 token ids.
        loss_mask: ``[L]`` bool, True on the generated tokens that carry a loss.
        behav_logprobs: ``[L]`` float32, the behaviour (sampling) policy's logprobs of the
            temperature-scaled distribution, 0 where ``loss_mask`` is False.
        advantages: a scalar (one per sequence, GRPO) or ``[L]`` float32 per token.
        old_logprobs: ``[L]`` float32 proximal-policy logprobs (decoupled PPO), or None.
        ref_logprobs: ``[L]`` float32 reference-policy logprobs for the KL penalty, or None.
        episode: the id of its episode within the batch: samples with the same id are one
            episode, which the seq-mean loss aggregations weigh once
            (:func:`~asyncrl.algo.loss.aggregate`); None: the sample is its own episode.
        sampled_with: the temperature and cut its tokens were drawn with, where its calls
            chose them (``rollout.endpoint_sampling = "per_call"``); None: the trainer's
            own (``rollout.sampling``). Every logprob of the sample (behaviour, proximal,
            reference, current) is of that distribution.
        group: the position of its group in the batch: a group's samples start with the
            same prompt, which the trainer forwards once for those of them that share a
            micro-batch (``trainer.share_prefix``); None: it shares with no sample.
        images: the image files (absolute paths) of a vision-language model's sample, one
            per image of its prompt, in order; ``input_ids`` already hold each image's
            placeholder tokens as :class:`~asyncrl.models.vision.VisionProcessor` expanded
            them. Empty: a text sample.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    behav_logprobs: torch.Tensor
    advantages: torch.Tensor | float
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    episode: int | None = None
    sampled_with: SampledWith | None = None
    group: int | None = None
    images: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.input_ids = _as_tensor(self.input_ids, torch.int64)
        self.images = tuple(str(p) for p in self.images)
        self.loss_mask = _as_tensor(self.loss_mask, torch.bool)
        self.behav_logprobs = _as_tensor(self.behav_logprobs, torch.float32)
        self.advantages = _as_tensor(self.advantages, torch.float32)
        if self.old_logprobs is not None:
            self.old_logprobs = _as_tensor(self.old_logprobs, torch.float32)
        if self.ref_logprobs is not None:
            self.ref_logprobs = _as_tensor(self.ref_logprobs, torch.float32)
        if self.input_ids.ndim != 1 or self.input_ids.numel() < 1:
            raise ValueError(
                f"input_ids must be 1-D and non-empty, got {tuple(self.input_ids.shape)}"
            )
        n = self.input_ids.numel()
        per_token = {
            "loss_mask": self.loss_mask,
            "behav_logprobs": self.behav_logprobs,
            "old_logprobs": self.old_logprobs,
            "ref_logprobs": self.ref_logprobs,
        }
        if self.advantages.ndim != 0:
            per_token["advantages"] = self.advantages
        for name, value in per_token.items():
            if value is not None and tuple(value.shape) != (n,):
                raise ValueError(f"{name} has shape {tuple(value.shape)}, input_ids ({n},)")
        if bool(self.loss_mask[0]):
            raise ValueError("loss_mask[0] must be False: the first token has no logprob")

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def advantages_per_token(self) -> torch.Tensor:
        """``[L]`` advantages, broadcasting a per-sequence scalar."""
        adv = self.advantages
        assert isinstance(adv, torch.Tensor)
        return adv.expand(len(self)) if adv.ndim == 0 else adv


Batch = Sequence[Sample]
"""A global training batch: every rank passes the same list, in the same order."""


def turns_to_go(sample: TrainSample) -> int:
    """How many calls of its episode came after this sample's last one:
    ``reward_info['turns_to_go']`` as the workflow recorded it (agent code whose episode
    gave several samples), else 0."""
    return int(sample.reward_info.get("turns_to_go", 0))


def build_samples(
    groups: Sequence[Group], loss_cfg: LossConfig, *, turn_discount: float = 1.0
) -> tuple[list[Sample], dict[str, float]]:
    """Train samples with group advantages, in the order of ``groups`` and their samples.

    The advantages are computed from each group's ``shaped_rewards``, shaped once as the
    buffer admitted the group (``trainer.shaping``,
    :func:`~asyncrl.algo.shaping.shaped_sample_rewards`; the numbers its dynamic filter
    judged), with ``L`` the generated tokens of a sample (its loss-mask sum)::

        r' = clamp((r + overlong(L) + bias) · scale, −clip, clip)

    where ``overlong`` is DAPO's soft penalty over the last ``overlong_buffer`` tokens of
    the generation budget (0 when the buffer is 0). ``reward_mean`` stays the raw reward.

    Episodes of several samples (agent code whose calls do not all continue one another)
    take the advantage of their episode, computed among the group's episodes from each
    episode's reward (its final sample's, undiscounted), discounted by the calls still to
    come after the sample (:func:`turns_to_go`)::

        A_j = γ^k_j · A_episode          (γ = ``turn_discount``, ``rollout.turn_discount``)

    (:func:`~asyncrl.algo.advantages.episode_advantages`). A group's episodes are its
    ``group_index`` es 0 … G − 1 (the buffer admits only whole groups).

    With ``trainer.loss.mask_truncated`` (DAPO's overlong filtering), a sample that stopped
    on its token budget (``finish_reason == "length"``) keeps its place in its group's
    baseline but carries no loss: its loss mask is cleared.

    Each sample's ``episode`` is the position of its (group, ``group_index``) in the batch,
    so that the seq-mean loss aggregations weigh an episode of several samples once, and
    its ``group`` the position of its group, whose prompt the trainer may forward once
    (``trainer.share_prefix``).
    """
    std_level = None if loss_cfg.adv_std_level == "none" else loss_cfg.adv_std_level
    trained = [t for g in groups for t in g.samples]
    rewards = torch.tensor([t.reward for t in trained], dtype=torch.float32)
    shaped = torch.tensor([r for g in groups for r in g.shaped_rewards], dtype=torch.float32)
    if all(t.episode_samples == 1 for t in trained):
        shaped_NG = torch.tensor([g.shaped_rewards for g in groups], dtype=torch.float32)
        adv_NG = group_advantages(
            shaped_NG, std_level=std_level, leave_one_out=loss_cfg.leave_one_out
        )
        adv = adv_NG.reshape(-1)
    else:
        episode_NG = torch.tensor(
            [[g.shaped_rewards[i] for i in g.final_positions] for g in groups],
            dtype=torch.float32,
        )
        per_group = episode_advantages(
            episode_NG,
            [torch.tensor([t.group_index for t in g.samples]) for g in groups],
            [torch.tensor([turns_to_go(t) for t in g.samples]) for g in groups],
            turn_discount=turn_discount,
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
        adv = torch.cat(per_group)
    episode_of: dict[tuple[int, int], int] = {}
    episodes = [
        episode_of.setdefault((k, t.group_index), len(episode_of))
        for k, g in enumerate(groups)
        for t in g.samples
    ]
    group_of = [k for k, g in enumerate(groups) for _ in g.samples]
    samples = []
    masked = 0
    for t, a, e, k in zip(trained, adv.tolist(), episodes, group_of, strict=True):
        loss_mask = torch.from_numpy(t.loss_mask.numpy().astype(bool))
        if loss_cfg.mask_truncated and t.finish_reason == "length":
            loss_mask = torch.zeros_like(loss_mask)
            masked += 1
        samples.append(
            Sample(
                input_ids=torch.from_numpy(t.input_ids.numpy().astype("int64")),
                loss_mask=loss_mask,
                behav_logprobs=torch.from_numpy(t.logprobs.numpy().astype("float32")),
                advantages=float(a),
                episode=e,
                sampled_with=t.sampled_with,
                group=k,
                images=tuple(t.images),
            )
        )
    stats = {
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "reward_shaped_mean": float(shaped.mean()),
        "adv_abs_mean": float(adv.abs().mean()),
    }
    if loss_cfg.mask_truncated:
        stats["truncated_masked"] = float(masked)
    return samples, stats
