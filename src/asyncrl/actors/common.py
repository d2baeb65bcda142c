"""What the actors build from a recipe: engines and checkpoint pointers.

Heavy imports (torch, transformers) happen inside the functions, so an actor module
loads quickly and only the roles that need a model pay for one.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from asyncrl.config import Recipe

CHECKPOINT_POINTER = "latest.json"


def latest_checkpoint_meta(run_dir: Path) -> dict[str, Any] | None:
    """``{"path", "step", "version", "data_state"}`` of the newest complete checkpoint."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    if not pointer.is_file():
        return None
    meta: dict[str, Any] = json.loads(pointer.read_text())
    return meta


def write_checkpoint_meta(run_dir: Path, path: Path, extra: dict[str, Any]) -> None:
    """Points ``latest.json`` at a finished checkpoint (atomically: a crash mid-save
    leaves the previous pointer in place)."""
    pointer = run_dir / "checkpoints" / CHECKPOINT_POINTER
    tmp = pointer.with_suffix(".tmp")
    tmp.write_text(json.dumps({"path": str(path.resolve()), **extra}))
    os.replace(tmp, pointer)


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (a full disk, most often); the previous one is
    intact and still the latest."""


def commit_checkpoint(
    run_dir: Path, path: Path, extra: dict[str, Any], write: Callable[[Path], None]
) -> None:
    """Writes a checkpoint with ``write(folder)`` under a temporary name, renames the
    folder to ``path`` once it is whole, and only then points ``latest.json`` at it.

    A ``step_*`` folder is therefore always complete. If anything fails on the way (a
    full disk: ``ENOSPC``), the half-written folder is removed to give the space back and
    :class:`CheckpointError` says what failed and which checkpoint is still the latest;
    nothing the previous checkpoint holds was touched.
    """
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # left over from a crash mid-save
    try:
        write(partial)
        if path.exists():  # the same step saved again (a resumed run): replace it whole
            shutil.rmtree(path)
        partial.rename(path)
        write_checkpoint_meta(run_dir, path, extra)
    except BaseException as exc:  # DCP's CheckpointException is a BaseException
        shutil.rmtree(partial, ignore_errors=True)
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        latest = latest_checkpoint_meta(run_dir)
        kept = f"{latest['path']} is intact and still the latest" if latest else "none before"
        raise CheckpointError(
            f"could not write the checkpoint of step {extra.get('step')} to {path}: "
            f"{_root_cause(exc)}; the previous checkpoint: {kept}"
        ) from exc


def _root_cause(exc: BaseException) -> str:
    """The OS error under ``exc``, else ``exc`` itself, as ``Type: message``.

    A full disk rarely surfaces as itself: torch's zip writer fails on its way out with a
    ``RuntimeError`` whose context is the ``OSError``, and DCP wraps that per rank in a
    ``CheckpointException`` (its ``failures``), so the causes, contexts and failures are
    searched."""
    todo: list[BaseException] = [exc]
    seen: set[int] = set()
    while todo:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return f"{type(e).__name__}: {e}"
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)
        if isinstance(failures, dict):  # DCP: rank -> (exception, traceback)
            for failure in failures.values():
                first = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(first, BaseException):
                    todo.append(first)
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def dist_rank() -> int:
    """This process's rank under torchrun (0 when not under torchrun)."""
    return int(os.environ.get("RANK", "0"))


def build_engine(recipe: Recipe) -> Any:
    """The rollout engine (not started)."""
    cfg = recipe.rollout.engine
    if cfg.type == "instant":
        from asyncrl.engines.instant import InstantEngine

        return InstantEngine(response_tokens=cfg.response_tokens)
    if cfg.type != "hf":
        return build_server_engine(recipe)
    from asyncrl.engines.hf import HFEngine

    return HFEngine(
        recipe.model.path,
        dtype=recipe.model.dtype,
        device=resolve_device(cfg.device),
        max_batch_size=cfg.max_batch_size,
        memory_saver=recipe.rollout.colocate and _has_memory_saver(),
    )


