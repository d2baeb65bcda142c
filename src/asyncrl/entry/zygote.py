"""A fork-server zygote: ``python -m asyncrl.entry.zygote SOCKET`` (what it is for, and
how ``up`` uses it: :mod:`asyncrl.entry.fork_server`).

It also runs commands: ``python -m asyncrl.entry.zygote --run MODULE [ARG...]`` is
``python -m MODULE ARG...`` forked from the zygote that ``ASYNCRL_FORK_ZYGOTE`` names
(:func:`run_through`), its imports done: an ``asyncrl replay`` or ``asyncrl attach`` starts
in a fraction of a second instead of after some 10 s of CPU. Where no zygote is named, or it
refuses, the command is executed as it would have been.

This module is what the zygote runs before its imports: it makes room in its own command
line for the titles of the fork servers it will start (by executing itself again with a
longer one, where the first is short), binds its socket, and only then imports torch and
transformers, so that a client can connect at once and wait for them. Nothing here imports
more than the standard library and the name of the zygote's variable.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import NoReturn

from asyncrl.runtime.zygote_socket import ZYGOTE_ENV

TITLE_ROOM = 4096
"""Bytes of command line a zygote keeps for the title of each fork server it starts."""

MODULE = "asyncrl.entry.zygote"

RUN_FLAG = "--run"

RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""Signals that :func:`run_through` passes on to the command the zygote runs."""


def _arg_area() -> tuple[int, int] | None:
    """Where this process's command line lies in its memory (``/proc/self/stat``'s fields 48
    and 49, ``arg_start`` and ``arg_end``), or None where there is no such file."""
    try:
        stat = Path("/proc/self/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # fields[0] is field 3
    return int(fields[45]), int(fields[46])


def _packed(argv: list[str]) -> bytes:
    return b"\0".join(a.encode() for a in argv) + b"\0"


def _room(area: tuple[int, int] | None) -> int:
    """Bytes of command line in ``area`` (none where it is unknown)."""
    return 0 if area is None else area[1] - area[0]


def title_fits(argv: list[str]) -> bool:
    """Whether :func:`retitle` can write ``argv``."""
    return len(_packed(argv)) <= _room(_arg_area())


def retitle(argv: list[str]) -> bool:
    """Rewrites this process's command line, as ``/proc/<pid>/cmdline`` and ``ps`` show it,
    to ``argv`` (in place, in the memory the kernel reads it from; what is left is zeroed);
    False, and nothing written, where it does not fit in what the process started with."""
    area, data = _arg_area(), _packed(argv)
    if area is None or len(data) > _room(area):
        return False
    ctypes.memmove(area[0], data.ljust(_room(area), b"\0"), _room(area))
    return True


def run_argv(module: str, *args: str) -> list[str]:
    """The command line of ``python -m module args`` run through the zygote, where the
    environment names one (:func:`run_through`)."""
    return [sys.executable, "-m", MODULE, RUN_FLAG, module, *args]


def _ask(path: str, request: dict[str, object]) -> int | None:
    """Has the zygote at ``path`` run ``request``'s command, with this process's standard
    streams, passing on :data:`RELAYED` signals; its status as asyncio's ``returncode``
    (minus a signal), or None where the zygote cannot be reached or refuses."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        try:
            conn.connect(path)
            socket.send_fds(conn, [(json.dumps(request) + "\n").encode()], [0, 1, 2])
        except OSError:
            return None
        replies = conn.makefile("rb")
        first = json.loads(replies.readline() or b"{}")
        if "pid" not in first:
            return None  # refused (the zygote's log says why), or gone
        pid = int(first["pid"])

        def relay(signum: int, _frame: object) -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

        for sig in RELAYED:
            signal.signal(sig, relay)
        last = json.loads(replies.readline() or b"{}")
        return int(last["exit"]) if "exit" in last else 255


def run_through(module: str, args: list[str]) -> NoReturn:
    """Runs ``python -m module args`` as a fork of the zygote that :data:`ZYGOTE_ENV` names
    and ends as it ended (its status, or killed by its signal); executes it instead where
    the variable is unset, or the zygote cannot be reached or refuses (a variable read at
    a start differs, the command line is too long for the zygote's room)."""
    title = [sys.executable, "-m", module, *args]
    path = os.environ.get(ZYGOTE_ENV)
    request = {"module": module, "args": args, "title": title}
    code = None
    if path:
        code = _ask(path, {**request, "env": dict(os.environ), "cwd": os.getcwd()})
    if code is None:
        os.execv(sys.executable, title)
    if code < 0:  # ended by a signal: this process ends by it too
        with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP take no handler
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == [RUN_FLAG] and len(args) > 1:
        run_through(args[1], args[2:])
    if not args or args[0].startswith("-"):
        print(f"usage: python -m {MODULE} SOCKET | {RUN_FLAG} MODULE [ARG...]", file=sys.stderr)
        return 2
    path = args[0]
    area = _arg_area()
    if area is not None and _room(area) < TITLE_ROOM:
        room = "--title-room=" + " " * TITLE_ROOM
        os.execv(sys.executable, [sys.executable, "-m", MODULE, path, room])
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)  # whoever connects has code run as this user
    listener.listen(64)
    from asyncrl.entry import fork_server  # noqa: PLC0415 - torch and transformers, once the socket is bound

    fork_server.serve_zygote(listener)


if __name__ == "__main__":
    sys.exit(main())
