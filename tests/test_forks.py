"""The fork server: actors forked from one process that imported once (asyncrl.runtime.forks,
asyncrl.entry.fork_server), against a real nats-server, and ``up`` when that server dies;
each with a server executed afresh and with one a zygote forked (asyncrl.entry.zygote)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from e2e_kit import run_processes, running_up

from asyncrl.config.recipe import Recipe
from asyncrl.entry.zygote import run_argv
from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.runtime import lineage
from asyncrl.runtime.allocator import mimalloc_preload
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.forks import (
    UNKNOWN_EXIT,
    ZYGOTE_ENV,
    ForkServer,
    ZygoteServer,
    fork_server_reason,
    forkable,
    server_env,
)
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.runtime.supervisor import actor_argv
from asyncrl.wire.subjects import Subjects


def test_which_runs_fork_their_actors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, whatever the machine has
    assert fork_server_reason("auto", ray=False) is None
    assert fork_server_reason("exec", ray=False) == "run.actor_start = exec"
    assert fork_server_reason("auto", ray=True) == "Ray starts the processes"
    assert forkable(actor_argv("rollout", Path("/r"), "rollout-0"))
    assert not forkable(["torchrun", "--nproc-per-node=2", "-m", "asyncrl.entry.actor"])
    # the trainer's load-time variables go to the server; its placement stays its own
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setenv("ASYNCRL_NATS_PASSWORD", "secret")  # up takes it only after the start
    env = server_env(
        {
            "OMP_WAIT_POLICY": "PASSIVE",
            "LD_PRELOAD": "/m.so",
            "MIMALLOC_X": "0",
            "ASYNCRL_CPUS": "0",
        }
    )
    assert (env["OMP_WAIT_POLICY"], env["LD_PRELOAD"], env["MIMALLOC_X"]) == (
        "PASSIVE",
        "/m.so",
        "0",
    )
    assert "ASYNCRL_NATS_PASSWORD" not in env
    assert "ASYNCRL_CPUS" not in env or env["ASYNCRL_CPUS"] == os.environ.get("ASYNCRL_CPUS")


SIBLINGS = """
import json, os, sys
import numpy as np, torch
from asyncrl.entry import actor as actor_entry, fork_server

def stand_in(argv):  # an actor that tells what it drew and exits with its last argument
    draws = {"torch": torch.initial_seed(), "numpy": int(np.random.randint(1 << 30))}
    print(json.dumps({**draws, "who": os.environ.get("WHO"), "argv": sys.argv[1:]}), flush=True)
    return int(argv[-1])

