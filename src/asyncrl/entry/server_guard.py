"""Runs one inference server and makes sure it never outlives the process that started it.

    python server_guard.py PARENT_PID -- SERVER_COMMAND ...

Standard library only: it runs under any interpreter. The engine starts it as the leader
of a new process group and hands it, as stdin, the read end of a pipe whose write end only
the engine holds. The server runs as the guard's child in the same group, so every process
the server spawns (vLLM's engine core and workers, SGLang's scheduler) is in that group too.

The guard ends the whole group — SIGTERM, then SIGKILL after a grace period — when

- its stdin reaches end of file: the engine closed the pipe or died, however it died
  (``kill -9`` included: the kernel closes a dead process's descriptors);
- it gets SIGTERM, also from ``PR_SET_PDEATHSIG``, the kernel's notice that the parent
  died (a second line, for a pipe end that leaked into a forked child of the engine);
- its parent process id is no longer the engine's (a third line, checked every second: a
  run once left a guard behind whose pipe end had leaked and whose SIGTERM had come
  blocked with the signal mask it inherited, so the guard also unblocks its signals);
- the server exits by itself: whatever it left running in the group goes too; the
  server's status is written to the log first.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading

GRACE_S = float(os.environ.get("ASYNCRL_SERVER_GRACE_S", "10"))
"""Seconds the server has to exit after SIGTERM before the group is killed."""

PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the stdin pipe still covers it
        pass
    if os.getppid() != parent:  # the parent died before the line above took effect
        sys.exit(1)


def main() -> int:
    parent = int(sys.argv[1])
    command = sys.argv[sys.argv.index("--") + 1 :]
    # A signal mask survives fork and exec: a thread of the engine that blocked SIGTERM
    # would otherwise leave the parent-death signal pending forever.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    _die_with_parent(parent)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    server = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def watch_stdin() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        finally:
            done.set()

    def watch_server() -> None:
        server.wait()
        done.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    threading.Thread(target=watch_server, daemon=True).start()
    while not done.wait(1.0):
        if os.getppid() != parent:  # orphaned: adopted by init or a subreaper
            break
    code = server.poll()
    if code is not None:
        print(f"[server_guard] the server exited with status {code}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group's SIGTERM is for the others
    group = os.getpgrp()
    os.killpg(group, signal.SIGTERM)
    try:
        server.wait(GRACE_S)
    except subprocess.TimeoutExpired:
        print("[server_guard] the server ignored SIGTERM; killing", file=sys.stderr, flush=True)
    # Whatever is left in the group, the guard included, ends here: nothing survives it.
    os.killpg(group, signal.SIGKILL)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
