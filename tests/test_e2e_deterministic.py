"""End to end: with ``rollout.deterministic`` and η = 0, two runs of the ci recipe with one
seed train the same weights, bit for bit, at every checkpoint.

The two runs go at once, sharing the cores, and the second runs fewer episodes at once
(``rollout.max_concurrent``) in smaller engine batches (``rollout.engine.max_batch_size``):
its sequences would share their decode steps with other sequences than the first's, and
its groups would reach the buffer in another order. Neither may change a bit: only the
seed, the prompt ids, the sample indices and the attempts decide what is generated and
trained. (Without the engine's one-sequence-at-a-time, these runs part at step 1.) That
another seed trains other weights is shown without a third run: a seed changes the tokens
(tests/test_deterministic.py), and the trainer is a function of its batches
(tests/test_e2e_replay.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_kit import run, up_args

from asyncrl.train.checkpoint import checkpoint_weights_sha256, run_checkpoints
from asyncrl.train.replay_log import read_record

pytestmark = pytest.mark.slow

DETERMINISTIC = (
    "trainer.max_steps=4",
    "trainer.checkpoint_every=2",
    "buffer.max_head_offpolicyness=0",
    "rollout.deterministic=true",
)


OTHER_BATCHES = ("rollout.max_concurrent=3", "rollout.engine.max_batch_size=5")
"""The second run's: other episodes overlap, other sequences would share a decode step."""


async def test_two_runs_of_one_seed_train_the_same_weights(tmp_path: Path) -> None:
    (code_a, out_a), (code_b, out_b) = await asyncio.gather(
        run(up_args(tmp_path, "a", *DETERMINISTIC)),
        run(up_args(tmp_path, "b", *DETERMINISTIC, *OTHER_BATCHES)),
    )
    assert code_a == 0, out_a
    assert code_b == 0, out_b
    hashes = {}
    for name in ("a", "b"):
        checkpoints = run_checkpoints(tmp_path / name)
        assert list(checkpoints) == [2, 4], name
        hashes[name] = {step: checkpoint_weights_sha256(p) for step, p in checkpoints.items()}
    if hashes["a"] != hashes["b"]:
        # where they parted: the first step whose trained batch differs
        parted = next(
            (
                s
                for s in range(1, 5)
                if read_record(tmp_path / "a", s) != read_record(tmp_path / "b", s)
            ),
            None,
        )
        pytest.fail(f"checkpoints differ: {hashes}; first differing batch: step {parted}")
