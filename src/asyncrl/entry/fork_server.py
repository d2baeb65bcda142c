"""The fork server of ``asyncrl up`` (``python -m asyncrl.entry.fork_server --run-dir DIR``):
one process that imports what every actor imports (torch, transformers, the actors'
modules) once, then starts each actor process as a fork of itself.

An actor process started afresh spends most of a short run importing: on a 2-core Intel
Xeon, a ``recipes/ci.toml`` run's trainer, rollout, reward and buffer took some 17 s of
CPU in imports together, of 21 s in all. Forked from here, an actor starts with its
imports done and shares their memory with its siblings (copy on write).

It speaks JSON lines: its standard input takes requests, ``{"id", "argv", "env", "log"}``
(an actor's command line as :func:`asyncrl.runtime.supervisor.actor_argv` writes it, its
whole environment and its log file); its standard output answers ``{"ready": pid}`` once
the imports are done, ``{"id", "pid"}`` for each fork, and ``{"exit": pid, "code": c}``
when a child ends (``c`` as :attr:`asyncio.subprocess.Process.returncode`: the exit
status, or minus the signal that ended it). It ends when its standard input closes; the
actors it started live on, each in a session of its own, as the supervisor's other
processes do.

A forked actor is the actor an executed command would be, with three differences that
come from what a process reads only when it starts: the C library's variables read at
load (torch's OpenMP pool's ``OMP_WAIT_POLICY``, ``LD_PRELOAD`` of an allocator) are the
fork server's, which ``up`` starts with the trainer's (:mod:`asyncrl.runtime.forks`);
``/proc/<pid>/environ`` and ``/proc/<pid>/cmdline`` show the fork server's (its command
line names the run folder, so :func:`asyncrl.runtime.lineage.naming` still finds the
run's actors; what an actor executes inherits the actor's own environment, marks
included); and torch's thread count is set by ``torch.set_num_threads`` rather than
``OMP_NUM_THREADS`` (:func:`asyncrl.entry.actor.place_process`).

**A zygote** (``python -m asyncrl.entry.zygote SOCKET``) does the imports once
for many runs: where ``up``'s environment names its socket in ``ASYNCRL_FORK_ZYGOTE``, ``up``
asks it for the run's fork server instead of starting one, and the zygote forks it, with
``up``'s environment, working folder and log, its command line rewritten to name the run
(:func:`asyncrl.entry.zygote.retitle`), talking over the socket as it would over its
pipes. For a machine that starts many short runs (a test suite, a sweep): the imports are
most of a short run's start (8 s of CPU on a 2-core AMD EPYC). A request whose variables
read at a process's start differ from the zygote's own (:func:`start_vars`: a fork cannot
change what they did) is refused, and ``up`` starts its own server as without one. The
server's exit status is the zygote's to collect, so ``up`` reports a zygote's server that
died with code :data:`asyncrl.runtime.forks.UNKNOWN_EXIT`.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import sys
import traceback
from typing import Any, NoReturn

import numpy as np
import torch

from asyncrl.actors import ACTORS, actor_class
from asyncrl.entry import actor as actor_entry
from asyncrl.entry.zygote import retitle, title_fits
from asyncrl.runtime.forks import ACTOR_MODULE, SERVER_MODULE, load_time_vars


def preload() -> None:
    """Imports every role's actor module (torch, transformers, FSDP with the trainer's)
    as an executed actor imports its own (:func:`asyncrl.entry.actor.imports_without_collector`:
    the collector off, then what they built frozen out of its passes): a forked child then
    never touches those pages to scan them, and shares them with its siblings."""
    with actor_entry.imports_without_collector():
        for role in ACTORS:
            actor_class(role)


def exit_code(status: int) -> int:
    """A ``waitpid`` status as asyncio's ``returncode``: the exit status, or minus the signal."""
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def system_exit_code(exc: SystemExit) -> int:
    """The status a ``SystemExit`` ends a process with, as the interpreter gives it (a
    message is printed, and is status 1)."""
    if exc.code is None or isinstance(exc.code, int):
        return exc.code or 0
    print(exc.code, file=sys.stderr)
    return 1


def leave(code: int, *, exit_handlers: bool, interrupted: bool = False) -> NoReturn:
    """Ends a fork with ``code``, its output flushed, without the interpreter's
    finalization (its state is the zygote's or the server's, and their threads' locks may
    be held): after its exit handlers where it ran an actor or a command of its own; killed
    by SIGINT where ``interrupted``, as an interpreter ends on an unhandled interrupt."""
    try:
        with contextlib.suppress(BaseException):  # a closed stream cannot say why: the code stands
            if exit_handlers:
                atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
    finally:
        if interrupted:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