def build_server_engine(recipe: Recipe) -> Any:
    """A ``vllm`` or ``sglang`` engine: its servers are started (or joined) by ``start()``,
    their logs go to ``<run>/logs``."""
    cfg = recipe.rollout.engine
    assert cfg.type in ("vllm", "sglang")
    options: dict[str, Any] = {
        "urls": cfg.urls,
        "command": cfg.command,
        "args": cfg.args,
        "env": cfg.env,
        "servers": cfg.servers,
        "host": cfg.host,
        "ports": cfg.ports,
        "dtype": recipe.model.dtype,
        "startup_timeout": cfg.startup_timeout,
        "request_timeout": cfg.request_timeout,
        "retries": cfg.retries,
        "retry_backoff": cfg.retry_backoff,
        "log_dir": recipe.run.path / "logs",
    }
    if cfg.type == "vllm":
        from asyncrl.engines.vllm import VLLMEngine

        return VLLMEngine(
            recipe.model.path,
            python=cfg.python,
            cpu_kvcache_gib=cfg.cpu_kvcache_gib,
            cpu_threads_bind=cfg.cpu_threads_bind,
            max_model_len=cfg.max_model_len,
            **options,
        )
    from asyncrl.engines.sglang import SGLangEngine

    return SGLangEngine(
        recipe.model.path,
        memory_saver=recipe.rollout.colocate,
        mem_fraction_static=cfg.mem_fraction_static,
        **options,
    )


def _has_memory_saver() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch_memory_saver") is not None


def resolve_device(choice: str) -> str:
    """``auto`` becomes ``cuda`` when a CUDA device is visible, else ``cpu``."""
    if choice != "auto":
        return choice
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def build_train_engine(recipe: Recipe) -> Any:
    """The FSDP train engine; joins the torchrun process group first when there is one."""
    import torch.distributed as dist

    from asyncrl.checks import generation_budget
    from asyncrl.models import resolve_model_path
    from asyncrl.train import LossConfig, TrainConfig, TrainEngine

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if recipe.trainer.device == "cuda" else "gloo"
        dist.init_process_group(backend)
    t, loss = recipe.trainer, recipe.trainer.loss
    norm_len = None
    if loss.loss_agg == "seq-mean-token-sum-norm":
        # Dr.GRPO divides by a constant, the generation budget: a batch-dependent divisor
        # (the longest answer) would bring back the length bias the variant removes.
        norm_len = float(loss.norm_len or generation_budget(recipe))
    config = TrainConfig(
        model=resolve_model_path(recipe.model.path),
        seed=recipe.run.seed,
        device=t.device,
        param_dtype=recipe.model.dtype,
        gradient_checkpointing=t.gradient_checkpointing,
        max_tokens_per_microbatch=t.max_tokens_per_microbatch,
        temperature=recipe.rollout.sampling.temperature,
        top_k=recipe.rollout.sampling.top_k,
        top_p=recipe.rollout.sampling.top_p,
        lr=t.optim.lr,
        weight_decay=t.optim.weight_decay,
        warmup_steps=t.optim.warmup_steps,
        lr_schedule=t.optim.schedule,
        total_steps=t.max_steps if t.optim.schedule == "cosine" else None,
        max_grad_norm=t.optim.grad_clip,
        ppo_minibatches=t.ppo_minibatches,
        loss=LossConfig(
            eps_clip=loss.eps_clip,
            eps_clip_high=loss.eps_clip_high,
            c_clip=loss.c_clip,
            behav_imp_weight_cap=loss.behav_imp_weight_cap,
            importance_sampling_level=loss.importance_sampling_level,
            loss_agg=loss.loss_agg,
            norm_len=norm_len,
            kl_coef=loss.kl_coef,
            kl_type=loss.kl_type,
            kl_in=loss.kl_in,
            entropy_coef=loss.entropy_coef,
            recompute_proximal=loss.proximal == "recompute",
        ),
    )
    return TrainEngine(config)
