"""FSDP2 under torchrun (gloo, world sizes 1 and 2, and 2 as two torchrun "nodes" of one
rank each, joined by a c10d rendezvous on loopback) against one unsharded process on the
same global batch: same losses, same updated weights, a checkpoint that reshards to one
process, and an HF export that transformers loads back."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from train_helpers.once import made_once
from train_helpers.tiny import fsdp_engine, full_weights, one_torch_thread, random_batch

from asyncrl.train.engine import TrainEngine
from asyncrl.train.torchrun import LOOPBACK, free_port, torchrun_argv

WORKER = Path(__file__).parent / "train_helpers" / "worker.py"


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


LAUNCHES = {"world1": (1, 1), "world2": (1, 2), "nodes2": (2, 1)}
"""Torchrun jobs of the worker: (nodes, ranks per node)."""

_results: dict[str, dict] = {}


def launch(kind: str, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The worker's ``fsdp`` job as ``kind`` (once per session, whichever worker's tests
    ask: :func:`made_once`): its stats, logprobs and weights, with the folder of its
    checkpoint and export."""
    if kind not in _results:
        tmp = made_once(tmp_path_factory, f"fsdp-{kind}", lambda folder: run_fsdp(kind, folder))
        result: dict = torch.load(tmp / "out.pt", weights_only=True)
        result.update(dir=tmp, world=LAUNCHES[kind][0] * LAUNCHES[kind][1])
        _results[kind] = result
    return _results[kind]


