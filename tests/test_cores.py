"""Automatic placement of a one-machine CPU run: the split rule, when it applies, and
that each process applies what it was given."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.recipe import load_recipe
from asyncrl.launch.core_placement import (
    WAIT_POLICY_ENV,
    CorePlacement,
    auto_placement,
    split_cores,
    why_not_placed,
)
from asyncrl.launch.up import actor_specs
from asyncrl.runtime import cores
from asyncrl.runtime.cores import CPUS_ENV, THREADS_ENV
from asyncrl.train import trainer_threads
from asyncrl.train.torchrun import UP_NODE_ENV

REPO = Path(__file__).resolve().parents[1]
CI = REPO / "recipes" / "ci.toml"


@pytest.mark.parametrize(
    ("n", "gen", "train"),
    [
        (2, [0], [0, 1]),  # overlapping on 2 cores
        (3, [0], [1, 2]),
        (4, [0], [1, 2, 3]),
        (8, [0, 1], list(range(2, 8))),
        (16, [0, 1, 2, 3], list(range(4, 16))),
        (64, list(range(16)), list(range(16, 64))),
    ],
)
def test_generation_takes_a_quarter_of_the_cores_and_training_the_rest(
    n: int, gen: list[int], train: list[int]
) -> None:
    assert split_cores(list(range(n))) == (gen, train)


def test_one_core_is_not_placed() -> None:
    with pytest.raises(ValueError, match="1 core"):
        split_cores([5])


def test_cores_are_taken_in_id_order_whatever_the_affinity_order() -> None:
    assert split_cores([7, 3, 5, 4]) == ([3], [4, 5, 7])
    assert split_cores([9, 2]) == ([2], [2, 9])


def test_threads_divide_each_set_among_its_processes() -> None:
    recipe = load_recipe(CI, ["rollout.actors=2", "trainer.nproc=2"])
    p = auto_placement(recipe, list(range(16)), cuda=False)
    assert p is not None
    assert (p.generation, p.training) == ([0, 1, 2, 3], list(range(4, 16)))
    # 4 generation cores for 2 rollout actors, the eval actor one thread beside them; the
    # other 12 cores for 2 ranks
    assert p.threads == {"rollout": 2, "eval": 1, "trainer": 6}
    assert p.describe().startswith("placement: 16 cores;")
    assert "training on [4,5,6,7,8,9,10,11,12,13,14,15], 6 thread(s)" in p.describe()
    two_nodes = load_recipe(CI, ["trainer.nodes=2"])
    p2 = auto_placement(two_nodes, list(range(8)), cuda=False)
    assert p2 is not None and p2.threads["trainer"] == 3  # both loopback nodes run here
    on_two = auto_placement(recipe, [0, 1], cuda=False)
    assert on_two is not None and on_two.threads == {"rollout": 1, "eval": 1, "trainer": 1}
    assert "training on [0,1] (generation's included)" in on_two.describe()


def test_a_trainer_pool_on_generations_cores_sleeps_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(WAIT_POLICY_ENV, raising=False)  # the test session sets it
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    recipe = load_recipe(CI)
    on_two = auto_placement(recipe, [0, 1], cuda=False)
    assert on_two is not None and on_two.passive == ("trainer",)
    assert on_two.env("trainer")[WAIT_POLICY_ENV] == "PASSIVE"
    assert WAIT_POLICY_ENV not in on_two.env("rollout")
    assert "2 thread(s) per trainer process, sleeping when idle" in on_two.describe()
    assert json.loads(on_two.to_json())["passive"] == ["trainer"]
    # on cores of its own the pool may spin; with one thread it has no workers to spin
    on_eight = auto_placement(recipe, list(range(8)), cuda=False)
    assert on_eight is not None and on_eight.passive == ()
    assert WAIT_POLICY_ENV not in on_eight.env("trainer")
    two_ranks = auto_placement(load_recipe(CI, ["trainer.nproc=2"]), [0, 1], cuda=False)
    assert two_ranks is not None and two_ranks.passive == ()
    # the user's own word on waiting is kept
    monkeypatch.setenv("GOMP_SPINCOUNT", "1000")
    assert WAIT_POLICY_ENV not in on_two.env("trainer")
    assert "sleeping" not in on_two.describe()


@pytest.mark.parametrize(
    ("sets", "cores", "cuda", "why"),
    [
        (["run.placement=none"], [0, 1], False, 'run.placement is "none"'),
        (["trainer.cpus=[1]"], [0, 1], False, "the recipe pins trainer.cpus itself"),
        (["rollout.cpus=[0]", "eval.cpus=[0]"], [0, 1], False, "rollout.cpus, eval.cpus"),
        ([], [0, 1], True, "a CUDA device runs the model"),
        ([], [0], False, "may use 1 core"),
    ],
)
def test_no_placement_where_the_user_or_the_machine_decides(
    sets: list[str], cores: list[int], cuda: bool, why: str
) -> None:
    recipe = load_recipe(CI, sets)
    reason = why_not_placed(recipe, cores, cuda=cuda)
    assert reason is not None and why in reason
    assert auto_placement(recipe, cores, cuda=cuda) is None


def test_every_process_up_starts_carries_its_roles_cores(tmp_path: Path) -> None:
    recipe = load_recipe(CI, ["eval.every=2", "trainer.nodes=2"])
    p = auto_placement(recipe, [0, 1, 2, 3], cuda=False)
    assert p is not None
    specs = actor_specs(recipe, tmp_path, p)
    assert {s.role for s in specs} == {"buffer", "reward", "rollout", "eval", "trainer"}
    for s in specs:
        want = "1,2,3" if s.role == "trainer" else "0"
        assert s.env[CPUS_ENV] == want, (s.actor_id, s.env)
    # the trainer gang keeps its own environment beside the placement
    assert all(UP_NODE_ENV in s.env for s in specs if s.role == "trainer")
    assert all(CPUS_ENV not in s.env for s in actor_specs(recipe, tmp_path))


@pytest.mark.parametrize(("visible", "gpu"), [("", False), ("-1", False), ("0", True)])
def test_cuda_visible_devices_can_hide_the_gpu_from_auto(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, visible: str, gpu: bool
) -> None:
    driver = tmp_path / "nvidiactl"
    driver.touch()  # a GPU driver's device file, as on a GPU machine
    monkeypatch.setattr(cores, "GPU_DEVICE_NODES", (str(driver),))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cores.gpu_visible() is gpu
    assert cores.is_cpu_device("auto") is not gpu
    assert cores.is_cpu_device("cpu")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert cores.gpu_visible()


def test_the_placed_threads_size_the_trainer_unless_the_recipe_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(THREADS_ENV, "3")
    assert trainer_threads(0) == 3
    assert trainer_threads(2) == 2


PROBE = """
import json, os, sys
from asyncrl.entry.actor import place_process
from asyncrl.config.recipe import load_recipe
recipe = load_recipe(sys.argv[1], sys.argv[3:])
place_process(sys.argv[2], recipe)
print(json.dumps({"cpus": sorted(os.sched_getaffinity(0)),
                  "omp": os.environ.get("OMP_NUM_THREADS")}))
"""


def probe(role: str, env: dict[str, str], *sets: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, str(CI), role, *sets],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to place on")
def test_a_process_pins_itself_where_it_was_placed_and_the_recipe_wins() -> None:
    last = max(os.sched_getaffinity(0))
    env = CorePlacement([0], [last], {"rollout": 1, "trainer": 1}).env("trainer")
    assert probe("trainer", env) == {"cpus": [last], "omp": "1"}
    # a recipe's own cores and threads win over the placement
    assert probe("trainer", env, "trainer.cpus=[0]", "trainer.threads=2") == {
        "cpus": [0],
        "omp": "2",
    }
    assert probe("buffer", CorePlacement([0], [last]).env("buffer"))["cpus"] == [0]
