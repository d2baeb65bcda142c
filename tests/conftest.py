"""Shared fixtures: a real nats-server per test, on a port it picks itself, and a bus."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo


@pytest.fixture
async def embedded_nats(tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    """A started embedded server whose run folder is ``tmp_path / "run"``."""
    async with EmbeddedNats(tmp_path / "run") as server:
        yield server


@pytest.fixture
async def nats_server(embedded_nats: EmbeddedNats) -> NatsInfo:
    """Connection info (URL and token) of a fresh embedded server."""
    return embedded_nats.info


@pytest.fixture
async def bus(nats_server: NatsInfo) -> AsyncIterator[Bus]:
    """A bus connected to the test's server; drained at the end of the test."""
    b = await Bus.connect(nats_server, name="test")
    try:
        yield b
    finally:
        await b.close()
