"""The engine side of every transport: one receiver a rollout or eval actor feeds with
each ``WeightsUpdated`` as it arrives, and asks for the newest weights, staged.

Files (``dir``, ``object_store``) are fetched and staged only when asked for, and only the
newest announced version: versions announced meanwhile are skipped. A broadcast
(``collective``) and IPC handles (``cuda_ipc``) are taken as they are announced, in
order (the trainer is sending them now); ``receive`` then yields the newest result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import io
import shutil
import tempfile
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.api.weights import NamedTensors, NothingAnnounced, Received, WeightReceiver
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.log import get_logger
from asyncrl.weights.cuda_ipc import open_handles
from asyncrl.weights.engine_side import CollectiveEngineSide
from asyncrl.weights.files import fetched, get_weights, read_safetensors
from asyncrl.weights.version import Wanted
from asyncrl.wire.messages import WeightsFallback, WeightsUpdated
from asyncrl.wire.subjects import Subjects

if TYPE_CHECKING:
    from asyncrl.api.inference import InferenceEngine

PENDING_LIMIT = 64
"""Announcements kept while none is taken: the trainer publishes one per step and a
receiver takes the newest, so more than a few means the actor is stuck; older ones are
dropped (a broadcast's job still runs: only its result is forgotten)."""


class EngineWeights(WeightReceiver):
    """Receives for ``engine``; ``want`` names the versions worth loading (the eval actor
    loads only those it evaluates; a broadcast does not even send it the others)."""

    def __init__(
        self,
        engine: InferenceEngine,
        bus: Bus,
        subjects: Subjects,
        actor_id: str,
        *,
        device: str,
        want: Wanted | None = None,
        in_order: bool = False,
    ) -> None:
        self.engine, self.bus, self.subjects, self.actor_id = engine, bus, subjects, actor_id
        self.device = device
        self.want = want or Wanted()
        self.in_order = in_order
        self._returned = (-1, -1)  # (epoch, version) of the newest weights yielded
        """Yield every wanted version, oldest first (the eval actor: each due version is
        evaluated), instead of the newest only; a received version not wanted gives its
        buffers back as soon as it arrives."""
        self._pending: deque[tuple[WeightsUpdated, concurrent.futures.Future[Any] | None]]
        self._pending = deque(maxlen=PENDING_LIMIT)
        self._arrived = asyncio.Event()
        self._collective: CollectiveEngineSide | None = None
        self._fallback_dir: Path | None = None
        self.counters = {"fallbacks": 0}
        self.log = get_logger(role="engine", part="weights")

    async def listen(self) -> None:
        """Takes every announcement on the run's weights subject (an actor that does
        nothing else with them; the rollout actor announces from its own handler)."""

        async def on_weights(msg: WeightsUpdated) -> None:
            self.announce(msg)

        await self.bus.subscribe(self.subjects.weights, WeightsUpdated, on_weights)

    def announce(self, msg: WeightsUpdated, *, force: bool = False) -> None:
        """``force``: keep a file announcement even if ``want`` refuses its version."""
        job: concurrent.futures.Future[Any] | None = None
        if msg.kind == "collective":
            job = self._group().announce(msg)
            if job is None:
                return  # the join under way brings these weights
        elif msg.kind == "cuda_ipc":
            job = self._group().lane.submit(
                lambda: open_handles(self._await_blob(msg.location), self.device)
            )
        elif not (force or self.want(msg.version)):
            return
        if job is not None and self.in_order:
            job.add_done_callback(self._let_go_unwanted)
        self._pending.append((msg, job))
        self._arrived.set()

    def _let_go_unwanted(self, job: concurrent.futures.Future[Any]) -> None:
        if job.cancelled() or job.exception() is not None:
            return
        version, _, payload, _, release = job.result()
        if release is not None and (version < 0 or payload is None or not self.want(version)):
            release()

    def _group(self) -> CollectiveEngineSide:
        if self._collective is None:
            self._collective = CollectiveEngineSide(
                self.bus,
                self.subjects,
                self.actor_id,
                device=self.device,
                loop=asyncio.get_running_loop(),
                fallback=self._fallback,
                engine=self.engine,
                want=self.want,
            )
        return self._collective

    def _await_blob(self, key: str) -> bytes:

        async def get() -> bytes:
            buf = io.BytesIO()
            await self.bus.get_blob(self.subjects.weights_bucket, key, buf)
            return buf.getvalue()

        loop = self._group().loop
        return asyncio.run_coroutine_threadsafe(get(), loop).result(120)

    async def _fallback(self, reason: str) -> tuple[int, int, NamedTensors | Path]:
        """The current weights from the object store, asked of the trainer."""
        self.counters["fallbacks"] += 1
        msg = await self.bus.request(
            self.subjects.weights_fallback,
            WeightsFallback(actor_id=self.actor_id, reason=reason[:500]),
            WeightsUpdated,
            timeout=300.0,
        )
        if self.engine.broadcast_protocol:
            # a server loads files itself: the folder stays until the next fallback's
            folder = Path(tempfile.mkdtemp(prefix="asyncrl-weights-"))
            await get_weights(self.bus, self.subjects.weights_bucket, msg.location, folder)
            if self._fallback_dir is not None:
                shutil.rmtree(self._fallback_dir, ignore_errors=True)
            self._fallback_dir = folder
            return msg.version, msg.epoch, folder
        with tempfile.TemporaryDirectory(prefix="asyncrl-weights-") as tmp:
            await get_weights(self.bus, self.subjects.weights_bucket, msg.location, Path(tmp))
            tensors = await asyncio.to_thread(read_safetensors, Path(tmp))
        return msg.version, msg.epoch, tensors

    async def close(self) -> None:
        if self._fallback_dir is not None:
            shutil.rmtree(self._fallback_dir, ignore_errors=True)

    @contextlib.asynccontextmanager
    async def receive(self, idle: float | None = None) -> AsyncIterator[Received]:
        while True:
            while not self._pending:
                self._arrived.clear()
                try:
                    async with asyncio.timeout(idle):
                        await self._arrived.wait()
                except TimeoutError:
                    raise NothingAnnounced(f"no weights announced in {idle} s") from None
            t0 = time.monotonic()
            best: tuple[WeightsUpdated, Any, str, Callable[[], None] | None] | None = None

            def keep(choice: tuple[WeightsUpdated, Any, str, Callable[[], None] | None]) -> None:
                nonlocal best
                if best is not None and best[3] is not None:
                    best[3]()  # superseded: its buffers serve a later version
                best = choice

            # jobs finish in their announcement order: waiting for each in turn costs
            # nothing, and every result is seen (the newest wanted one is kept, or with
            # ``in_order`` the oldest, unless a later announcement is of a newer trainer
            # epoch, which rolled it back)
            while self._pending:
                msg, job = self._pending.popleft()
                if job is None:
                    version, epoch, payload, via, release = (
                        msg.version,
                        msg.epoch,
                        None,
                        str(msg.kind),
                        None,
                    )
                else:
                    try:
                        version, epoch, payload, via, release = await asyncio.wrap_future(job)
                    except Exception as exc:
                        self.counters["failed"] = self.counters.get("failed", 0) + 1
                        self.log.warning(
                            "weights not received", version=msg.version, error=str(exc)[:300]
                        )
                        continue
                    if version < 0 or payload is None or not self.want(version):
                        if release is not None:
                            release()
                        continue
                rolled_back = any(m.epoch > epoch for m, _ in self._pending)
                newer = best is None or (epoch, version) >= (best[0].epoch, best[0].version)
                if (
                    (epoch, version) <= self._returned
                    or not newer
                    or (self.in_order and rolled_back)
                ):
                    if release is not None:
                        release()
                    continue
                done = msg.model_copy(update={"version": version, "epoch": epoch})
                keep((done, payload, via, release))
                if self.in_order:
                    break  # the later ones wait for the next call
            if best is None:
                continue
            msg, payload, via, release = best
            self._returned = (msg.epoch, msg.version)
            try:
                if payload is not None:
                    staged = await self.engine.stage_weights(payload)
                    yield Received(msg.version, msg.epoch, staged, time.monotonic() - t0, via)
                    return
                async with fetched(self.bus, self.subjects.weights_bucket, msg) as folder:
                    staged = await self.engine.stage_weights(folder)
                    yield Received(msg.version, msg.epoch, staged, time.monotonic() - t0, via)
                return
            finally:
                if release is not None:
                    release()  # loaded (or given up): the buffers serve a later version


__all__ = ["EngineWeights"]
