"""The file transports, ``dir`` and ``object_store``: an HF export of each version, read
from a folder every actor can reach or from the run's NATS object store.

A version is exported to ``weights/<name>`` (full weights, or a LoRA adapter) and, over
the object store, stored as one blob per file (:func:`safetensors_files`),
``weights-<name>/<file>``, plus a manifest blob ``weights-<name>`` listing the files;
``WeightsUpdated.location`` names the folder or the manifest. Sharded exports of large
models therefore travel like single files.

``<name>`` (:func:`export_name`) holds the trainer's epoch as well as the version: a
trainer restarted from its checkpoint (or from the initial weights) publishes versions
again that the dead one published too, and the two must not overwrite or delete each
other's files. Only the newest few *published* versions are kept (:class:`KeptExports`),
so neither the disk nor the object store grows with the run, and the newest is never
among those deleted.

A step that both publishes and checkpoints exports its weights once: the second folder
gets the first one's files (:func:`link_export`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

from asyncrl.api.weights import NamedTensors, WeightPublisher, Weights
from asyncrl.models.resolve import torch_dtype
from asyncrl.runtime.bus import Bus
from asyncrl.weights.lora import ADAPTER_CONFIG
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects

KEEP_VERSIONS = 3
"""Versions kept in the object store (and on disk): a rollout actor may still be
fetching the previous one while the next is uploaded."""


def export_name(epoch: int, version: int) -> str:
    """The folder (and object-store key) name of ``version`` published in ``epoch``."""
    return f"e{epoch}-v{version:06d}"


def manifest_key(name: str) -> str:
    """The manifest blob of the export named ``name``."""
    return f"weights-{name}"


class KeptExports:
    """The exported versions in ``weights_dir``, in the order they were published; the
    newest :data:`KEEP_VERSIONS` are kept.

    Exports left by earlier trainers of the run (a restarted one, or the run before a
    ``--resume``) count as published before any of this trainer's, oldest first by
    modification time: epochs restart their versions, so names do not order them."""

    def __init__(self, weights_dir: Path) -> None:
        found = [p for p in weights_dir.glob("*") if p.is_dir()] if weights_dir.is_dir() else []
        self.order: list[Path] = sorted(found, key=lambda p: p.stat().st_mtime)

    def published(self, export_dir: Path) -> list[Path]:
        """Records ``export_dir`` as the newest; returns the exports no longer kept."""
        self.order = [p for p in self.order if p != export_dir] + [export_dir]
        stale, self.order = self.order[:-KEEP_VERSIONS], self.order[-KEEP_VERSIONS:]
        return stale


def link_export(source: Path, target: Path) -> None:
    """Makes ``target`` an export of the same bytes as the export ``source``: hard links
    where the filesystem allows (no copy, and deleting either folder, as
    :class:`KeptExports` does, leaves the other whole), copies where it does not. Written
    under a temporary name and renamed, so ``target`` is whole or absent."""
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(source, tmp, copy_function=link)
    tmp.rename(target)


def _uploaded_files(export_dir: Path) -> list[str]:
    files = sorted(p.name for p in export_dir.glob("*.safetensors"))
    if (export_dir / ADAPTER_CONFIG).is_file():
        files.append(ADAPTER_CONFIG)
    return files


def safetensors_files(export_dir: Path) -> list[str]:
    """The files an export travels as: its safetensors files, and a LoRA adapter's config
    (:mod:`asyncrl.weights.lora`; full exports need none, the engines have the model's)."""
    files = _uploaded_files(export_dir)
    if not files or files == [ADAPTER_CONFIG]:
        raise FileNotFoundError(f"no safetensors files in {export_dir}")
    return files


async def put_weights(bus: Bus, bucket: str, export_dir: Path) -> str:
    """Uploads an HF export's safetensors files under the export's name; returns the
    manifest key."""
    key = manifest_key(export_dir.name)
    files = safetensors_files(export_dir)
    for name in files:
        await bus.put_blob(bucket, f"{key}/{name}", export_dir / name)
    await bus.put_blob(bucket, key, json.dumps({"files": files}).encode())
    return key


async def delete_weights(bus: Bus, bucket: str, export_dir: Path) -> None:
    """Deletes the object-store copy of an export (the manifest first, so that no reader
    finds a manifest whose files are gone); blobs already gone are no error."""
    key = manifest_key(export_dir.name)
    files = await asyncio.to_thread(_uploaded_files, export_dir)
    await bus.delete_blob(bucket, key)
    for name in files:
        await bus.delete_blob(bucket, f"{key}/{name}")


async def get_weights(bus: Bus, bucket: str, key: str, dest_dir: Path) -> None:
    """Downloads the files of manifest ``key`` into ``dest_dir``."""

    buf = io.BytesIO()
    await bus.get_blob(bucket, key, buf)
    for name in json.loads(buf.getvalue())["files"]:
        await bus.get_blob(bucket, f"{key}/{name}", dest_dir / name)


@contextlib.asynccontextmanager
async def fetched(bus: Bus, bucket: str, msg: WeightsUpdated) -> AsyncIterator[Path]:
    """The folder of the export ``msg`` announces: its own (``dir``), or a temporary one
    the object store's copy is downloaded into, which lives as long as the context."""
    if msg.kind == "dir":
        yield Path(msg.location)
        return
    with tempfile.TemporaryDirectory(prefix="asyncrl-weights-") as tmp:
        await get_weights(bus, bucket, msg.location, Path(tmp))
        yield Path(tmp)


def read_safetensors(folder: Path, dtype: str | None = None) -> NamedTensors:
    """Every tensor of the safetensors files in ``folder`` (cast to ``dtype``)."""
    from safetensors import safe_open  # noqa: PLC0415 - the rollout actor of a server engine runs without torch

    cast = torch_dtype(dtype) if dtype else None
    out: NamedTensors = []
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                out.append((name, t if cast is None else t.to(cast)))
    if not out:
        raise FileNotFoundError(f"no safetensors files in {folder}")
    return out


class DirPublisher(WeightPublisher):
    """``dir``: the export stays in ``<run>/weights/<name>``; the announcement names the
    folder. The newest :data:`KEEP_VERSIONS` published exports are kept."""

    kind = "dir"

    def __init__(self, weights_dir: Path, bus: Bus, subjects: Subjects) -> None:
        super().__init__(bus, subjects)
        self.exports = KeptExports(weights_dir)

    async def publish(self, weights: Weights) -> WeightsUpdated:
        folder = await asyncio.to_thread(weights.directory)
        msg = await self.announce(weights, await self._location(folder))
        for old in self.exports.published(folder):
            await self._drop(old)
        return msg

    async def _location(self, folder: Path) -> str:
        return str(await asyncio.to_thread(folder.resolve))

    async def _drop(self, old: Path) -> None:
        await asyncio.to_thread(shutil.rmtree, old, True)


class ObjectStorePublisher(DirPublisher):
    """``object_store``: the export's files go into the run's object store (one blob per
    file and a manifest); the announcement names the manifest. Works across machines
    that share nothing but NATS."""

    kind = "object_store"

    async def _location(self, folder: Path) -> str:
        return await put_weights(self.bus, self.subjects.weights_bucket, folder)

    async def _drop(self, old: Path) -> None:
        await delete_weights(self.bus, self.subjects.weights_bucket, old)
        await super()._drop(old)
