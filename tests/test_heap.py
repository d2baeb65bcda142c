"""A process that runs a torch model on the CPU keeps what malloc frees, so the next step's
memory comes without page faults; other processes and ``ASYNCRL_RETAIN_HEAP=0`` keep the C
library's defaults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import load_recipe
from asyncrl.cores import computes_on_cpu
from asyncrl.runtime.heap import RETAIN_HEAP_ENV

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "recipes" / "ci.toml"

# Places the process as an actor of ``role`` would be, then allocates and fills 256 MB,
# frees it, and counts the page faults of doing the same again.
PROBE = """
import json, resource, sys
from asyncrl.actors.launch import place_process
from asyncrl.config import load_recipe
place_process(sys.argv[2], load_recipe(sys.argv[1], sys.argv[3:]))
size = 256 << 20
block = b"\\x01" * size
del block
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = b"\\x02" * size
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""


def refill_faults(role: str, *sets: str, retain: str = "1") -> int:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(CI), role, *sets],
        env={**os.environ, RETAIN_HEAP_ENV: retain},
        capture_output=True,
        text=True,
        check=True,
    )
    return int(json.loads(out.stdout.strip().splitlines()[-1])["faults"])


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)
def test_a_cpu_trainer_refills_freed_memory_without_page_faults() -> None:
    pages = (256 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert refill_faults("trainer", "trainer.device=cpu") < pages // 50
    # the C library's defaults: a fresh mapping, every page faulted in again
    assert refill_faults("trainer", "trainer.device=cpu", retain="0") > pages // 2
    assert refill_faults("buffer") > pages // 2


def test_the_roles_that_compute_on_the_cpu() -> None:
    recipe = load_recipe(CI, ["trainer.device=cpu", "rollout.engine.device=cpu"])
    assert computes_on_cpu("trainer", recipe)
    assert computes_on_cpu("rollout", recipe)
    assert computes_on_cpu("eval", recipe)
    assert not computes_on_cpu("buffer", recipe)
    assert not computes_on_cpu("reward", recipe)
    on_cuda = load_recipe(CI, ["trainer.device=cuda", "rollout.engine.device=cuda"])
    assert not computes_on_cpu("trainer", on_cuda)
    assert not computes_on_cpu("rollout", on_cuda)
    # a client of an inference server computes nothing itself
    server = load_recipe(CI, ["rollout.engine.type=vllm"])
    assert not computes_on_cpu("rollout", server)
