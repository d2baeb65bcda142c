"""The record of what each trainer step consumed, for ``asyncrl replay``.

A run keeps one file per step, ``<run>/replay/step-<step>.bin``: a
:class:`~asyncrl.wire.messages.TrainedBatch` in the wire codec's bytes
(:func:`~asyncrl.wire.codec.encode`, the envelope that names its kind and schema version),
compressed with zlib. It holds the batch as the buffer served it (the groups, in batch
order, each with its samples: token ids, loss mask, behaviour logprobs, versions, reward,
``sampled_with``, and its shaped rewards) and what else the step's result depends on or
is checked against: the step and epoch, the trainer's ranks, threads and allocator, the
torch version, a digest of the recipe's settings that shape a step
(:func:`settings_digest`) and the step's train statistics.

A file is written under a temporary name and renamed once whole, so a killed trainer
leaves a whole record or none. A trainer that restarts from the checkpoint of step c
first drops the records after c (what the dead trainer did after its checkpoint did not
happen), then writes c + 1, … again: the folder holds the run's final lineage.

Retention: the records are kept as long as the run folder, as its checkpoints are (a run
deletes none of its checkpoints). A record is needed only from the oldest checkpoint a
replay may start from: the records up to a checkpoint's step may go when every earlier
checkpoint and the initial weights are given up as starting points
(:func:`drop_records_through`).

Imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from asyncrl.config.recipe import Recipe
from asyncrl.runtime.allocator import loaded_mimalloc
from asyncrl.train.checkpoint import STATE_FILE, run_checkpoints
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import Group, TrainedBatch

REPLAY_DIR = "replay"
"""The run folder's sub-folder of step records."""

ZLIB_LEVEL = 6
"""zlib's default level: the ci and quickstart records shrink 20x and 10x (the prompt a
group's samples share is what compresses); level 9 saves 6-8 % more and lzma 12-20 %, for
several times the time (``bench/replay_record.py``)."""

NOT_SETTINGS = frozenset(
    {"node", "gpus", "ray_cpus", "cpus", "rendezvous", "checkpoint_every", "update_every"}
)
"""``trainer`` keys that place the trainer or schedule its side work but never change
what a step computes: left out of :func:`settings_digest`."""


def record_path(run_dir: Path, step: int) -> Path:
    return run_dir / REPLAY_DIR / f"step-{step:06d}.bin"


def recorded_steps(run_dir: Path) -> list[int]:
    """The steps the run has records of, in order."""
    steps = []
    for path in (run_dir / REPLAY_DIR).glob("step-*.bin"):
        if path.stem[5:].isdigit():
            steps.append(int(path.stem[5:]))
    return sorted(steps)


def pack(record: TrainedBatch) -> bytes:
    """The bytes of a record file."""
    return zlib.compress(encode(record), ZLIB_LEVEL)


def unpack(data: bytes) -> TrainedBatch:
    """A record from the bytes of its file; a damaged file raises ``zlib.error`` or
    :class:`~asyncrl.wire.codec.DecodeError`."""
    return decode(zlib.decompress(data), TrainedBatch)


def read_record(run_dir: Path, step: int) -> TrainedBatch | None:
    """The record of ``step``, or None when the run has none."""
    path = record_path(run_dir, step)
    if not path.is_file():
        return None
    return unpack(path.read_bytes())


