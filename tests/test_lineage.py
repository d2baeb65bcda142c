"""Nothing outlives a run: the processes an actor starts are found by their session or by
the mark they inherit, in any session, and ended; ``asyncrl up`` returns only once a
grandchild that left the actor's session (as an inference server under its guard does)
and ignores SIGTERM is gone. Real processes throughout."""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from e2e_kit import running_up, wait_for_file

from asyncrl.runtime import lineage
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects

# a child that stays in the parent's session, and a grandchild in a session of its own
# that ignores SIGTERM; the parent prints both pids once the grandchild is ready, and exits
TREE = """
import subprocess, sys
stay = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
away = subprocess.Popen(
    [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
     "signal.SIG_IGN); print('ready', flush=True); time.sleep(120)"],
    start_new_session=True, stdout=subprocess.PIPE,
)
away.stdout.readline()
print(stay.pid, away.pid, flush=True)
"""


def start_tree(token: str, actor_id: str) -> tuple[subprocess.Popen[str], int, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", TREE],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the supervisor starts an actor
        env={**lineage.lineage_env(token, actor_id), "PATH": "/usr/bin:/bin"},
    )
    assert parent.stdout is not None
    stay, away = map(int, parent.stdout.readline().split())
    parent.wait(30)
    return parent, stay, away


async def test_an_actors_processes_are_found_in_any_session_and_ended() -> None:
    token = secrets.token_hex(8)
    parent, stay, away = start_tree(token, "rollout-0")
    try:
        # the parent is gone: its children are orphans, the grandchild in another session
        assert sorted(lineage.find([parent.pid], token)) == sorted([stay, away])
        assert sorted(lineage.find([], token, "rollout-0")) == sorted([stay, away])
        assert lineage.find([], token, "rollout-1") == []  # another actor's mark
        assert lineage.find([], token, "rollout") == []  # a mark is matched whole
        assert lineage.find([], secrets.token_hex(8)) == []  # another run's
        # SIGTERM, which the grandchild ignores; SIGKILL after the grace; waited for
        left = await lineage.end(lambda: lineage.find([parent.pid], token), grace=0.3)
        assert left == []
        assert not lineage.alive(stay) and not lineage.alive(away)
    finally:
        await lineage.end(lambda: lineage.find([], token), grace=0)


async def test_wait_gone_returns_what_still_runs_after_the_limit() -> None:
    sleeper = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(120)"
    )
    try:
        assert await lineage.wait_gone([sleeper.pid], 0.1) == [sleeper.pid]
        sleeper.kill()
        waiter = asyncio.create_task(lineage.wait_gone([sleeper.pid], 30))
        await sleeper.wait()
        assert await waiter == []
    finally:
        if sleeper.returncode is None:
            sleeper.kill()
            await sleeper.wait()


LEAVER = """
import os, subprocess, sys
from pathlib import Path

import pytest


def reward(completion, data):
    # once per reward actor, from its worker (a grandchild of up): a process in a session
    # of its own, deaf to SIGTERM, that nobody waits for; its pid in <actor id>.pid, which
    # appears whole (renamed into place: the test reads it as soon as it exists)
    actor_id = os.environ["{env}"].split(":", 1)[1]
    folder = Path({folder!r})
    try:
        os.close(os.open(folder / f"{{actor_id}}.once", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return 0.0
    child = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    (folder / f"{{actor_id}}.tmp").write_text(str(child.pid))
    os.replace(folder / f"{{actor_id}}.tmp", folder / f"{{actor_id}}.pid")
    return 0.0
"""


@pytest.mark.slow
async def test_what_an_actor_left_in_another_session_goes_before_its_replacement_and_up(
    tmp_path: Path,
) -> None:
    """The reward actor's worker leaves a process behind; ``kill -9`` of the actor: its
    leftover is gone before the replacement starts. The replacement's worker leaves one
    too; a stop of ``up``: it is gone when ``up`` returns."""
    left = tmp_path / "left"
    left.mkdir()
    leaver = tmp_path / "leaver.py"
    leaver.write_text(LEAVER.format(env=lineage.LINEAGE_ENV, folder=str(left)))
    sets = ("trainer.max_steps=1000", f"reward.fn={leaver}:reward", "run.restart_backoff=0.1")
    pids: list[int] = []
    try:
        async with running_up(tmp_path, "leave", *sets) as up:
            bus = await Bus.connect(nats_info_for_run(up.run_dir), name="test")
            beats: dict[str, asyncio.Future[ActorInfo]] = {
                a: asyncio.get_running_loop().create_future() for a in ("reward-0", "reward-0-r1")
            }

            stepped = asyncio.Event()  # every actor is up: a death is restarted from here on

            async def on_beat(info: ActorInfo) -> None:
                if info.actor_id in beats and not beats[info.actor_id].done():
                    beats[info.actor_id].set_result(info)

            async def on_metrics(m: Metrics) -> None:
                stepped.set()

            try:
                await bus.subscribe(Subjects("leave").heartbeat("reward"), ActorInfo, on_beat)
                await bus.subscribe(Subjects("leave").metrics("trainer"), Metrics, on_metrics)
                await wait_for_file(left / "reward-0.pid", up.proc)
                pids.append(int((left / "reward-0.pid").read_text()))
                victim = await asyncio.wait_for(beats["reward-0"], 120)
                await asyncio.wait_for(stepped.wait(), 240)
                os.kill(victim.pid, signal.SIGKILL)
                await asyncio.wait_for(beats["reward-0-r1"], 120)
            finally:
                await bus.close()
            assert not lineage.alive(pids[0]), "a dead actor's process outlived its replacement"
            await wait_for_file(left / "reward-0-r1.pid", up.proc)
            pids.append(int((left / "reward-0-r1.pid").read_text()))
            up.proc.send_signal(signal.SIGTERM)  # a stop, as Ctrl-C is
            assert await asyncio.wait_for(up.proc.wait(), 120) == 0
        assert not lineage.alive(pids[1]), "a process the run started outlived asyncrl up"
        log = (up.run_dir / "logs" / "up.log").read_text()
        assert "stopping what the actors left behind" in log
    finally:
        for pid in pids:
            if lineage.alive(pid):
                os.kill(pid, signal.SIGKILL)
