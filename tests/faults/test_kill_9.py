"""``kill -9`` of any one actor in mid-run: the run still finishes its steps.

For each role the same check: ``asyncrl up`` exits 0 after ``trainer.max_steps``, and
``asyncrl audit``'s checks hold: every step is recorded once, no sample id is trained
twice, every prompt that was ever leased is trained, dropped with a counted reason, or
still held by the buffer at the end, and every trained token is within the staleness
bound. ``bench/chaos.py`` runs the same checks at random kill moments.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
from pathlib import Path
from typing import Any

import pytest
from e2e_kit import cli, run, running_up
from test_e2e import RUN_TIMEOUT, connect

from asyncrl.observe.audit import audit_run, read_jsonl
from asyncrl.train.replay_log import read_record
from asyncrl.weights.files import KEEP_VERSIONS
from asyncrl.wire.messages import Metrics
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow

STEPS = 8
CHECKPOINT_EVERY = 4


def check_every_prompt_accounted_for(run_dir: Path) -> dict[str, Any]:
    """Every check of ``asyncrl audit`` holds: each step recorded once, no sample trained
    twice, every leased prompt trained, dropped with a reason or held by the buffer at the
    end, every trained token within the staleness bound. Returns the buffer's final
    event."""
    result = audit_run(run_dir)
    assert result.violations == [], result.violations
    return read_jsonl(run_dir / "buffer_events.jsonl")[-1]


def forked_pid(run_dir: Path, actor: str) -> int:
    """The pid of ``actor``'s first process, from the supervisor's line in up.log."""
    found = re.search(
        rf"forked actor={actor} .*?pid=(\d+)", (run_dir / "logs" / "up.log").read_text()
    )
    assert found, f"up.log names no fork of {actor}"
    return int(found.group(1))


async def kill_in_mid_run(
    tmp_path: Path, name: str, role: str, after_step: int, *sets: str
) -> Path:
    async with running_up(
        tmp_path,
        name,
        *sets,
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint_every={CHECKPOINT_EVERY}",
        "eval.every=0",
        "rollout.lease_ttl=5",
        "run.restart_backoff=0.5",
    ) as run:
        bus = await connect(run.run_dir)
        reached = asyncio.Event()

        async def on_metrics(m: Metrics) -> None:
            if m.step >= after_step:
                reached.set()

        try:
            await bus.subscribe(Subjects(name).metrics("trainer"), Metrics, on_metrics)
            await asyncio.wait_for(reached.wait(), RUN_TIMEOUT)
        finally:
            await bus.close()
        # the pid as the supervisor forked it, not from a heartbeat (one a second): a fast
        # run had finished its steps by the victim's first heartbeat the test saw
        os.kill(forked_pid(run.run_dir, f"{role}-0"), signal.SIGKILL)
        assert await asyncio.wait_for(run.proc.wait(), RUN_TIMEOUT) == 0, "the run did not finish"
    run_dir = run.run_dir
    assert (run_dir / "logs" / f"{role}-0-r1.log").is_file(), f"no replacement {role}"
    return run_dir


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("role", "after_step"),
    [
        # before the first checkpoint: for all but the trainer a checkpoint changes nothing
        # (a rollout actor: tests/faults/test_chaos_smoke.py)
        ("reward", 2),
        ("buffer", 2),
        # restarts from the initial weights, as version 0 of epoch 1, while the dead
        # trainer's versions 1..3 (as many as are kept, or more) are still on disk: the
        # files transport, whose exports are kept
        ("trainer", 3),
        # restarts from step 4's checkpoint; the broadcast: the engines join the new
        # trainer's group
        ("trainer", 5),
    ],
)
async def test_kill_9_in_mid_run_and_the_run_finishes(
    tmp_path: Path, role: str, after_step: int
) -> None:
    transport = "dir" if (role, after_step) == ("trainer", 3) else "collective"
    run_dir = await kill_in_mid_run(
        tmp_path, f"kill-{role}-{after_step}", role, after_step, f"weights.transport={transport}"
    )
    final = check_every_prompt_accounted_for(run_dir)
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS
    assert final["version"] == STEPS
    if role == "trainer":
        # the versions after the checkpoint (or all of them) were rolled back, and the
        # trained records of the dead trainer's later steps are gone with them
        assert final["epoch"] == 1
        restarted = (run_dir / "logs" / "trainer-0-r1.log").read_text()
        kept = after_step // CHECKPOINT_EVERY * CHECKPOINT_EVERY
        if kept:
            assert f"step={kept}" in restarted and "resumed" in restarted
        else:
            assert "resumed" not in restarted
        published = read_jsonl(run_dir / "weights.jsonl")
        assert (published[-1]["epoch"], published[-1]["version"]) == (1, STEPS)
        if transport == "dir":
            # the newest few published versions are kept, the run's last one among them
            exported = sorted(p.name for p in (run_dir / "weights").iterdir())
            assert len(exported) <= KEEP_VERSIONS and f"e1-v{STEPS:06d}" in exported, exported
        else:  # the engines joined the restarted trainer's broadcast
            assert published[-1]["sent_to"] == ["rollout-0"], published[-1]
        # the step records are the final lineage: the steps after the checkpoint are the
        # restarted trainer's (epoch 1), and training them again from the initial weights
        # gives every checkpoint's weights bit for bit, across the restore
        records = [read_record(run_dir, step) for step in range(1, STEPS + 1)]
        assert [r.epoch if r else None for r in records] == [
            int(step > kept) for step in range(1, STEPS + 1)
        ]
        code, out = await run(cli("replay", str(run_dir)))
        assert code == 0 and "2 of 2 checkpoints identical" in out, out
    if role == "buffer":
        restored = (run_dir / "logs" / "buffer-0-r1.log").read_text()
        assert "restored" in restored, "the replacement buffer started empty"
