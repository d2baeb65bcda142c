"""AsyncTaskRunner: drives many concurrent episodes, at most ``max_concurrent`` at once.

The runner is an async context manager that owns one ``asyncio.TaskGroup``::

    async with AsyncTaskRunner(max_concurrent=32) as runner:
        await runner.submit(workflow.arun_episode, engine, item, tag=item)
        results = await runner.wait(count=4)

Contract:

- ``submit`` puts a task into a queue bounded by ``max_concurrent`` (it waits while the
  queue is full).
- A queued task starts when fewer than ``max_concurrent`` tasks run, in submission order.
- Every task ends as a :class:`TaskResult`: its value, or the exception it raised. An
  exception is never raised out of the runner and never stops other tasks.
- ``wait(count)`` returns ``count`` results in completion order; a ``wait`` cancelled
  before they all arrived takes nothing, leaving them for the next call.
- Leaving the context cancels queued and running tasks; it does not wait for them to finish.
- ``idle_s`` is the time since entering the context during which no task ran (waiting
  for work): how long the work this runner drives stood still.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class TaskResult(Generic[T]):
    """How one task ended. Exactly one of ``value`` (maybe None) and ``error`` is meaningful."""

    value: T | None = None
    error: BaseException | None = None
    tag: Any = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Pending:
    task_id: int
    fn: Callable[..., Awaitable[Any]]
    args: tuple[Any, ...]
    tag: Any


class AsyncTaskRunner(Generic[T]):
    """Bounded execution of coroutine functions, each ending as a :class:`TaskResult`."""

    def __init__(self, max_concurrent: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        """The queue of tasks not yet started holds ``max_concurrent``: a submitter may run
        ahead by at most one full wave of tasks, so a producer never piles up work that
        admission will refuse. The result queue holds at most ``2 · max_concurrent``
        results; a task whose result finds it full waits there, keeping its slot, which is
        the backpressure on a consumer that stopped calling ``wait``. ``clock`` times
        ``idle_s`` (a test passes its own, to step time by hand)."""
        if max_concurrent < 1:
            raise ValueError("max_concurrent must be >= 1")
        self.max_concurrent = max_concurrent
        self._pending: asyncio.Queue[_Pending] = asyncio.Queue(max_concurrent)
        self._results: deque[TaskResult[T]] = deque()
        self._result_slots = asyncio.Semaphore(2 * max_concurrent)
        self._tasks: set[asyncio.Task[None]] = set()
        self._slot_freed = asyncio.Event()  # set when a running task ends
        self._arrived = asyncio.Event()  # set when a result is appended
        self._running = 0
        self._ids = itertools.count()
        self._tg: asyncio.TaskGroup | None = None
        self._dispatcher: asyncio.Task[None] | None = None
        self._clock = clock
        self._entered_at = 0.0
        self._idle_since: float | None = None  # None while a task runs
        self._idle_total = 0.0

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> AsyncTaskRunner[T]:
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._entered_at = self._idle_since = self._clock()
        self._dispatcher = self._tg.create_task(self._dispatch(), name="runner-dispatch")
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        assert self._tg is not None
        # Cancelling every child makes the TaskGroup exit promptly; the tasks' own
        # exceptions were already turned into results, so none escapes here.
        assert self._dispatcher is not None
        self._dispatcher.cancel()
        for task in list(self._tasks):
            task.cancel()
        try:
            await self._tg.__aexit__(None, None, None)
        finally:
            self._tg = None

    # -- state ---------------------------------------------------------------------------------

    @property
    def running(self) -> int:
        """Tasks started and not yet finished."""
        return self._running

    @property
    def queued(self) -> int:
        return self._pending.qsize()

    @property
    def idle_s(self) -> float:
        """Seconds since entering the context with no task running (the current stretch
        included)."""
        current = 0.0 if self._idle_since is None else self._clock() - self._idle_since
        return self._idle_total + current

    @property
    def age_s(self) -> float:
        """Seconds since entering the context: ``idle_s / age_s`` is the idle fraction."""
        return self._clock() - self._entered_at

    # -- work ----------------------------------------------------------------------------------

    async def submit(self, fn: Callable[..., Awaitable[T]], *args: Any, tag: Any = None) -> None:
        """Queues ``fn(*args)``; waits while the queue is full. ``tag`` comes back on the
        task's :class:`TaskResult`."""
        if self._tg is None:
            raise RuntimeError("submit() outside 'async with AsyncTaskRunner(...)'")
        await self._pending.put(_Pending(next(self._ids), fn, args, tag))

    async def wait(self, count: int = 1) -> list[TaskResult[T]]:
        """The next ``count`` results in completion order.

        Cancelled before they all arrived, it takes nothing: the results that did arrive
        stay for the next call, so none is lost."""
        while len(self._results) < count:
            self._arrived.clear()
            await self._arrived.wait()
        got = [self._results.popleft() for _ in range(count)]
        for _ in got:
            self._result_slots.release()
        return got

    async def _dispatch(self) -> None:
        assert self._tg is not None
        while True:
            item = await self._pending.get()
            while self._running >= self.max_concurrent:
                self._slot_freed.clear()
                await self._slot_freed.wait()
            if self._running == 0 and self._idle_since is not None:
                self._idle_total += self._clock() - self._idle_since
                self._idle_since = None
            self._running += 1
            task = self._tg.create_task(self._run_one(item), name=f"runner-task-{item.task_id}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run_one(self, item: _Pending) -> None:
        result: TaskResult[T] = TaskResult(tag=item.tag)
        try:
            try:
                result.value = await item.fn(*item.args)
            except Exception as exc:  # a failing episode is a result, never the runner's death
                result.error = exc
            await self._result_slots.acquire()
            self._results.append(result)
            self._arrived.set()
        finally:
            self._running -= 1
            if self._running == 0:
                self._idle_since = self._clock()
            self._slot_freed.set()
