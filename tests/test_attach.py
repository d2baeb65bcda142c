"""``asyncrl attach``: which roles may join a live run, driven through the command line.

The run is a folder with a recipe and the ``nats.json`` of a real, live nats-server, so
an attach that wrongly went ahead would connect and announce itself there."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.recipe import load_recipe
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.wire.messages import ActorInfo
from asyncrl.wire.subjects import Subjects

REPO = Path(__file__).resolve().parent.parent

# Generous: the only wait is for a Python process to start and either exit or announce
# itself; an attach that (wrongly) proceeds announces itself within this.
ATTACH_LIMIT_S = 120.0


async def attach(run_dir: Path, role: str, bus: Bus) -> tuple[int | None, str, list[str]]:
    """Runs ``asyncrl attach ROLE``; returns its exit code (None if it was still running
    when an actor of the run announced itself), its stderr and who announced itself."""
    started: list[str] = []
    announced = asyncio.Event()

    async def on_started(info: ActorInfo) -> None:
        started.append(f"{info.role}:{info.actor_id}")
        announced.set()

    await bus.subscribe(Subjects(run_dir.name).started, ActorInfo, on_started)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncrl.entry.cli",
        "attach",
        role,
        "--run",
        str(run_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=REPO,
    )
    exited = asyncio.ensure_future(proc.communicate())
    seen = asyncio.ensure_future(announced.wait())
    try:
        async with asyncio.timeout(ATTACH_LIMIT_S):
            await asyncio.wait([exited, seen], return_when=asyncio.FIRST_COMPLETED)
    finally:
        seen.cancel()
        if not exited.done():
            proc.kill()
    _, err = await exited
    return (proc.returncode if not started else None), err.decode(), started


@pytest.fixture
def run_dir(embedded_nats: EmbeddedNats) -> Path:
    """The embedded server's run folder, with the recipe a run would have written."""
    folder = embedded_nats.run_dir
    recipe = load_recipe(None, [f"run.name={folder.name}", "model.path=tiny-random-llama"])
    (folder / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    return folder


@pytest.mark.parametrize(
    ("role", "reason"),
    [
        ("buffer", "a second buffer would answer the same lease and batch subjects"),
        ("trainer", "a second trainer would ask for the same steps"),
    ],
)
async def test_attach_refuses_a_second_buffer_or_trainer(
    run_dir: Path, bus: Bus, role: str, reason: str
) -> None:
    code, err, started = await attach(run_dir, role, bus)
    assert not started, f"attach {role} started an actor in the run: {started}"
    assert code == 2, err
    assert f"cannot attach a {role}: {reason}" in err, err
    assert "Traceback" not in err


async def test_attach_names_the_roles_that_may_join(run_dir: Path, bus: Bus) -> None:
    code, err, started = await attach(run_dir, "critic", bus)
    assert not started
    assert code == 2, err
    assert "the roles that can join a run are rollout, reward, eval" in err, err


ATTACH_THAT_RAISES = """
import sys
import asyncrl.entry.actor
from asyncrl.entry.cli import main


def failing(*args, **kwargs):
    raise RuntimeError("the actor failed after its stop")


asyncrl.entry.actor.run_actor = failing
try:
    main(["attach", "rollout", "--run", sys.argv[1]])
except RuntimeError:  # what rank_main must not let through
    sys.exit(3)
"""


def test_an_attached_actor_that_raises_leaves_through_the_ranks_way_out(tmp_path: Path) -> None:
    """However an attached actor ends, it leaves as every actor process does (through
    ``rank_main``): an exception is printed and gives status 1, instead of escaping into
    the interpreter's finalization, where an engine's gloo thread still forming its group
    with a trainer that just went away aborts the process (SIGABRT). In a process of its
    own: ``rank_main`` may leave by ``os._exit``, which must not end the test's."""
    proc = subprocess.run(
        [sys.executable, "-c", ATTACH_THAT_RAISES, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" in proc.stderr, proc.stderr[-3000:]
    assert "RuntimeError: the actor failed after its stop" in proc.stderr, proc.stderr[-3000:]
