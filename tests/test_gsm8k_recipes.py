"""The GSM8K recipes from a fresh clone, on a machine that has neither a GPU nor the
cluster's files: ``check`` and ``slurm`` say what they could not verify here instead of
refusing, ``up`` refuses before it starts anything, naming the key and the CPU way. Nothing
is fetched from the hub: the commands never read a hub dataset or model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.recipe import HFData, JsonlData, RecipeError, load_recipe, path_problems

REPO = Path(__file__).resolve().parent.parent
GSM8K = REPO / "recipes" / "gsm8k.toml"
EIGHT = REPO / "recipes" / "gsm8k_8gpu.toml"
LOCAL = ["data.type=jsonl", "data.path=../shared/data/gsm8k/train.jsonl"]
LOCAL += ["eval.data.type=jsonl", "eval.data.path=../shared/data/gsm8k/test.jsonl"]


def asyncrl(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The command line on a machine without a GPU (whatever this one has)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    return subprocess.run(
        [sys.executable, "-m", "asyncrl.entry.cli", *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,  # a checkout's working directory holds no data/ folder of GSM8K
        env=env,
        timeout=120,
    )


def sets(*items: str) -> list[str]:
    return [x for s in items for x in ("--set", s)]


@pytest.mark.parametrize("path", [GSM8K, EIGHT], ids=["gsm8k", "gsm8k_8gpu"])
def test_the_gsm8k_recipes_read_gsm8k_from_the_hub_and_a_local_copy_on_request(
    path: Path,
) -> None:
    r = load_recipe(path)
    assert isinstance(r.data, HFData) and isinstance(r.eval.data, HFData)
    assert (r.data.name, r.data.subset, r.data.split) == ("openai/gsm8k", "main", "train")
    assert r.eval.data.split == "test"
    assert path_problems(r) == []  # nothing local to miss
    # the override the recipe's comment documents: the hub's keys go with the type
    local = load_recipe(path, [s.replace("../shared", str(REPO.parent / "shared")) for s in LOCAL])
    assert isinstance(local.data, JsonlData) and isinstance(local.eval.data, JsonlData)
    # a key given with --set that the new type lacks is still refused, naming it
    with pytest.raises(RecipeError, match=r"data\.jsonl\.name"):
        load_recipe(path, ["data.type=jsonl", "data.path=x.jsonl", "data.name=gsm8k"])


def test_check_of_the_8_gpu_recipe_on_one_node_passes_without_a_gpu(tmp_path: Path) -> None:
    out = asyncrl(tmp_path, "check", str(EIGHT), "--nodes", "1")
    assert out.returncode == 0, out.stderr
    assert 'transport = "collective"' in out.stdout
    verified = [x for x in out.stderr.splitlines() if x.startswith("asyncrl check: verified")]
    assert len(verified) == 1 and "the placement on 1 Slurm node(s)" in verified[0]
    assert "trainer-0: 3,4,5,6" in verified[0]
    unverified = out.stderr.count("asyncrl check: not verified here:")
    assert unverified == 4, out.stderr  # the model, two datasets, the node's 8 GPUs
    assert "openai/gsm8k" in out.stderr and "8 GPUs" in out.stderr


def test_check_with_nodes_and_slurm_report_paths_only_the_cluster_has(tmp_path: Path) -> None:
    cluster = ["data.type=jsonl", "data.path=/cluster/gsm8k/train.jsonl"]
    out = asyncrl(
        tmp_path, "check", str(GSM8K), "--nodes", "4", *sets("rollout.actors=3", *cluster)
    )
    assert out.returncode == 0, out.stderr
    assert "not verified here: data.path: file '/cluster/gsm8k/train.jsonl'" in out.stderr
    here = asyncrl(tmp_path, "check", str(GSM8K), *sets(*cluster))  # a run on this machine
    assert here.returncode == 2 and "data.path" in here.stderr
    script = tmp_path / "job.sbatch"
    for extra in ([], cluster):
        job = asyncrl(
            tmp_path,
            "slurm",
            str(GSM8K),
            "--nodes",
            "4",
            "--out",
            str(script),
            *sets("rollout.actors=3", f"run.dir={tmp_path / 'runs'}", *extra),
        )
        assert job.returncode == 0, job.stderr
        assert script.read_text().startswith("#!/bin/bash")
    assert "/cluster/gsm8k/train.jsonl' does not exist here" in job.stderr


def test_up_without_a_gpu_stops_before_anything_starts(tmp_path: Path) -> None:
    out = asyncrl(tmp_path, "up", str(GSM8K), *sets(f"run.dir={tmp_path / 'runs'}"))
    assert out.returncode == 2, out.stderr
    assert 'trainer.device = "cuda" but this machine has no GPU' in out.stderr
    assert "asyncrl up recipes/quickstart.toml" in out.stderr and "make run" in out.stderr
    assert not (tmp_path / "runs").exists(), "a run folder was made"
    assert "nats" not in out.stdout
