"""End to end: weights published every k = 3 steps with η = 1 (k ≥ η + 2).

Judged against the trainer's unpublished version, every group of the third step would be
stale (no rollout can have weights that were never sent) and the trainer would ask for
batches forever; judged against the published version, the run finishes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from e2e_kit import run, up_args

pytestmark = pytest.mark.slow

RUN_LIMIT = 300.0
"""Seconds the run may take (it needs well under a minute); past it, it hangs."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def test_update_every_beyond_eta_plus_one_finishes(tmp_path: Path) -> None:
    steps, k, eta = 6, 3, 1
    code, out = await run(
        up_args(
            tmp_path,
            "k3",
            f"trainer.max_steps={steps}",
            f"trainer.update_every={k}",
            f"buffer.max_head_offpolicyness={eta}",
            "trainer.checkpoint_every=0",
        ),
        RUN_LIMIT,
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
