"""The reaper that runs a role's command inside a Ray actor (:func:`start_reaper`): when
the process holding its lifeline (the actor's worker) dies, however it dies, the role's
whole process group goes, grandchildren too; a SIGTERM to the group while the holder
lives is a stop that the command answers itself, and its status comes back. No Ray needed:
the holder is a plain process here."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

# the role: a process that starts a grandchild and sleeps (as torchrun starts its ranks)
ROLE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "time.sleep(60)"
)
# the holder (a Ray actor's worker): starts the reaper as RoleHost does, prints the
# group, then the status the reaper reports
HOLDER = f"""
import sys
from asyncrl.launch.ray_cluster import read_status, start_reaper
pgid, status, life = start_reaper([sys.executable, "-c", {ROLE!r}], None, sys.argv[1], None)
print(pgid, flush=True)
print(read_status(status), flush=True)
"""


def group(pgid: int) -> list[int]:
    """The live (not zombie) processes of process group ``pgid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def until(check, limit: float = 30.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def start_holder(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "role.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None
    pgid = int(holder.stdout.readline())
    # the reaper, the role and its grandchild
    assert until(lambda: len(group(pgid)) == 3), group(pgid)
    return holder, pgid


def test_the_whole_group_goes_when_the_holder_dies(tmp_path: Path) -> None:
    holder, pgid = start_holder(tmp_path)
    holder.kill()  # SIGKILL: nothing of it runs, its pipe ends close
    holder.wait()
    assert until(lambda: not group(pgid)), f"left behind: {group(pgid)}"


def test_a_stop_is_answered_by_the_role_and_its_status_returned(tmp_path: Path) -> None:
    holder, pgid = start_holder(tmp_path)
    try:
        os.killpg(pgid, signal.SIGTERM)  # what RoleHost.signal does on a stop
        assert holder.stdout is not None
        assert int(holder.stdout.readline()) == 128 + signal.SIGTERM  # the role's own status
        holder.wait(timeout=30)
    finally:
        holder.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
