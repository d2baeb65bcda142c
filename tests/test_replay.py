"""``asyncrl replay``'s parts: the weights' digest, the step records (format, atomic
writes, the final lineage, retention) and the replay's plan. The whole command on a real
run is tests/test_e2e_replay.py."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers.tiny import (
    full_weights,
    one_torch_thread,
    random_batch,
    resume_engine,
    tiny_engine,
)

from asyncrl.config.recipe import load_recipe
from asyncrl.train import dcp
from asyncrl.train.checkpoint import (
    STATE_FILE,
    WEIGHTS_SHA256,
    checkpoint_weights_sha256,
    run_checkpoints,
)
from asyncrl.train.commands import Leader
from asyncrl.train.replay_log import (
    ReplayError,
    ReplayLog,
    drop_records_through,
    outcome,
    pack,
    plan_replay,
    read_record,
    record_path,
    recorded_steps,
    settings_digest,
    unpack,
)
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import Array, Group, SampledWith, TrainedBatch, TrainSample


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


# -- the weights' digest ------------------------------------------------------------------


def test_the_digest_covers_names_dtypes_shapes_and_bytes_in_any_order() -> None:
    weights = {"b.weight": torch.arange(6.0).reshape(2, 3), "a.bias": torch.ones(3)}
    digest = dcp.weights_sha256(weights.items())
    assert digest == dcp.weights_sha256(reversed(list(weights.items())))
    assert len(digest) == 64
    flipped = weights["b.weight"].clone()
    flipped.view(torch.int32)[0, 0] ^= 1  # the last bit of one float
    changed = [
        {**weights, "b.weight": flipped},
        {**weights, "b.weight": weights["b.weight"].reshape(3, 2)},  # same bytes, shape
        {**weights, "a.bias": weights["a.bias"].view(torch.int32)},  # same bytes, dtype
        {"c.weight": weights["b.weight"], "a.bias": weights["a.bias"]},  # a name
        {"b.weight": weights["b.weight"]},  # a tensor fewer
    ]
    digests = {dcp.weights_sha256(w.items()) for w in changed}
    assert len(digests) == len(changed) and digest not in digests
    with pytest.raises(ValueError, match="came twice"):
        dcp.weights_sha256([("a", torch.ones(1)), ("a", torch.ones(1))])


def test_the_leaders_digest_is_of_the_full_float32_weights() -> None:
    engine = tiny_engine()
    ranks = Leader(engine)
    before = ranks.weights_sha256()
    assert before == dcp.weights_sha256(full_weights(engine).items())
    ranks.train(random_batch(0))
    assert ranks.weights_sha256() not in (before, "")


def test_a_restored_checkpoint_trains_on_bit_for_bit(tmp_path: Path) -> None:
    """What replaying a run across a trainer restart rests on: the weights, optimizer state
    and RNG (the model has dropout) a checkpoint restores give the same bits as the engine
    that never stopped, step after step."""
    straight = Leader(resume_engine())
    for seed in range(2):
        straight.train(random_batch(seed))
    straight.save(tmp_path / "ckpt", {WEIGHTS_SHA256: straight.weights_sha256()})
    # one torch RNG per process: the engine that goes on first, then the restored one
    losses = [straight.train(random_batch(seed))["loss"] for seed in range(2, 4)]
    digest = straight.weights_sha256()
    resumed = Leader(resume_engine())
    resumed.load(tmp_path / "ckpt")
    assert resumed.weights_sha256() == checkpoint_weights_sha256(tmp_path / "ckpt")
    assert [resumed.train(random_batch(seed))["loss"] for seed in range(2, 4)] == losses
    assert resumed.weights_sha256() == digest


# -- the step records -----------------------------------------------------------------------


def group(prompt: str, rewards: list[float], generated: int = 3) -> Group:
    samples = []
    for i, reward in enumerate(rewards):
        n = 4 + generated
        mask = np.arange(n) >= 4
        samples.append(
            TrainSample(
                uid=f"{prompt}/{i}",
                prompt_uid=prompt,
                group_index=i,
                input_ids=Array.of(np.arange(n, dtype=np.int32) + i),
                loss_mask=Array.of(mask),
                logprobs=Array.of(np.where(mask, -1.5 - i, 0.0).astype(np.float32)),
                versions=Array.of(np.where(mask, 2, -1).astype(np.int32)),
                reward=reward,
                sampled_with=SampledWith(temperature=0.5) if i == 1 else None,
            )
        )
    return Group(prompt_uid=prompt, samples=samples, shaped_rewards=[r - 0.5 for r in rewards])


def record(step: int, **fields: object) -> TrainedBatch:
    values: dict[str, object] = dict(
        step=step,
        epoch=0,
        groups=[group("p", [1.0, 0.0]), group("q", [0.0, 0.0, 1.0])],
        world_size=1,
        threads=2,
        allocator="mimalloc",
        torch_version="2.x",
        settings_sha256="0" * 64,
        stats={"loss": 0.25, "grad_norm": float("nan")},
    )
    values.update(fields)
    return TrainedBatch.model_validate(values)


def test_a_record_is_the_wire_codecs_bytes_compressed() -> None:
    rec = record(3)
    data = pack(rec)
    assert len(data) < len(encode(rec))
    back = unpack(data)
    assert encode(back) == encode(rec)  # NaN included: the same bytes
    assert [g.prompt_uid for g in back.groups] == ["p", "q"]
    assert back.groups[0].samples[1].sampled_with == SampledWith(temperature=0.5)


def test_records_are_written_whole_and_a_restart_keeps_the_final_lineage(tmp_path: Path) -> None:
    recipe = load_recipe(None, [])
    log = ReplayLog(tmp_path, recipe)
    assert log.open(0, world_size=1, threads=2) == 0
    for step in range(1, 6):
        log.write(step, 0, record(step).groups, {"loss": float(step), "time/step_s": 1.0})
    assert recorded_steps(tmp_path) == [1, 2, 3, 4, 5]
    assert [p.name for p in (tmp_path / "replay").iterdir() if p.name.startswith(".")] == []
    first = read_record(tmp_path, 1)
    assert first is not None
    assert (first.threads, first.world_size, first.epoch) == (2, 1, 0)
    assert first.settings_sha256 == settings_digest(recipe)
    assert first.stats == {"loss": 1.0}  # no timings
    # a trainer restarted from the checkpoint of step 3: steps 4, 5 did not happen
    again = ReplayLog(tmp_path, recipe)
    assert again.open(3, world_size=1, threads=2) == 2
    assert recorded_steps(tmp_path) == [1, 2, 3]
    again.write(4, 1, record(4).groups, {"loss": 40.0})
    fourth = read_record(tmp_path, 4)
    assert fourth is not None and (fourth.epoch, fourth.stats["loss"]) == (1, 40.0)
    assert read_record(tmp_path, 5) is None
    assert drop_records_through(tmp_path, 2) == 2
    assert recorded_steps(tmp_path) == [3, 4]


def test_outcome_keeps_what_the_inputs_determine() -> None:
    stats = {"loss": 1.0, "grad_norm": 2, "time/step_s": 3.0, "tokens_per_s": 4.0}
    assert outcome(stats) == {"loss": 1.0, "grad_norm": 2.0}


def test_settings_digest_follows_what_shapes_a_step() -> None:
    base = settings_digest(load_recipe(None, []))
    placed = load_recipe(None, ["trainer.cpus=[0]", "trainer.checkpoint_every=3"])
    assert settings_digest(placed) == base
    for change in ("trainer.optim.lr=0.5", "rollout.sampling.temperature=0.5", "run.seed=7"):
        assert settings_digest(load_recipe(None, [change])) != base, change


# -- the plan -----------------------------------------------------------------------------


def fake_run(tmp_path: Path, steps: list[int], checkpoints: list[int]) -> Path:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "recipe.json").write_text(load_recipe(None, []).model_dump_json())
    for step in steps:
        path = record_path(run_dir, step)
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(pack(record(step)))
    for step in checkpoints:
        folder = run_dir / "checkpoints" / f"step_{step:06d}"
        folder.mkdir(parents=True)
        state = {"step": step, "version": step, "extra_state": {WEIGHTS_SHA256: "ab" * 32}}
        (folder / STATE_FILE).write_text(json.dumps(state))
    (run_dir / "checkpoints" / "step_000009.partial").mkdir(parents=True)
    return run_dir


def test_the_plan_takes_the_records_and_checkpoints_in_range(tmp_path: Path) -> None:
    run_dir = fake_run(tmp_path, [1, 2, 3, 4, 5, 6], [2, 4, 6])
    assert list(run_checkpoints(run_dir)) == [2, 4, 6]
    plan = plan_replay(run_dir)
    assert (plan.start, plan.until, list(plan.checkpoints), plan.first.step) == (0, 6, [2, 4, 6], 1)
    plan = plan_replay(run_dir, "2", 4)
    assert (plan.start, plan.until, list(plan.checkpoints), plan.first.step) == (2, 4, [2, 4], 3)
    plan = plan_replay(run_dir, str(run_dir / "checkpoints" / "step_000004"))
    assert (plan.start, plan.start_checkpoint) == (4, run_dir / "checkpoints" / "step_000004")
    record_path(run_dir, 6).unlink()  # through the last checkpoint all the same: step 6 fails
    assert plan_replay(run_dir).until == 6


@pytest.mark.parametrize(
    ("steps", "start_from", "until", "message"),
    [
        ([], None, None, "no step records"),
        ([2, 3], None, None, "step 1 has no record"),
        ([1, 2], "3", None, "no checkpoint of that step"),
        ([1, 2], "/nonexistent", None, "not a complete checkpoint"),
        ([1, 2, 3], "2", 2, "nothing to replay"),
    ],
)
def test_a_plan_that_cannot_be_says_why(
    tmp_path: Path, steps: list[int], start_from: str | None, until: int | None, message: str
) -> None:
    run_dir = fake_run(tmp_path, steps, [2])
    with pytest.raises(ReplayError, match=message):
        plan_replay(run_dir, start_from, until)
    with pytest.raises(ReplayError, match="not a run folder"):
        plan_replay(tmp_path)
