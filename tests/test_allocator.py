"""The CPU trainer's allocator: a trainer process runs its own command again with mimalloc
preloaded (same process id, same arguments), a ``system`` recipe or a GPU trainer keeps the
C library's malloc, a user's settings survive, and a preload the loader refuses cannot
start a loop. Each case runs in a subprocess: the real thing executes a new image."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.runtime.allocator import PURGE_ENV, REEXEC_ENV, mimalloc_library, wheel_platform

pytestmark = pytest.mark.skipif(
    not wheel_platform(), reason="cmeel-mimalloc ships Linux wheels only"
)

PROBE = """
import json, os, sys
print("start", flush=True)
from asyncrl.config.recipe import Recipe
from asyncrl.entry.actor import choose_allocator
recipe = Recipe.model_validate({"trainer": json.loads(sys.argv[1])})
chosen = choose_allocator("trainer", recipe)
import torch
x = torch.randn(512, 512)
print(json.dumps({
    "pid": os.getpid(), "argv": sys.argv[1:], "chosen": chosen,
    "mapped": "libmimalloc" in open("/proc/self/maps").read(),
    "preload": os.environ.get("LD_PRELOAD", ""), "purge": os.environ.get("MIMALLOC_PURGE_DECOMMITS"),
    "finite": bool(torch.isfinite(x @ x).all()),
}))
"""


def probe(trainer: dict, *extra: str, env: dict[str, str] | None = None) -> tuple[dict, str]:
    """Runs PROBE with a recipe whose trainer section is ``trainer``; returns its report and
    everything it printed."""
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", PURGE_ENV, REEXEC_ENV)}
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(trainer), *extra],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1]), proc.stdout


def test_the_wheel_is_installed_where_it_ships() -> None:
    library = mimalloc_library()
    assert library is not None and library.name == "libmimalloc.so", library


def test_a_cpu_trainer_runs_again_under_mimalloc_as_the_same_process() -> None:
    report, out = probe({"device": "cpu"}, "two words", "--flag")
    assert out.count("start") == 2, "the command did not run again"
    assert report["chosen"] == "mimalloc" and report["mapped"], report
    assert report["argv"][1:] == ["two words", "--flag"], "the arguments changed"
    assert report["preload"] == str(mimalloc_library())
    assert report["purge"] == "0"  # freed memory is given back lazily, not decommitted
    assert report["finite"]


def test_system_or_a_gpu_trainer_keeps_the_c_library_malloc() -> None:
    report, out = probe({"device": "cpu", "allocator": "system"})
    assert out.count("start") == 1 and not report["mapped"]
    assert "trainer.allocator = system" in report["chosen"]
    report, out = probe({"device": "cuda"})
    assert out.count("start") == 1 and not report["mapped"]
    assert "GPU" in report["chosen"]


def test_a_users_own_preload_and_purge_setting_are_kept() -> None:
    # a library the user preloads (here the maths library, which any Linux has) stays,
    # after mimalloc; the user's purge setting wins over the trainer's
    report, _ = probe({"device": "cpu"}, env={"LD_PRELOAD": "libm.so.6", PURGE_ENV: "1"})
    assert report["preload"] == f"{mimalloc_library()}:libm.so.6"
    assert report["purge"] == "1" and report["chosen"] == "mimalloc" and report["mapped"]


def test_a_preload_the_loader_refuses_runs_once_more_and_no_more(tmp_path: Path) -> None:
    """A library the dynamic loader cannot load (here: not an ELF file) leaves the process
    on the C library's malloc after one more start, with the reason, instead of executing
    itself forever."""
    bogus = tmp_path / "site" / "cmeel.prefix" / "lib" / "libmimalloc.so"
    bogus.parent.mkdir(parents=True)
    bogus.write_text("not a library\n")
    shim = tmp_path / "shim" / "sitecustomize.py"
    shim.parent.mkdir()
    shim.write_text(
        "import asyncrl.runtime.allocator as a\n"
        f"a.mimalloc_library = lambda: __import__('pathlib').Path({str(bogus)!r})\n"
    )
    path = os.pathsep.join([str(shim.parent), os.environ.get("PYTHONPATH", "")])
    report, out = probe({"device": "cpu"}, env={"PYTHONPATH": path})
    assert out.count("start") == 2, out
    assert not report["mapped"]
    assert "did not preload" in report["chosen"], report


def test_a_trainer_that_up_starts_has_mimalloc_from_its_first_start(tmp_path: Path) -> None:
    """``up`` puts the preload in the trainer's own environment (every node of a gang
    too), so the trainer does not execute itself a second time; the other roles and a
    ``system`` trainer get none."""
    from asyncrl.config.recipe import load_recipe
    from asyncrl.launch.up import actor_specs

    ci = Path(__file__).resolve().parents[1] / "recipes" / "ci.toml"
    specs = actor_specs(load_recipe(ci, ["trainer.nodes=2", "trainer.device=cpu"]), tmp_path)
    trainers = [s for s in specs if s.role == "trainer"]
    assert len(trainers) == 2
    for s in trainers:
        assert s.env["LD_PRELOAD"].split(":")[0] == str(mimalloc_library()), s.env
    assert all("LD_PRELOAD" not in s.env for s in specs if s.role != "trainer")
    system = load_recipe(ci, ["trainer.allocator=system", "trainer.device=cpu"])
    assert all("LD_PRELOAD" not in s.env for s in actor_specs(system, tmp_path))
    # such an environment starts the trainer once, under mimalloc
    (one,) = [s for s in actor_specs(load_recipe(ci, ["trainer.device=cpu"]), tmp_path)
              if s.role == "trainer"]  # fmt: skip
    report, out = probe({"device": "cpu"}, env=one.env)
    assert out.count("start") == 1 and report["mapped"] and report["chosen"] == "mimalloc"
