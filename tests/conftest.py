"""Shared fixtures: a real nats-server per test, on a port it picks itself, and a bus."""

from __future__ import annotations

import os

# Two test processes share the machine's cores, with the runs they start: an idle OpenMP
# worker that spins for its next region (GNU OpenMP's default) burns a core another test
# needs. Set before anything loads torch, so that this process and every one it starts
# sleep instead. Measured with two runs of recipes/ci.toml side by side on 2 cores: 29 s
# each with the spinning, 20 s without.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.data.shapes import shapes_records
from asyncrl.entry.zygote import MODULE as ZYGOTE_MODULE
from asyncrl.models.tiny_vlm import IDEFICS3_NAME, QWEN2_5_VL_NAME, QWEN2_VL_NAME, tiny_vlm_dir
from asyncrl.runtime.allocator import mimalloc_preload
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.forks import ZYGOTE_ENV
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


RUN_STARTERS = ("up_args", "running_up", "cli")
"""Names a test module takes from tests/e2e_kit.py when its tests start ``asyncrl up``."""


def _starts_runs(item: pytest.Item) -> bool:
    module = getattr(item, "module", None)
    return any(hasattr(module, name) for name in RUN_STARTERS)


@pytest.fixture(scope="session")
def fork_zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fork-server zygote (asyncrl.entry.zygote) for this test process, its socket
    named in ``ASYNCRL_FORK_ZYGOTE`` so that every ``asyncrl up`` the tests start forks its
    fork server from it: some 40 runs then skip the imports of torch and transformers that
    are most of a short run's start (8 s of CPU each on a 2-core AMD EPYC). It has the
    load-time variables ``up`` gives a trainer on a machine of few cores (mimalloc
    preloaded, OpenMP's passive wait, set above); a run whose differ starts its own server,
    as do those whose test takes the variable out of the environment."""
    folder = tmp_path_factory.mktemp("zygote")
    path = folder / "z.sock"
    with open(folder / "zygote.log", "ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", ZYGOTE_MODULE, str(path)],
            env={**os.environ, **mimalloc_preload()},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            start_new_session=True,
        )
    deadline = time.monotonic() + 60
    while not path.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)  # it binds its socket before it imports; up waits for the imports
    os.environ[ZYGOTE_ENV] = str(path)
    try:
        yield str(path)
    finally:
        os.environ.pop(ZYGOTE_ENV, None)
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session", autouse=True)
def _zygote_for_runs(request: pytest.FixtureRequest) -> None:
    """Starts :func:`fork_zygote` in a test process whose tests start runs."""
    if any(_starts_runs(item) for item in request.session.items):
        request.getfixturevalue("fork_zygote")


VLM_NAMES = [QWEN2_VL_NAME, QWEN2_5_VL_NAME, IDEFICS3_NAME]
"""The tiny vision-language models, by their model.path names."""


@pytest.fixture(scope="module")
def vlm_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each tiny vision-language model's folder, built once per test module."""
    root = tmp_path_factory.mktemp("models")
    return {name: tiny_vlm_dir(name, root) for name in VLM_NAMES}


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Four shapes counting records (seed 0), their images rendered once per module."""
    return shapes_records(4, seed=0, cache_dir=tmp_path_factory.mktemp("shapes"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tests' order for pytest-xdist's work stealing (``make test``): each worker first
    takes a contiguous slice of the collection, runs it in order, and one that runs out
    steals from the end of a busy worker's slice. The ``slow`` tests (a run of ``asyncrl
    up``, SmolLM2, several processes: about 70% of the suite's time in 90 of its 1,200
    tests) are dealt in turn to the slices and go first in each, so that what is left at
    the end is short tests the workers can still share, rather than one long test running
    alone while the other worker idles. Without workers, the order is left alone."""
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers < 2 or not items:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    # the slice sizes xdist sends first: len // workers, then the rest evenly
    sizes, left = [], len(items)
    for k in range(workers):
        sizes.append(left // (workers - k))
        left -= sizes[-1]
    ordered: list[pytest.Item] = []
    for k, size in enumerate(sizes):
        mine = slow[k::workers]
        need = max(0, size - len(mine))
        ordered += mine + fast[:need]
        fast = fast[need:]
    items[:] = ordered + fast


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one thread, as a rollout actor's decode runs (the CPU kernel's products
    and decoder layers take calls there only)."""
    import torch  # only the tests that ask for it need torch loaded

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
