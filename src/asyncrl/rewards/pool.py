"""RewardPool: runs a reward function in worker processes, each call under a hard timeout.

    pool = RewardPool("math", workers=2, timeout=10.0)
    await pool.start()                      # optional: waits until every worker loaded it
    result = await pool.score(completion_text, data)    # never raises for a bad reward
    pool.close()

A reward function (:class:`asyncrl.api.reward.RewardFunction`) is
``fn(completion: str, data: dict) -> float`` (or an ``async def``) named by a registry key (:data:`REWARDS`), ``module:function`` or
``path/to/file.py:function``. Each worker is a fresh ``python -m asyncrl.entry.reward_worker``
process that loads it once and then scores one call at a time; being a new interpreter
rather than a fork, it shares no threads or locks with the caller and needs no
``if __name__ == "__main__"`` guard in the caller's script.

Failures are results, not exceptions: a reward that raises, returns something that is
not a finite number, or kills its process scores 0 with ``ok=False`` and a ``reason``
that starts with its kind (``raised``, ``bad_value``, ``died``, ``timeout``); a reward
that runs past ``timeout`` has its worker killed and replaced. Each failure is counted in
:attr:`RewardPool.failures` and logged with its reason. A reward that cannot even be
loaded is a configuration error and raises :class:`RewardLoadError`.
"""

from __future__ import annotations

import asyncio
import math
import numbers
import pickle
import struct
import sys
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import structlog

from asyncrl.api.reward import RewardResult
from asyncrl.workflows.loader import SpecError, is_file_spec, split_spec

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe

REWARDS = {
    "math": "asyncrl.rewards.math_reward:math_reward",
    "math_boxed": "asyncrl.rewards.math_reward:boxed_math_reward",
    "gsm8k": "asyncrl.rewards.math_reward:math_reward",
}
"""Built-in reward functions by the name a recipe uses."""

STARTUP_TIMEOUT = 120.0
"""Seconds a fresh worker may take to import and load the reward (math-verify pulls in
sympy: seconds on a busy machine)."""

HEADER = struct.Struct("<I")
"""Each message between the pool and a worker: this length prefix, then a pickle."""

log = structlog.get_logger(__name__)


class RewardLoadError(RuntimeError):
    """The reward function could not be loaded in a worker."""


def resolve_reward_spec(spec: str) -> str:
    """A registry name becomes its ``module:function``; other specs are checked for form."""
    spec = REWARDS.get(spec, spec)
    split_spec(spec)
    return spec


