"""The ranks of a trainer of one CPU node, forked from one process that imported once:
``python -m asyncrl.entry.ranks --nproc-per-node N TARGET...``, where ``TARGET`` is what
torchrun would run (``-m module args`` or ``script.py args``).

torchrun executes each rank afresh, and a rank's imports (torch, transformers, FSDP) are
some 10 s of CPU on a 2-core machine, on top of torchrun's own import of torch: a trainer
of two ranks spends more than 20 s of CPU before its first step. Here the imports are done
once, then each rank is a fork that runs ``TARGET`` as ``python`` would, with the
variables torchrun gives a rank of a standalone node (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
...): ``init_process_group`` finds its peers through rank 0's store on a free loopback
port. :func:`asyncrl.train.torchrun.torchrun_argv` chooses it for one node where no GPU is
visible; a GPU machine keeps torchrun, since a fork must not inherit a CUDA driver that an
import touched (and where this command was made elsewhere for a machine with a GPU, it
executes torchrun in its place), and several nodes keep torchrun's rendezvous.

As under torchrun, each rank runs in a session of its own and shares this process's
standard streams; SIGTERM, SIGINT, SIGHUP and SIGQUIT are passed on to every rank; a rank
that fails (a non-zero status, or a signal) has the others sent SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`. This process then ends with the status of the first rank that failed
(128 + the signal for one killed by a signal), 0 where every rank ended with 0 (torchrun
says 1 for any failure).
"""

from __future__ import annotations

import os
import runpy
import signal
import sys
import time
import traceback
import uuid

from asyncrl.runtime.cores import gpu_visible
from asyncrl.train.torchrun import LOOPBACK, free_port, torchrun_argv

STOP_GRACE_S = 30.0
"""Seconds the other ranks have to end after one failed, before SIGKILL."""

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)

PRELOAD = ("torch", "torch.distributed", "asyncrl.train.engine")
"""What every trainer rank imports, imported once before the ranks are forked."""


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """The variables torchrun sets for ``rank`` of a standalone node of ``nproc`` ranks."""
    world = str(nproc)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": world,
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def _run_target(target: list[str]) -> None:
    """Runs ``target`` in this process as ``python TARGET`` would have: ``-m module`` with
    the working folder first on ``sys.path``, a script with its own folder."""
    if target[0] == "-m":
        module, args = target[1], target[2:]
        sys.argv = [module, *args]  # run_module puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        script, args = target[0], target[1:]
        sys.argv = [script, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        runpy.run_path(script, run_name="__main__")


def _become_rank(rank: int, env: dict[str, str], target: list[str]) -> None:
    """The forked child's part: its own session, the rank's variables, then the target (its
    signals as this process started with them: :func:`supervise` sets its own only after
    the forks); a target that returns ends the process with 0 and one that raises with 1,
    as the interpreter would (a ``SystemExit`` passes through)."""
    os.setsid()
    os.environ.update(env)
    try:
        _run_target(target)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        raise SystemExit(1) from None
    raise SystemExit(0)


def _status(wait_status: int) -> int:
    """A shell's view of a ``waitpid`` status: the exit code, or 128 + the signal."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    return os.waitstatus_to_exitcode(wait_status)


def _signal(pids: dict[int, int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def supervise(ranks: dict[int, int]) -> int:
    """Waits for the ranks (pid → rank); the process's status, as the module says."""
    living = dict(ranks)
    asked: list[int] = []

    def forward(signum: int, _frame: object) -> None:
        asked.append(signum)
        _signal(living, signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    failed: int | None = None
    deadline: float | None = None
    while living:
        if deadline is None:
            pid, wait_status = os.waitpid(-1, 0)
        else:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if time.monotonic() >= deadline:
                    _signal(living, signal.SIGKILL)
                    deadline = float("inf")
                time.sleep(0.05)
                continue
        rank = living.pop(pid, None)
        if rank is None:
            continue
        status = _status(wait_status)
        if status != 0 and failed is None:
            failed = status
            if living and not asked:
                print(
                    f"asyncrl.entry.ranks: rank {rank} ended with status {status}; "
                    f"stopping the other {len(living)}",
                    file=sys.stderr,
                    flush=True,
                )
                _signal(living, signal.SIGTERM)
                deadline = time.monotonic() + STOP_GRACE_S
    return failed or 0


USAGE = (
    "usage: python -m asyncrl.entry.ranks --nproc-per-node=N [--preload=MODULE,...] "
    "(-m MODULE | SCRIPT) [ARG...]"
)


def parse(argv: list[str]) -> tuple[int, tuple[str, ...], list[str]]:
    """(nproc, preload, target) from the command line (:data:`USAGE`); ``SystemExit`` with
    the usage line otherwise. The options come first; everything from the first argument
    that is not one of them is the target's, its own options included (``-m``).
    ``--preload``: the modules imported before the fork (default :data:`PRELOAD`; empty
    for none)."""
    options = {"--nproc-per-node": "", "--preload": ",".join(PRELOAD)}
    while argv and argv[0].partition("=")[0] in options:
        name, eq, value = argv[0].partition("=")
        if not eq:  # the value as the next argument
            if len(argv) < 2:
                raise SystemExit(USAGE)
            value, argv = argv[1], argv[1:]
        options[name] = value
        argv = argv[1:]
    count = options["--nproc-per-node"]
    if not count.isdigit() or int(count) < 1 or not argv or argv[:2] == ["-m"]:
        raise SystemExit(USAGE)
    return int(count), tuple(filter(None, options["--preload"].split(","))), argv


def main(argv: list[str] | None = None) -> int:
    nproc, preload, target = parse(sys.argv[1:] if argv is None else argv)
    if gpu_visible():
        # the command was made on a machine without a GPU (a head node) for this one, which
        # has one: an import may touch the CUDA driver, which a fork must not inherit
        os.execv(sys.executable, torchrun_argv(target, nproc=nproc, forked=False))
    if nproc > 1:
        # as torchrun: a rank's OpenMP threads default to one (read once, at torch's load)
        os.environ.setdefault("OMP_NUM_THREADS", "1")
    for name in preload:
        __import__(name)
    port, run_id = free_port(), uuid.uuid4().hex
    sys.stdout.flush()
    sys.stderr.flush()
    ranks: dict[int, int] = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _become_rank(rank, rank_env(rank, nproc, port, run_id), target)
        ranks[pid] = rank
    return supervise(ranks)


if __name__ == "__main__":
    sys.exit(main())
