"""End to end: weights published every k = 3 steps with η = 1 (k ≥ η + 2).

Judged against the trainer's unpublished version, every group of the third step would be
stale (no rollout can have weights that were never sent) and the trainer would ask for
batches forever; judged against the published version, the run finishes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CI_RECIPE = REPO / "recipes" / "ci.toml"
RUN_LIMIT = 300.0
"""Seconds the run may take (it needs well under a minute); past it, it hangs."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def run_up(parent: Path, name: str, *sets: str) -> tuple[int, str]:
    """``asyncrl up`` on the ci recipe; the whole process group is ended if it hangs."""
    flags = [x for s in (f"run.dir={parent}", f"run.name={name}", *sets) for x in ("--set", s)]
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "asyncrl.cli", "up", str(CI_RECIPE), *flags, "--quiet"],
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), RUN_LIMIT)
    except TimeoutError:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), 30)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
        pytest.fail(f"the run did not finish within {RUN_LIMIT:.0f} s")
    return proc.returncode or 0, out.decode()


async def test_update_every_beyond_eta_plus_one_finishes(tmp_path: Path) -> None:
    steps, k, eta = 6, 3, 1
    code, out = await run_up(
        tmp_path,
        "k3",
        f"trainer.max_steps={steps}",
        f"trainer.update_every={k}",
        f"buffer.max_head_offpolicyness={eta}",
        "trainer.checkpoint_every=0",
    )
    assert code == 0, out
    run_dir = tmp_path / "k3"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    events = read_jsonl(run_dir / "buffer_events.jsonl")
    admitted = [e for e in events if e["event"] == "admit"]
    assert admitted and all(e["version"] - e["head"] <= eta for e in admitted)
    # the buffer's version only ever took published versions: 0, 3 (and 6 at the end)
    assert {e["version"] for e in admitted} <= {0, 3, 6}
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    recipe = json.loads((run_dir / "recipe.json").read_text())
    assert len(trained) == steps * recipe["buffer"]["batch_size"] * recipe["rollout"]["group_size"]
    # what was trained came from the weights published at most η publications before
    assert all(t["head_version"] in (0, 3) for t in trained)
    log = (run_dir / "logs" / "trainer-0.log").read_text()
    assert "Traceback" not in log
