"""End to end: colocation (engines release their memory around every trainer step) and
weight updates staged over the object store while generation goes on."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from e2e_kit import running_up
from test_e2e import RUN_TIMEOUT, check_staleness_and_uniqueness, connect, read_jsonl

from asyncrl.wire.messages import Metrics
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow


async def test_colocated_run_releases_memory_every_step_and_reports_update_pauses(
    tmp_path: Path,
) -> None:
    steps = 4
    updates: list[Metrics] = []
    async with running_up(
        tmp_path,
        "colo",
        f"trainer.max_steps={steps}",
        "trainer.checkpoint_every=0",
        "weights.transport=object_store",
        "rollout.colocate=true",
        # One row decodes at a time, answers are long and the trainer keeps to one thread,
        # so generation is slower than a trainer step and each release finds sequences
        # running (with 24-token answers it kept pace, and the rollout sometimes waited at
        # the staleness bound through every release: tests/test_e2e_staleness.py says more)
        "rollout.sampling.max_new_tokens=128",
        "rollout.engine.max_batch_size=1",
        "rollout.group_size=4",
        "trainer.threads=1",
    ) as up:
        run_dir = up.run_dir
        bus = await connect(run_dir)
        try:

            async def on_metrics(m: Metrics) -> None:
                if "rollout/pause_s" in m.values:
                    updates.append(m)

            await bus.subscribe(Subjects("colo").metrics("rollout"), Metrics, on_metrics)
            assert await asyncio.wait_for(up.proc.wait(), RUN_TIMEOUT) == 0
        finally:
            await bus.close()

    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    # every step asked the rollout side to release; on the CPU nothing is shared, so 0 bytes
    assert all(m["rollout_freed_bytes"] == 0.0 for m in metrics)
    log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert log.count("memory released") == steps
    check_staleness_and_uniqueness(run_dir, eta=1)

    # every published version reached the rollout actor, fetched and loaded
    assert updates, "no weight update was reported"
    assert {int(m.values["version"]) for m in updates} <= set(range(1, steps + 1))
    for m in updates:
        assert m.values["rollout/weights_fetch_s"] > 0 and m.values["rollout/pause_s"] > 0
    # releases interrupt sequences mid-way: their tokens come from two versions
    assert max(m.values.get("mixed_version_samples", 0) for m in updates) > 0
