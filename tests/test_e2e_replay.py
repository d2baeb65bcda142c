"""End to end: ``asyncrl replay`` proves a real run of the ci recipe (η = 2, checkpoints
every 2 steps) bit for bit, and finds the step of a tampered record.

The run's trainer is a process of its own, under mimalloc, on the threads ``up`` gave it,
its steps in a worker thread; the replay is one process that trains the recorded batches
again. Every checkpoint's SHA-256 must come out the same: no tolerance."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from e2e_kit import cli, run, up_args

from asyncrl.train.checkpoint import checkpoint_weights_sha256, run_checkpoints
from asyncrl.train.replay_log import read_record, record_path, recorded_steps, write_record
from asyncrl.wire.messages import Array, TrainedBatch

pytestmark = pytest.mark.slow

STEPS = 6
EVERY = 2


def tampered(
    record: TrainedBatch, *, logprob: float = 0.0, shaped: float = 0.0, group: int = 0
) -> TrainedBatch:
    """``record`` with group ``group``'s first sample's first behaviour logprob on a loss
    token moved by ``logprob``, and that group's first shaped reward by ``shaped``."""
    chosen = record.groups[group]
    sample = chosen.samples[0]
    logprobs = sample.logprobs.numpy().copy()
    logprobs[int(np.flatnonzero(sample.loss_mask.numpy())[0])] += logprob
    sample = sample.model_copy(update={"logprobs": Array.of(logprobs)})
    shaped_rewards = [chosen.shaped_rewards[0] + shaped, *chosen.shaped_rewards[1:]]
    chosen = chosen.model_copy(
        update={"samples": [sample, *chosen.samples[1:]], "shaped_rewards": shaped_rewards}
    )
    groups = list(record.groups)
    groups[group] = chosen
    return record.model_copy(update={"groups": groups})


def with_advantage(record: TrainedBatch | None) -> int | None:
    """The first group of ``record`` whose shaped rewards differ, so that its samples'
    advantages are not zero and a moved behaviour logprob moves the gradient; None when
    every group's rewards are equal."""
    assert record is not None
    return next((i for i, g in enumerate(record.groups) if len(set(g.shaped_rewards)) > 1), None)


def checkpoint_lines(out: str) -> dict[int, str]:
    return {
        int(m[1]): m[2]
        for m in re.finditer(r"^step\s+(\d+)\s+sha256 [0-9a-f]{64}\s+(.*)$", out, re.M)
    }


async def test_replay_proves_a_run_and_finds_the_step_of_a_tampered_record(
    tmp_path: Path,
) -> None:
    code, out = await run(
        up_args(
            tmp_path,
            "ci",
            f"trainer.max_steps={STEPS}",
            f"trainer.checkpoint_every={EVERY}",
            "buffer.max_head_offpolicyness=2",
        )
    )
    assert code == 0, out
    run_dir = tmp_path / "ci"
    assert recorded_steps(run_dir) == list(range(1, STEPS + 1))
    checkpoints = run_checkpoints(run_dir)
    assert list(checkpoints) == [2, 4, 6]
    assert all(checkpoint_weights_sha256(p) for p in checkpoints.values())
    sizes = [record_path(run_dir, s).stat().st_size for s in range(1, STEPS + 1)]
    print(f"\nci recipe: {sum(sizes) / len(sizes):.0f} bytes of record a step ({sizes})")

    code, out = await run(cli("replay", str(run_dir)))
    print(out)
    assert code == 0, out
    assert checkpoint_lines(out) == {2: "= checkpoint", 4: "= checkpoint", 6: "= checkpoint"}
    assert "3 of 3 checkpoints identical" in out, out
    assert out.count("as recorded") == STEPS, out  # every step's statistics, bit for bit

    # one behaviour logprob of step 3 or 4 moved, in a group whose advantages are not
    # zero (a token with no advantage has no gradient to move): the step's statistics and
    # every later checkpoint part from the run's
    step, group = next(
        (s, g) for s in (3, 4) if (g := with_advantage(read_record(run_dir, s))) is not None
    )
    original = read_record(run_dir, step)
    assert original is not None
    write_record(run_dir, tampered(original, logprob=-0.5, group=group))
    code, out = await run(cli("replay", str(run_dir), "--from", "2"))
    print(out)
    assert code == 1, out
    assert checkpoint_lines(out) == {
        2: "= checkpoint",  # the weights --from loaded
        4: f"DIFFERS from the checkpoint's {checkpoint_weights_sha256(checkpoints[4])}",
        6: f"DIFFERS from the checkpoint's {checkpoint_weights_sha256(checkpoints[6])}",
    }
    assert re.search(rf"^step\s+{step}\s.*differs: ", out, re.M), out
    assert "2 of 3 checkpoints differ; first at step 4 (identical through step 2)" in out
    assert f"part at step {step}" in out
    write_record(run_dir, original)

    # one shaped reward of step 5 (what the advantages are computed from), replayed from
    # step 4 through 6
    original = read_record(run_dir, 5)
    assert original is not None
    write_record(run_dir, tampered(original, shaped=1.0))
    code, out = await run(cli("replay", str(run_dir), "--from", "4", "--until", "6"))
    assert code == 1, out
    assert "1 of 2 checkpoints differ; first at step 6 (identical through step 4)" in out, out
    assert "part at step 5" in out, out

    # a missing record fails the replay before it trains anything
    record_path(run_dir, 5).unlink()
    code, out = await run(cli("replay", str(run_dir), "--from", "4"))
    assert code == 1 and "step 5 has no record" in out, out


async def test_a_run_of_two_trainer_ranks_is_replayed_by_two(tmp_path: Path) -> None:
    """FSDP over two gloo ranks: the replay starts two ranks through torchrun, rank 0
    leading the other as the run's trainer did, and the reduce-scatters add in the same
    order."""
    code, out = await run(
        up_args(
            tmp_path,
            "ranks",
            "trainer.max_steps=4",
            f"trainer.checkpoint_every={EVERY}",
            "trainer.nproc=2",
            "buffer.max_head_offpolicyness=2",
        )
    )
    assert code == 0, out
    record = read_record(tmp_path / "ranks", 1)
    assert record is not None and record.world_size == 2
    code, out = await run(cli("replay", str(tmp_path / "ranks")))
    assert code == 0, out
    assert "trainer: 2 rank(s)" in out, out
    assert checkpoint_lines(out) == {2: "= checkpoint", 4: "= checkpoint"}, out
    assert "2 of 2 checkpoints identical" in out, out
