"""A fork-server zygote: ``python -m asyncrl.entry.zygote SOCKET`` (what it is for, and
how ``up`` uses it: :mod:`asyncrl.entry.fork_server`).

This module is what the zygote runs before its imports: it makes room in its own command
line for the titles of the fork servers it will start (by executing itself again with a
longer one, where the first is short), binds its socket, and only then imports torch and
transformers, so that a client can connect at once and wait for them. Nothing here imports
more than the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import sys
from pathlib import Path

TITLE_ROOM = 4096
"""Bytes of command line a zygote keeps for the title of each fork server it starts."""

MODULE = "asyncrl.entry.zygote"


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


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print(f"usage: python -m {MODULE} SOCKET", file=sys.stderr)
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
