"""Runs a coroutine to completion on uvloop when it is installed, else on asyncio's loop."""

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
