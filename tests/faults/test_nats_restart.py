"""NATS itself dies in mid-run: the run still finishes.

- the embedded server (``asyncrl up`` starts it): ``kill -9`` of nats-server, and ``up``
  starts it again on the same port with the same credentials and JetStream store;
- an external server (``run.nats_url``): it goes away for a few seconds and comes back
  (here the test plays its operator); the actors reconnect by themselves.

Either way the run ends with exit 0 after every step, each step recorded once and no
sample trained twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections import Counter
from pathlib import Path

import pytest
from e2e_kit import UpRun, running_up
from test_e2e import RUN_TIMEOUT, read_jsonl

from asyncrl.runtime.nats_server import EmbeddedNats

pytestmark = pytest.mark.slow

STEPS = 8
KILL_AT_STEP = 3


async def wait_for_steps(run_dir: Path, n: int, up: asyncio.subprocess.Process) -> None:
    metrics = run_dir / "metrics.jsonl"
    async with asyncio.timeout(RUN_TIMEOUT):
        while not metrics.exists() or len(read_jsonl(metrics)) < n:
            assert up.returncode is None, "the run ended early"
            await asyncio.sleep(0.1)


def check_finished(run_dir: Path) -> None:
    steps = [m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")]
    assert steps == list(range(1, STEPS + 1)), f"steps recorded: {steps}"
    uids = Counter(t["uid"] for t in read_jsonl(run_dir / "trained_samples.jsonl"))
    assert max(uids.values()) == 1, "a sample was trained twice"


def server_pid(run_dir: Path) -> int:
    """The embedded nats-server's pid, from the ports file it writes."""
    (ports,) = (run_dir / "nats").glob("nats-server_*.ports")
    return int(ports.stem.rsplit("_", 1)[1])


def start_up(
    tmp_path: Path, name: str, *sets: str
) -> contextlib.AbstractAsyncContextManager[UpRun]:
    return running_up(
        tmp_path,
        name,
        f"trainer.max_steps={STEPS}",
        "eval.every=0",
        *sets,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


@pytest.mark.timeout(600)
async def test_kill_9_of_the_embedded_server_and_the_run_finishes(tmp_path: Path) -> None:
    async with start_up(tmp_path, "nats-kill") as up:
        run_dir = up.run_dir
        await wait_for_steps(run_dir, KILL_AT_STEP, up.proc)
        pid = server_pid(run_dir)
        os.kill(pid, signal.SIGKILL)
        out, _ = await asyncio.wait_for(up.proc.communicate(), RUN_TIMEOUT)
    assert up.proc.returncode == 0, out.decode()
    assert "nats-server died, starting it again" in (run_dir / "logs" / "up.log").read_text()
    check_finished(run_dir)


@pytest.mark.timeout(600)
async def test_an_external_server_that_goes_away_and_comes_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "nats-away"
    server = EmbeddedNats(tmp_path / "external")
    await server.start()
    try:
        assert server.info.token
        monkeypatch.setenv("ASYNCRL_NATS_TOKEN", server.info.token)
        async with start_up(tmp_path, "nats-away", f"run.nats_url={server.info.url}") as up:
            await wait_for_steps(run_dir, KILL_AT_STEP, up.proc)
            await server.stop()
            await asyncio.sleep(5.0)  # an outage longer than one reconnect attempt
            await server.start()  # the same port, credentials and JetStream store
            out, _ = await asyncio.wait_for(up.proc.communicate(), RUN_TIMEOUT)
        assert up.proc.returncode == 0, out.decode()
    finally:
        await server.stop()
    check_finished(run_dir)
