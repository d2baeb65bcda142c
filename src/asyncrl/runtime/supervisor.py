"""The supervisor: the bones of ``asyncrl up``.

It spawns one OS process per actor (a fork of ``up``'s fork server where it has one,
:mod:`.forks`; else a fresh interpreter), waits until every actor has said ``started``
(a handshake on NATS, never a sleep), and then watches them:

- the run ends well when every *primary* actor (the trainer) has exited with code 0;
  the others are then asked to stop and given ``grace`` seconds before SIGKILL;
- an actor that dies unexpectedly (non-zero exit, or any exit before ``started``) ends
  the run: the others are stopped and :meth:`Supervisor.run` returns 1, with the reason
  naming the actor and its log file; except that an actor with ``restarts`` left (the
  stateless roles: rollout, reward) that dies after the run is up is started again under
  a new id (``<id>-r<n>``), so the buffer sees a new actor and returns the dead one's
  leases; never one that failed fatally (:mod:`.exits`: a setup the run refuses, which
  a replacement would meet again), whose reason ends the run. Each role has
  ``run.max_restarts`` replacements, each after a back-off that doubles (``run.restart_backoff``): the buffer restores its durable state, the trainer
  its latest checkpoint (its replacement's ``ASYNCRL_RESTART`` makes it a new epoch),
  the other roles hold nothing of their own;
- a *gang* (the torchrun processes of a trainer across nodes, :attr:`ActorSpec.gang`) is
  one actor: one ``started`` counts for every member, and when one member dies the others
  are killed and the whole gang is started again together;
- Ctrl-C / SIGTERM to the supervisor becomes a graceful stop of every actor (children run
  in their own session, so the terminal's SIGINT reaches only the supervisor);
- nothing outlives the run: the stop ends with every process an actor started, in its
  session or not (an inference server and its engine processes, :mod:`.lineage`): SIGTERM,
  a short grace, SIGKILL, and a wait until they are gone; a dead actor's
  leftovers are killed and waited for before its replacement starts, so that they never
  hold the memory (a GPU's) the replacement needs.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from asyncrl.runtime import lineage
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.exits import FATAL_EXIT
from asyncrl.runtime.forks import ForkedProcess, ForkServer, forkable
from asyncrl.runtime.log import get_logger
from asyncrl.wire.messages import ActorExit, ActorInfo, Control
from asyncrl.wire.subjects import Subjects

RESTART_ENV = "ASYNCRL_RESTART"
"""Set in a replacement actor's environment: the run's restart count when it started (the
trainer takes it as its epoch)."""

MAX_BACKOFF = 30.0

LEFTOVER_GRACE_S = 5.0
"""Seconds that processes the actors left behind get between SIGTERM and SIGKILL at the
stop. Short: an actor that stops well stops its servers itself (each waits for its
guard), so what is left at this point belonged to an actor that was killed."""


@dataclass
class ActorSpec:
    """One process to start. ``actor_id`` must be the id the process reports."""

    role: str
    actor_id: str
    argv: list[str]
    primary: bool = False
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0
    """How many times this actor is started again if it dies once the run is up."""

    backoff: float = 1.0
    """Seconds before the first replacement; doubled for each later one."""
    generation: int = 0
    """How many replacements came before this one."""
    gang: str = ""
    """The actor id shared by processes that are one actor together (a trainer's torchrun
    processes, one per node; each passes it as ``--actor-id``, and whichever holds global
    rank 0 reports under it). Empty: this process is an actor of its own."""

    def restarted(self, n: int) -> ActorSpec:
        def renamed(actor_id: str) -> str:
            return f"{re.sub(r'-r[0-9]+$', '', actor_id)}-r{n}"

        new_id, gang = renamed(self.actor_id), renamed(self.gang) if self.gang else ""
        names = {self.actor_id: new_id, **({self.gang: gang} if gang else {})}
        argv = [names.get(a, a) for a in self.argv]
        return replace(
            self,
            actor_id=new_id,
            gang=gang,
            argv=argv,
            restarts=self.restarts - 1,
            env={**self.env, RESTART_ENV: str(n)},
            generation=self.generation + 1,
        )

    @property
    def can_fork(self) -> bool:
        """Whether a fork server may start this process (:mod:`.forks`): an actor's own
        command, not a member of a gang (torchrun starts those)."""
        return forkable(self.argv) and not self.gang

    def delay(self) -> float:
        """How long to wait before starting this replacement."""
        if self.generation == 0:
            return 0.0
        return min(MAX_BACKOFF, self.backoff * 2 ** (self.generation - 1))


@dataclass
class _Proc:
    spec: ActorSpec
    proc: asyncio.subprocess.Process | ForkedProcess
    log_path: Path
    started: bool = False
    exit_code: int | None = None
    replaced: bool = False


class Supervisor:
    def __init__(
        self,
        bus: Bus,
        subjects: Subjects,
        run_dir: Path,
        specs: list[ActorSpec],
        *,
        startup_timeout: float = 600.0,
        grace: float = 30.0,
        on_started: Callable[[], Any] | None = None,
        forks: ForkServer | None = None,
    ) -> None:
        self.bus = bus
        self.subjects = subjects
        self.run_dir = run_dir
        self.specs = specs
        self.startup_timeout = startup_timeout
        self.grace = grace
        self.on_started = on_started
        self.forks = forks
        """Where actor processes are forked from (:mod:`.forks`); None: each is executed.
        The run fails should that server die: it alone can tell its actors' exit codes."""
        if forks is not None:
            forks.on_death = self.fail
        self.log = get_logger(role="supervisor", run=subjects.run)
        self.procs: dict[str, _Proc] = {}
        self._fatal_ids: set[str] = set()
        """Actors (or gangs) whose exit message said fatal: it may come after the exit."""
        self.reason = ""
        self._all_started = asyncio.Event()
        self._stopping = False
        self._stop_request = asyncio.Event()
        self._event = asyncio.Event()  # anything changed: a start, an exit
        self._tg: asyncio.TaskGroup | None = None
        self.restarts = 0
        self._pending = 0  # replacements waiting out their back-off
        self._failed = False
        self.token = secrets.token_hex(8)
        """Marks every process this run's actors start (:mod:`.lineage`)."""

    async def run(self) -> int:
        """Runs the actors to the end; 0 when every primary actor finished cleanly."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self.request_stop, f"signal {sig.name}")
            except (NotImplementedError, RuntimeError):
                pass
        await self.bus.subscribe(self.subjects.started, ActorInfo, self._on_started)
        await self.bus.subscribe(self.subjects.exited, ActorExit, self._on_exit_msg)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                for spec in self.specs:
                    await self._spawn(spec)
                code = await self._watch()
                await self._stop_all()
            return code
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                try:
                    loop.remove_signal_handler(sig)
                except (NotImplementedError, RuntimeError):
                    pass

    def fail(self, reason: str) -> None:
        """Ends the run as failed (exit 1) for a reason outside the actors."""
        self._failed = True
        self.request_stop(reason)

    def request_stop(self, reason: str = "stop requested") -> None:
        if not self._stop_request.is_set():
            self.reason = reason
            self._stop_request.set()
            self._event.set()

    async def _spawn(self, spec: ActorSpec) -> _Proc:
        log_path = self.run_dir / "logs" / f"{spec.actor_id}.log"
        env = {**os.environ, **spec.env, **lineage.lineage_env(self.token, spec.actor_id)}
        proc: asyncio.subprocess.Process | ForkedProcess | None = None
        if self.forks is not None and spec.can_fork:
            try:
                proc = await self.forks.spawn(spec.argv, env, log_path)
            except RuntimeError as exc:  # the server is gone: executed, as without one
                self.log.warning("cannot fork", actor=spec.actor_id, error=str(exc))
        if proc is None:
            with open(log_path, "ab") as log_file:  # noqa: ASYNC230 - a local log file, opened once
                proc = await asyncio.create_subprocess_exec(
                    *spec.argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
        p = _Proc(spec, proc, log_path)
        self.procs[spec.actor_id] = p
        assert self._tg is not None
        self._tg.create_task(self._reap(p), name=f"reap-{spec.actor_id}")
        how = "forked" if isinstance(proc, ForkedProcess) else "spawned"
        self.log.info(how, actor=spec.actor_id, pid=proc.pid, log=str(log_path))
        return p

    async def _reap(self, p: _Proc) -> None:
        p.exit_code = await p.proc.wait()
        self.log.info("exited", actor=p.spec.actor_id, code=p.exit_code)
        self._event.set()

    def _members(self, actor_id: str) -> list[_Proc]:
        """The live processes that ``actor_id`` names: one, or every member of a gang."""
        return [
            p
            for p in self.procs.values()
            if not p.replaced and actor_id in (p.spec.actor_id, p.spec.gang)
        ]

    async def _on_started(self, info: ActorInfo) -> None:
        for p in self._members(info.actor_id):
            if not p.started:
                p.started = True
                self._event.set()

    async def _on_exit_msg(self, msg: ActorExit) -> None:
        if msg.fatal:
            self._fatal_ids.add(msg.actor_id)
            self._event.set()
        if not msg.ok and (self._members(msg.actor_id) or msg.fatal) and not self.reason:
            self.reason = f"actor {msg.actor_id} ({msg.role}) failed: {msg.reason}"

    def _is_fatal(self, p: _Proc) -> bool:
        """Whether ``p`` failed in a way a restart cannot mend: its exit code, or the exit
        message of it or its gang."""
        named = p.spec.actor_id in self._fatal_ids or p.spec.gang in self._fatal_ids
        return p.exit_code == FATAL_EXIT or (p.exit_code is not None and named)

    def _crashed(self, p: _Proc) -> bool:
        if p.exit_code is None or p.replaced or self._stopping:
            return False
        return p.exit_code != 0 or not p.started

    async def _restart_crashed(self) -> None:
        """Starts a fresh copy of each restartable actor that died after the run was up,
        after its back-off delay."""
        if not self._all_started.is_set():
            return  # a death during start-up is a broken set-up, not bad luck
        for p in list(self.procs.values()):
            if self._crashed(p) and p.spec.restarts > 0 and not self._is_fatal(p):
                # a gang goes as a whole: its other members cannot go on without this one
                gang = self._members(p.spec.gang) if p.spec.gang else [p]
                self.restarts += 1
                for member in gang:
                    member.replaced = True
                    spec = member.spec.restarted(self.restarts)
                    self.log.warning(
                        "actor died, starting a replacement",
                        actor=member.spec.actor_id,
                        code=member.exit_code,
                        replacement=spec.actor_id,
                        delay_s=spec.delay(),
                        restarts_left=spec.restarts,
                    )
                    self._pending += 1
                    assert self._tg is not None
                    self._tg.create_task(
                        self._spawn_later(spec, member), name=f"respawn-{spec.actor_id}"
                    )

    async def _spawn_later(self, spec: ActorSpec, dead: _Proc) -> None:
        try:
            # whatever the dead actor started (torchrun's ranks, an inference server and
            # its engine processes) goes first, at once: it holds what the replacement needs
            left = await lineage.end(
                lambda: lineage.find([dead.proc.pid], self.token, dead.spec.actor_id), grace=0
            )
            if left:
                self.log.error("processes of a dead actor outlived SIGKILL", pids=left)
            await asyncio.sleep(spec.delay())
            if self._is_fatal(dead):
                # its fatal exit message came after the exit: no replacement, the run fails
                dead.replaced = False
            elif not self._stopping and not self._stop_request.is_set():
                await self._spawn(spec)
        finally:
            self._pending -= 1
            self._event.set()

    def _failure(self) -> str | None:
        for p in self.procs.values():
            if p.exit_code is None or p.replaced:
                continue
            crashed = p.exit_code != 0 or (not p.started and not self._stopping)
            if crashed and not self._stopping:
                detail = self.reason if p.spec.actor_id in self.reason else ""
                gen = p.spec.generation
                return (
                    f"actor {p.spec.actor_id} ({p.spec.role}) exited with code {p.exit_code}"
                    f"{' before it started' if not p.started else ''}"
                    f"{f' after {gen} restarts' if gen and self._all_started.is_set() else ''}"
                    f"{' (fatal: not restarted)' if self._is_fatal(p) else ''}"
                    f"{': ' + detail if detail else ''}; see {p.log_path}"
                )
        return None

    async def _watch(self) -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        while True:
            self._event.clear()
            await self._restart_crashed()
            failure = self._failure()
            if failure:
                self.reason = failure
                self.log.error("run failed", reason=failure)
                return 1
            if self._stop_request.is_set():
                self.log.info("stopping", reason=self.reason)
                if self._failed:
                    return 1
                return 130 if "SIGINT" in self.reason else 0
            if not self._all_started.is_set():
                if all(p.started for p in self.procs.values() if not p.replaced):
                    self._all_started.set()
                    self.log.info("all actors started", count=len(self.procs))
                    if self.on_started is not None:
                        self.on_started()
                elif loop.time() > deadline:
                    missing = [a for a, p in self.procs.items() if not p.started]
                    self.reason = f"actors did not start within {self.startup_timeout}s: {missing}"
                    return 1
            # a replaced primary (a restarted eval actor) is represented by its replacement
            primaries = [p for p in self.procs.values() if p.spec.primary and not p.replaced]
            if primaries and all(p.exit_code == 0 for p in primaries) and not self._pending:
                self.reason = "finished"
                return 0
            timeout = None if self._all_started.is_set() else max(0.0, deadline - loop.time())
            try:
                async with asyncio.timeout(timeout):
                    await self._event.wait()
            except TimeoutError:
                pass

    async def _stop_all(self) -> None:
        """Control ``stop`` to everyone, SIGTERM, then SIGKILL whoever outlives the grace;
        then the same for every process the actors left behind (:mod:`.lineage`), which
        are waited for: when this returns, nothing the run started is running."""
        self._stopping = True
        alive = [p for p in self.procs.values() if p.exit_code is None]
        if alive:
            try:
                await self.bus.publish(
                    self.subjects.control, Control(command="stop", reason=self.reason)
                )
            except Exception as exc:  # the bus may be the thing that broke
                self.log.warning("could not publish stop", error=str(exc))
            for p in alive:
                _signal(p.proc, signal.SIGTERM)
            try:
                async with asyncio.timeout(self.grace):
                    for p in alive:
                        await p.proc.wait()
            except TimeoutError:
                for p in alive:
                    if p.proc.returncode is None:
                        self.log.warning("killing", actor=p.spec.actor_id)
                        _signal(p.proc, signal.SIGKILL)
                for p in alive:
                    await p.proc.wait()
        sessions = [p.proc.pid for p in self.procs.values()]

        def leftovers() -> list[int]:
            return lineage.find(sessions, self.token)

        if found := leftovers():
            self.log.warning("stopping what the actors left behind", pids=found)
            if left := await lineage.end(leftovers, LEFTOVER_GRACE_S):
                self.log.error("processes outlived SIGKILL", pids=left)


def _signal(proc: asyncio.subprocess.Process | ForkedProcess, sig: int) -> None:
    if proc.returncode is not None:
        return
    try:
        # children run in their own session: signal the whole group (torchrun's ranks too)
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def actor_argv(role: str, run_dir: Path, actor_id: str) -> list[str]:
    """The command line of one actor process."""
    return [
        sys.executable,
        "-m",
        "asyncrl.entry.actor",
        role,
        "--run-dir",
        str(run_dir),
        "--actor-id",
        actor_id,
    ]