def run_fsdp(kind: str, tmp: Path) -> None:
    """The torchrun job ``kind`` of the worker into ``tmp``. Nodes are started with the
    command lines ``asyncrl up`` uses for a trainer across nodes on one machine."""
    nodes, nproc = LAUNCHES[kind]
    out = tmp / "out.pt"
    target = [str(WORKER), "fsdp", "--out", str(out), "--ckpt", str(tmp / "ckpt")]
    target += ["--export", str(tmp / "hf")]
    if kind == "world2":  # LoRA under FSDP rides along (test_train_lora.py checks it)
        target += ["--lora", str(tmp / "lora")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if nodes == 1:
        # --standalone: rendezvous on a free local port that torchrun picks itself
        subprocess.run(torchrun_argv(target, nproc=nproc), check=True, timeout=240, env=env)
    else:
        endpoint = f"{LOOPBACK}:{free_port()}"
        logs = [tmp / f"node{k}.log" for k in range(nodes)]
        outs = [log.open("w") for log in logs]
        procs = [
            subprocess.Popen(
                torchrun_argv(
                    target,
                    nproc=nproc,
                    nodes=nodes,
                    endpoint=endpoint,
                    run_id=kind,
                    is_host=k == 0,
                    local_addr=LOOPBACK,
                ),
                env=env,
                stdout=outs[k],
                stderr=subprocess.STDOUT,
            )
            for k in range(nodes)
        ]
        codes = wait_all(procs, timeout=240)
        for f in outs:
            f.close()
        text = "\n".join(f"== {log.name}\n{log.read_text()[-3000:]}" for log in logs)
        assert codes == [0] * nodes, f"torchrun nodes ended {codes}\n{text}"


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """The exit codes of ``procs`` once all ended, or as soon as one failed (then the rest
    are killed and read as None), or at ``timeout`` (all killed)."""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes) or any(c not in (None, 0) for c in codes):
                return codes
            time.sleep(0.2)
        return [p.poll() for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module", params=list(LAUNCHES))
def fsdp_run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return launch(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def one_rank() -> tuple[TrainEngine, list[dict[str, float]]]:
    """The same two steps in this process, unsharded."""
    with one_torch_thread():
        engine = fsdp_engine()
        stats = [engine.train_step(random_batch(step)) for step in range(2)]
    return engine, stats


@pytest.mark.slow
def test_fsdp_steps_match_one_process(fsdp_run: dict, one_rank: tuple) -> None:
    engine, plain_steps = one_rank
    for fsdp_stats, plain_stats in zip(fsdp_run["stats"], plain_steps, strict=True):
        keys = ("loss", "pg_loss", "grad_norm", "clip_frac", "approx_kl", "kl_ref", "lr")
        for key in keys:
            assert fsdp_stats[key] == pytest.approx(plain_stats[key], rel=1e-5, abs=1e-7), key
        assert fsdp_stats["optimizer_steps"] == plain_stats["optimizer_steps"] == 2
        assert fsdp_stats["tokens"] == plain_stats["tokens"]
        # Every token was computed once over all ranks: the work was split, not duplicated.
        assert fsdp_stats["input_tokens"] == plain_stats["input_tokens"] == plain_stats["tokens"]
        assert fsdp_stats["micro_batches"] >= max(plain_stats["micro_batches"], fsdp_run["world"])
    plain = full_weights(engine)
    assert fsdp_run["weights"].keys() == plain.keys()
    assert "lm_head.weight" not in plain  # tied: exported once, as HF does
    # Adam divides each gradient by its own running RMS, so where a gradient is ~0 the
    # summation-order noise between 1 and 2 ranks becomes an update of up to lr (1e-3);
    # 1e-5 is 1% of one step. Typical differences are ~1e-8.
    for name, tensor in plain.items():
        torch.testing.assert_close(fsdp_run["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)


@pytest.mark.slow
def test_fsdp_logprobs_match_one_process(fsdp_run: dict, one_rank: tuple) -> None:
    plain = one_rank[0].compute_logprobs(random_batch(7))
    for a, b in zip(fsdp_run["logprobs"], plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_fsdp_checkpoint_loads_in_one_process(fsdp_run: dict) -> None:
    engine = fsdp_engine()
    extra = engine.load_checkpoint(fsdp_run["dir"] / "ckpt")
    assert extra == {"world": fsdp_run["world"]}
    assert (engine.step, engine.version) == (2, 2)
    for name, tensor in full_weights(engine).items():
        torch.testing.assert_close(tensor, fsdp_run["weights"][name], rtol=0, atol=0, msg=name)


@pytest.mark.slow
def test_fsdp_export_loads_in_transformers(fsdp_run: dict) -> None:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(fsdp_run["dir"] / "hf", dtype=torch.float32)
    state = lm.state_dict()
    for name, tensor in fsdp_run["weights"].items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)
    torch.testing.assert_close(state["lm_head.weight"], state["model.embed_tokens.weight"])


@pytest.mark.slow
def test_two_nodes_train_exactly_as_one_node_of_two_ranks(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The same two ranks, on one node or on two: the same shards, the same collectives,
    so the same numbers (the rendezvous only changes how the ranks found each other)."""
    one, two = launch("world2", tmp_path_factory), launch("nodes2", tmp_path_factory)
    for a, b in zip(two["stats"], one["stats"], strict=True):
        assert a.keys() == b.keys()
        # wall times and the rates made of them differ from run to run
        for key in (k for k in a if not k.startswith("time") and not k.endswith("_per_s")):
            assert a[key] == pytest.approx(b[key], rel=0, abs=1e-5), key
    assert one["stats"][0]["loss"] != 0
    for a, b in zip(two["logprobs"], one["logprobs"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    for name, tensor in one["weights"].items():
        torch.testing.assert_close(two["weights"][name], tensor, rtol=0, atol=1e-5, msg=name)


EXITING_RANK = """
import atexit, sys
from pathlib import Path
import torch.distributed as dist
from asyncrl.train.torchrun import rank_main
folder, group, ending = Path(sys.argv[1]), sys.argv[2], sys.argv[3]


def main():
    if group == "group":
        init = f"file://{folder / 'store'}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
        dist.barrier()
    atexit.register(lambda: (folder / "atexit").write_text("ran"))
    print("buffered, no newline", end="")
    if ending == "raise":
        raise ValueError("no checkpoint there")
    if ending == "refuse":
        raise SystemExit("refused to lead")
    return 3


rank_main(main)
"""


@pytest.mark.parametrize(
    ("group", "ending", "status", "stderr"),
    [
        ("group", "return", 3, ""),
        ("none", "return", 3, ""),
        ("group", "raise", 1, "ValueError: no checkpoint there"),
        ("group", "refuse", 1, "refused to lead"),
    ],
)
def test_a_rank_leaves_with_its_status_exit_handlers_and_output(
    tmp_path: Path, group: str, ending: str, status: int, stderr: str
) -> None:
    """A rank leaves through rank_main and exit_rank (without finalization when it joined
    a process group), whether its main returned, raised or refused: with its status,
    after its exit handlers, with its buffered output and its error written out."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered stdout
    proc = subprocess.run(
        [sys.executable, "-c", EXITING_RANK, str(tmp_path), group, ending],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == status, proc.stderr
    assert proc.stdout == "buffered, no newline"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert stderr in proc.stderr
    assert ("Traceback" in proc.stderr) == (ending == "raise")


LANE_AT_EXIT = """
import atexit, subprocess, sys, threading, time
import torch.distributed as dist
from asyncrl.train.torchrun import exit_rank
from asyncrl.weights import wire

if sys.argv[1] == "host":  # the trainer's side: the rendezvous store, until killed
    store = wire.open_store("127.0.0.1", 30)
    print(store.port, flush=True)
    time.sleep(3600)

host = subprocess.Popen([sys.executable, sys.argv[0], "host"], stdout=subprocess.PIPE, text=True)
port = int(host.stdout.readline())
go = threading.Event()


def join():  # an engine's join, on its lane: it opens its group only once told to
    go.wait()
    store = dist.TCPStore("127.0.0.1", port, None, False, timeout=wire.timeout_of(30))
    return wire.open_pair(store, "g", 1, "gloo", 30, "cpu")


def trainer_goes_away():
    # the join goes ahead as the process ends (after exit_rank looked for open groups)
    # and waits in the rendezvous for the trainer, which then goes away
    go.set()
    time.sleep(1.0)
    host.kill()


wire.Lane("weights").submit(join)
atexit.register(trainer_goes_away)
exit_rank(0)
"""


def test_a_lane_that_opens_its_group_as_the_process_ends_does_not_abort_it(tmp_path: Path) -> None:
    """An attached engine stopped while its lane was about to join the broadcast: the
    lane went on during the interpreter's finalization, waited in the rendezvous, and the
    trainer's end unwound it in native code there (SIGABRT, "terminate called without
    an active exception", after a clean stop). A process with a live daemon thread now
    leaves without finalization, so it ends with its own status."""
    script = tmp_path / "lane_at_exit.py"
    script.write_text(LANE_AT_EXIT)
    proc = subprocess.run(
        [sys.executable, str(script), "engine"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


STOP_A_RANK = """
import os, subprocess, sys, time
import torch.distributed as dist
from asyncrl.train.commands import Leader, next_command
from asyncrl.train.torchrun import exit_rank

port, follows = int(sys.argv[1]), sys.argv[2] == "follows"
if len(sys.argv) > 3:  # rank 1: follows rank 0's commands, or is alive but never listens
    parent = os.getppid()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    if follows:
        # one write: with PYTHONUNBUFFERED each piece of a print is a write of its own, and
        # rank 0's line could land between them
        print(f"rank 1 got {next_command()[0].name}", flush=True)
    while not follows and os.getppid() == parent:  # deaf until rank 0 is gone
        time.sleep(0.1)
    sys.exit(0)
other = subprocess.Popen([sys.executable, *sys.argv, "rank1"])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
print(f"taken={Leader(None).stop(within=2.0)}", flush=True)
if follows:
    other.wait(30)
exit_rank(0)  # the deaf rank is still there, and the stop still waiting for it
"""


@pytest.mark.parametrize("follows", [True, False])
def test_a_bounded_stop_leaves_a_rank_that_never_listens(tmp_path: Path, follows: bool) -> None:
    """A gloo broadcast waits for every receiver: rank 0's stop to a rank that is alive
    but no longer following (stopping on its own signal) used to hold rank 0 for the
    group's whole timeout, past up's grace. Given ``within``, the stop returns False after
    that time and the process ends with its own status while the command still waits in
    its daemon thread; a following rank takes it as before."""
    script = tmp_path / "stop_a_rank.py"
    script.write_text(STOP_A_RANK)
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), "follows" if follows else "deaf"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    if follows:
        assert "rank 1 got STOP" in proc.stdout and "taken=True" in proc.stdout, proc.stdout
    else:
        assert "taken=False" in proc.stdout, proc.stdout
