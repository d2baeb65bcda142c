"""Torch threads of a trainer process: never more than the cores it may run on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from asyncrl.train import trainer_threads


def threads_in(cpus: list[int], threads: int, local_world: int) -> int:
    code = (
        "import os; from asyncrl.train import trainer_threads;"
        f"os.sched_setaffinity(0, {cpus}); print(trainer_threads({threads}))"
    )
    env = dict(os.environ, LOCAL_WORLD_SIZE=str(local_world))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return int(out.stdout)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_threads_follow_the_affinity_and_the_local_ranks() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    assert threads_in(cpus[:1], 0, 1) == 1
    assert threads_in(cpus, 0, 1) == len(cpus)
    assert threads_in(cpus, 0, len(cpus)) == 1  # one core per rank
    assert threads_in(cpus[:1], 0, 4) == 1  # at least one
    assert threads_in(cpus[:1], 3, 1) == 3  # trainer.threads wins
    assert trainer_threads(5) == 5
