"""The trainer's records of a run: a line per step in ``metrics.jsonl`` (and every other
sink), a line per trained sample in ``trained_samples.jsonl``, a line per published
version in ``weights.jsonl`` (its transport and whom it reached), with what a batch alone
says (response lengths, reward shape per group, staleness); records of steps a dead
trainer took after its last checkpoint are dropped on restart."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.algo.shaping import replies
from asyncrl.observe.sinks import open_sinks

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.wire.messages import Group, TrainSample, Trajectory

SAMPLES_FILE = "trained_samples.jsonl"
METRICS_FILE = "metrics.jsonl"
WEIGHTS_FILE = "weights.jsonl"

TRAIN_KEYS = {"loss": "loss", "kl_ref": "kl", "clip_frac": "clip_frac", "grad_norm": "grad_norm"}
"""Train statistics recorded under a top-level name (``lr`` too); the others go under
``train/``."""


def token_digest(ids: list[int]) -> str:
    """A short fingerprint of a token sequence (``trained_samples.jsonl``'s
    ``tokens_sha1``): what was trained can be matched with what was sampled without
    writing every sequence out."""
    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def batch_stats(groups: Sequence[Group], max_new_tokens: int) -> dict[str, float]:
    """Response lengths and per-group reward shape of one training batch.

    - ``response_length/mean``, ``/max``: generated tokens per sample (loss-mask sum);
    - ``response_length/clip_ratio``: share of samples whose (last) reply stopped on the
      token budget;
    - ``reward_groups/all_zero``, ``/all_one``: share of groups whose rewards are all <= 0,
      or all >= 1 (no GRPO signal either way);
    - ``reward_groups/std_mean``: mean over groups of the within-group reward std
      (population std: the spread GRPO normalises by);
    - ``versions/mixed_samples``: samples whose tokens span two policy versions or more.
    """
    trajectories = [t for g in groups for t in g.samples]
    masks = [t.loss_mask.numpy().astype(bool) for t in trajectories]
    lengths = [int(m.sum()) for m in masks]
    # A reply that filled its budget counts as cut even when it ended on a stop token; a
    # sample of several replies (multi-turn, agents) is judged by its last reply's finish
    # reason only, since its total length may exceed one reply's budget.
    clipped = [
        t.finish_reason == "length" or (n >= max_new_tokens and replies(m) == 1)
        for t, n, m in zip(trajectories, lengths, masks, strict=True)
    ]
    rewards = [[t.reward for t in g.samples] for g in groups]
    stds = []
    for g in rewards:
        mu = sum(g) / len(g)
        stds.append((sum((r - mu) ** 2 for r in g) / len(g)) ** 0.5)
    n_groups = max(1, len(rewards))
    return {
        "response_length/mean": sum(lengths) / max(1, len(lengths)),
        "response_length/max": float(max(lengths, default=0)),
        "response_length/clip_ratio": sum(clipped) / max(1, len(clipped)),
        "reward_groups/all_zero": sum(all(r <= 0 for r in g) for g in rewards) / n_groups,
        "reward_groups/all_one": sum(all(r >= 1 for r in g) for g in rewards) / n_groups,
        "reward_groups/std_mean": sum(stds) / n_groups,
        # samples whose tokens came from two versions or more (an update mid-generation)
        "versions/mixed_samples": float(sum(t.versions_spanned > 1 for t in trajectories)),
    }


def drop_records_after(path: Path, step: int) -> int:
    """Rewrites a JSON-lines file without the records of steps after ``step`` (written
    under a temporary name, then renamed); returns how many were dropped."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record_step = int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            dropped += 1  # a line torn by the killed writer
            continue
        if record_step > step:
            dropped += 1
        else:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)
    return dropped


