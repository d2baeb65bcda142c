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
running :func:`asyncrl.sft.rank.run_rank` (``python -m asyncrl.entry.sft_rank RUN_DIR``); rank 0 writes the
records, decodes the held-out answers and commits checkpoints.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from asyncrl.config.recipe import RecipeError, dump_recipe
from asyncrl.runtime.allocator import mimalloc_env, system_malloc_reason
from asyncrl.sft.config import SftRecipe
from asyncrl.train.torchrun import torchrun_argv

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
    # a CPU trainer's ranks start under mimalloc (trainer.allocator), so a single rank runs
    # in a child process then rather than in this one, whose allocator is fixed already
    env = None if system_malloc_reason(recipe.trainer) else mimalloc_env()
    if recipe.trainer.nproc > 1:
        return subprocess.call(torchrun_argv(target, nproc=recipe.trainer.nproc), env=env)
    if env is None:
        from asyncrl.sft.rank import run_rank  # noqa: PLC0415 - imports torch, in this process only here

        return run_rank(run_dir, quiet=quiet)
    return subprocess.call([sys.executable, *target], env=env)
