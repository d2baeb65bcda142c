"""The ``python`` tool's sandbox: hostile programs are contained, reported as tool errors
with a reason, and leave nothing behind (small limits keep each test to a few seconds)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncrl.tools.base import ToolBox
from asyncrl.tools.builtin import python_tool
from asyncrl.tools.calls import ToolCall
from asyncrl.tools.sandbox import SANDBOX_UID_BASE, SANDBOX_UID_SPAN, Limits, probe

ROOT = os.getuid() == 0


def sandbox_processes() -> list[int]:
    """Pids of live (not zombie) processes owned by a sandbox uid."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            continue
        if SANDBOX_UID_BASE <= uid < SANDBOX_UID_BASE + SANDBOX_UID_SPAN and state not in "ZX":
            pids.append(int(entry.name))
    return pids


def exists(path: str) -> bool:
    return Path(path).exists()


def no_sandbox_process_left() -> bool:
    """True once every sandbox process is gone: a SIGKILLed process takes a moment to exit,
    so this looks again for up to 5 s."""
    deadline = time.monotonic() + 5
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    return not sandbox_processes()


async def run(code: str, **limits: float) -> tuple[bool, str, str]:
    box = ToolBox([python_tool(Limits(**{"cpu_s": 2, "wall_s": 20.0, **limits}))])  # type: ignore[arg-type]
    result = await box.run(ToolCall("python", {"code": code}, "c"))
    return result.ok, result.reason, result.content


async def test_a_program_runs_in_a_scratch_directory_that_is_removed() -> None:
    ok, reason, content = await run("import os\nprint(6 * 7)\nprint(os.getcwd())")
    assert (ok, reason) == (True, "")
    answer, cwd = content.splitlines()
    assert answer == "42" and "asyncrl-sandbox-" in cwd
    assert not exists(cwd)
    assert "fresh limited subprocess" in python_tool().description


async def test_an_infinite_loop_hits_the_cpu_limit() -> None:
    ok, reason, content = await run("while True:\n    pass", cpu_s=1)
    assert (ok, reason) == (False, "killed")
    assert "SIGXCPU (CPU time limit)" in content


async def test_a_sleeper_hits_the_wall_clock() -> None:
    ok, reason, content = await run(
        "import time\nprint('start', flush=True)\ntime.sleep(60)", wall_s=0.5
    )
    assert (ok, reason) == (False, "timeout")
    assert content == "Error: start\n[killed: ran past 0.5 s]"


async def test_a_memory_bomb_fails_inside_the_sandbox() -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))"
    ok, reason, content = await run(code, memory_mb=128)
    assert (ok, reason) == (False, "exit_status")
    assert "MemoryError" in content and "[exit status 1]" in content


@pytest.mark.skipif(
    not ROOT, reason="the process limit is only enforced for a separate user, which needs root"
)
async def test_the_process_limit_holds_and_no_process_survives_the_run() -> None:
    code = (
        "import os, time\n"
        "n = 0\n"
        "for _ in range(50):\n"
        "    try:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "            os._exit(0)\n"
        "        n += 1\n"
        "    except OSError as exc:\n"
        "        print('refused:', exc.strerror)\n"
        "        break\n"
        "print('forked', n)\n"
    )
    ok, _, content = await run(code, processes=6)
    assert ok, content
    assert "refused: Resource temporarily unavailable" in content
    forked = int(content.rsplit("forked ", 1)[1])
    assert 0 < forked < 6
    assert no_sandbox_process_left()  # the sleeping children were killed with the run


@pytest.mark.skipif(
    not ROOT, reason="the process limit is only enforced for a separate user, which needs root"
)
async def test_a_fork_bomb_is_contained() -> None:
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    ok, reason, _ = await run(code, processes=8, cpu_s=1, wall_s=2.0)
    assert not ok and reason in ("timeout", "killed")
    assert no_sandbox_process_left()


async def test_the_environment_is_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYNCRL_NATS_TOKEN", "s3cret-nats-token")
    monkeypatch.setenv("ASYNCRL_RUN_TOKEN", "s3cret-run-token")
    ok, _, content = await run("import os\nprint(dict(os.environ))")
    assert ok
    assert "s3cret" not in content and "ASYNCRL" not in content and "PATH" not in content


@pytest.fixture
def private_file() -> Iterator[Path]:
    """A 0600 file in an open folder, like a run folder's ``nats.json``."""
    run_dir = Path(tempfile.mkdtemp(prefix="asyncrl-run-"))
    run_dir.chmod(0o755)
    secret = run_dir / "nats.json"
    secret.write_text('{"token": "s3cret-nats-token"}')
    secret.chmod(0o600)
    yield secret
    secret.unlink()
    run_dir.rmdir()


@pytest.mark.skipif(
    not ROOT, reason="without root the code runs as the same user and can read its files"
)
async def test_a_private_file_like_nats_json_is_unreadable(private_file: Path) -> None:
    ok, reason, content = await run(f"print(open({str(private_file)!r}).read())")
    assert (ok, reason) == (False, "exit_status")
    assert "PermissionError" in content and "s3cret" not in content


async def test_no_network_where_a_namespace_can_be_made() -> None:
    if not probe().network_isolated:
        pytest.skip("this machine allows no network namespace: the sandbox has network")
    connected = asyncio.Event()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        writer.close()

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
        ok, reason, content = await run(code)
    assert (ok, reason) == (False, "exit_status")
    assert "connected" not in content.splitlines()[-2] and not connected.is_set()
    assert "OSError" in content or "unreachable" in content


async def test_endless_output_is_cut_to_its_tail() -> None:
    ok, _, content = await run("for i in range(200000):\n    print(i)", output_chars=100)
    assert ok
    assert content.startswith("[...]\n") and content.endswith("199999")
    assert len(content) <= 110
