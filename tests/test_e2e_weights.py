"""The ``collective`` weight transport end to end over gloo, on the ci recipe: an engine
attached mid-run joins the broadcast, and ``kill -9`` of an engine in the middle of a
broadcast costs the trainer no step while its replacement serves the current version."""

from __future__ import annotations

import asyncio
import os
import signal
from collections import defaultdict
from pathlib import Path

import pytest
from e2e_kit import REPO, cli, running_up
from test_e2e import RUN_TIMEOUT, check_staleness_and_uniqueness, connect, read_jsonl

from asyncrl.weights.wire import STALL_ENV
from asyncrl.wire.messages import Metrics
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow


async def test_an_attached_engine_joins_the_broadcast_and_both_get_every_version(
    tmp_path: Path,
) -> None:
    """Two engines, the second attached while the run goes on: every version after its
    join is broadcast to both, both load versions by the broadcast, and their pauses are
    in their records. The run is stopped (SIGTERM, as Ctrl-C) once the attached engine has
    loaded three versions, so the test does not hang on this machine's speed."""
    loaded: dict[str, dict[int, float]] = defaultdict(dict)
    enough = asyncio.Event()

    async def on_rollout(m: Metrics) -> None:
        if "rollout/pause_s" in m.values:
            loaded[m.actor_id][int(m.values["version"])] = float(m.values["rollout/pause_s"])
            if len(loaded["extra"]) >= 3:
                enough.set()

    async with running_up(
        tmp_path,
        "coll",
        "weights.transport=collective",
        "trainer.max_steps=100000",
        "rollout.max_concurrent=4",
    ) as up:
        run_dir = up.run_dir
        bus = await connect(run_dir)
        try:
            await bus.subscribe(Subjects("coll").metrics("rollout"), Metrics, on_rollout)
            await asyncio.wait_for(_first_step(run_dir, up.proc), RUN_TIMEOUT)
            extra = await asyncio.create_subprocess_exec(
                *cli("attach", "rollout", "--run", str(run_dir), "--actor-id", "extra"),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=REPO,
            )
            await asyncio.wait_for(enough.wait(), RUN_TIMEOUT)
            # what was published while both ran (the stop may drop whoever leaves first)
            before_stop = len(read_jsonl(run_dir / "weights.jsonl"))
            records = read_jsonl(run_dir / "metrics.jsonl")
        finally:
            await bus.close()
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.proc.wait(), 120) == 0
        out, _ = await asyncio.wait_for(extra.communicate(), 120)
        assert extra.returncode == 0, out.decode()
    text = out.decode()
    assert "joined the weight broadcast" in text and "via=collective" in text
    published = read_jsonl(run_dir / "weights.jsonl")
    assert all(p["transport"] == "collective" for p in published)
    joined = next(i for i, p in enumerate(published) if "extra" in p["sent_to"])
    # from its join on, every version went to both engines and none was dropped
    assert before_stop > joined
    for p in published[joined:before_stop]:
        assert p["sent_to"] == ["extra", "rollout-0"] and not p["dropped"], p
    for actor in ("rollout-0", "extra"):
        pauses = loaded[actor]
        assert len(pauses) >= 3 and all(0 < s < 30 for s in pauses.values()), (actor, pauses)
    assert records[-1]["weights/engines"] == 2 and records[-1]["weights/dropped"] == 0
    assert all(r["time_gen_pause_s"] >= 0 for r in records)
    check_staleness_and_uniqueness(run_dir, eta=1)


async def _first_step(run_dir: Path, proc: asyncio.subprocess.Process) -> None:
    metrics = run_dir / "metrics.jsonl"
    while not (metrics.exists() and read_jsonl(metrics)):
        assert proc.returncode is None, "up ended before its first step"
        await asyncio.sleep(0.5)


STEPS = 8
TIMEOUT_S = 20.0


@pytest.mark.timeout(600)
async def test_kill_9_of_an_engine_in_mid_broadcast_loses_no_step(tmp_path: Path) -> None:
    """The run's engine stops in the middle of version 3's broadcast (after its header:
    :data:`~asyncrl.weights.collective.STALL_ENV`) and is killed there. The trainer's
    publish returns within ``weights.timeout_s`` and drops the dead engine; every step
    is trained and recorded once; and since the run has no other engine, it finishes only
    because the replacement joined the broadcast and generated with the current weights."""
    stall = tmp_path / "stalled.pid"
    env = {**os.environ, STALL_ENV: f"{stall}:3"}
    async with running_up(
        tmp_path,
        "kill-mid",
        "weights.transport=collective",
        f"weights.timeout_s={TIMEOUT_S}",
        f"trainer.max_steps={STEPS}",
        "rollout.lease_ttl=5",
        "run.restart_backoff=0.5",
        env=env,
    ) as up:
        async with asyncio.timeout(RUN_TIMEOUT):
            while not (stall.exists() and stall.read_text()):
                assert up.proc.returncode is None, "the run ended before any engine stalled"
                await asyncio.sleep(0.2)
        os.kill(int(stall.read_text()), signal.SIGKILL)
        assert await asyncio.wait_for(up.proc.wait(), RUN_TIMEOUT) == 0, "the run did not finish"
    run_dir = up.run_dir
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1)), f"steps recorded: {steps}"
    check_staleness_and_uniqueness(run_dir, eta=1)
    published = read_jsonl(run_dir / "weights.jsonl")
    assert max(p["publish_s"] for p in published) < TIMEOUT_S + 10, published
    dropped = {a for p in published for a in p["dropped"]}
    assert len(dropped) == 1, published
    (victim,) = dropped
    replacement = (run_dir / "logs" / f"{victim}-r1.log").read_text()
    assert "joined the weight broadcast" in replacement
    # the replacement loaded a version by the broadcast, the run's last at the latest
    versions = [
        int(line.split("version=")[1].split()[0])
        for line in replacement.splitlines()
        if "weights updated" in line and "via=collective" in line
    ]
    assert versions, replacement[-2000:]
    assert published[-1]["version"] == STEPS
    assert f"{victim}-r1" in published[-1]["sent_to"], published[-1]
