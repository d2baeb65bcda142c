"""Placement in the recipe (`<role>.node`, `<role>.gpus`, `rollout.actors_per_node`,
`[nodes.*]`): how it parses, which node each process goes on, and the placements that
`asyncrl check` refuses, naming the keys. No ray import: these run in `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.checks import recipe_problems
from asyncrl.config import RecipeError, load_recipe
from asyncrl.placement import node_for, placement_problems, process_gpus

CLUSTER = """
[nodes.gpu-a]
gpus = 8
cpus = 32
[nodes.gpu-b]
gpus = 8
[rollout]
actors = 4
actors_per_node = 2
node = ["gpu-a", "gpu-b"]
gpus = 1
[trainer]
nodes = 2
nproc = 2
node = ["gpu-a", "gpu-b"]
gpus = 1
[buffer]
node = "gpu-a"
"""


def recipe_from(tmp_path: Path, text: str, *sets: str):  # type: ignore[no-untyped-def]
    path = tmp_path / "r.toml"
    path.write_text(text)
    return load_recipe(path, list(sets))


def test_placement_parses_and_places_each_process(tmp_path: Path) -> None:
    r = recipe_from(tmp_path, CLUSTER)
    assert r.buffer.node == ["gpu-a"]  # one name is a list of one
    assert r.nodes["gpu-a"].gpus == 8 and r.nodes["gpu-b"].cpus is None
    # actors_per_node fills each node in turn
    assert [node_for(r, "rollout", i) for i in range(4)] == ["gpu-a", "gpu-a", "gpu-b", "gpu-b"]
    assert [node_for(r, "trainer", k) for k in range(2)] == ["gpu-a", "gpu-b"]
    assert node_for(r, "reward", 0) == ""  # no node named: any
    assert process_gpus(r, "trainer") == 2.0  # nproc ranks of one GPU each
    assert process_gpus(r, "rollout") == 1.0
    assert recipe_problems(r) == ([], [])


def test_without_actors_per_node_actors_go_round_robin() -> None:
    r = load_recipe(None, ["rollout.actors=3", 'rollout.node=["a", "b"]'])
    assert [node_for(r, "rollout", i) for i in range(3)] == ["a", "b", "a"]
    assert placement_problems(r) == []  # no [nodes]: nothing to fit


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        (["rollout.actors=3"], ["rollout.actors = 3", "rollout.actors_per_node = 2", "= 4"]),
        (["trainer.nodes=3"], ["trainer.nodes = 3", "trainer.node names 2"]),
        (["buffer.gpus=7"], ["nodes.gpu-a.gpus = 8", "11 GPUs", "buffer, rollout, trainer"]),
        (["trainer.nproc=8"], ["nodes.gpu-a.gpus = 8", "10 GPUs", "trainer.nproc"]),
        (['buffer.node="cpu-c"'], ["buffer.node", "'cpu-c'", "[nodes.cpu-c]"]),
        (["buffer.ray_cpus=31"], ["nodes.gpu-a.cpus = 32", "34 CPUs", "ray_cpus"]),
        (["reward.gpus=1"], ["reward.gpus = 1", "reward.node empty"]),
        (['trainer.node=["gpu-a", "gpu-a"]'], ["trainer.node", "twice"]),
    ],
    ids=[
        "per-node-count",
        "gang-too-large",
        "gpus-per-node",
        "trainer-ranks",
        "undeclared",
        "cpus",
        "gpus-no-node",
        "node-twice",
    ],
)
def test_check_refuses_a_placement_that_cannot_fit(
    tmp_path: Path, sets: list[str], keys: list[str]
) -> None:
    errors, _ = recipe_problems(recipe_from(tmp_path, CLUSTER, *sets))
    assert errors, sets
    assert all(k in errors[0] for k in keys), errors[0]


def test_no_rollout_actors_started_fits_any_actors_per_node(tmp_path: Path) -> None:
    # what the Slurm script's `up` is given: its rollout actors attach from their nodes
    assert recipe_problems(recipe_from(tmp_path, CLUSTER, "rollout.actors=0"))[0] == []


def test_actors_per_node_needs_nodes() -> None:
    errors = placement_problems(load_recipe(None, ["rollout.actors_per_node=2"]))
    assert len(errors) == 1 and "rollout.node empty" in errors[0]


def test_asyncrl_check_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(CLUSTER.replace("nodes = 2\n", "nodes = 3\n"))
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "check", str(path)], capture_output=True, text=True
    )
    assert out.returncode != 0
    assert "trainer.nodes = 3" in out.stderr


def test_unknown_placement_key_fails(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"nodes\.gpu-a\.gpu"):
        recipe_from(tmp_path, "[nodes.gpu-a]\ngpu = 8\n")


def test_a_node_name_finds_the_alive_node_that_declares_it() -> None:
    from asyncrl.ray_launch import find_node, nodes_used

    nodes = [
        {"NodeID": "dead", "Alive": False, "Resources": {"gpu-b": 1.0}},
        {
            "NodeID": "a",
            "Alive": True,
            "Resources": {"CPU": 4.0, "gpu-a": 1.0},
            "Labels": {"zone": "z1"},
            "NodeManagerHostname": "host-a",
            "NodeManagerAddress": "10.0.0.1",
        },
        {"NodeID": "b", "Alive": True, "Resources": {"gpu-b": 1.0}},
    ]
    assert [find_node(n, nodes) for n in ("gpu-a", "z1", "host-a", "10.0.0.1")] == ["a"] * 4
    assert find_node("gpu-b", nodes) == "b"  # the dead node that declares it is skipped
    assert find_node("gpu-c", nodes) is None
    # the nodes of the nats-servers: the trainer's and the buffer's first
    r = load_recipe(None, ["rollout.node=gpu-a", "buffer.node=gpu-b", "trainer.node=gpu-b"])
    assert nodes_used(r, nodes) == ["b", "a"]
