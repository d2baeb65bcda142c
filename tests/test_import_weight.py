"""The processes that never compute on a model start without torch, transformers or sympy:
each is a fresh interpreter that imports its entry module, as ``asyncrl up`` starts it.
Imports sit at the top of modules (ruff's PLC0415), so this is what keeps the heavy ones
off these paths: a module on them that needs torch defers it, saying why.

The layers under them stay apart too, as each light process pays for what it imports: the
bus, which every process connects with, loads no recipe schema beyond the ``run`` section;
the recipe schema loads none of what it only builds (the workflows, on the wire messages
and numpy; the endpoint, on aiohttp's server); the command line, for ``--help``, ``check``
and a recipe's sections, loads neither NATS nor the step records' codec."""

from __future__ import annotations

import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "sympy")


@pytest.mark.parametrize(
    "module",
    [
        "asyncrl.entry.cli",
        "asyncrl.entry.actor",
        "asyncrl.entry.reward_worker",
        "asyncrl.launch.up",
        "asyncrl.actors.buffer.actor",
        "asyncrl.actors.reward",
        "asyncrl.actors.rollout",
        "asyncrl.actors.eval",
        "asyncrl.sft.run",
    ],
)
def test_light_processes_import_no_heavy_library(module: str) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", f"{module} loads {out.stdout.strip()}"


@pytest.mark.parametrize(
    ("module", "absent"),
    [
        ("asyncrl.runtime.bus", ("asyncrl.config.recipe", "asyncrl.config.workflow")),
        (
            "asyncrl.config.recipe",
            (
                "numpy",
                "aiohttp",
                "asyncrl.wire.messages",
                "asyncrl.endpoint",
                "asyncrl.runtime.bus",
            ),
        ),
        ("asyncrl.entry.cli", ("nats", "numpy", "aiohttp", "asyncrl.wire.messages")),
    ],
)
def test_layers_import_only_what_they_use(module: str, absent: tuple[str, ...]) -> None:
    code = f"import sys, {module}; print(sorted(m for m in {absent!r} if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", f"{module} loads {out.stdout.strip()}"
