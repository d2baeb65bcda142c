"""``asyncrl sft RECIPE``: a supervised fine-tuning run, one process per trainer rank.

The step loop (every rank runs it, with the same global batches)::

    evaluate(0)
    for step in 1..trainer.max_steps:
        batch = next sft.batch_size examples of the shuffled epoch
        engine.sft_step(batch)                           # masked CE, one optimizer step
        record; evaluate every sft.eval_every and at the end; checkpoint

The run folder (``run.dir/run.name``) holds ``recipe.json`` and ``config.toml``,
``metrics.jsonl`` (one record per step: ``loss``, ``grad_norm``, ``lr``, tokens, time),
``eval.jsonl`` (one per evaluation: ``eval/loss``, the held-out token-mean
cross-entropy, and ``eval/accuracy`` of greedy answers, see :mod:`asyncrl.sft.evaluate`),
and ``checkpoints/step_<N>/`` in the GRPO trainer's format (DCP model and optimizer,
``trainer_state.json``, and ``hf/``, the weights as an HF directory). ``<run>/hf`` links
the last checkpoint's ``hf/``: an RL recipe starts from it with ``model.path = <run>/hf``.

With ``trainer.nproc > 1`` the command starts ``torchrun`` with that many ranks, each
running :func:`run_rank` (``python -m asyncrl.entry.sft_rank RUN_DIR``); rank 0 writes the
records, decodes the held-out answers and commits checkpoints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from asyncrl.config.recipe import RecipeError, dump_recipe
from asyncrl.sft.config import SftRecipe
from asyncrl.train import build_train_engine

METRICS_FILE = "metrics.jsonl"
EVAL_FILE = "eval.jsonl"
EXPORT_LINK = "hf"
"""``<run>/hf``: the last checkpoint's HF directory, what ``model.path`` of an RL recipe names."""


def prepare_run_dir(recipe: SftRecipe, *, overwrite: bool) -> Path:
    """The run folder, created (or emptied with ``overwrite``), with the resolved recipe."""
    run_dir = recipe.run.path
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            raise RecipeError(
                f"run folder {run_dir} exists: use --overwrite to replace it, or "
                f"--set run.name=<new name>"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.json").write_text(recipe.model_dump_json(indent=2))
    (run_dir / "config.toml").write_text(dump_recipe(recipe))
    return run_dir


def sft(recipe: SftRecipe, *, overwrite: bool = False, quiet: bool = False) -> int:
    """Runs ``recipe`` to its last step; returns the exit status."""
    run_dir = prepare_run_dir(recipe, overwrite=overwrite)
    target = ["-m", "asyncrl.entry.sft_rank", str(run_dir)] + (["--quiet"] if quiet else [])
    from asyncrl.entry.actor import system_malloc_reason
    from asyncrl.runtime.allocator import mimalloc_env

    # a CPU trainer's ranks start under mimalloc (trainer.allocator), so a single rank runs
    # in a child process then rather than in this one, whose allocator is fixed already
    env = None if system_malloc_reason(recipe.trainer) else mimalloc_env()
    if recipe.trainer.nproc > 1:
        from asyncrl.train.torchrun import torchrun_argv

        return subprocess.call(torchrun_argv(target, nproc=recipe.trainer.nproc), env=env)
    if env is None:
        return run_rank(run_dir, quiet=quiet)
    return subprocess.call([sys.executable, *target], env=env)


class _Records:
    """Appends JSON lines to the run folder's record files (rank 0 only)."""

    def __init__(self, run_dir: Path, enabled: bool) -> None:
        self.run_dir, self.enabled = run_dir, enabled

    def write(self, name: str, record: dict[str, Any]) -> None:
        if self.enabled:
            with (self.run_dir / name).open("a") as f:
                f.write(json.dumps({**record, "time": time.time()}) + "\n")


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def run_rank(run_dir: Path, *, quiet: bool = False) -> int:
    """One rank of the SFT run in ``run_dir`` (its ``recipe.json``)."""
    recipe = SftRecipe.model_validate_json((run_dir / "recipe.json").read_text())
    from asyncrl.entry.actor import pin_cpus

    pin_cpus("trainer", recipe.trainer.cpus)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per model load says nothing in a run's log
    from asyncrl.data.sampler import ShardSampler
    from asyncrl.runtime.allocator import loaded_mimalloc
    from asyncrl.sft.data import render_records, split_records
    from asyncrl.sft.engine import SFTEngine
    from asyncrl.train.checkpoint import commit_checkpoint

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
            from asyncrl.sft.evaluate import greedy_accuracy

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