def take_request(request: dict[str, Any]) -> None:
    """A fork's output appended to the request's ``log`` and its environment the request's
    ``env`` (both the actor's, or a zygote's fork server's)."""
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(request["env"])


def enter_folder(cwd: str) -> None:
    """Makes ``cwd`` this fork's working folder, and the first entry of ``sys.path`` where
    the zygote's own folder was, as ``python -m`` started there would have it."""
    if sys.path and sys.path[0] == os.getcwd():
        sys.path[0] = cwd
    os.chdir(cwd)


def run_child(request: dict[str, Any], close: list[int]) -> NoReturn:
    """The forked child: becomes the actor ``request`` describes and exits with its code."""
    code = 1
    try:
        os.setsid()  # a session of its own, as the supervisor starts every actor
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        take_request(request)
        argv: list[str] = request["argv"]
        sys.orig_argv = argv  # what an allocator's re-execution runs (runtime.allocator)
        sys.argv = [actor_entry.__file__ or ACTOR_MODULE, *argv[3:]]
        # fresh seeds, as a fresh interpreter draws them: a sibling's draws are not its own
        # (Python's random module reseeds itself after a fork)
        np.random.seed()
        torch.seed()
        code = actor_entry.main(argv[3:])
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException:
        traceback.print_exc()
    finally:
        leave(code, exit_handlers=True)


class Server:
    """The request loop: forks on each request, reports each child's end."""

    def __init__(self, replies: int) -> None:
        self.replies = replies
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def reply(self, message: dict[str, Any]) -> None:
        data = (json.dumps(message) + "\n").encode()
        while data:
            data = data[os.write(self.replies, data) :]

    def fork(self, request: dict[str, Any]) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            run_child(request, [self.replies, self.wake_r, self.wake_w])
        self.children.add(pid)
        self.reply({"id": request["id"], "pid": pid})

    def reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 255 << 8
            if done:
                self.children.discard(pid)
                self.reply({"exit": pid, "code": exit_code(status)})

    def serve(self) -> None:
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.reply({"ready": os.getpid()})
        pending = b""
        while True:
            readable, _, _ = select.select([0, self.wake_r], [], [])
            if self.wake_r in readable:
                while True:
                    try:
                        if not os.read(self.wake_r, 512):
                            break
                    except BlockingIOError:
                        break
                self.reap()
            if 0 in readable:
                data = os.read(0, 1 << 16)
                if not data:
                    return  # up closed the pipe: the run is over, or up is gone
                pending += data
                while b"\n" in pending:
                    line, pending = pending.split(b"\n", 1)
                    self.fork(json.loads(line))


def server_title(run_dir: str) -> list[str]:
    """The command line of a run's fork server (:func:`main`'s ``--run-dir``)."""
    return [sys.executable, "-m", SERVER_MODULE, "--run-dir", run_dir]


def _read_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A request's JSON line, and the descriptors sent with it (a command's standard
    streams, :func:`asyncrl.entry.zygote.run_through`)."""
    line, fds = b"", []
    while not line.endswith(b"\n"):
        chunk, received, _, _ = socket.recv_fds(conn, 1 << 16, 3)
        fds += received
        if not chunk:
            for fd in fds:
                os.close(fd)
            raise ValueError("the connection closed before its request ended")
        line += chunk
    request: dict[str, Any] = json.loads(line)
    return request, fds


def start_vars(env: dict[str, str]) -> dict[str, str]:
    """The variables of ``env`` that a process reads as it starts: the C library's and
    OpenMP's (:func:`asyncrl.runtime.forks.load_time_vars`) and the interpreter's own
    (``PYTHON*``: ``PYTHONPATH`` makes ``sys.path``)."""
    return {**load_time_vars(env), **{k: v for k, v in env.items() if k.startswith("PYTHON")}}


ALLOCATOR_VARS = ("LD_PRELOAD",)
"""Start variables a command run by the zygote may differ in (with ``MIMALLOC_*``): it runs
under the zygote's allocator, which changes how fast memory comes, not what it computes."""


def refusal(request: dict[str, Any]) -> str | None:
    """Why the zygote cannot start the fork server, or run the command (``module``),
    that ``request`` asks for; None where it can."""
    own, asked = start_vars(dict(os.environ)), start_vars(request["env"])
    differ = sorted(k for k in own.keys() | asked.keys() if own.get(k) != asked.get(k))
    if "module" in request:
        differ = [k for k in differ if k not in ALLOCATOR_VARS and not k.startswith("MIMALLOC_")]
    if differ:
        return f"the variables read at a start differ from the zygote's: {', '.join(differ)}"
    if "module" in request:
        if not title_fits(request["title"]):
            return "the command line does not fit in the zygote's"
    elif not title_fits(server_title(request["run_dir"])):
        return "the run folder's name does not fit in the zygote's command line"
    return None


