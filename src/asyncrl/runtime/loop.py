"""Runs a coroutine to completion on uvloop when it is installed, else on asyncio's loop;
and re-raises a cancellation that a library swallowed."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # optional: the dependency is not installed on Windows
    uvloop = None  # type: ignore[assignment]

T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    if uvloop is None:
        return asyncio.run(coro)
    return uvloop.run(coro)


def raise_if_cancelled() -> None:
    """Re-raises a cancellation of the current task that something it awaited swallowed:
    nats-py waits with ``asyncio.wait_for``, which on Python 3.11 drops a cancel that comes
    with the reply (and a handler may catch one and return). A loop that went on would keep
    its actor, or the task group that cancelled it, from ever stopping."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
