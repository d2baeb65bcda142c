"""One rank of a supervised fine-tuning run (:mod:`asyncrl.sft.run` starts them): the step
loop over the run folder's ``recipe.json``, records and evaluations on rank 0, checkpoints
in the GRPO trainer's format."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist
from transformers.utils import logging as hf_logging

from asyncrl.data.sampler import ShardSampler
from asyncrl.runtime.allocator import loaded_mimalloc
from asyncrl.runtime.cores import pin_cpus
from asyncrl.sft.config import SftRecipe
from asyncrl.sft.data import render_records, split_records
from asyncrl.sft.engine import SFTEngine
from asyncrl.sft.evaluate import greedy_accuracy
from asyncrl.sft.run import EVAL_FILE, EXPORT_LINK, METRICS_FILE
from asyncrl.train.checkpoint import commit_checkpoint
from asyncrl.train.engine import build_train_engine


class _Records:
    """Appends JSON lines to the run folder's record files (rank 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.run_dir, self.enabled = run_dir, enabled

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with (self.run_dir / name).open("a") as f:
                f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_rank(run_dir: Path, *, quiet: bool = False) -> int:
    """One rank of the SFT run in ``run_dir`` (its ``recipe.json``)."""
    recipe = SftRecipe.model_validate_json((run_dir / "recipe.json").read_text())
    pin_cpus("trainer", recipe.trainer.cpus)
    hf_logging.disable_progress_bar()  # a bar per model load says nothing in a run's log
    engine = build_train_engine(recipe, SFTEngine)
    lead = engine.rank == 0
    say = print if lead and not quiet else (lambda *a, **k: None)
    cfg, steps = recipe.sft, recipe.trainer.max_steps
    train_records, held_records = split_records(recipe)
    train = render_records(engine.tokenizer, train_records, cfg)
    held = render_records(engine.tokenizer, held_records, cfg)
    if len(train.samples) < 1:
        raise SystemExit(f"sft: no example fits sft.max_length={cfg.max_length}")
    allocator = "mimalloc" if loaded_mimalloc() else "the C library's malloc"
    say(
        f"sft: {len(train.samples)} training examples ({train.dropped} dropped, "
        f"{train.truncated} cut at sft.max_length), {len(held.samples)} held out; memory"
        f" allocator {allocator}",
        flush=True,
    )
    records = _Records(run_dir, lead)
    sampler = ShardSampler(len(train.samples), seed=recipe.run.seed)

    def evaluate(step: int) -> None:
        values: dict[str, float] = {}
        if held.samples:
            values["eval/loss"] = engine.eval_loss(held.samples)
        prompts = held.records[: cfg.eval_prompts or len(held.records)]
        if cfg.eval_accuracy and prompts:
            weights = run_dir / "eval_weights"
            if lead:
                shutil.rmtree(weights, ignore_errors=True)
            _barrier()
            engine.export_hf(weights)
            if lead:
                values.update(
                    greedy_accuracy(
                        weights,
                        prompts,
                        reward=cfg.reward,
                        max_new_tokens=cfg.max_new_tokens,
                        dtype=recipe.model.dtype,
                        system_prompt=cfg.system_prompt,
                    )
                )
            _barrier()
        if values:
            records.write(EVAL_FILE, {"step": step, "version": step, **values})
            say(f"eval step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))

    def checkpoint(step: int) -> Path:
        path = run_dir / "checkpoints" / f"step_{step:06d}"

        def write(folder: Path) -> None:
            _barrier()  # rank 0 has cleared a partial folder of an earlier attempt
            engine.save_checkpoint(folder, {"sampler": sampler.state()})
            engine.export_hf(folder / "hf")

        if lead:
            commit_checkpoint(run_dir, path, step, write)
        else:
            write(path.with_name(path.name + ".partial"))
        _barrier()
        return path

    evaluate(0)
    path: Path | None = None
    for step in range(1, steps + 1):
        batch = [train.samples[i] for _, i in sampler.take(cfg.batch_size)]
        stats = engine.sft_step(batch)
        records.write(
            METRICS_FILE, {"step": step, "version": step, "epoch": sampler.epoch, **stats}
        )
        say(
            f"step {step}/{steps}  loss {stats['loss']:.4f}  grad_norm {stats['grad_norm']:.3f}  "
            f"lr {stats['lr']:.2e}  {stats['time/step_s']:.1f} s",
            flush=True,
        )
        last = step == steps
        if last or (cfg.eval_every and step % cfg.eval_every == 0):
            evaluate(step)
        every = recipe.trainer.checkpoint_every
        if last or (every and step % every == 0):
            path = checkpoint(step)
    if lead and path is not None:
        link = run_dir / EXPORT_LINK
        link.unlink(missing_ok=True)
        link.symlink_to((path / "hf").relative_to(run_dir))
        shutil.rmtree(run_dir / "eval_weights", ignore_errors=True)
        say(f"sft: done; model.path = {link}", flush=True)
    _barrier()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl-sft-rank")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    return run_rank(args.run_dir, quiet=args.quiet)
