"""``asyncrl audit``: each check holds on a sound run folder and names what breaks it.

The folders are written by hand, the smallest that show each fault: two steps of two
prompts, η = 1, versions per token chosen so that the ages are known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.observe.audit import audit, audit_run, read_jsonl
from asyncrl.train.replay_log import record_path, write_record
from asyncrl.wire.messages import Array, Group, TrainedBatch, TrainSample


def sample(prompt: str, i: int, versions: list[int]) -> TrainSample:
    """Two prompt tokens, then one generated token per entry of ``versions``."""
    n = 2 + len(versions)
    mask = np.arange(n) >= 2
    return TrainSample(
        uid=f"{prompt}/{i}",
        prompt_uid=prompt,
        group_index=i,
        input_ids=Array.of(np.arange(n, dtype=np.int32)),
        loss_mask=Array.of(mask),
        logprobs=Array.of(np.where(mask, -1.0, 0.0).astype(np.float32)),
        versions=Array.of(np.array([-1, -1, *versions], dtype=np.int32)),
        reward=float(i),
    )


def step_record(step: int, groups: dict[str, list[list[int]]]) -> TrainedBatch:
    return TrainedBatch(
        step=step,
        epoch=0,
        groups=[
            Group(
                prompt_uid=p,
                samples=[sample(p, i, v) for i, v in enumerate(vs)],
                shaped_rewards=[float(i) for i in range(len(vs))],
            )
            for p, vs in groups.items()
        ],
        world_size=1,
        threads=1,
        allocator="system",
        torch_version="2.x",
        settings_sha256="0" * 64,
    )


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# step 1 trains version 0: tokens of version 0; step 2 trains version 1: prompt b's sample
# 1 mixes versions 0 and 1 (its oldest is 1 version old, within η = 1)
STEPS = {1: {"a": [[0, 0], [0]]}, 2: {"b": [[1], [0, 1]]}}


def sound_run(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    recipe = {"buffer": {"max_head_offpolicyness": 1}, "trainer": {"update_every": 1}}
    (run / "recipe.json").write_text(json.dumps(recipe))
    write_jsonl(run / "metrics.jsonl", [{"step": 1}, {"step": 2}])
    trained = []
    for step, groups in STEPS.items():
        write_record(run, step_record(step, groups))
        for p, vs in groups.items():
            for i, v in enumerate(vs):
                age = step - 1 - min(v)
                trained.append({"step": step, "uid": f"{p}/{i}", "prompt_uid": p, "staleness": age})
    write_jsonl(run / "trained_samples.jsonl", trained)
    final = {"event": "stop", "leased": [], "pool": ["d"], "ready": [], "partial": []}
    events = [
        *({"event": "lease", "prompt": p} for p in "abcd"),
        {"event": "lease", "prompt": "a"},  # leased again after its first lease expired
        {"event": "reject", "prompt": "c"},
        final,
    ]
    write_jsonl(run / "buffer_events.jsonl", events)
    return run


def test_a_sound_run_passes_every_check(tmp_path: Path, capsys: Any) -> None:
    run = sound_run(tmp_path)
    result = audit_run(run)
    assert result.violations == []
    assert (result.steps, result.samples, result.bound) == (2, 4, 1)
    assert (result.prompts_leased, result.leases, result.extra_leases) == (4, 5, 1)
    assert audit(run) == 0
    assert "staleness      ok" in capsys.readouterr().out


def test_a_step_recorded_twice_or_missing_is_named(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    write_jsonl(run / "metrics.jsonl", [{"step": 1}, {"step": 1}, {"step": 3}])
    metrics, records = audit_run(run).of("steps")
    assert "twice [1], missing [2]" in metrics.detail
    assert "records of [1, 2], not 1..3" in records.detail
    assert audit(run) == 1


def test_a_lost_step_record_is_named(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    write_jsonl(run / "metrics.jsonl", [{"step": s} for s in (1, 2, 3)])
    (found,) = audit_run(run).of("steps")
    assert "records of [1, 2], not 1..3" in found.detail


def test_a_sample_trained_twice_is_named(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    rows = read_jsonl(run / "trained_samples.jsonl")
    write_jsonl(run / "trained_samples.jsonl", [*rows, rows[0]])
    (found,) = audit_run(run).of("trained_twice")
    assert "['a/0']" in found.detail


def test_a_leased_prompt_neither_trained_dropped_nor_held_is_lost(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    events = read_jsonl(run / "buffer_events.jsonl")
    events[-1]["pool"] = []  # d is no longer held
    write_jsonl(run / "buffer_events.jsonl", events)
    (found,) = audit_run(run).of("unaccounted")
    assert "1 prompts" in found.detail and "['d']" in found.detail


def test_a_buffer_that_never_stopped_cannot_account_for_its_prompts(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    events = read_jsonl(run / "buffer_events.jsonl")[:-1]
    # a killed writer's torn last line is skipped, not fatal
    (run / "buffer_events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events) + '{"event": "st'
    )
    (found,) = audit_run(run).of("unaccounted")
    assert "did not stop cleanly" in found.detail


def test_a_token_older_than_the_bound_or_from_a_later_version_is_a_violation(
    tmp_path: Path,
) -> None:
    run = sound_run(tmp_path)
    # step 2 trains version 1: a token of version -> age: 3 -> -2 (a rolled-back lineage)
    write_record(run, step_record(2, {"b": [[1], [3]]}))
    (found,) = audit_run(run).of("staleness")
    assert "1 samples outside [0, 1]" in found.detail and "b/1 at step 2: -2" in found.detail
    # step 3 with a record whose oldest token is version 0: 2 versions old
    write_jsonl(run / "metrics.jsonl", [{"step": s} for s in (1, 2, 3)])
    write_record(run, step_record(2, STEPS[2]))
    write_record(run, step_record(3, {"e": [[2], [0, 2]]}))
    (found,) = audit_run(run).of("staleness")
    assert "e/1 at step 3: 2 versions old" in found.detail


def test_steps_without_records_are_judged_from_the_trained_samples(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    record_path(run, 1).unlink()
    record_path(run, 2).unlink()
    assert audit_run(run).violations == []
    rows = read_jsonl(run / "trained_samples.jsonl")
    rows[0]["staleness"] = 2
    write_jsonl(run / "trained_samples.jsonl", rows)
    (found,) = audit_run(run).of("staleness")
    assert "a/0 at step 1: 2 versions old" in found.detail


def test_update_every_widens_the_bound_by_the_unpublished_steps(tmp_path: Path) -> None:
    run = sound_run(tmp_path)
    recipe = {"buffer": {"max_head_offpolicyness": 1}, "trainer": {"update_every": 3}}
    (run / "recipe.json").write_text(json.dumps(recipe))
    assert audit_run(run).bound == 3
