"""Where metric records go: one small interface, three backends.

A record is a flat ``{name: number}`` dict logged at a step. Every sink receives the same
names (``reward_mean``, ``eval/accuracy``, ``time_train_s`` ...), so a curve has one name in
``metrics.jsonl``, in TensorBoard and in W&B. The JSONL sink is always on; TensorBoard and
W&B follow ``run.tensorboard`` and ``run.wandb``.

Each process that writes metrics (the trainer, the eval actor) opens its own sinks: its
own JSONL file, its own TensorBoard event file in the shared ``<run>/tensorboard`` folder
(TensorBoard reads every event file of a folder as one run), and its own W&B run in a
group named after the run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe

TENSORBOARD_DIR = "tensorboard"


class Sink(Protocol):
    def log(self, record: dict[str, Any], step: int) -> None:
        """Writes one record at ``step`` (the policy version the numbers describe)."""

    def close(self) -> None: ...


def numeric(record: dict[str, Any]) -> dict[str, float]:
    """The finite numbers of a record (booleans count as numbers; None and text do not)."""
    out = {}
    for key, value in record.items():
        if isinstance(value, bool | int | float) and math.isfinite(float(value)):
            out[key] = float(value)
    return out


class JsonlSink:
    """One JSON object per line; the record as given, plus nothing."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1)  # line-buffered: a killed run keeps its lines

    def log(self, record: dict[str, Any], step: int) -> None:
        self._file.write(json.dumps(record) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    """Scalars in a TensorBoard event file; the tag is the metric's name, the event's step
    the record's step, its wall time the record's ``time``."""

    def __init__(self, logdir: Path, suffix: str) -> None:
        # run.tensorboard only: its protobuf modules load when a run asks for them
        from tensorboard.summary.writer.event_file_writer import (  # noqa: PLC0415 - optional
            EventFileWriter,
        )

        logdir.mkdir(parents=True, exist_ok=True)
        self._writer = EventFileWriter(str(logdir), filename_suffix=f".{suffix}")

    def log(self, record: dict[str, Any], step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event  # noqa: PLC0415 - as above
        from tensorboard.compat.proto.summary_pb2 import Summary  # noqa: PLC0415 - as above

        values = numeric(record)
        values.pop("step", None)  # the x-axis already
        wall = values.pop("time", None)
        summary = Summary(value=[Summary.Value(tag=k, simple_value=v) for k, v in values.items()])
        self._writer.add_event(Event(wall_time=wall or time.time(), step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A W&B run in the group named after the asyncrl run."""

    def __init__(self, recipe: Recipe, run_dir: Path, job: str) -> None:
        import wandb  # noqa: PLC0415 - optional: the wandb extra, for run.wandb only

        cfg = recipe.run.wandb
        assert cfg is not None
        name = cfg.name or recipe.run.name
        self._run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            name=name if job == "trainer" else f"{name}-{job}",
            group=recipe.run.name,
            job_type=job,
            tags=cfg.tags,
            dir=str(run_dir),
            config=recipe.model_dump(mode="json"),
            reinit=True,
        )
        # every curve is drawn against the policy version it describes
        self._run.define_metric("version")
        self._run.define_metric("*", step_metric="version")

    def log(self, record: dict[str, Any], step: int) -> None:
        self._run.log({**numeric(record), "version": float(step)})

    def close(self) -> None:
        self._run.finish()


class Sinks:
    """Fans a record out to every configured sink."""

    def __init__(self, sinks: list[Sink]) -> None:
        self.sinks = sinks

    def log(self, record: dict[str, Any], step: int) -> None:
        for sink in self.sinks:
            sink.log(record, step)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def open_sinks(recipe: Recipe, run_dir: Path, *, jsonl: str, job: str) -> Sinks:
    """The sinks of one writer process: ``<run>/<jsonl>`` always, TensorBoard and W&B when
    the recipe turns them on. ``job`` names the writer (``trainer``, ``eval``)."""
    sinks: list[Sink] = [JsonlSink(run_dir / jsonl)]
    if recipe.run.tensorboard:
        sinks.append(TensorBoardSink(run_dir / TENSORBOARD_DIR, job))
    if recipe.run.wandb is not None and recipe.run.wandb.mode != "disabled":
        sinks.append(WandbSink(recipe, run_dir, job))
    return Sinks(sinks)
