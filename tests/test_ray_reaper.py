"""The reaper that runs a role's command inside a Ray actor (``python -m
asyncrl.ray_launch --reap -- CMD``): when the actor's process dies, the role's whole
process group goes (grandchildren too); a SIGTERM while the actor lives is a stop that
the command answers itself. No Ray needed: the actor's process is a plain parent here."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG")

# the role: a process that starts a grandchild and sleeps (as torchrun starts its ranks)
ROLE = (
    "import subprocess, sys, time; "
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
    "time.sleep(60)"
)
# the actor's process: starts the reaper as RoleHost does, prints its pid, sleeps
HOST = f"""
import signal, subprocess, sys, time
from asyncrl.ray_launch import _pdeathsig
p = subprocess.Popen(
    [sys.executable, "-m", "asyncrl.ray_launch", "--reap", "--", sys.executable, "-c", {ROLE!r}],
    start_new_session=True,
    preexec_fn=_pdeathsig(signal.SIGTERM),
)
print(p.pid, flush=True)
print(p.wait(), flush=True)
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


def start_host() -> tuple[subprocess.Popen[str], int]:
    host = subprocess.Popen([sys.executable, "-c", HOST], stdout=subprocess.PIPE, text=True)
    assert host.stdout is not None
    pgid = int(host.stdout.readline())
    # reaper, role and grandchild
    assert until(lambda: len(group(pgid)) == 3), group(pgid)
    return host, pgid


def test_the_whole_group_goes_when_the_host_dies() -> None:
    host, pgid = start_host()
    host.kill()
    host.wait()
    assert until(lambda: not group(pgid)), f"left behind: {group(pgid)}"


def test_a_stop_is_answered_by_the_role_and_its_status_returned() -> None:
    host, pgid = start_host()
    try:
        os.killpg(pgid, signal.SIGTERM)  # what RoleHost.signal does on a stop
        assert host.stdout is not None
        assert int(host.stdout.readline()) == 128 + signal.SIGTERM  # the role's own status
        host.wait(timeout=30)
    finally:
        host.kill()
