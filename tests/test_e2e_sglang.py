"""The quickstart on a real SGLang server on the CPU (``.venv-sglang``): ``make test-sglang``.

A module of its own, so that the engine tests' server is gone before the run starts its
own (the rollout actor's; evaluation is off, as its actor would start a second one).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest
from test_engine_sglang_real import KV_TOKENS, SGLANG_PYTHON

REPO = Path(__file__).resolve().parent.parent

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(not SGLANG_PYTHON.exists(), reason="no .venv-sglang: run `make sglang`"),
    pytest.mark.skipif(
        os.environ.get("ASYNCRL_SGLANG_TESTS") != "1",
        reason="real-SGLang tests are opt-in: `make test-sglang` (ASYNCRL_SGLANG_TESTS=1)",
    ),
    pytest.mark.timeout(2400),
]


async def test_quickstart_runs_on_sglang(tmp_path: Path) -> None:
    from e2e_kit import running_up

    sets = [
        f"run.dir={tmp_path}",
        "run.name=qs",
        "run.tensorboard=false",
        "run.plots=false",
        "rollout.engine.type=sglang",
        f"rollout.engine.python={SGLANG_PYTHON}",
        "rollout.engine.cpu=true",
        f"rollout.engine.max_total_tokens={KV_TOKENS}",
        "rollout.engine.startup_timeout=1200",
        "trainer.max_steps=2",
        "buffer.batch_size=2",
        "eval.every=0",  # an eval actor would start a second server
        "model.dtype=float32",  # what this test ran with; "auto" may pick bf16 here
    ]
    argv = [
        sys.executable,
        "-m",
        "asyncrl.entry.cli",
        "up",
        str(REPO / "recipes" / "quickstart.toml"),
    ]
    argv += [x for s in sets for x in ("--set", s)] + ["--quiet"]
    async with running_up(tmp_path, "qs", argv=argv) as run:
        code = await asyncio.wait_for(run.proc.wait(), 2300)
        logs = run.run_dir / "logs"
        assert code == 0, (logs / "up.log").read_text()[-3000:]
    metrics = [json.loads(x) for x in (run.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    assert list(logs.glob("sglang-*.log")), "the rollout actor started no SGLang server"
