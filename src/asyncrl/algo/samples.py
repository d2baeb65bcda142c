"""The training batch of one step: the batch's groups become train samples, with group (or
episode) advantages from the rewards each group was given at admission and, for truncated
samples, a cleared loss mask. Pure: the same groups and recipe give the same batch."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.algo.advantages import episode_advantages, group_advantages
from asyncrl.config.recipe import Recipe
from asyncrl.train.batch import Sample
from asyncrl.wire.messages import Group


def build_samples(groups: Sequence[Group], recipe: Recipe) -> tuple[list[Sample], dict[str, float]]:
    """Train samples with group advantages, in the order of ``groups`` and their samples.

    The advantages are computed from each group's ``shaped_rewards``, shaped once as the
    buffer admitted the group (``trainer.shaping``,
    :func:`~asyncrl.algo.shaping.recipe_shaped_rewards`; the numbers its dynamic filter
    judged), with ``L`` the generated tokens of a sample (its loss-mask sum)::

        r' = clamp((r + overlong(L) + bias) · scale, −clip, clip)

    where ``overlong`` is DAPO's soft penalty over the last ``overlong_buffer`` tokens of
    the generation budget (0 when the buffer is 0). ``reward_mean`` stays the raw reward.

    Episodes of several samples (agent code whose calls do not all continue one another)
    take the baseline and scale of their group's episodes, each episode's reward being its
    final sample's (:func:`~asyncrl.algo.advantages.episode_advantages`). A group's
    episodes are its ``group_index`` es 0 … G − 1 (the buffer admits only whole groups).

    With ``trainer.loss.mask_truncated`` (DAPO's overlong filtering), a sample that stopped
    on its token budget (``finish_reason == "length"``) keeps its place in its group's
    baseline but carries no loss: its loss mask is cleared.
    """
    loss_cfg = recipe.trainer.loss
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
            [torch.tensor(g.shaped_rewards, dtype=torch.float32) for g in groups],
            [torch.tensor([t.group_index for t in g.samples]) for g in groups],
            std_level=std_level,
            leave_one_out=loss_cfg.leave_one_out,
        )
        adv = torch.cat(per_group)
    samples = []
    masked = 0
    for t, a in zip(trained, adv.tolist(), strict=True):
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


__all__ = ["build_samples"]