actor_entry.main = stand_in
replies = os.dup(1)
os.dup2(2, 1)
fork_server.Server(replies).serve()
"""


def test_forked_siblings_draw_their_own_seeds_and_exit_codes(tmp_path: Path) -> None:
    """Two forks of one server: each gets its request's environment and arguments, draws
    its own torch seed and numpy numbers (a fresh interpreter does; forks would share the
    server's), and its exit code comes back with its pid."""
    script = tmp_path / "siblings.py"
    script.write_text(SIBLINGS)
    server = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert server.stdin is not None and server.stdout is not None
    try:
        assert "ready" in json.loads(server.stdout.readline())
        for k, who in enumerate(["a", "b"]):
            argv = [*actor_argv("rollout", tmp_path, f"rollout-{k}"), str(3 * k)]
            request = {"id": k, "argv": argv, "env": {"WHO": who}, "log": str(tmp_path / who)}
            server.stdin.write((json.dumps(request) + "\n").encode())
            server.stdin.flush()
        said = [json.loads(server.stdout.readline()) for _ in range(4)]
        pids = {m["id"]: m["pid"] for m in said if "id" in m}
        codes = {m["exit"]: m["code"] for m in said if "exit" in m}
        assert codes == {pids[0]: 0, pids[1]: 3}, said
    finally:
        server.stdin.close()
        assert server.wait(30) == 0
    a, b = (json.loads((tmp_path / who).read_text()) for who in "ab")
    assert (a["who"], b["who"]) == ("a", "b")
    assert a["argv"] == ["rollout", "--run-dir", str(tmp_path), "--actor-id", "rollout-0", "0"]
    assert a["torch"] != b["torch"] and a["numpy"] != b["numpy"], (a, b)


@pytest.fixture(params=["exec", "zygote"])
def server_start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the fork server starts: executed afresh, or forked by the session's zygote."""
    if request.param == "exec":
        monkeypatch.delenv(ZYGOTE_ENV, raising=False)
    else:
        monkeypatch.setenv(ZYGOTE_ENV, request.getfixturevalue("fork_zygote"))
    return str(request.param)


async def wait_for_line(path: Path, needle: str, limit_s: float = 120.0) -> None:
    async with asyncio.timeout(limit_s):
        while not path.is_file() or needle not in path.read_text():  # noqa: ASYNC110, ASYNC240 - another process writes it
            await asyncio.sleep(0.1)


async def test_a_forked_actor_has_its_environment_log_session_and_exit_code(
    tmp_path: Path, embedded_nats: EmbeddedNats, bus: Bus, server_start: str
) -> None:
    run_dir = tmp_path / "run"  # the embedded server's folder: nats.json is there
    (run_dir / "logs").mkdir()
    recipe = Recipe()
    (run_dir / "recipe.json").write_text(recipe.model_dump_json())
    await ensure_trajectory_stream(bus, Subjects(recipe.run.name))  # what a reward actor reads
    # the load-time variables up gives a trainer here, which the zygote has (conftest.py)
    server = await ForkServer.start(run_dir, {**os.environ, **mimalloc_preload()})
    try:
        assert isinstance(server.proc, ZygoteServer) == (server_start == "zygote")
        logs = run_dir / "logs"
        # the environment is the request's: a log level that does not exist fails the
        # actor's first line, with the traceback in its own log and exit code 1
        bad = await server.spawn(
            actor_argv("reward", run_dir, "reward-0"),
            {**os.environ, "ASYNCRL_LOG_LEVEL": "NO_SUCH_LEVEL"},
            logs / "reward-0.log",
        )
        assert await asyncio.wait_for(bad.wait(), 60) == 1
        assert "NO_SUCH_LEVEL" in (logs / "reward-0.log").read_text()
        # a folder that is not a run's: the actor's own message, exit code 1
        lost = await server.spawn(
            actor_argv("reward", tmp_path / "nowhere", "reward-1"),
            dict(os.environ),
            logs / "reward-1.log",
        )
        assert await asyncio.wait_for(lost.wait(), 60) == 1
        assert "is not a run folder" in (logs / "reward-1.log").read_text()
        # a live actor: in a session of its own, on the run's bus; SIGKILL is reported as such
        live = await server.spawn(
            actor_argv("reward", run_dir, "reward-2"), dict(os.environ), logs / "reward-2.log"
        )
        await wait_for_line(logs / "reward-2.log", "started")
        assert os.getsid(live.pid) == live.pid
        assert live.returncode is None
        os.kill(live.pid, signal.SIGKILL)
        assert await asyncio.wait_for(live.wait(), 30) == -signal.SIGKILL
        # nothing of an actor's output reached the server's answers or its own log
        assert "started" not in (logs / "fork-server.log").read_text()
        # the server itself: found by the run folder on its command line (a zygote's fork
        # has its own rewritten), in a session of its own, its log the run's
        assert server.proc.pid in lineage.naming(run_dir)
        assert os.getsid(server.proc.pid) == server.proc.pid
    finally:
        await server.close()
    # an executed server's exit status is up's to see; a zygote's fork's is not
    assert server.proc.returncode == (0 if server_start == "exec" else UNKNOWN_EXIT)
    assert not lineage.alive(server.proc.pid)


@pytest.mark.slow
async def test_a_run_whose_fork_server_dies_fails_and_leaves_nothing(
    tmp_path: Path, server_start: str
) -> None:
    async with running_up(
        tmp_path,
        "forkdies",
        "trainer.max_steps=400",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    ) as up:
        up_log = up.run_dir / "logs" / "up.log"
        await wait_for_line(up_log, "all actors started")
        pid = int(re.findall(r"actors are forked .*server_pid=(\d+)", up_log.read_text())[0])
        assert pid in run_processes(up.run_dir)
        os.kill(pid, signal.SIGKILL)
        assert up.proc.stdout is not None
        out, _ = await asyncio.wait_for(up.proc.communicate(), 120)
        assert up.proc.returncode == 1, out.decode()
        code = -signal.SIGKILL if server_start == "exec" else UNKNOWN_EXIT
        assert f"the fork server exited with code {code}" in out.decode(), out.decode()
        # its actors were stopped with the run: none outlived up
        left = [p for p in run_processes(up.run_dir) if lineage.alive(p)]
        assert not left, left


async def test_a_zygote_refuses_what_a_fork_of_it_cannot_be(
    tmp_path: Path, fork_zygote: str
) -> None:
    """Variables read when a process starts (an allocator's preload, OpenMP's wait, the
    interpreter's path) that differ from the zygote's own, and a run folder too long for
    the command line it keeps, are refused with the reason (``up`` then starts its own
    server); so is a socket where no zygote listens."""
    log = tmp_path / "fork-server.log"
    same = {**os.environ, **mimalloc_preload()}  # the zygote's (conftest.py)
    other = {**same, "OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "1000", "PYTHONPATH": "/x"}
    why = await ZygoteServer.ask(fork_zygote, tmp_path, other, log)
    assert isinstance(why, str)
    differ = "GOMP_SPINCOUNT, OMP_WAIT_POLICY, PYTHONPATH"
    assert f"variables read at a start differ from the zygote's: {differ}" in why, why
    why = await ZygoteServer.ask(fork_zygote, tmp_path.joinpath(*["x" * 200] * 25), same, log)
    assert isinstance(why, str) and "does not fit in the zygote's command line" in why, why
    why = await ZygoteServer.ask(str(tmp_path / "none.sock"), tmp_path, same, log)
    assert isinstance(why, str) and why.startswith("no zygote at"), why
    assert not log.exists()  # nothing was forked


COMMAND = r"""
import json, os, signal, sys, time
out = os.environ["OUT"]


def stop(signum, frame):
    with open(os.path.join(out, "stopped"), "w") as f:
        f.write(str(signum))
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
with open("/proc/self/cmdline", "rb") as f:
    cmdline = f.read().rstrip(b"\0").decode().split("\0")  # a retitled one is zero-padded
record = {"pid": os.getpid(), "session": os.getsid(0), "cwd": os.getcwd(), "argv": sys.argv[1:],
          "name": __name__, "cmdline": cmdline}
with open(os.path.join(out, "ran.json"), "w") as f:
    json.dump(record, f)
print("out", sys.stdin.read().strip(), flush=True)
print("err", file=sys.stderr, flush=True)
if sys.argv[1] == "wait":
    time.sleep(120)
sys.exit(int(sys.argv[2]))
"""


def command_env(tmp_path: Path, zygote: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ZYGOTE_ENV}
    return {**env, **({ZYGOTE_ENV: zygote} if zygote else {}), "OUT": str(tmp_path), **extra}


def ran(tmp_path: Path, limit_s: float = 60.0) -> dict:
    path = tmp_path / "ran.json"
    deadline = time.monotonic() + limit_s
    while not path.is_file() or not path.read_text().endswith("}"):
        assert time.monotonic() < deadline, "the command never started"
        time.sleep(0.05)
    return json.loads(path.read_text())


def test_the_zygote_runs_a_command_with_its_streams_folder_and_status(
    tmp_path: Path, fork_zygote: str
) -> None:
    """``python -m asyncrl.entry.zygote --run MODULE ARGS`` is ``python -m MODULE ARGS``
    forked from the zygote: the caller's standard streams, working folder, arguments and
    status, the command line ``python -m`` would show, a session of its own. Where the
    zygote refuses (a start variable differs) or none is named, the command is executed,
    as the same process."""
    (tmp_path / "job.py").write_text(COMMAND)
    argv = run_argv("job", "exit", "3")
    for zygote, extra, forked in [
        (fork_zygote, {}, True),
        (fork_zygote, {"OMP_WAIT_POLICY": "ACTIVE"}, False),
        (None, {}, False),
    ]:
        proc = subprocess.Popen(
            argv,
            cwd=tmp_path,
            env=command_env(tmp_path, zygote, **extra),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = proc.communicate("in", timeout=120)
        assert (proc.returncode, out, err) == (3, "out in\n", "err\n"), (zygote, extra)
        record = ran(tmp_path)
        (tmp_path / "ran.json").unlink()
        assert (record["pid"] != proc.pid) == forked, (zygote, extra)
        assert record["argv"] == ["exit", "3"] and record["name"] == "__main__"
        assert record["cwd"] == str(tmp_path)
        assert record["cmdline"] == [sys.executable, "-m", "job", "exit", "3"]
        if forked:
            assert record["session"] == record["pid"]


def test_the_command_takes_the_callers_signals_and_ends_with_it(
    tmp_path: Path, fork_zygote: str
) -> None:
    """SIGTERM to the caller reaches the command (which stops cleanly: status 0); a command
    killed by a signal has its caller end by that signal; a caller killed takes its
    command with it."""
    (tmp_path / "job.py").write_text(COMMAND)
    env = command_env(tmp_path, fork_zygote)
    argv = run_argv("job", "wait", "0")

    def start() -> tuple[subprocess.Popen, int]:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdin=subprocess.DEVNULL)
        pid = ran(tmp_path)["pid"]
        (tmp_path / "ran.json").unlink()
        assert pid != proc.pid
        return proc, pid

    proc, pid = start()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert (tmp_path / "stopped").read_text() == str(signal.SIGTERM)

    proc, pid = start()
    os.kill(pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL

    proc, pid = start()
    proc.kill()
    proc.wait(60)
    deadline = time.monotonic() + 30
    while lineage.alive(pid):
        assert time.monotonic() < deadline, "the command outlived its caller"
        time.sleep(0.05)
