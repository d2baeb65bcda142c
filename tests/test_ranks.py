"""``python -m asyncrl.entry.ranks``: a CPU node's ranks forked from one process, with
torchrun's variables, sessions, signals and a failed rank's status."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.entry.ranks import PRELOAD, USAGE, parse, rank_env
from asyncrl.train.torchrun import RANKS_MODULE, torchrun_argv

WORLD = r"""
import json, os, sys
import torch, torch.distributed as dist
out = sys.argv[1]
dist.init_process_group("gloo")  # env:// from the launcher's variables
total = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(total)
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_PORT")
record = {k: os.environ[k] for k in keys}
record.update(total=total.item(), argv=sys.argv, name=__name__, pid=os.getpid(),
              session=os.getsid(0), threads=os.environ.get("OMP_NUM_THREADS"))
dist.destroy_process_group()
with open(f"{out}/rank{record['RANK']}.json", "w") as f:
    json.dump(record, f)
sys.stdout.write(f"rank {record['RANK']} done\n")  # one write: the ranks share the pipe
"""

WAITER = """
import os, signal, sys, time
from pathlib import Path
folder, rank = Path(sys.argv[1]), os.environ["RANK"]
def stop(signum, frame):
    (folder / f"stopped{rank}").write_text(str(signum))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
(folder / f"up{rank}").write_text(str(os.getpid()))
if rank == sys.argv[2]:
    sys.exit(int(sys.argv[3]))
time.sleep(120)
"""


def launch(nproc: int, target: list[str], *, preload: str = "") -> list[str]:
    """The launcher's command line, importing only ``preload`` before the fork."""
    return [
        sys.executable,
        "-m",
        RANKS_MODULE,
        f"--nproc-per-node={nproc}",
        f"--preload={preload}",
        *target,
    ]


def wait_for(paths: list[Path], limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never written: {[p for p in paths if not p.exists()]}"
        time.sleep(0.05)


def test_two_ranks_form_a_gloo_world_with_torchruns_variables(tmp_path: Path) -> None:
    script = tmp_path / "world.py"
    script.write_text(WORLD)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    proc = subprocess.run(
        launch(2, [str(script), str(tmp_path)], preload="torch,torch.distributed"),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == ["rank 0 done", "rank 1 done"]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for r, record in enumerate(ranks):
        assert record["RANK"] == record["LOCAL_RANK"] == str(r)
        assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == "2"
        assert record["GROUP_RANK"] == "0"
        assert record["total"] == 3.0  # 1 + 2: the all-reduce crossed both ranks
        assert record["argv"] == [str(script), str(tmp_path)]
        assert record["name"] == "__main__"
        assert record["session"] == record["pid"]  # a session of its own, as under torchrun
        assert record["threads"] == "1"  # torchrun's default for several ranks
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"]


def test_a_module_target_runs_as_python_m_would(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "job.py").write_text(
        "import os, sys\n"
        "print(__name__, os.path.basename(sys.argv[0]), sys.argv[1:], os.environ['RANK'])\n"
        "sys.exit(0 if sys.path[0] == os.getcwd() else 9)\n"
    )
    proc = subprocess.run(
        launch(1, ["-m", "pkg.job", "--flag", "x"]),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "__main__ job.py ['--flag', 'x'] 0\n"


def test_a_failed_rank_stops_the_others_and_gives_its_status(tmp_path: Path) -> None:
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    proc = subprocess.run(
        launch(3, [str(script), str(tmp_path), "1", "7"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 7, proc.stderr
    assert "rank 1 ended with status 7; stopping the other 2" in proc.stderr
    # the two that waited were sent SIGTERM and ended
    assert {(tmp_path / f"stopped{r}").read_text() for r in (0, 2)} == {str(signal.SIGTERM)}
    assert not (tmp_path / "stopped1").exists()


def waiting_ranks(tmp_path: Path) -> subprocess.Popen:
    """Two ranks of :data:`WAITER` that wait until stopped, once both have started."""
    script = tmp_path / "waiter.py"
    script.write_text(WAITER)
    proc = subprocess.Popen(
        launch(2, [str(script), str(tmp_path), "none", "0"]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for([tmp_path / "up0", tmp_path / "up1"])
    except BaseException:
        proc.kill()
        raise
    return proc


def test_sigterm_reaches_every_rank_and_a_clean_stop_is_status_0(tmp_path: Path) -> None:
    proc = waiting_ranks(tmp_path)
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert {(tmp_path / f"stopped{r}").read_text() for r in (0, 1)} == {str(signal.SIGTERM)}
    assert "stopping the other" not in err  # asked to stop: no rank failed


def test_a_rank_killed_by_a_signal_is_128_plus_it(tmp_path: Path) -> None:
    proc = waiting_ranks(tmp_path)
    try:
        os.kill(int((tmp_path / "up1").read_text()), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGKILL, err
    assert (tmp_path / "stopped0").read_text() == str(signal.SIGTERM)


def test_the_command_line_is_checked_and_one_cpu_node_uses_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse(["--nproc-per-node=2", "-m", "m", "--nproc-per-node=3"]) == (
        2,
        PRELOAD,
        ["-m", "m", "--nproc-per-node=3"],  # the target's own options are its own
    )
    assert parse(["--nproc-per-node", "1", "--preload=", "s.py"]) == (1, (), ["s.py"])
    for bad in (["s.py"], ["--nproc-per-node=0", "s.py"], ["--nproc-per-node=2"], ["-m"]):
        with pytest.raises(SystemExit, match="usage"):
            parse(bad)
    assert USAGE.startswith("usage: python -m asyncrl.entry.ranks")
    env = rank_env(1, 2, 29500, "id")
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_PORT"]) == ("1", "2", "29500")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU visible, whatever the machine
    argv = torchrun_argv(["-m", "x"], nproc=2)
    assert argv == [sys.executable, "-m", RANKS_MODULE, "--nproc-per-node=2", "-m", "x"]
    assert torchrun_argv(["-m", "x"], nproc=2, forked=False)[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "x",
    ]  # what the launcher executes in its place where a GPU is visible
    nodes = torchrun_argv(["-m", "x"], nproc=2, nodes=2, endpoint="h:1", run_id="r")
    assert nodes[1:3] == ["-m", "torch.distributed.run"]
