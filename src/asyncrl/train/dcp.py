"""A train engine's state on disk: model and optimizer by torch.distributed.checkpoint
(resumable on another number of ranks), each rank's RNG state, and the weights exported
as HF safetensors or streamed in buckets of full tensors to the inference side. The
folder layout and its atomic commit are :mod:`asyncrl.train.checkpoint`'s."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint import load, save
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor

from asyncrl.train.checkpoint import STATE_FILE


def _rank_world() -> tuple[int, int]:

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:

    if _rank_world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    # DCP warns on every single-process save/load, which is a supported, intended use here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rng_state() -> dict[str, torch.Tensor]:
    """This process's torch RNG states (CPU, and the current CUDA device if any)."""

    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:

    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_state: dict[str, Any],
    *,
    trainable_only: bool = False,
) -> None:
    """Saves a resumable checkpoint; collective: every rank calls it.

    ``trainer_state`` must be JSON-serialisable (step, version, the caller's extra state).
    ``trainable_only`` leaves out the frozen parameters (LoRA: the base model, which a
    restore reloads from its source) and so keeps only the adapters and their optimizer
    state.
    The directory is complete when this returns; a run makes it its latest checkpoint
    through :func:`commit_checkpoint`.
    """

    root = Path(path)
    rank, _ = _rank_world()
    blob = json.dumps(trainer_state, indent=2, sort_keys=True)  # fail before writing anything
    model_sd, optim_sd = get_state_dict(module, optimizer, options=_options(trainable_only))
    model_sd = _trainable(module, model_sd) if trainable_only else model_sd
    with _single_process_quiet():
        save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(root / "dcp"),
            no_dist=not dist.is_initialized(),
        )
    (root / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), root / "rng" / f"rank{rank}.pt")
    if rank == 0:
        (root / STATE_FILE).write_text(blob)
    _barrier()


def load_checkpoint(
    path: str | os.PathLike[str],
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    trainable_only: bool = False,
) -> dict[str, Any]:
    """Restores model, optimizer and this rank's RNG in place; returns the trainer state.
    ``trainable_only``: as saved with it (the frozen parameters are left as they are).

    Collective. With a different world size than at save time, DCP reshards the model and
    optimizer; rank ``r`` then takes the RNG of saved rank ``r mod saved_world``.
    """

    root = Path(path)
    if not (root / STATE_FILE).is_file():
        raise FileNotFoundError(f"{root} is not a complete checkpoint (no {STATE_FILE})")
    trainer_state: dict[str, Any] = json.loads((root / STATE_FILE).read_text())
    options = _options(trainable_only)
    model_sd, optim_sd = get_state_dict(module, optimizer, options=options)
    model_sd = _trainable(module, model_sd) if trainable_only else model_sd
    with _single_process_quiet():
        load(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(root / "dcp"),
            no_dist=not dist.is_initialized(),
        )
    set_state_dict(
        module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd, options=options
    )
    rank, _ = _rank_world()
    saved = sorted((root / "rng").glob("rank*.pt"))
    rng_file = root / "rng" / f"rank{rank % max(1, len(saved))}.pt"
    set_rng_state(torch.load(rng_file, weights_only=True))
    return trainer_state


