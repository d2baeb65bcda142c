"""``make gpu-check DEVICE=cpu``: the prepared GPU check runs its every row on small shapes,
so the script that waits for the first GPU machine cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
ROWS = [
    "trainer MFU",
    "hf engine decode",
    "weight-update pause",
    "colocation",
    "asyncrl up",
]


def test_gpu_check_on_the_cpu_prints_every_row_and_passes(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_check.py"),
            "--device",
            "cpu",
            "--run-dir",
            str(tmp_path / "up"),
            "--out",
            str(out),
            "--profile",
            str(tmp_path / "profile"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert lines[0].startswith("| # | check | result | goal | met |")
    body = lines[1:]
    assert len(body) == len(ROWS), proc.stdout
    for i, (line, name) in enumerate(zip(body, ROWS, strict=True), 1):
        assert line.startswith(f"| {i} | {name}"), line
        assert "FAIL" not in line, line

    rows = json.loads(out.read_text())["rows"]
    assert [r["check"].startswith(n) for r, n in zip(rows, ROWS, strict=True)] == [True] * 5
    # every row but the weights one (which waits on bench/weight_sync.py's measure) ran
    for row in rows:
        if not row["check"].startswith("weight-update pause"):
            assert row["error"] is None, row
    up = rows[-1]["figures"]
    assert up["exit"] == 0 and up["steps"] == 3 and 0 <= up["staleness_max"] <= 1
    colocation = rows[3]["figures"]
    assert colocation["engine_released_gib"] == 0 and colocation["trainer_released_gib"] == 0
    # --profile: a table of one more trainer step and one more decode burst
    # (the engine's ops run on its model thread: on the CPU only its Python profile shows)
    trainer = (tmp_path / "profile" / "trainer.txt").read_text()
    assert "Self CPU time total" in trainer and "aten::" in trainer, trainer[:400]
    decode = (tmp_path / "profile" / "decode.txt").read_text()
    assert "the model thread" in decode and "function calls" in decode, decode[:400]
