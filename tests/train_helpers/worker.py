"""Runs train-engine steps in a process of its own: ``resume`` (load a checkpoint, go on),
``fsdp`` (under torchrun, any world size; the first step through the ranks' command
protocol, as the trainer actor runs it; with ``--lora``, then the same with LoRA
adapters), ``invariance`` (under torchrun: the two-rank gradient-invariance cases),
``prefix`` (under torchrun: float64 steps with and without shared prefixes).
Results go to ``--out`` via torch.save."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.train.commands import Leader, follow
from asyncrl.train.torchrun import rank_main
from train_helpers.invariance import OffsetEngine, run_case, world2_cases
from train_helpers.tiny import (
    float64_engine,
    fsdp_engine,
    full_weights,
    lora_fsdp_engine,
    prefix_batch,
    prefix_config,
    random_batch,
    resume_engine,
    step_gradients,
)


def resume(args: argparse.Namespace) -> None:
    engine = resume_engine()
    extra = engine.load_checkpoint(args.ckpt)
    losses = [engine.train_step(random_batch(step))["loss"] for step in range(engine.step, 5)]
    torch.save(
        {"extra": extra, "step": engine.step, "losses": losses, "weights": full_weights(engine)},
        args.out,
    )


def fsdp(args: argparse.Namespace) -> None:
    from torch.distributed.fsdp import FSDPModule

    dist.init_process_group("gloo")
    engine = fsdp_engine()
    units = [m for m in engine.module.modules() if isinstance(m, FSDPModule)]
    assert len(units) == engine.lm.config.num_hidden_layers + 1, "one unit per layer + root"
    # step 0 the trainer actor's way: rank 0 plans and sends each rank its own shard;
    # step 1 with the global batch on every rank
    if dist.get_rank() == 0:
        leader = Leader(engine)
        stats = [leader.train(random_batch(0))]
        leader.stop()
    else:
        follow(engine)
        stats = [{}]
    stats.append(engine.train_step(random_batch(1)))
    logprobs = engine.compute_logprobs(random_batch(7))
    weights = full_weights(engine)
    engine.save_checkpoint(args.ckpt, {"world": dist.get_world_size()})
    engine.export_hf(args.export)
    if dist.get_rank() == 0:
        torch.save({"stats": stats, "logprobs": logprobs, "weights": weights}, args.out)
    else:
        assert weights == {}, "only rank 0 receives full weights"
    if args.lora:
        lora(Path(args.lora))


def lora(folder: Path) -> None:
    """Two LoRA steps under FSDP2 (in the process group of ``fsdp``, which costs less than
    a torchrun of its own): stats, logprobs (policy and reference) and merged weights to
    ``folder/out.pt``, a checkpoint to ``folder/ckpt``, the adapter to ``folder/adapter``."""
    engine = lora_fsdp_engine()
    stats = [engine.train_step(random_batch(step)) for step in range(2)]
    logprobs = engine.compute_logprobs(random_batch(7))
    ref_logprobs = engine.compute_ref_logprobs(random_batch(7))
    weights = full_weights(engine)
    engine.save_checkpoint(folder / "ckpt")
    engine.export_weights(folder / "adapter")
    if dist.get_rank() == 0:
        result = {"stats": stats, "logprobs": logprobs, "ref": ref_logprobs, "weights": weights}
        torch.save(result, folder / "out.pt")


def lead_or_follow(engine: OffsetEngine, batch: list) -> dict[str, float]:
    """One train step the trainer actor's way: rank 0 plans it and sends each rank its
    shard; rank 0 returns the step's stats, the others nothing."""
    if dist.get_rank() == 0:
        leader = Leader(engine)
        stats = leader.train(batch)
        leader.stop()
        return stats
    follow(engine)
    return {}


def invariance(args: argparse.Namespace) -> None:
    """Every two-rank case of :func:`~train_helpers.invariance.world2_cases`, one process
    group for all: each case's loss and gradients, by case id."""
    dist.init_process_group("gloo")
    out = {case.id: run_case(case, lead_or_follow) for case in world2_cases()}
    if dist.get_rank() == 0:
        torch.save(out, args.out)


def prefix(args: argparse.Namespace) -> None:
    """The shared-prefix step (:func:`prefix_batch`, :func:`prefix_config`) in float64
    without and with ``trainer.share_prefix``, through the ranks' command protocol (rank
    0 plans, every other rank receives its shard as tensors, groups included): each run's
    stats, gradients and logprobs."""
    dist.init_process_group("gloo")
    batch = prefix_batch()
    out = {}
    for share in (False, True):
        engine = float64_engine(prefix_config(share_prefix=share))
        stats, grads = step_gradients(engine, lambda e=engine: lead_or_follow(e, batch))
        logprobs = engine.compute_logprobs(batch)
        out[share] = {"stats": stats, "grads": grads, "logprobs": logprobs}
    if dist.get_rank() == 0:
        torch.save(out, args.out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["resume", "fsdp", "invariance", "prefix"])
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", default="")
    parser.add_argument("--export", default="")
    parser.add_argument("--lora", default="", help="fsdp: then LoRA steps, results here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"resume": resume, "fsdp": fsdp, "invariance": invariance, "prefix": prefix}[args.mode](args)


if __name__ == "__main__":
    rank_main(main)  # destroys the process group and leaves as every trainer rank does
