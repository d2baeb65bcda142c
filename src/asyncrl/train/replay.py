"""``asyncrl replay``'s training: the run's trainer built again from its recipe, stepped
through the run's records (:mod:`asyncrl.train.replay_log`), its weights checked against
each checkpoint's SHA-256.

Each step goes as the trainer actor's did: the record's groups become samples with
:func:`~asyncrl.train.batch.build_samples` (the recipe's loss config and turn discount),
rank 0 leads the ranks through ``train`` (:class:`~asyncrl.train.commands.Leader`), and
the step's statistics are compared with the recorded ones. The process must already run
as the run's trainer ran (its allocator, its torch threads, its world size):
:mod:`asyncrl.entry.replay` sees to that before torch is imported.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from asyncrl.config.schema import resolve_device
from asyncrl.runtime.allocator import loaded_mimalloc
from asyncrl.train.batch import build_samples
from asyncrl.train.checkpoint import checkpoint_weights_sha256
from asyncrl.train.commands import Leader, follow
from asyncrl.train.engine import build_train_engine
from asyncrl.train.replay_log import ReplayPlan, outcome, read_record, settings_digest

SHOWN = ("loss", "grad_norm", "entropy")
"""Statistics each step's line shows."""

_Say = Callable[[str], None]


def replay_rank(plan: ReplayPlan, out: TextIO, export: str | None = None) -> int:
    """This rank's part of the replay: rank 0 trains through ``plan`` and reports to
    ``out`` (0: every checkpoint and every step's statistics matched; 1: one differs, or a
    record is missing); the other ranks follow it. ``export``: a folder for the replayed weights at the last step
    (HF, as the run published them)."""
    if resolve_device(plan.recipe.trainer.device) == "cpu":
        # The trainer's CPU kernels give the same bits with this as without (runs trained
        # without it replay bit for bit with it); here it is a guard: an op torch knows to
        # be nondeterministic raises, and memory a kernel reads unwritten comes back NaN.
        # Not on CUDA, where it would pick other kernels than the run had.
        torch.use_deterministic_algorithms(True)
    engine = build_train_engine(plan.recipe)
    torch.set_num_threads(plan.first.threads)  # the run's, whatever the recipe says now
    if int(os.environ.get("RANK", "0")) > 0:
        return follow(engine)
    ranks = Leader(engine)
    try:
        code = _replay(ranks, plan, out)
        if export is not None:
            ranks.export(export)
            print(f"replayed weights of step {engine.step}: {export}", file=out, flush=True)
        return code
    finally:
        ranks.stop()


def _replay(ranks: Leader, plan: ReplayPlan, out: TextIO) -> int:
    recipe = plan.recipe
    first = plan.first
    origin = "the initial weights" if plan.start == 0 else f"the checkpoint {plan.start_checkpoint}"
    say = _printer(out)
    say(f"replay {plan.run_dir}: steps {plan.start + 1}-{plan.until} from {origin}")
    here = (ranks.world_size, torch.get_num_threads(), _allocator(), torch.__version__)
    run = (first.world_size, first.threads, first.allocator, first.torch_version)
    say(f"  trainer: {_describe(*here)}; the run's: {_describe(*run)}")
    if torch.are_deterministic_algorithms_enabled():
        say("  torch.use_deterministic_algorithms(True), unwritten memory read as NaN")
    differing: list[int] = []
    matched: list[int] = []
    if plan.start_checkpoint is not None:
        ranks.load(plan.start_checkpoint)
        same = _check(ranks, plan.start_checkpoint, plan.start, say)
        (matched if same else differing).append(plan.start)
    settings = settings_digest(recipe)
    parted: int | None = None
    warned = False
    for step in range(plan.start + 1, plan.until + 1):
        record = first if step == first.step else read_record(plan.run_dir, step)
        if record is None:
            say(f"step {step}: no record; the replay stops here")
            return 1
        if record.settings_sha256 != settings and not warned:
            warned = True  # once: a resumed run's later steps all share its new settings
            say(f"step {step}: trained under other settings than recipe.json's (a resume?)")
        samples, _ = build_samples(
            record.groups, recipe.trainer.loss, turn_discount=recipe.rollout.turn_discount
        )
        stats = outcome(ranks.train(samples))
        others = sorted(
            (k for k in record.stats if not _same(stats.get(k), record.stats[k])),
            key=lambda k: (k not in SHOWN, k),  # the shown ones first
        )
        if others and parted is None:
            parted = step
        shown = "  ".join(f"{k} {stats[k]:.6g}" for k in SHOWN if k in stats)
        verdict = "as recorded" if not others else f"differs: {', '.join(others[:4])}"
        say(f"step {step:>6}  {shown}  {verdict}")
        if step in plan.checkpoints:
            same = _check(ranks, plan.checkpoints[step], step, say)
            (matched if same else differing).append(step)
    for line in _summary(matched, differing, parted, plan):
        say(line)
    return 1 if differing or parted is not None else 0


def _check(ranks: Leader, checkpoint: Path, step: int, say: _Say) -> bool:
    """Compares the weights now with the SHA-256 the checkpoint of ``step`` recorded, and
    says so; True unless they differ (a checkpoint that recorded none is reported, not
    failed)."""
    recorded = checkpoint_weights_sha256(checkpoint)
    digest = ranks.weights_sha256()
    if recorded is None:
        say(f"step {step:>6}  sha256 {digest}  (the checkpoint recorded none)")
        return True
    if digest == recorded:
        say(f"step {step:>6}  sha256 {digest}  = checkpoint")
        return True
    say(f"step {step:>6}  sha256 {digest}  DIFFERS from the checkpoint's {recorded}")
    return False


def _summary(
    matched: list[int], differing: list[int], parted: int | None, plan: ReplayPlan
) -> list[str]:
    checked = len(matched) + len(differing)
    if not differing:
        steps = f" (steps {', '.join(map(str, matched))})" if matched else ""
        lines = [f"replay: {checked} of {checked} checkpoints identical{steps}"]
        if parted is not None:  # no checkpoint after the step, or a statistic alone parts
            lines.append(f"replay: the step statistics part from the run's at step {parted}")
        return lines
    since = max((s for s in matched if s < differing[0]), default=plan.start)
    lines = [
        f"replay: {len(differing)} of {checked} checkpoints differ; first at step {differing[0]} "
        f"(identical through step {since})"
    ]
    if parted is not None:
        lines.append(f"replay: the run and its replay part at step {parted}")
    return lines


def _describe(world_size: int, threads: int, allocator: str, version: str) -> str:
    return f"{world_size} rank(s), {threads} thread(s), {allocator}, torch {version}"


def _allocator() -> str:
    return "mimalloc" if loaded_mimalloc() else "system"


def _printer(out: TextIO) -> _Say:
    def say(line: str) -> None:
        print(line, file=out, flush=True)

    return say


def _same(a: float | None, b: float) -> bool:
    """Bitwise-equal floats (NaN equals NaN)."""
    if a is None:
        return False
    return a == b or (math.isnan(a) and math.isnan(b))


__all__ = ["replay_rank"]
