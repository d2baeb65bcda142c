"""How the trainer's processes start: torchrun command lines, one per trainer node.

A trainer is ``trainer.nodes`` nodes of ``trainer.nproc`` ranks each (world size
nodes × nproc). One node without a GPU is :mod:`asyncrl.entry.ranks`, which forks its ranks
from one process that imported torch once; one node with GPUs is torchrun's
``--standalone`` mode. Several nodes join through a c10d
rendezvous at ``HOST:PORT`` (``--rdzv-backend c10d``), hosted by the first trainer node's
torchrun. The rendezvous numbers the nodes itself, in the order of their addresses (then
process ids): global rank 0, the one rank that is an actor on NATS and publishes the
weights, is on the node whose address sorts first, not necessarily the first one started.
That is why every node runs the same command (the same ``--actor-id``), and why a node
started outside ``up`` (by a Slurm script) must never win rank 0: ``up``'s own nodes carry
:data:`UP_NODE_ENV`, and a rank 0 without it refuses to run (:func:`check_lead_node`).

How they end: :func:`rank_main` and :func:`exit_rank`.

Imports no torch.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import traceback
from collections.abc import Callable
from typing import NoReturn

from asyncrl.runtime.cores import gpu_visible

UP_NODE_ENV = "ASYNCRL_TRAINER_NODE"
"""Set by ``up`` on the trainer nodes it starts itself: that node's index."""

LOOPBACK = "127.0.0.1"

RANKS_MODULE = "asyncrl.entry.ranks"
"""The launcher of one CPU node's ranks (:mod:`asyncrl.entry.ranks`)."""


def torchrun_argv(
    target: list[str],
    *,
    nproc: int,
    nodes: int = 1,
    endpoint: str = "",
    run_id: str = "",
    is_host: bool | None = None,
    local_addr: str = "",
    forked: bool | None = None,
) -> list[str]:
    """The command line of one trainer node: torchrun with ``nproc`` ranks running
    ``target`` (``["-m", "module", ...]`` or ``["script.py", ...]``); for one node where no
    GPU is visible, :mod:`asyncrl.entry.ranks`, which forks the ranks instead.

    ``nodes`` > 1 needs ``endpoint`` (``HOST:PORT`` of the c10d rendezvous) and ``run_id``
    (the same on every node). ``is_host``: whether this node's torchrun hosts the
    rendezvous store (None: torchrun decides from ``HOST``, which can be wrong where every
    node is one machine). ``local_addr``: the address this node is known by (it orders the
    nodes, and rank 0's is where the other ranks find its store); empty: its host name.
    ``forked``: one node's ranks forked by :mod:`asyncrl.entry.ranks` (None: where no GPU
    is visible here; the launcher itself hands over to torchrun on a machine that has one,
    should the command run elsewhere)."""
    if nodes == 1 and (not gpu_visible() if forked is None else forked):
        # the ranks forked from one process that imported once (asyncrl.entry.ranks)
        return [sys.executable, "-m", RANKS_MODULE, f"--nproc-per-node={nproc}", *target]
    argv = [sys.executable, "-m", "torch.distributed.run"]
    if nodes == 1:
        argv += ["--standalone", f"--nproc-per-node={nproc}"]
    else:
        if not endpoint or not run_id:
            raise ValueError("a trainer across nodes needs a rendezvous endpoint and run id")
        argv += [
            f"--nnodes={nodes}",
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
        ]
        if is_host is not None:
            argv.append(f"--rdzv-conf=is_host={str(is_host).lower()}")
        if local_addr:
            argv.append(f"--local-addr={local_addr}")
    return [*argv, *target]


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port nothing listens on right now (for a rendezvous on this machine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def check_lead_node() -> None:
    """Called by global rank 0 of a trainer across nodes before it becomes the actor:
    refuses a rank 0 on a node that ``up`` did not start (that node lacks the restart
    count that makes a restarted trainer a new epoch, and ``up`` would not know it)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    across_nodes = world > int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    if across_nodes and UP_NODE_ENV not in os.environ:
        host = socket.gethostname()
        raise SystemExit(
            f"the trainer's global rank 0 is on {host}, a trainer node that asyncrl up did "
            "not start: the c10d rendezvous ranks nodes by address, so the node running "
            "up (the first trainer node) must have the address that sorts first"
        )


def exit_rank(code: int) -> NoReturn:
    """Ends a process with exit status ``code``; the way out of every torchrun rank.

    In a process that joined a torch process group, the group is destroyed and the process
    leaves without the interpreter's finalization, after running the exit handlers and
    flushing the standard streams. Finalization is what goes wrong there: a gloo worker
    thread can still be releasing the tensors of the last collective (their Python objects
    need the GIL) when the interpreter finalizes, and CPython ends a thread that asks for
    the GIL at that point by unwinding it, through a C++ destructor that may not throw:
    std::terminate, SIGABRT, "terminate called without an active exception", after a run
    that did all its work (about one two-node launch in ten on 2 cores). Those threads
    cannot be joined first: torch keeps the group alive after ``destroy_process_group``
    (FSDP2's sharded parameters leave their device mesh, which holds the group, in DTensor's
    sharding cache).

    The same holds for a daemon thread that is alive at the end, such as the weight
    broadcast's lane (:class:`~asyncrl.weights.wire.Lane`): a daemon is abandoned at exit
    either way, but during finalization it can still run, enter native code (a rendezvous
    with a trainer that is going away: its group opened after this function looked), and
    be unwound there when it comes back for the GIL. So the process also leaves without
    finalization while a daemon thread lives. Elsewhere this is ``sys.exit(code)``."""
    dist = sys.modules.get("torch.distributed")
    weights = sys.modules.get("asyncrl.weights.wire")
    grouped = dist is not None and dist.is_available() and dist.is_initialized()
    # the weight broadcast's own groups (an engine's, rank 0's) have gloo threads too
    opened = getattr(weights, "GROUPS_OPENED", False)
    daemons = any(t.daemon and t.is_alive() for t in threading.enumerate())
    if not grouped and not opened and not daemons:
        sys.exit(code)
    if grouped and dist is not None:
        dist.destroy_process_group()
    atexit._run_exitfuncs()  # logging's shutdown among them
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or gone: nothing left to write there
            pass
    os._exit(code)


def rank_main(main: Callable[[], int | None]) -> NoReturn:
    """Runs a rank's ``main`` and leaves through :func:`exit_rank` however it ends, so that
    a rank that failed reports its own status, not the SIGABRT of the finalization it would
    otherwise go through: an exception prints its traceback and gives status 1, a
    ``SystemExit`` its status (a message is printed, status 1, as the interpreter does)."""
    try:
        code: object = main()
    except SystemExit as stop:
        code = stop.code
    except BaseException:
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    exit_rank(code)


__all__ = [
    "UP_NODE_ENV",
    "check_lead_node",
    "exit_rank",
    "free_port",
    "rank_main",
    "torchrun_argv",
]
