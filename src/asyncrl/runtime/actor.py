"""The actor base: one process, one bus connection, one TaskGroup.

Lifecycle of :meth:`Actor.main`:

1. connect to NATS, subscribe to the control subject;
2. ``setup()``: the subclass makes its subscriptions (and whatever else must exist
   before others may talk to it);
3. publish ``started`` (only now, so a peer that sees it can rely on the subscriptions);
4. run ``run()`` and the heartbeat loop side by side in one ``asyncio.TaskGroup``; each
   heartbeat carries the bus's drop counters (:meth:`Actor.dropped`);
5. stop when ``run()`` returns, on SIGTERM/SIGINT, or on a ``stop`` control message:
   the group is cancelled, ``teardown()`` runs, ``ActorExit`` is published, the bus drains.

An exception from ``run()`` (or any child task) ends the actor with ``ok=False`` and a
non-zero exit code, after the same teardown: errors propagate, they are not swallowed.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from asyncrl import __version__
from asyncrl.config.run import trace_window
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.exits import FATAL_EXIT, FatalError
from asyncrl.runtime.log import get_logger
from asyncrl.runtime.trace import Tracer
from asyncrl.wire.messages import ActorExit, ActorInfo, Control, Message, Metrics
from asyncrl.wire.subjects import Subjects

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.runtime.nats_server import NatsInfo


@dataclass
class ActorContext:
    """What an actor process is told at start."""

    run_name: str
    run_dir: Path
    nats: NatsInfo
    recipe: Recipe
    actor_id: str = ""
    heartbeat_interval: float = 1.0
    extra: dict[str, Any] = field(default_factory=dict)


STOP_STALL_S = 5.0
"""Seconds after a stop request past which the actor logs what it still waits for."""


def awaiting(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits, outermost first: the chain of coroutines each awaits (a
    task's own stack shows only the outermost)."""
    where: list[str] = []
    coro: Any = task.get_coro()
    while coro is not None and len(where) < 16:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:
            break
        where.append(
            f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
        )
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return " > ".join(where)


class _StopRequested(Exception):
    """Raised inside the TaskGroup to end it; never escapes :meth:`Actor.main`."""


