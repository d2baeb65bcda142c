"""One way for end-to-end tests to start ``asyncrl up`` and to leave nothing behind.

``running_up`` starts ``asyncrl up`` (the ci recipe unless told otherwise) in a session of
its own, waits until the run's ``nats.json`` exists, and yields the process and its run
folder. However the test ends, whatever is left of the run is then killed: ``up``'s process
group (its nats-server, the ``up`` process itself) and every actor of the run, each of
which the supervisor started in a session of its own. A failed test thus leaves no actor
holding a core for the tests after it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.entry.zygote import run_argv
from asyncrl.runtime import lineage
from asyncrl.runtime.zygote_socket import ZYGOTE_ENV

REPO = Path(__file__).resolve().parent.parent
CI_RECIPE = REPO / "recipes" / "ci.toml"


def cli(*args: str) -> list[str]:
    """The command line of ``asyncrl ARGS``. Where the test process has a zygote
    (conftest.py), every command but ``up`` runs forked from it
    (:func:`asyncrl.entry.zygote.run_argv`), its imports done: an ``asyncrl replay`` or an
    attached actor then starts at once rather than after its imports (~10 s of CPU each on
    2 cores, while a live run goes on stepping). ``up`` is executed: its tests signal its
    process group, and it asks the zygote for its own fork server."""
    if args[:1] != ("up",) and os.environ.get(ZYGOTE_ENV):
        return run_argv("asyncrl.entry.cli", *args)
    return [sys.executable, "-m", "asyncrl.entry.cli", *args]


def up_args(parent: Path, name: str, *sets: str, recipe: Path = CI_RECIPE) -> list[str]:
    """``asyncrl up`` of the ci recipe (or ``recipe``) as the run ``parent/name``, with
    evaluation off (its eval actor would hold a core the run needs), no TensorBoard events
    and no plots at the end (seconds per run that tests/test_e2e_observe.py spends once),
    unless ``sets`` turn them on again."""
    quiet = ("eval.every=0", "run.tensorboard=false", "run.plots=false")
    flags = [
        x for s in (f"run.dir={parent}", f"run.name={name}", *quiet, *sets) for x in ("--set", s)
    ]
    return cli("up", str(recipe), *flags, "--quiet")


async def wait_for_file(path: Path, proc: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(120):
        while not path.exists():  # noqa: ASYNC240 - a stat, while another process starts
            assert proc.returncode is None, f"the run ended before {path.name} appeared"
            await asyncio.sleep(0.1)


@dataclass
class UpRun:
    proc: asyncio.subprocess.Process
    run_dir: Path


def run_processes(run_dir: Path) -> list[int]:
    """Pids of the processes whose command line names ``run_dir`` (a run's actors)."""
    return lineage.naming(run_dir)


def kill_run(proc: asyncio.subprocess.Process, run_dir: Path) -> None:
    """SIGKILL to ``up``'s process group, to the group of each of the run's actors, and to
    each process the test itself started for the run (``asyncrl attach``: it is in the
    test's own group, which is spared)."""
    lineage.kill_run(proc.pid, run_dir)


def run_dir_of(argv: list[str]) -> Path | None:
    """The run folder an ``asyncrl up`` command line names with ``--set run.dir=`` and
    ``--set run.name=``; None for any other command, or one that leaves either out."""
    sets = dict(a.split("=", 1) for a in argv if a.startswith(("run.dir=", "run.name=")))
    if "up" not in argv or len(sets) < 2:
        return None
    return Path(sets["run.dir"]) / sets["run.name"]


async def run(argv: list[str], limit: float = 420.0) -> tuple[int, str]:
    """A command to its end, with its exit code and output. If it has not ended within
    ``limit`` seconds (or the test is cancelled) it is killed, with its process group and,
    for an ``asyncrl up`` of a named run, every actor of that run."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), limit)
    finally:
        if proc.returncode is None:
            run_dir = run_dir_of(argv)
            if run_dir is not None:
                kill_run(proc, run_dir)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
    return proc.returncode or 0, out.decode()


@contextlib.asynccontextmanager
async def running_up(
    parent: Path,
    name: str,
    *sets: str,
    argv: list[str] | None = None,
    env: Mapping[str, str] | None = None,
    stdout: Any = asyncio.subprocess.DEVNULL,
    stderr: Any = asyncio.subprocess.DEVNULL,
    cwd: Path = REPO,
) -> AsyncIterator[UpRun]:
    """``asyncrl up`` of the run ``parent/name`` with the given ``--set`` overrides (or the
    whole command line ``argv``), once its ``nats.json`` exists. The run folder is
    ``parent/name`` either way. Kills the run on exit if it is still going."""
    run_dir = parent / name
    proc = await asyncio.create_subprocess_exec(
        *(argv if argv is not None else up_args(parent, name, *sets)),
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        env=dict(env) if env is not None else None,
        start_new_session=True,
    )
    try:
        await wait_for_file(run_dir / "nats.json", proc)
        yield UpRun(proc, run_dir)
    finally:
        # an actor that outlived a finished ``up`` is killed too
        kill_run(proc, run_dir)
        if proc.returncode is None:
            await proc.wait()