class StepRecords:
    """Writes the trainer's records of one run; :meth:`open` first, :meth:`close` last."""

    def __init__(self, recipe: Recipe, run_dir: Path) -> None:
        self.recipe = recipe
        self.run_dir = run_dir
        self.sinks: Any = None
        self._t_start = time.monotonic()
        self._samples_total = 0
        self._tokens_total = 0

    def open(self, kept_step: int) -> None:
        """Drops the records of steps after ``kept_step`` (the restored checkpoint's: what
        a dead trainer recorded after it did not happen; 0 in a fresh run), then opens the
        sinks."""
        for name in (SAMPLES_FILE, METRICS_FILE):
            drop_records_after(self.run_dir / name, kept_step)
        self.sinks = open_sinks(self.recipe, self.run_dir, jsonl=METRICS_FILE, job="trainer")

    def close(self) -> None:
        if self.sinks is not None:
            self.sinks.close()

    def published(self, line: dict[str, Any]) -> None:
        """Appends a published version's line to ``weights.jsonl``."""
        with open(self.run_dir / WEIGHTS_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")

    def step(
        self,
        step: int,
        version: int,
        groups: Sequence[Group],
        counters: dict[str, int],
        stats: dict[str, float],
        train_stats: dict[str, float],
        times: dict[str, float],
        live: dict[str, float],
    ) -> dict[str, float]:
        """Records step ``step`` (which took the policy to ``version``) trained on
        ``groups``: a line per sample, and the step's record to every sink: ``stats`` (the
        batch's rewards and advantages), the buffer's ``counters``, staleness, throughput,
        ``train_stats``, ``times`` (``time_<phase>_s``), :func:`batch_stats`, the agent
        metrics (:func:`agent_metrics`) and ``live`` (the fleet's
        and the drops' numbers). Returns the record's numbers."""
        samples = [t for g in groups for t in g.samples]
        trained_at = version - 1  # the weights these samples updated
        staleness = []
        n_tokens = 0
        with open(self.run_dir / SAMPLES_FILE, "a") as f:
            for t in samples:
                # a sample without a generated token (greedy calls only) trained nothing
                s = trained_at - t.head_version if t.head_version >= 0 else None
                if s is not None:
                    staleness.append(s)
                ids = t.input_ids.numpy()
                response_tokens = int(t.loss_mask.numpy().sum())
                n_tokens += response_tokens
                line = {
                    "step": step,
                    "uid": t.uid,
                    "prompt_uid": t.prompt_uid,
                    "actor_id": t.actor_id,
                    "head_version": t.head_version,
                    "trained_version": trained_at,
                    "staleness": s,
                    "reward": t.reward,
                    "response_tokens": response_tokens,
                    "tokens": int(ids.size),
                    "tokens_sha1": token_digest(ids.tolist()),
                }
                f.write(json.dumps(line) + "\n")
        self._samples_total += len(samples)
        self._tokens_total += n_tokens
        elapsed = time.monotonic() - self._t_start
        record: dict[str, Any] = {
            "step": step,
            "version": version,
            **stats,
            "accepted": counters.get("accepted", 0),
            "rejected": counters.get("rejected", 0),
            "staleness_mean": sum(staleness) / max(1, len(staleness)),
            "staleness_max": max(staleness, default=0),
            **{f"staleness/{s}": n for s, n in sorted(Counter(staleness).items())},
            "samples": len(samples),
            "samples_per_s": self._samples_total / elapsed,
            "tokens_per_s": self._tokens_total / elapsed,
            **{name: train_stats.get(key) for key, name in TRAIN_KEYS.items()},
            "lr": train_stats.get("lr"),
            **times,
            **batch_stats(groups, self.recipe.rollout.sampling.max_new_tokens),
            **agent_metrics(samples),
            **live,
            **{f"train/{k}": v for k, v in train_stats.items() if k not in (*TRAIN_KEYS, "lr")},
            "time": time.time(),
        }
        self.sinks.log(record, step)
        return {k: float(v) for k, v in record.items() if isinstance(v, int | float)}


def agent_metrics(trajectories: Sequence[Trajectory | TrainSample]) -> dict[str, float]:
    """The ``agent/...`` metrics of a batch of agent trajectories (those whose
    ``reward_info`` has ``turns``; none: ``{}``), per episode:

    - ``agent/turns``, ``agent/tool_calls``: means per episode;
    - ``agent/tool_success``: the fraction of calls that succeeded, over the samples that
      know (agent code that does not report ``tool_success`` is left out; none: absent);
    - ``agent/tool_errors/<reason>``: counts;
    - ``agent/tool_latency_s``: mean per call, over the samples that report it;
    - ``agent/endpoint_added_latency_s``: the endpoint's own time per call (agent code),
      mean over the calls."""
    # an episode of several samples (agent code) counts once, by its final sample
    infos = [
        t.reward_info
        for t in trajectories
        if "turns" in t.reward_info and t.episode_sample == t.episode_samples - 1
    ]
    if not infos:
        return {}
    metrics = {
        "agent/turns": sum(i["turns"] for i in infos) / len(infos),
        "agent/tool_calls": sum(i.get("tool_calls", 0) for i in infos) / len(infos),
    }
    known = [i for i in infos if "tool_success" in i]
    calls = sum(i.get("tool_calls", 0) for i in known)
    if known:
        metrics["agent/tool_success"] = (
            sum(i["tool_success"] for i in known) / calls if calls else 0.0
        )
    timed = [i for i in infos if "tool_latency_s" in i]
    calls = sum(i.get("tool_calls", 0) for i in timed)
    if timed:
        metrics["agent/tool_latency_s"] = (
            sum(i["tool_latency_s"] for i in timed) / calls if calls else 0.0
        )
    served = [i for i in infos if "endpoint_added_latency_s" in i]
    if served:
        n = sum(i["turns"] for i in served)
        added = sum(i["endpoint_added_latency_s"] * i["turns"] for i in served)
        metrics["agent/endpoint_added_latency_s"] = added / n if n else 0.0
    errors: Counter[str] = Counter()
    for i in infos:
        errors.update(i.get("tool_errors") or {})
    metrics.update({f"agent/tool_errors/{reason}": float(n) for reason, n in errors.items()})
    return metrics


__all__ = ["StepRecords", "batch_stats", "drop_records_after", "token_digest"]
