"""Tools from a real MCP server (the ``mcp`` package's MCPServer) started over stdio."""

from __future__ import annotations

import os
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

import pytest

from asyncrl.tools.base import ToolBox
from asyncrl.tools.calls import ToolCall
from asyncrl.tools.mcp import MCPServerSpec, MCPTools

SERVER = textwrap.dedent(
    '''
    import os
    import time

    from mcp.server.mcpserver import MCPServer

    server = MCPServer("test")


    @server.tool()
    def multiply(a: int, b: int) -> int:
        """Multiplies two integers."""
        return a * b


    @server.tool()
    def whoami() -> str:
        """The server's pid and whether it sees the actor's secrets."""
        secret = os.environ.get("ASYNCRL_NATS_TOKEN", "none")
        return f"{os.getpid()} {os.environ.get('GREETING')} {secret}"


    @server.tool()
    def fails() -> str:
        """Always raises."""
        raise ValueError("broken on purpose")


    @server.tool()
    def slow() -> str:
        """Answers after the client gave up (and soon enough not to hold up the shutdown)."""
        time.sleep(3)
        return "late"


    server.run()
    '''
)


@pytest.fixture
def server_file(tmp_path: Path) -> Path:
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return path


@pytest.fixture
def errlog(tmp_path: Path) -> Iterator[TextIO]:
    """The servers' stderr (the transport needs a real file)."""
    with (tmp_path / "server.log").open("w") as log:
        yield log


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_mcp_tools_are_listed_called_and_the_server_ends(
    server_file: Path, errlog: TextIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ASYNCRL_NATS_TOKEN", "s3cret")
    spec = MCPServerSpec(sys.executable, [str(server_file)], env={"GREETING": "hi"}, timeout_s=2)
    async with MCPTools(spec, errlog=errlog) as server:
        names = [t.name for t in server.tools]
        assert names == ["multiply", "whoami", "fails", "slow"]
        multiply = server.tools[0].schema()["function"]
        assert multiply["description"] == "Multiplies two integers."
        assert multiply["parameters"]["required"] == ["a", "b"]
        assert multiply["parameters"]["properties"]["a"]["type"] == "integer"
        assert all(t.timeout_s == 2 for t in server.tools)

        box = ToolBox(server.tools)
        product = await box.run(ToolCall("multiply", {"a": 123, "b": 4567}, "a"))
        assert (product.ok, product.content) == (True, "561741")
        who = await box.run(ToolCall("whoami", {}, "b"))
        pid_text, greeting, secret = who.content.split()
        assert (greeting, secret) == ("hi", "none")
        bad = await box.run(ToolCall("multiply", {"a": "many"}, "c"))
        assert (bad.ok, bad.reason) == (False, "raised") and "validation" in bad.content
        fails = await box.run(ToolCall("fails", {}, "d"))
        assert (fails.ok, fails.reason) == (False, "raised")
        slow = await box.run(ToolCall("slow", {}, "e"))
        assert (slow.ok, slow.reason) == (False, "timeout")
        again = await box.run(ToolCall("multiply", {"a": 2, "b": 3}, "f"))
        assert again.content == "6"  # the session survives a timed-out call
    assert server.tools == []
    assert not alive(int(pid_text))


async def test_a_server_that_cannot_start_raises(tmp_path: Path, errlog: TextIO) -> None:
    broken = tmp_path / "broken.py"
    broken.write_text("raise SystemExit(3)\n")
    spec = MCPServerSpec(sys.executable, [str(broken)], timeout_s=5)
    with pytest.raises(RuntimeError, match=r"MCP server .*broken\.py.* did not start"):
        async with MCPTools(spec, errlog=errlog):
            pass
