"""Placement in the recipe (`<role>.node`, `<role>.gpus`, `rollout.actors_per_node`,
`[nodes.*]`): how it parses, which node each process goes on, and the placements that
`asyncrl check` refuses, naming the keys. No ray import: these run in `make test`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.checks import machine_problems, recipe_problems
from asyncrl.config.placement import (
    assign_gpus,
    gpu_problems,
    gpus_needed,
    node_for,
    node_placement_problems,
    process_gpus,
)
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.runtime import cores

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
    assert node_placement_problems(r) == []  # no [nodes]: nothing to fit


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
    errors = node_placement_problems(load_recipe(None, ["rollout.actors_per_node=2"]))
    assert len(errors) == 1 and "rollout.node empty" in errors[0]


def test_asyncrl_check_names_the_key(tmp_path: Path) -> None:
    path = tmp_path / "r.toml"
    path.write_text(CLUSTER.replace("nodes = 2\n", "nodes = 3\n"))
    out = subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", "check", str(path)],
        capture_output=True,
        text=True,
    )
    assert out.returncode != 0
    assert "trainer.nodes = 3" in out.stderr


def test_unknown_placement_key_fails(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match=r"nodes\.gpu-a\.gpu"):
        recipe_from(tmp_path, "[nodes.gpu-a]\ngpu = 8\n")


def test_a_node_name_finds_the_alive_node_that_declares_it() -> None:
    from asyncrl.launch.ray_cluster import find_node, nodes_used

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


# --- GPUs of one node: what `asyncrl up` gives each process ----------------------------------

EIGHT = Path(__file__).resolve().parent.parent / "recipes" / "gsm8k_8gpu.toml"


def test_each_process_gets_the_next_gpus_in_role_order() -> None:
    r = load_recipe(EIGHT)
    sets = assign_gpus(r)
    assert sets["rollout"] == [(0,), (1,), (2,)]
    assert sets["trainer"] == [(3, 4, 5, 6)]  # trainer.gpus × trainer.nproc
    assert sets["eval"] == [(7,)]
    assert sets["buffer"] == [()] and sets["reward"] == [()]  # no GPU: they see the node's
    assert gpus_needed(sets) == 8
    assert gpu_problems(r) == []


def test_up_starts_each_process_with_its_own_cuda_visible_devices(tmp_path: Path) -> None:
    from asyncrl.launch.up import actor_specs

    # the node's GPUs as its CUDA_VISIBLE_DEVICES names them (a Slurm allocation)
    node = [f"GPU-{i}" for i in range(8)]
    specs = {s.actor_id: s.env for s in actor_specs(load_recipe(EIGHT), tmp_path, gpus=node)}
    assert specs["rollout-1"]["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert specs["trainer-0"]["CUDA_VISIBLE_DEVICES"] == "GPU-3,GPU-4,GPU-5,GPU-6"
    assert specs["eval-0"]["CUDA_VISIBLE_DEVICES"] == "GPU-7"
    assert "CUDA_VISIBLE_DEVICES" not in specs["buffer-0"]  # gpus = 0: as today
    # a replacement keeps its predecessor's GPUs
    (rollout,) = [
        s for s in actor_specs(load_recipe(EIGHT), tmp_path, gpus=node) if s.actor_id == "rollout-1"
    ]
    assert rollout.restarted(1).env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert all(
        "CUDA_VISIBLE_DEVICES" not in s.env for s in actor_specs(load_recipe(None), tmp_path)
    )


@pytest.mark.parametrize(
    ("sets", "expected"),
    [
        # shares of a GPU are packed as Ray packs them
        (
            ["rollout.actors=3", "rollout.gpus=0.5", "trainer.gpus=1"],
            {"rollout": [(0,), (0,), (1,)], "trainer": [(2,)]},
        ),
        # a colocated rollout takes the trainer's GPUs, actor i the i-th (wrapping round)
        (
            [
                *["rollout.actors=3", "rollout.gpus=1", "rollout.colocate=true"],
                *["trainer.nproc=2", "trainer.gpus=1"],
            ],
            {"rollout": [(0,), (1,), (0,)], "trainer": [(0, 1)]},
        ),
        (
            ["rollout.actors=2", "rollout.colocate=true", "trainer.nproc=2", "trainer.gpus=1"],
            {"rollout": [(0, 1), (0, 1)], "trainer": [(0, 1)]},
        ),
        # trainer nodes on loopback all run here; with a rendezvous only the first
        (["trainer.nodes=2", "trainer.gpus=1"], {"trainer": [(0,), (1,)]}),
        (
            ["trainer.nodes=2", "trainer.gpus=1", 'trainer.rendezvous="h:1"'],
            {"trainer": [(0,)]},
        ),
    ],
    ids=["shares", "colocated", "colocated-all", "trainer-nodes", "rendezvous"],
)
def test_gpu_assignment(sets: list[str], expected: dict[str, list[tuple[int, ...]]]) -> None:
    got = assign_gpus(load_recipe(None, sets))
    assert {role: got[role] for role in expected} == expected


@pytest.mark.parametrize(
    ("sets", "keys"),
    [
        (
            ["rollout.gpus=1", "trainer.device=cuda"],
            ["trainer.device", "rollout.gpus", "GPU 0", "trainer.gpus = 1", "colocate"],
        ),
        (
            ["trainer.gpus=1", "rollout.engine.device=cuda:0"],
            ["rollout.engine.device", "trainer.gpus", "GPU 0"],
        ),
        (
            ["rollout.gpus=1", "trainer.gpus=1", "eval.every=2", "rollout.engine.device=cuda"],
            ["eval", "eval.gpus = 1"],
        ),
        (
            ["rollout.gpus=1", "rollout.engine.device=cuda:1", "trainer.device=cpu"],
            ['"cuda:1"', "rollout.gpus"],
        ),
        (
            [
                *["trainer.gpus=0.5", "trainer.nproc=2", "trainer.device=cuda"],
                "rollout.engine.device=cpu",
            ],
            ["trainer.gpus = 0.5", "trainer.nproc = 2"],
        ),
    ],
    ids=["inherits-a-taken-gpu", "cuda-n-taken", "eval", "beyond-its-own", "rank-share"],
)
def test_check_refuses_gpus_that_overlap_naming_the_keys(sets: list[str], keys: list[str]) -> None:
    errors, _ = recipe_problems(load_recipe(None, sets))
    assert len(errors) == 1, errors
    assert all(k in errors[0] for k in keys), errors[0]


def test_colocated_roles_may_share_and_roles_on_the_cpu_never_overlap() -> None:
    colocated = ["rollout.gpus=1", "trainer.device=cuda", "rollout.colocate=true"]
    assert gpu_problems(load_recipe(None, colocated)) == []
    # a CPU trainer sees the GPUs but computes on none of them
    assert gpu_problems(load_recipe(None, ["rollout.gpus=1", "trainer.device=cpu"])) == []
    # two roles of gpus = 0 on one device: today's behaviour (cuda_ipc shares it)
    both = ["trainer.device=cuda", "rollout.engine.device=cuda"]
    assert gpu_problems(load_recipe(None, both)) == []


def test_a_gpu_count_is_a_share_or_whole() -> None:
    with pytest.raises(RecipeError, match=r"rollout\.gpus.*share of one GPU"):
        load_recipe(None, ["rollout.gpus=1.5"])
    assert load_recipe(None, ["rollout.gpus=0.25", "trainer.gpus=2"]).trainer.gpus == 2


def test_up_refuses_a_machine_without_the_gpus_naming_keys_and_the_cpu_way() -> None:
    r = load_recipe(EIGHT)
    errors = machine_problems(r, [], cuda=False)
    assert any('trainer.device = "cuda"' in e and "no GPU" in e for e in errors), errors
    assert any('rollout.engine.device = "cuda"' in e for e in errors), errors
    assert any("8 GPUs" in e and "has 0" in e for e in errors), errors
    assert "recipes/quickstart.toml" in errors[-1] and "trainer.device=cpu" in errors[-1]
    four = machine_problems(r, ["0", "1", "2", "3"], cuda=True)
    assert len(four) == 1 and "take 8 GPUs" in four[0] and "has 4" in four[0], four
    assert machine_problems(r, [str(i) for i in range(8)], cuda=True) == []
    # auto resolves to the CPU where there is no GPU; a CPU recipe runs anywhere
    assert machine_problems(load_recipe(None), [], cuda=False) == []


@pytest.mark.parametrize(
    ("visible", "files", "expected"),
    [
        (None, 2, ["0", "1"]),
        (None, 0, []),
        ("", 2, []),
        ("-1", 2, []),
        ("2,3", 8, ["2", "3"]),
        ("GPU-a,-1,GPU-b", 8, ["GPU-a"]),  # CUDA stops at -1
    ],
)
def test_the_node_gpus_come_from_cuda_visible_devices_or_the_device_files(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    visible: str | None,
    files: int,
    expected: list[str],
) -> None:
    for i in range(files):
        (tmp_path / f"nvidia{i}").touch()
    (tmp_path / "nvidiactl").touch()  # the driver's control file is no GPU
    monkeypatch.setattr(cores, "NVIDIA_GPU_FILES", str(tmp_path / "nvidia[0-9]*"))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert cores.node_gpus() == expected
