"""AsyncTaskRunner semantics: ordering, bounds, exceptions, cancelled waits, shutdown."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.runtime.runner import AsyncTaskRunner


async def _value(x: int) -> int:
    await asyncio.sleep(0)
    return x


async def _gate(ev: asyncio.Event, x: int) -> int:
    await ev.wait()
    return x


async def test_results_come_back_in_completion_order() -> None:
    gates = [asyncio.Event() for _ in range(3)]
    async with AsyncTaskRunner[int](max_concurrent=3) as runner:
        for i, g in enumerate(gates):
            await runner.submit(_gate, g, i)
        gates[2].set()
        assert [r.value for r in await runner.wait(1)] == [2]
        gates[0].set()
        gates[1].set()
        assert sorted(r.value for r in await runner.wait(2)) == [0, 1]


async def test_max_concurrent_bounds_running_tasks() -> None:
    gate = asyncio.Event()
    async with AsyncTaskRunner[int](max_concurrent=2) as runner:
        for i in range(5):
            await runner.submit(_gate, gate, i)
        await asyncio.sleep(0.01)
        assert runner.running == 2
        assert runner.queued == 2  # one more is held by the dispatcher, waiting for a slot
        gate.set()
        # the results held at once are bounded (2 · max_concurrent): take them in two
        results = [*await runner.wait(3), *await runner.wait(2)]
        assert sorted(r.value for r in results) == [0, 1, 2, 3, 4]


async def test_exceptions_are_results_and_the_runner_goes_on() -> None:
    async def boom(x: int) -> int:
        raise ValueError(f"bad {x}")

    async with AsyncTaskRunner[int](max_concurrent=2) as runner:
        await runner.submit(boom, 1, tag="episode-1")
        await runner.submit(_value, 2)
        results = await runner.wait(2)
        failed = [r for r in results if not r.ok]
        assert len(failed) == 1
        assert isinstance(failed[0].error, ValueError) and "bad 1" in str(failed[0].error)
        assert failed[0].tag == "episode-1"
        assert [r.value for r in results if r.ok] == [2]


async def test_a_cancelled_wait_loses_no_result() -> None:
    returned = asyncio.Event()

    async def seven() -> int:
        returned.set()  # the runner files the result before anything else runs
        return 7

    async with AsyncTaskRunner[int](max_concurrent=2) as runner:
        waiting = asyncio.create_task(runner.wait(2))
        await runner.submit(seven)
        await returned.wait()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert [r.value for r in await runner.wait(1)] == [7]


async def test_leaving_the_context_cancels_in_flight_tasks() -> None:
    cancelled = asyncio.Event()

    async def forever() -> int:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    async with AsyncTaskRunner[int](max_concurrent=1) as runner:
        await runner.submit(forever)
        await runner.submit(forever)  # queued, never started
        await asyncio.sleep(0.01)
        assert runner.running == 1
    assert cancelled.is_set()
    assert runner.running == 0


async def test_submit_outside_context_is_an_error() -> None:
    runner = AsyncTaskRunner[int](max_concurrent=1)
    with pytest.raises(RuntimeError):
        await runner.submit(_value, 1)


async def test_idle_time_counts_only_stretches_with_no_task_running() -> None:
    now = [0.0]
    started = asyncio.Event()
    gate = asyncio.Event()

    async def episode() -> int:
        started.set()
        await gate.wait()
        return 1

    async with AsyncTaskRunner[int](max_concurrent=2, clock=lambda: now[0]) as runner:
        now[0] = 5.0  # nothing submitted yet: idle
        assert runner.idle_s == 5.0
        await runner.submit(episode)
        await started.wait()
        now[0] = 8.0  # a task runs: busy
        assert runner.idle_s == 5.0
        gate.set()
        await runner.wait(1)
        now[0] = 10.0  # idle again since the task ended at 8
        assert runner.idle_s == 7.0
        assert runner.age_s == 10.0