def write_record(run_dir: Path, record: TrainedBatch) -> int:
    """Writes (or replaces) the record of ``record.step``, whole or not at all; returns
    the bytes written."""
    path = record_path(run_dir, record.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = pack(record)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
    return len(data)


def drop_records_after(run_dir: Path, step: int) -> int:
    """Deletes the records of the steps after ``step``; returns how many."""
    dropped = [s for s in recorded_steps(run_dir) if s > step]
    for s in dropped:
        record_path(run_dir, s).unlink()
    return len(dropped)


def drop_records_through(run_dir: Path, step: int) -> int:
    """Deletes the records of steps 1 … ``step``: what a run may do once the checkpoint
    of ``step`` is the oldest it keeps (a replay then starts there); returns how many."""
    dropped = [s for s in recorded_steps(run_dir) if s <= step]
    for s in dropped:
        record_path(run_dir, s).unlink()
    return len(dropped)


def settings_digest(recipe: Recipe) -> str:
    """SHA-256 of the recipe's settings that shape a train step: the model, the trainer
    (without :data:`NOT_SETTINGS`), the sampler's temperature and cut (the trainer's
    logprobs are of that distribution), the seed and the turn discount. A record made
    under other settings (a run resumed with other overrides) is trained by a replay with
    the run's current ``recipe.json`` all the same, and it says so."""
    trainer = recipe.trainer.model_dump(mode="json", exclude=set(NOT_SETTINGS))
    settings = {
        "model": recipe.model.model_dump(mode="json"),
        "trainer": trainer,
        "sampling": [recipe.trainer.temperature, recipe.trainer.top_k, recipe.trainer.top_p],
        "seed": recipe.run.seed,
        "turn_discount": recipe.rollout.turn_discount,
    }
    blob = json.dumps(settings, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def torch_version() -> str:
    """The installed torch's version, read without importing it."""
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return ""


class ReplayLog:
    """The trainer's side: one record per step it trains. :meth:`open` once the engine is
    built (its ranks and threads known), then :meth:`write` after each step."""

    def __init__(self, run_dir: Path, recipe: Recipe) -> None:
        self.run_dir = run_dir
        self.settings = settings_digest(recipe)
        self.world_size = 1
        self.threads = 1
        self.allocator = "mimalloc" if loaded_mimalloc() else "system"
        self.torch_version = torch_version()
        self.bytes_written = 0
        """The bytes of the records this trainer wrote."""

    def open(self, kept_step: int, *, world_size: int, threads: int) -> int:
        """Drops the records after ``kept_step`` (the restored checkpoint's step; 0 in a
        fresh run); returns how many. ``world_size`` and ``threads``: the trainer's ranks
        and each rank's torch threads, as every record states them."""
        self.world_size = world_size
        self.threads = threads
        return drop_records_after(self.run_dir, kept_step)

    def write(self, step: int, epoch: int, groups: Sequence[Group], stats: dict[str, float]) -> int:
        """Records step ``step``, trained on ``groups`` with ``stats`` as its outcome (the
        timings are left out: they differ in every run); returns the bytes written."""
        record = TrainedBatch(
            step=step,
            epoch=epoch,
            groups=list(groups),
            world_size=self.world_size,
            threads=self.threads,
            allocator=self.allocator,
            torch_version=self.torch_version,
            settings_sha256=self.settings,
            stats=outcome(stats),
        )
        written = write_record(self.run_dir, record)
        self.bytes_written += written
        return written


def outcome(stats: dict[str, float]) -> dict[str, float]:
    """The numbers of a step's train statistics that its inputs determine: all but the
    timings and rates."""
    return {
        k: float(v)
        for k, v in stats.items()
        if not k.startswith("time/") and k not in ("tokens_per_s",)
    }


class ReplayError(ValueError):
    """A replay that cannot start: what is missing or wrong, in words for the user."""


@dataclass
class ReplayPlan:
    """What ``asyncrl replay`` trains: the run's recipe, from ``start`` (0: the initial
    weights, else the step of ``start_checkpoint``) through ``until``, checking the
    weights at the run's ``checkpoints`` in that range; ``first`` is the first record,
    which says how the run's trainer ran (ranks, threads, allocator)."""

    run_dir: Path
    recipe: Recipe
    start: int
    start_checkpoint: Path | None
    until: int
    checkpoints: dict[int, Path]
    first: TrainedBatch


def plan_replay(
    run_dir: Path, start_from: str | None = None, until: int | None = None
) -> ReplayPlan:
    """The replay of the run at ``run_dir`` from the checkpoint ``start_from`` names (its
    folder, or its step; None: the initial weights) through step ``until`` (None: the
    last recorded step, or the last checkpoint if that is later). Raises
    :class:`ReplayError` naming what is missing."""
    recipe_path = run_dir / "recipe.json"
    if not recipe_path.is_file():
        raise ReplayError(f"{run_dir} is not a run folder (no recipe.json)")
    recipe = Recipe.model_validate(json.loads(recipe_path.read_text()))
    steps = recorded_steps(run_dir)
    if not steps:
        raise ReplayError(
            f"{run_dir} has no step records ({REPLAY_DIR}/): it was trained before "
            "asyncrl recorded them, or its trainer took no step"
        )
    checkpoints = run_checkpoints(run_dir)
    start, start_checkpoint = 0, None
    if start_from is not None:
        start_checkpoint = _checkpoint_named(start_from, checkpoints)
        start = int(json.loads((start_checkpoint / STATE_FILE).read_text())["step"])
    # by default through the last checkpoint too: a record missing before it fails
    last = until if until is not None else max([steps[-1], *checkpoints])
    if last <= start:
        raise ReplayError(f"nothing to replay: --until {last} is not after step {start}")
    first = read_record(run_dir, start + 1)
    if first is None:
        raise ReplayError(f"step {start + 1} has no record in {run_dir / REPLAY_DIR}")
    return ReplayPlan(
        run_dir=run_dir,
        recipe=recipe,
        start=start,
        start_checkpoint=start_checkpoint,
        until=last,
        checkpoints={s: p for s, p in checkpoints.items() if start <= s <= last},
        first=first,
    )


def _checkpoint_named(name: str, checkpoints: dict[int, Path]) -> Path:
    """The checkpoint ``--from`` names: a folder, or the step of one of the run's."""
    if name.isdigit():
        if int(name) not in checkpoints:
            have = ", ".join(map(str, checkpoints)) or "none"
            raise ReplayError(f"--from {name}: the run has no checkpoint of that step ({have})")
        return checkpoints[int(name)]
    path = Path(name)
    if not (path / STATE_FILE).is_file():
        raise ReplayError(f"--from {name}: not a complete checkpoint (no {STATE_FILE})")
    return path


__all__ = [
    "REPLAY_DIR",
    "ReplayError",
    "ReplayLog",
    "ReplayPlan",
    "drop_records_after",
    "drop_records_through",
    "outcome",
    "pack",
    "plan_replay",
    "read_record",
    "record_path",
    "recorded_steps",
    "settings_digest",
    "unpack",
    "write_record",
]