class Actor:
    """Subclass and set ``role``; override ``setup``, ``run`` and maybe ``teardown``."""

    role: ClassVar[str] = "actor"

    def __init__(self, ctx: ActorContext) -> None:
        self.ctx = ctx
        self.actor_id = ctx.actor_id or f"{self.role}-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(ctx.run_name)
        self.recipe = ctx.recipe
        self.log = get_logger(run=ctx.run_name, role=self.role, actor=self.actor_id)
        self._version = -1
        self.status = "starting"
        self._stop = asyncio.Event()
        self._stop_reason = ""
        self._bus: Bus | None = None
        self._stopped = False
        self._stall_watch: asyncio.TimerHandle | None = None
        self.tracer = self._make_tracer()

    def _make_tracer(self) -> Tracer:
        steps = self.recipe.run.trace_steps
        window = trace_window(steps) if steps else None
        return Tracer(self.ctx.run_dir, self.actor_id, self.role, window, lambda: self.version)

    @property
    def bus(self) -> Bus:
        assert self._bus is not None, "the bus exists from setup() on"
        return self._bus

    @property
    def version(self) -> int:
        """The policy version this actor holds (reported in heartbeats); -1 if none."""
        return self._version

    @version.setter
    def version(self, value: int) -> None:
        self._version = value

    # -- for subclasses ---------------------------------------------------------------------

    async def setup(self, tg: asyncio.TaskGroup) -> None:
        """Make subscriptions here; long-running children may be started in ``tg``."""

    async def run(self) -> None:
        """The actor's work. Returning ends the actor cleanly. Default: wait for a stop."""
        await self._stop.wait()

    async def teardown(self) -> None:
        """Release resources after the group has stopped (the bus is still connected)."""

    def lease_report(self) -> dict[str, list[str]]:
        """For heartbeats of actors that take leases: ``holding`` (prompt uids being run)
        and ``delivered`` (recently finished) fields of :class:`ActorInfo`. The buffer
        frees what a live actor reports in neither."""
        return {}

    def stop(self, reason: str = "") -> None:
        """Asks the actor to stop gracefully (safe from signal handlers and callbacks)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()
            with contextlib.suppress(RuntimeError):  # no loop: nothing to watch
                loop = asyncio.get_running_loop()
                self._stall_watch = loop.call_later(STOP_STALL_S, self._log_stalled_stop)

    def _log_stalled_stop(self) -> None:
        """Logs each task still alive ``STOP_STALL_S`` after the stop was asked for, with
        where it waits: a task that swallows its cancellation keeps the actor alive until
        the supervisor's grace ends in SIGKILL, and this names it."""
        if self._stopped:
            return
        for task in asyncio.all_tasks():
            if task is asyncio.current_task() or task.done():
                continue
            self.log.warning("stop stalled", task=task.get_name(), waiting_in=awaiting(task))

    def info(self) -> ActorInfo:
        return ActorInfo(
            role=self.role,
            actor_id=self.actor_id,
            pid=os.getpid(),
            host=socket.gethostname(),
            version=self.version,
            asyncrl_version=__version__,
            status=self.status,
            time=time.time(),
            dropped=self.dropped(),
            **self.lease_report(),
        )

    def dropped(self) -> dict[str, int]:
        """What this actor's bus received and did not handle, by ``<subject>/<reason>``
        with the run's prefix cut off the subject (``control/garbage``). Every heartbeat
        carries it, so a run's bad input shows without anyone asking."""
        if self._bus is None:
            return {}
        prefix = self.subjects.prefix + "."
        return {key.removeprefix(prefix): n for key, n in self.bus.drops.items()}

    async def emit_metrics(self, values: dict[str, float | int], step: int = -1) -> None:
        """Publishes a metrics record on ``asyncrl.<run>.metrics.<role>``."""
        msg = Metrics(
            role=self.role, actor_id=self.actor_id, step=step, time=time.time(), values=values
        )
        await self.bus.publish(self.subjects.metrics(self.role), msg)

    async def publish(self, subject: str, msg: Message) -> None:
        await self.bus.publish(subject, msg)

    # -- lifecycle --------------------------------------------------------------------------

    async def main(self) -> int:
        """Runs the actor to its end; returns the process exit code: 0, 1 for a failure,
        :data:`~asyncrl.runtime.exits.FATAL_EXIT` for a :class:`~asyncrl.runtime.exits.FatalError`
        (the supervisor does not start it again)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.stop, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError):  # not the main thread (tests)
                pass
        self._bus = await Bus.connect(self.ctx.nats, name=self.actor_id)
        ok, reason, fatal = True, "", False
        try:
            async with asyncio.TaskGroup() as tg:
                await self.bus.subscribe(self.subjects.control, Control, self._on_control)
                await self.setup(tg)
                # what setup built (modules, models) lives as long as the actor: keep it
                # out of the collector's full passes, which otherwise tax every message
                gc.freeze()
                self.status = "running"
                await self.bus.publish(self.subjects.started, self.info())
                self.log.info("started", pid=os.getpid())
                tg.create_task(self._heartbeats(), name="heartbeat")
                tg.create_task(self._run_then_stop(), name="run")
                tg.create_task(self._raise_on_stop(), name="stop-watch")
        except* _StopRequested:
            reason = self._stop_reason
        except* Exception as group:
            ok, fatal = False, group.subgroup(FatalError) is not None
            reason = "; ".join(f"{type(e).__name__}: {e}" for e in group.exceptions)
            self.log.error("actor failed", error=reason, exc_info=group.exceptions[0])
        self.status = "stopping"
        try:
            await self.teardown()
        except Exception as exc:
            ok, reason = False, reason or f"teardown: {type(exc).__name__}: {exc}"
            self.log.error("teardown failed", exc_info=exc)
        self.tracer.close()
        try:
            exit_msg = ActorExit(
                role=self.role, actor_id=self.actor_id, ok=ok, reason=reason, fatal=fatal
            )
            await self.bus.publish(self.subjects.exited, exit_msg)
            await self.bus.close()
        except Exception as exc:  # the server may already be gone at the end of a run
            self.log.warning("could not say goodbye", error=str(exc))
        self._stopped = True
        if self._stall_watch is not None:
            self._stall_watch.cancel()
        self.log.info("stopped", ok=ok, reason=reason, **({"fatal": True} if fatal else {}))
        return 0 if ok else FATAL_EXIT if fatal else 1

    async def _run_then_stop(self) -> None:
        await self.run()
        self.stop(self._stop_reason or "finished")

    async def _raise_on_stop(self) -> None:
        await self._stop.wait()
        raise _StopRequested(self._stop_reason)

    async def _heartbeats(self) -> None:
        while True:
            await self.bus.publish(self.subjects.heartbeat(self.role), self.info())
            await asyncio.sleep(self.ctx.heartbeat_interval)

    async def _on_control(self, msg: Control) -> None:
        if msg.command == "stop" and msg.target in ("*", self.role, self.actor_id):
            self.stop(f"control: {msg.reason or 'stop'}")
