"""``bench/agent.py --quick`` runs end to end on the tiny model and prints its tables.
Timings are not checked: the bench's figures are for people, not for assertions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_agent_bench_quick_run_prints_its_tables() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "agent.py"), "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    lines = out.splitlines()
    header = next(line for line in lines if line.startswith("workload"))
    assert header.split()[:4] == ["workload", "conc", "episodes", "turns"]
    single = next(line for line in lines if line.startswith("single-turn"))
    agent = next(line for line in lines if line.startswith("3-turn tool"))
    # concurrency 2, one episode per client: 2 episodes of 1 and of 3 turns, 6 tokens a reply
    assert single.split()[2:5] == ["2", "2", "12"]
    assert agent.split()[3:6] == ["2", "6", "36"]
    assert agent.split()[-1].endswith("/4")  # own calls of the 4 tool calls (2 per episode)
    assert "# one tool turn alone" in out
    assert "openai+endpoint" in out and "endpoint added" in out
    latency = lines[lines.index(next(x for x in lines if x.startswith("conc calls"))) + 1]
    assert latency.split()[:2] == ["1", "2"]
    assert "3-turn tool episodes at" in lines[-1]
