"""Entry point of one actor process: ``python -m asyncrl.entry.actor ROLE --run-dir DIR``.

``asyncrl up`` spawns this for every actor; ``asyncrl attach`` runs the same code in the
foreground. The recipe comes from ``<run>/recipe.json`` and NATS from ``<run>/nats.json``,
so an attached actor joins exactly the run it names. On another machine, a folder with
copies of those two files is enough (``nats.json`` may also be given apart, ``--nats``)."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

from asyncrl.actors import actor_class
from asyncrl.config.recipe import Recipe, role_cpus
from asyncrl.runtime.actor import ActorContext
from asyncrl.runtime.allocator import system_malloc_reason, use_mimalloc
from asyncrl.runtime.cores import pin_cpus, placed_cpus, placed_threads
from asyncrl.runtime.log import configure_logging, get_logger
from asyncrl.runtime.loop import run_async
from asyncrl.runtime.nats_server import NatsInfo, nats_info_for_run
from asyncrl.train.torchrun import check_lead_node, rank_main


def build_context(run_dir: Path, actor_id: str = "", nats_file: Path | None = None) -> ActorContext:
    recipe_path = run_dir / "recipe.json"
    if not recipe_path.is_file():
        raise SystemExit(f"{run_dir} is not a run folder (no recipe.json)")
    recipe = Recipe.model_validate(json.loads(recipe_path.read_text()))
    try:
        nats = nats_info_for_run(run_dir) if nats_file is None else NatsInfo.read(nats_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"no connection info for the run: {exc}") from None
    return ActorContext(
        run_name=recipe.run.name,
        run_dir=run_dir,
        nats=nats,
        recipe=recipe,
        actor_id=actor_id,
    )


def dist_rank() -> int:
    """This process's rank under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0"))


def place_process(role: str, recipe: Recipe) -> tuple[list[int], int]:
    """Pins this process to its role's cores and sizes torch's thread pools, before torch
    is imported (a forked actor's torch is loaded already: its pool is sized then): the
    recipe's ``<role>.cpus`` and ``<role>.threads`` when set, else what ``up``'s automatic
    placement chose (:mod:`asyncrl.launch.core_placement`). Returns (cores, threads),
    empty and 0 where nothing was set."""
    threads = {
        "rollout": recipe.rollout.threads,
        "trainer": recipe.trainer.threads,
        "eval": recipe.eval.threads,
    }.get(role) or placed_threads()
    if threads:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    cpus = role_cpus(recipe).get(role) or placed_cpus()
    pin_cpus(role, cpus)
    torch = sys.modules.get("torch")
    if torch is not None and (threads or cpus):
        # a forked actor (asyncrl.entry.fork_server): torch was loaded by the fork server,
        # whose pool size the variable above no longer changes
        torch.set_num_threads(threads or len(cpus))
    if cpus or threads:
        get_logger(role=role).info("placed", cpus=cpus, threads=threads or "default")
    return cpus, threads


def choose_allocator(role: str, recipe: Recipe) -> str | None:
    """A CPU trainer process runs under mimalloc unless ``trainer.allocator = "system"``:
    this executes the process's command again with it preloaded (same process id; see
    :mod:`asyncrl.runtime.allocator`). Returns the allocator in use for a trainer process
    (or why it is the C library's), None for the other roles. Call it before torch is
    imported."""
    if role != "trainer":
        return None
    if (reason := system_malloc_reason(recipe.trainer)) is not None:
        return reason
    return use_mimalloc()


def run_actor(
    role: str, run_dir: Path, actor_id: str = "", *, nats_file: Path | None = None
) -> int:
    configure_logging(os.environ.get("ASYNCRL_LOG_LEVEL", "INFO"))
    ctx = build_context(run_dir, actor_id, nats_file)
    allocator = choose_allocator(role, ctx.recipe)
    place_process(role, ctx.recipe)
    if allocator is not None and dist_rank() == 0:
        get_logger(role=role).info("memory allocator", allocator=allocator)
    if role == "trainer" and dist_rank() > 0:
        # torchrun ranks > 0 are not actors: they follow rank 0's collective commands
        # torch loads here, after choose_allocator and place_process: the allocator must
        # be in place and OMP_NUM_THREADS set before torch starts
        with imports_without_collector():
            from asyncrl.train.commands import follow  # noqa: PLC0415 - imports torch
            from asyncrl.train.engine import build_train_engine  # noqa: PLC0415 - imports torch

        return follow(build_train_engine(ctx.recipe))
    if role == "trainer":
        check_lead_node()
    with imports_without_collector():
        cls = actor_class(role)  # the trainer's: torch, transformers, FSDP
    return run_async(cls(ctx).main())


@contextlib.contextmanager
def imports_without_collector() -> Iterator[None]:
    """Imports with the cyclic garbage collector off, then what they loaded out of its
    passes. With it on, importing the trainer's modules (torch, transformers, FSDP: some
    670,000 objects) costs about 0.8 s more CPU, some 15% of it: the collector runs full
    passes over the growing heap of modules again and again. Modules live as long as the
    process, so they are frozen (``gc.freeze``) as the actor freezes what its setup
    built; the few cycles the import machinery left go with them."""
    if not gc.isenabled():  # someone turned it off: not ours to turn on
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="asyncrl-actor")
    parser.add_argument("role")
    parser.add_argument("--run-dir", type=Path, required=True)
    parser.add_argument("--actor-id", default="")
    args = parser.parse_args(argv)
    return run_actor(args.role, args.run_dir, args.actor_id)


if __name__ == "__main__":
    rank_main(main)
