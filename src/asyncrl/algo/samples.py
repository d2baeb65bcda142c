"""The training batch of one step: whole groups of scored samples become train samples,
with shaped rewards, group (or episode) advantages and, for truncated samples, a cleared
loss mask. Pure: the same samples and recipe give the same batch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.wire.messages import TrainSample


def build_samples(
    trajectories: Sequence[TrainSample], recipe: Any
) -> tuple[list[Any], dict[str, float]]:
    """Train samples with group advantages from whole groups laid end to end.

    The rewards are shaped first (``trainer.shaping``, :func:`~asyncrl.algo.shaping.recipe_shaped_rewards`: the numbers
    the buffer's dynamic filter judges too), with ``L`` the generated tokens of a sample
    (its loss-mask sum)::

        r' = clamp((r + overlong(L) + bias) · scale, −clip, clip)

    where ``overlong`` is DAPO's soft penalty over the last ``overlong_buffer`` tokens of
    the generation budget (0 when the buffer is 0). ``reward_mean`` stays the raw reward.

    Episodes of several samples (agent code whose calls do not all continue one another)
    take the baseline and scale of their group's episodes, each episode's reward being its
    final sample's (:func:`~asyncrl.algo.advantages.episode_advantages`).

    With ``trainer.loss.mask_truncated`` (DAPO's overlong filtering), a sample that stopped
    on its token budget (``finish_reason == "length"``) keeps its place in its group's
    baseline but carries no loss: its loss mask is cleared.
    """
    import torch

    from asyncrl.algo import episode_advantages, group_advantages
    from asyncrl.algo.shaping import recipe_shaped_rewards
    from asyncrl.train import Sample

    loss_cfg = recipe.trainer.loss
    rewards = torch.tensor([float(t.reward or 0.0) for t in trajectories], dtype=torch.float32)
    shaped = torch.tensor(recipe_shaped_rewards(trajectories, recipe), dtype=torch.float32)
    std_level = None if loss_cfg.adv_std_level == "none" else loss_cfg.adv_std_level
    if all(t.episode_samples == 1 for t in trajectories):
        adv = group_advantages(
            shaped,
            recipe.rollout.group_size,
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
    else:
        episode_of, finals = episodes_of(trajectories)
        adv = episode_advantages(
            shaped,
            torch.tensor(episode_of),
            shaped[finals],
            recipe.rollout.group_size,
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
    samples = []
    masked = 0
    for t, a in zip(trajectories, adv.tolist(), strict=True):
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


def episodes_of(trajectories: Sequence[TrainSample]) -> tuple[list[int], list[int]]:
    """For samples of whole groups laid end to end, each in episode order: the episode
    index of every sample, and the position of each episode's final sample (the one that
    holds its last call, whose reward is the episode's)."""
    episode_of: list[int] = []
    finals: list[int] = []
    key = None
    for i, t in enumerate(trajectories):
        if (t.prompt_uid, t.group_index) != key:
            key = (t.prompt_uid, t.group_index)
            finals.append(i)
        if t.episode_sample == t.episode_samples - 1:
            finals[-1] = i
        episode_of.append(len(finals) - 1)
    return episode_of, finals


__all__ = ["build_samples", "episodes_of"]
