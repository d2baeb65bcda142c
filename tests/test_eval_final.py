"""An eval actor that starts after the trainer announced its last weights and left (the
replacement of one killed at the end of a run) evaluates the last version from the
trainer's final checkpoint instead of waiting for an announcement that will never come."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from actor_helpers.eval_kit import eval_actor

import asyncrl.actors.eval as eval_module
from asyncrl.observe.sinks import open_sinks
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.train.checkpoint import STATE_FILE, write_checkpoint_meta
from asyncrl.weights.build import build_receiver


def checkpoint(run_dir: Path, step: int) -> Path:
    path = run_dir / "checkpoints" / f"step_{step:06d}"
    (path / "hf").mkdir(parents=True)
    (path / STATE_FILE).write_text(json.dumps({"step": step, "version": step}))
    write_checkpoint_meta(run_dir, path)
    return path


async def ready_actor(tmp_path: Path, nats: NatsInfo) -> eval_module.EvalActor:
    """The eval kit's actor (``trainer.max_steps = 8``, ``eval.every = 4``) with what its
    setup would add: a bus, its sinks and a listening receiver; no baseline to score (a
    checkpoint exists: this is not the run's start)."""
    actor = await eval_actor(tmp_path, nats, [], lambda text: "\\boxed{408}")
    actor._bus = await Bus.connect(nats, name="eval-0-r1")
    actor.sinks = open_sinks(actor.recipe, tmp_path, jsonl=eval_module.EVAL_FILE, job="eval")
    actor.receiver = build_receiver(
        actor.recipe, actor._engine, actor.bus, actor.subjects, "eval-0-r1", want=actor.due
    )
    await actor.receiver.listen()
    actor._baseline = False
    return actor


async def test_the_last_version_comes_from_the_final_checkpoint_when_none_is_announced(
    tmp_path: Path, nats_server: NatsInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(eval_module, "FINAL_CHECK_EVERY", 0.2)
    checkpoint(tmp_path, 4)  # the trainer is still training: nothing to take yet
    actor = await ready_actor(tmp_path, nats_server)
    loaded: list[tuple[object, int]] = []
    update = actor._engine.update_weights

    async def spy(source: object, version: int) -> None:
        loaded.append((source, version))
        await update(source, version)  # type: ignore[arg-type]

    actor._engine.update_weights = spy  # type: ignore[method-assign]
    try:
        run = asyncio.create_task(actor.run())
        await asyncio.sleep(1.0)  # five idle checks: the step-4 checkpoint is not the last
        assert not run.done() and actor.evaluated == [] and loaded == []
        final = checkpoint(tmp_path, 8)  # the trainer wrote its last checkpoint and left
        await asyncio.wait_for(run, 30)
    finally:
        await actor.teardown()
        await actor.bus.close()
    assert loaded == [(final / "hf", 8)]
    assert actor.evaluated == [8]
    records = [json.loads(x) for x in (tmp_path / eval_module.EVAL_FILE).read_text().splitlines()]
    assert [r["version"] for r in records] == [8]
    assert records[0]["eval/accuracy"] == pytest.approx(1 / 3)  # 408 is right for 12 * 34