def _options(trainable_only: bool) -> Any:

    # strict=False: the frozen parameters are absent from the state dict by design
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def _trainable(module: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """``state`` without frozen entries that ``ignore_frozen_params`` keeps: a tied LM head
    is a state-dict key but no parameter name of its own, so it escapes that filter."""
    names = {name for name, p in module.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in names}


def _full(tensor: torch.Tensor) -> torch.Tensor:

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _named_tensors(lm: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Parameters once each (a tied LM head is not repeated: HF checkpoints omit it) and
    persistent buffers, with the HF checkpoint names."""
    named: list[tuple[str, torch.Tensor]] = list(lm.named_parameters())
    persistent = set(lm.state_dict().keys())
    named += [(n, b) for n, b in lm.named_buffers() if n in persistent]
    return named


def iter_full_weights(
    lm: nn.Module,
    bucket_bytes: int,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    copy: bool = True,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yields the full (unsharded) weights of ``lm`` as buckets of ``(name, tensor)`` of
    about ``bucket_bytes`` each (a tensor larger than that gets a bucket of its own).

    Collective: every rank must exhaust the iterator in step, because each tensor is
    all-gathered as it comes. Rank 0 receives the tensors; the other ranks receive empty
    buckets, one per rank-0 bucket, so their loops run the same number of times.
    """
    rank, _ = _rank_world()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in _named_tensors(lm):
        full = _full(tensor.detach())
        nbytes = full.numel() * (dtype.itemsize if dtype is not None else full.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket if rank == 0 else []
            bucket, size = [], 0
        if rank == 0:
            # unsharded, `full` is the live parameter, which the next step updates: a copy
            # unless the caller (``copy=False``) is done with it before then
            bucket.append((name, full.to(device=device, dtype=dtype or full.dtype, copy=copy)))
        else:
            bucket.append((name, full[:0]))  # keep the count, drop the data
        size += nbytes
        del full
    if bucket:
        yield bucket if rank == 0 else []


def weights_sha256(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """The SHA-256 that identifies a model's weights bit for bit (hex): over the tensors'
    names in sorted order, each with its dtype, shape and the digest of its bytes::

        sha256( for each name, sorted:  "<name> <dtype> <shape> <sha256(bytes)>\\n" )

    Each tensor's bytes are hashed as it comes, so a stream of buckets
    (:func:`iter_full_weights`) is hashed without holding the model twice; the order the
    tensors come in does not matter. Two models with the same digest have the same names,
    dtypes, shapes and bytes."""
    lines: dict[str, str] = {}
    for name, tensor in named:
        if name in lines:
            raise ValueError(f"weights_sha256: the tensor {name} came twice")
        flat = tensor.detach().contiguous().reshape(-1).cpu()
        digest = hashlib.sha256(flat.view(torch.uint8).numpy().data).hexdigest()
        dtype = str(tensor.dtype).removeprefix("torch.")
        lines[name] = f"{name} {dtype} {list(tensor.shape)} {digest}\n"
    return hashlib.sha256("".join(lines[n] for n in sorted(lines)).encode()).hexdigest()


def export_hf(
    path: str | os.PathLike[str],
    lm: nn.Module,
    *,
    dtype: torch.dtype | None = None,
    tokenizer: Any = None,
    max_shard_bytes: int = 4 << 30,
    buckets: Callable[[int], Iterator[list[tuple[str, torch.Tensor]]]] | None = None,
) -> None:
    """Writes an HF model directory (safetensors shards + index, config, generation config,
    tokenizer if given) that ``AutoModelForCausalLM.from_pretrained`` and vLLM/SGLang load.
    ``buckets(max_bytes)`` yields the weights (default: :func:`iter_full_weights` of
    ``lm``; a LoRA model passes its merged weights).

    Collective; rank 0 writes.
    """

    rank, _ = _rank_world()
    root = Path(path)
    total = 0
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    shards: list[list[str]] = []
    if buckets is None:
        stream = iter_full_weights(lm, max_shard_bytes, dtype=dtype)
    else:
        stream = buckets(max_shard_bytes)
    for bucket in stream:
        if rank != 0:
            continue
        # contiguous(): safetensors writes raw storage; clone(): tied or viewed tensors
        # must not share memory inside one file.
        tensors = {k: v.contiguous().clone() for k, v in bucket}
        total += sum(v.numel() * v.element_size() for v in tensors.values())
        tmp = root / f".shard-{len(shards)}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        shards.append(list(tensors))
    if rank == 0:
        weight_map: dict[str, str] = {}
        for k, names in enumerate(shards):
            name = (
                "model.safetensors"
                if len(shards) == 1
                else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            )
            (root / f".shard-{k}.tmp").replace(root / name)
            weight_map.update(dict.fromkeys(names, name))
        if len(shards) > 1:
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (root / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config: Any = copy.deepcopy(getattr(lm, "config", None))
        if config is not None:
            if dtype is not None:
                config.dtype = dtype
            config.save_pretrained(str(root))
        generation_config: Any = getattr(lm, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(str(root))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(root))
    _barrier()