def become_server(conn: socket.socket, request: dict[str, Any]) -> NoReturn:
    """The zygote's fork: the fork server of ``request``'s run, speaking over ``conn``."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        enter_folder(request["cwd"])
        take_request(request)
        retitle(server_title(request["run_dir"]))
        sys.argv = [__file__ or SERVER_MODULE, "--run-dir", request["run_dir"]]
        replies = conn.detach()
        os.dup2(replies, 0)
        Server(replies).serve()
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        leave(code, exit_handlers=False)


def run_command(request: dict[str, Any], streams: list[int]) -> NoReturn:
    """The zygote's grandchild: ``python -m MODULE ARGS`` as ``request`` asks
    (:func:`asyncrl.entry.zygote.run_through`), with the client's standard streams,
    environment, working folder and command line, in a session of its own; it exits with
    the command's status (killed by SIGINT where an interrupt went unhandled, as the
    interpreter ends then)."""
    code, interrupted = 1, False
    try:
        os.setsid()
        for target, fd in zip((0, 1, 2), streams, strict=True):
            os.dup2(fd, target)
            os.close(fd)
        for stream in (sys.stdout, sys.stderr):  # a terminal's output by lines, as at a start
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=stream.isatty())  # type: ignore[union-attr]
        os.environ.clear()
        os.environ.update(request["env"])
        enter_folder(request["cwd"])
        retitle(request["title"])
        sys.orig_argv = request["title"]
        sys.argv = [request["module"], *request["args"]]
        np.random.seed()
        torch.seed()
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = system_exit_code(exc)
    except BaseException as exc:
        traceback.print_exc()
        interrupted = isinstance(exc, KeyboardInterrupt)
    finally:
        leave(code, exit_handlers=True, interrupted=interrupted)


def become_runner(conn: socket.socket, request: dict[str, Any], streams: list[int]) -> NoReturn:
    """The zygote's fork for a command: forks :func:`run_command`, tells the client its pid,
    then its status (``{"exit": code}``, as :func:`exit_code`); should the client go first,
    the command's session is killed."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        pid = os.fork()
        if pid == 0:
            conn.close()
            run_command(request, streams)
        for fd in streams:
            os.close(fd)
        conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        ended, client = os.pidfd_open(pid), conn.fileno()
        while ended not in select.select([client, ended], [], [])[0]:
            if not conn.recv(1 << 10):  # the client is gone: so is its command
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                break
        _, status = os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps({"exit": exit_code(status)}) + "\n").encode())
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        leave(code, exit_handlers=False)


def serve_zygote(listener: socket.socket) -> NoReturn:
    """A zygote's loop (:mod:`asyncrl.entry.zygote` binds ``listener`` and calls it): the
    imports, then a fork server forked for each request it does not refuse."""
    preload()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # its servers are reaped by the kernel
    print(json.dumps({"zygote": os.getpid(), "ready": True}), flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            streams: list[int] = []
            try:
                request, streams = _read_request(conn)
                why = refusal(request)
                if "module" in request and len(streams) != 3:
                    why = f"a command comes with its 3 standard streams, not {len(streams)}"
            except (ValueError, KeyError, TypeError, OSError) as exc:
                why = f"a bad request: {exc!r}"
            if why is None:
                sys.stdout.flush()
                sys.stderr.flush()
                if os.fork() == 0:
                    listener.close()
                    if "module" in request:
                        become_runner(conn, request, streams)
                    become_server(conn, request)
            else:
                print(json.dumps({"refused": why}), flush=True)
                with contextlib.suppress(OSError):
                    conn.sendall((json.dumps({"refused": why}) + "\n").encode())
            for fd in streams:
                os.close(fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl.entry.fork_server")
    # the run folder on the command line: lineage.naming finds this process and its forks
    parser.add_argument("--run-dir", required=True)
    parser.parse_args(argv)
    # what up's process held when it started this one (its end of this process's pipes, a
    # terminal's): every fork would inherit it, and a pipe stays open while anyone holds it
    # (up would never see this process's answers end). An executed actor starts with 0-2.
    inherited = [int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2]
    for fd in inherited:
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed already
            os.close(fd)
    # the answers go through a copy of stdout; stdout itself becomes the log (stderr), so
    # that nothing an import prints can reach the pipe
    replies = os.dup(1)
    os.dup2(2, 1)
    preload()
    Server(replies).serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
