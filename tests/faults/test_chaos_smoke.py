"""The chaos bench's smoke: ``bench/chaos.py --runs 2`` with a fixed seed, whose two
kills are one server of the 3-server NATS cluster and the eval actor (a rollout actor's
kill is ``tests/test_e2e.py``'s, the other roles' ``tests/faults/test_kill_9.py``'s).
Each run must end with exit 0 and pass every check of ``asyncrl audit``; the bench exits 1
on any violation. The smoke skips the bench's replay of each run (``--no-replay``), which
``tests/faults/test_kill_9.py`` checks after its kills, and the 100-run bench after each."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from e2e_kit import REPO, run

pytestmark = pytest.mark.slow

SEED = 165
"""With 6 steps its kills are: a nats-server 0.39 of a step after step 2, then eval 0.59
after step 2 (``plan_kill``; checked below, so that a change of the
plan cannot go unnoticed): early, so that each lands while steps remain on a loaded
machine, where a 0.1 s step can end the run before a late kill (the bench then runs it
again, which costs the smoke a run)."""


@pytest.mark.timeout(900)
async def test_two_seeded_kills_and_nothing_lost(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        str(REPO / "bench" / "chaos.py"),
        *("--runs", "2", "--seed", str(SEED), "--clean", "0", "--steps", "6", "--no-replay"),
        *("--out", str(tmp_path)),
    ]
    code, out = await run(argv, limit=840)
    print(out)
    kills = re.findall(r"^run \d/2 \(seed [\d:]+\): kill -9 (\w+)", out, re.M)
    assert kills == ["nats", "eval"], out
    assert code == 0, out
    assert "(total 0)" in out, out
    assert len(re.findall(r"^  \d+ s, recovered in (?:[\d.]+ s|-): ok$", out, re.M)) == 2, out
