"""``asyncrl slurm`` without Slurm: the sbatch script for 4 nodes is read line by line,
then run by bash with stand-ins for ``scontrol`` (the job's node list) and ``srun`` (which
records what it was asked to start where), and placements that cannot fit are refused by
``asyncrl check --nodes``."""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

from asyncrl.config.recipe import load_recipe
from asyncrl.entry.cli import main
from asyncrl.launch.slurm import sbatch_script, slurm_job_problems
from asyncrl.train.torchrun import UP_NODE_ENV, check_lead_node

CI = str(Path(__file__).resolve().parent.parent / "recipes" / "ci.toml")
FOUR_NODES = ["trainer.nodes=2", "rollout.actors=2"]


def script_for(tmp_path: Path, *sets: str, nodes: int = 4) -> str:
    overrides = [f"run.dir={tmp_path / 'runs'}", *FOUR_NODES, *sets]
    recipe = load_recipe(CI, overrides)
    assert slurm_job_problems(recipe, nodes) == []
    return sbatch_script(recipe, CI, overrides, nodes, partition="gpu", time="02:00:00")


def test_the_script_names_its_nodes_roles_and_rendezvous(tmp_path: Path) -> None:
    text = script_for(tmp_path)
    sbatch = dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)$", text, re.M))
    assert (sbatch["nodes"], sbatch["partition"], sbatch["time"]) == ("4", "gpu", "02:00:00")
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST"' in text
    assert "RDZV=$HEAD:29500" in text and "HEAD=${NODES[0]}" in text
    sruns = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 3
    for line in sruns:
        assert "--nodelist=" in line and "--nodes=" in line, line
    up, trainer, rollout = sruns
    assert '--nodelist="$HEAD"' in up and "asyncrl.entry.cli up" in up and "--nodes=1" in up
    assert "rollout.actors=0" in up and '"trainer.rendezvous=\\"$RDZV\\""' in up
    assert '--nodelist="$TRAINER_NODES"' in trainer and "--nodes=1" in trainer
    assert "trainer_node" in trainer
    assert '--nodelist="$ROLLOUT_NODES"' in rollout and "--nodes=2 --ntasks=2" in rollout
    assert "--nnodes=2" in text and '--rdzv-endpoint="$RDZV"' in text


def fake_slurm(bin_dir: Path) -> None:
    """``scontrol`` answers a node list out of order; ``srun`` records each step (its
    options, and the command a task would run, with the task's environment expanded) and
    does what the up step must for the script to go on: write nats.json."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\nprintf 'gpu3\\ngpu1\\ngpu4\\ngpu2\\n'\n")
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        # one write per step: the steps run at once, and two writes each would interleave
        'line=$(printf "%q " "$@"); printf "%s\\n" "$line" >> "$SRUN_LOG"\n'
        'if [[ "$*" == *"asyncrl.entry.cli up"* ]]; then\n'
        '  mkdir -p "$RUN"; echo {} > "$RUN/nats.json"\n'
        "  # the run lasts until the other two steps have started\n"
        '  for _ in $(seq 200); do [ "$(wc -l < "$SRUN_LOG")" -ge 3 ] && break; sleep 0.05; done\n'
        "fi\n"
        'if [[ "$*" == *"bash -c trainer_node"* ]]; then type trainer_node > "$SRUN_LOG.fn"; fi\n'
    )
    for tool in ("scontrol", "srun"):
        path = bin_dir / tool
        path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_the_script_runs_each_role_on_its_nodes(tmp_path: Path) -> None:
    script = tmp_path / "run.sbatch"
    script.write_text(script_for(tmp_path))
    fake_slurm(tmp_path / "bin")
    log = tmp_path / "srun.log"
    env = {
        **os.environ,
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "gpu[1-4]",
        "SRUN_LOG": str(log),
    }
    subprocess.run(["bash", str(script)], check=True, env=env, timeout=60)
    # srun's arguments, as bash handed them over, one step a line; the steps start in the
    # background, so their lines come in any order
    steps = [shlex.split(line) for line in log.read_text().splitlines()]
    assert len(steps) == 3, steps
    (up,) = [s for s in steps if "up" in s]
    (trainer,) = [s for s in steps if s[-1] == "trainer_node"]
    (rollout,) = [s for s in steps if s[-1] == "rollout_actor"]
    assert up[:3] == ["--nodes=1", "--ntasks=1", "--nodelist=gpu1"]
    assert up[4:7] == ["-m", "asyncrl.entry.cli", "up"]
    assert 'trainer.rendezvous="gpu1:29500"' in up  # the first trainer node hosts it
    assert up[up.index("--listen") + 1] == "0.0.0.0:4222"
    assert trainer == [
        "--nodes=1",
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--nodelist=gpu2",
        "bash",
        "-c",
        "trainer_node",
    ]
    assert rollout == [
        "--nodes=2",
        "--ntasks=2",
        "--nodelist=gpu3,gpu4",
        "bash",
        "-c",
        "rollout_actor",
    ]
    # the function the trainer step runs, as srun's environment carries it
    assert "--rdzv-id=ci --rdzv-conf=is_host=false" in Path(f"{log}.fn").read_text()


@pytest.mark.parametrize(
    ("sets", "nodes", "named"),
    [
        (["trainer.nodes=2"], 2, "trainer.nodes = 2 with --nodes = 2"),
        (["trainer.nodes=3"], 2, "trainer.nodes = 3 with --nodes = 2"),
        (["rollout.actors=1"], 3, "rollout.actors = 1 on the 2 rollout nodes"),
        (["rollout.colocate=true"], 2, "rollout.colocate"),
    ],
)
def test_check_refuses_a_placement_that_cannot_fit(
    sets: list[str], nodes: int, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [x for s in sets for x in ("--set", s)]
    assert main(["check", CI, *flags, "--nodes", str(nodes)]) == 2
    assert named in capsys.readouterr().err
    assert main(["check", CI, *flags]) == 0  # the recipe alone is fine


def test_submit_without_sbatch_is_refused_and_the_script_kept(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "job.sbatch"
    flags = [x for s in FOUR_NODES for x in ("--set", s)]
    code = main(["slurm", CI, *flags, "--nodes", "4", "--out", str(out), "--submit"])
    assert code == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
    assert out.read_text().startswith("#!/bin/bash")


def test_rank_0_on_a_node_up_did_not_start_refuses_to_lead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UP_NODE_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    with pytest.raises(SystemExit, match="did not start"):
        check_lead_node()
    monkeypatch.setenv(UP_NODE_ENV, "0")
    check_lead_node()
    monkeypatch.delenv(UP_NODE_ENV)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # one node: nothing to check
    check_lead_node()


def test_a_one_node_job_runs_the_whole_run_under_up(tmp_path: Path) -> None:
    """``--nodes 1``: up starts the rollout actors too, each on its GPUs, as on any machine;
    NATS stays on loopback."""
    overrides = [f"run.dir={tmp_path / 'runs'}", "rollout.actors=2", "rollout.colocate=true"]
    recipe = load_recipe(CI, overrides)
    assert slurm_job_problems(recipe, 1) == []
    text = sbatch_script(recipe, CI, overrides, 1)
    sruns = [line for line in text.splitlines() if line.startswith("srun ")]
    assert len(sruns) == 1 and "asyncrl.entry.cli up" in sruns[0], sruns
    assert "rollout.actors=0" not in sruns[0] and "--listen" not in sruns[0]
    two = load_recipe(CI, [*overrides, "trainer.nodes=2"])
    assert any("trainer.nodes = 2 with --nodes = 1" in p for p in slurm_job_problems(two, 1))