class _Worker:
    """One worker process and its pipes; ``ready`` once it reported loading the reward."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.ready = False

    @classmethod
    async def spawn(cls, spec: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "asyncrl.entry.reward_worker",
            spec,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        return cls(process)

    async def send(self, message: Any) -> None:
        assert self.process.stdin is not None
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        self.process.stdin.write(HEADER.pack(len(body)) + body)
        await self.process.stdin.drain()

    async def receive(self) -> Any:
        """The next message; ``asyncio.IncompleteReadError`` if the worker is gone."""
        assert self.process.stdout is not None
        header = await self.process.stdout.readexactly(HEADER.size)
        (size,) = HEADER.unpack(header)
        return pickle.loads(await self.process.stdout.readexactly(size))

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def exit_code(self, grace: float = 0.0) -> int | None:
        """The worker's exit status once it has ended: it gets ``grace`` seconds to end by
        itself (a worker whose pipe closed is usually already exiting), then it is killed."""
        if grace > 0:
            try:
                async with asyncio.timeout(grace):
                    return await self.process.wait()
            except TimeoutError:
                pass
        self.kill()
        return await self.process.wait()


class RewardPool:
    """A fixed number of reward worker processes behind an async ``score``: the
    :class:`~asyncrl.api.reward.RewardScorer` of a run."""

    def __init__(self, fn: str, workers: int = 2, timeout: float = 10.0) -> None:
        """Checks ``fn``'s form (and that its file exists); workers start on
        :meth:`start` or on the first :meth:`score`."""
        if workers < 1:
            raise ValueError("workers must be >= 1")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self.spec = resolve_reward_spec(fn)
        if is_file_spec(self.spec):
            path = Path(split_spec(self.spec)[0]).expanduser()
            if not path.is_file():
                raise SpecError(f"reward file {str(path)!r} does not exist")
        self.size = workers
        self.timeout = timeout
        self.calls = 0
        self.failures: Counter[str] = Counter()
        self._workers: list[_Worker] = []
        # Holds every idle worker: at most `workers` calls run, the others wait here.
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue(maxsize=workers)
        self._spawn_lock = asyncio.Lock()
        self._closed = False

    async def start(self) -> None:
        """Starts the workers and waits until each has loaded the reward; raises
        :class:`RewardLoadError` if one cannot. Idempotent."""
        async with self._spawn_lock:
            if self._workers or self._closed:
                return
            self._workers = [await _Worker.spawn(self.spec) for _ in range(self.size)]
            try:
                for w in self._workers:
                    await self._ensure_ready(w)
            except BaseException:
                await self.aclose()
                raise
            for w in self._workers:
                self._idle.put_nowait(w)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def close(self) -> None:
        """Kills every worker (idempotent). The event loop reaps them later; prefer
        :meth:`aclose` from async code, which also waits for that."""
        self._closed = True
        for w in self._workers:
            w.kill()

    async def aclose(self) -> None:
        """Kills every worker and waits until they are gone. A worker that a replacement
        under way (a cancelled call's, which runs on shielded) puts in the pool after this
        began is killed too: the replacement sees the pool closed."""
        self.close()
        for i in range(len(self._workers)):
            while self._workers[i].process.returncode is None:
                await self._workers[i].exit_code()  # killed and reaped

    async def score(self, completion: str, data: dict[str, Any]) -> RewardResult:
        """The reward of ``completion`` for the prompt record ``data``; never raises for a
        reward's own failure (see the module docstring)."""
        await self.start()
        if self._closed:
            raise RuntimeError("the reward pool is closed")
        worker = await self._idle.get()
        try:
            await self._ensure_ready(worker)
            self.calls += 1
            try:
                async with asyncio.timeout(self.timeout):
                    await worker.send((completion, data))
                    kind, value = await worker.receive()
            except TimeoutError:
                worker = await self._replace(worker)
                return self._failed("timeout", f"no result after {self.timeout:g}s")
            except (asyncio.IncompleteReadError, ConnectionError) as exc:
                code = await worker.exit_code(grace=1.0)
                worker = await self._replace(worker)
                return self._failed("died", f"worker exited (code {code}): {exc!r}")
            except asyncio.CancelledError:
                # its answer, if it ever comes, would be read by the next call
                worker = await asyncio.shield(self._replace(worker))
                raise
            if kind == "error":
                return self._failed("raised", str(value))
            return self._checked(value)
        finally:
            self._idle.put_nowait(worker)

    def _checked(self, value: Any) -> RewardResult:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return self._failed("bad_value", f"returned {type(value).__name__} {value!r:.80}")
        if not math.isfinite(value):
            return self._failed("bad_value", f"returned {value!r}")
        return RewardResult(float(value))

    def _failed(self, kind: str, detail: str) -> RewardResult:
        self.failures[kind] += 1
        reason = f"{kind}: {detail}"
        log.warning("reward failed", reward=self.spec, reason=reason)
        return RewardResult(0.0, ok=False, reason=reason)

    async def _replace(self, worker: _Worker) -> _Worker:
        await worker.exit_code()  # killed and reaped: no process outlives its pool
        if self._closed:
            return worker  # nobody will call again: no fresh worker to outlive the pool
        fresh = await _Worker.spawn(self.spec)
        self._workers[self._workers.index(worker)] = fresh
        if self._closed:  # closed while it started: aclose waits for it, so end it now
            fresh.kill()
        return fresh

    async def _ensure_ready(self, worker: _Worker) -> None:
        if worker.ready:
            return
        try:
            async with asyncio.timeout(STARTUP_TIMEOUT):
                kind, detail = await worker.receive()
        except (TimeoutError, asyncio.IncompleteReadError) as exc:
            raise RewardLoadError(
                f"reward worker for {self.spec!r} did not start: {exc!r}"
            ) from exc
        if kind != "ready":
            raise RewardLoadError(f"cannot load reward {self.spec!r}: {detail}")
        worker.ready = True


def build_reward_pool(recipe: Recipe) -> RewardPool:
    """The reward function of the recipe in worker processes (not started)."""
    cfg = recipe.reward
    return RewardPool(cfg.fn, workers=cfg.workers, timeout=cfg.timeout)
