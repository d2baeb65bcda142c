"""Moving exported weights between the trainer and rollout actors over the object store.

A version is stored as one blob per safetensors file, ``weights-v<N>/<file>``, plus a
manifest blob ``weights-v<N>`` listing the files; ``WeightsUpdated.location`` names the
manifest. Sharded exports of large models therefore travel like single files. Only the
newest few versions are kept, so the object store does not grow with the run.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from asyncrl.messages import WeightsUpdated
from asyncrl.runtime.bus import Bus

KEEP_VERSIONS = 3
"""Versions kept in the object store (and on disk): a rollout actor may still be
fetching the previous one while the next is uploaded."""


def manifest_key(version: int) -> str:
    return f"weights-v{version}"


def safetensors_files(export_dir: Path) -> list[str]:
    files = sorted(p.name for p in export_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors files in {export_dir}")
    return files


async def put_weights(bus: Bus, bucket: str, export_dir: Path, version: int) -> str:
    """Uploads an HF export's safetensors files; returns the manifest key."""
    key = manifest_key(version)
    files = safetensors_files(export_dir)
    for name in files:
        await bus.put_blob(bucket, f"{key}/{name}", export_dir / name)
    await bus.put_blob(bucket, key, json.dumps({"files": files}).encode())
    old = version - KEEP_VERSIONS
    if old >= 0:
        await delete_weights(bus, bucket, old, files)
    return key


async def delete_weights(bus: Bus, bucket: str, version: int, files: list[str]) -> None:
    key = manifest_key(version)
    await bus.delete_blob(bucket, key)
    for name in files:
        await bus.delete_blob(bucket, f"{key}/{name}")


async def get_weights(bus: Bus, bucket: str, key: str, dest_dir: Path) -> None:
    """Downloads the files of manifest ``key`` into ``dest_dir``."""
    import io

    buf = io.BytesIO()
    await bus.get_blob(bucket, key, buf)
    for name in json.loads(buf.getvalue())["files"]:
        await bus.get_blob(bucket, f"{key}/{name}", dest_dir / name)


@contextlib.asynccontextmanager
async def staged_weights(
    engine: Any, bus: Bus, bucket: str, msg: WeightsUpdated
) -> AsyncIterator[Any]:
    """The weights ``msg`` announces, fetched (from the object store, into a temporary
    directory that lives as long as the context) and staged by the engine, all while it
    keeps generating; yields what ``engine.update_weights`` then takes."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-weights-") as tmp:
        source = Path(msg.location)
        if msg.kind != "dir":
            source = Path(tmp)
            await get_weights(bus, bucket, msg.location, source)
        yield await engine.stage_weights(source)


async def load_published_weights(engine: Any, bus: Bus, bucket: str, msg: WeightsUpdated) -> None:
    """Loads the weights ``msg`` announces into an inference engine (it pauses around the
    load itself unless the caller paused it)."""
    async with staged_weights(engine, bus, bucket, msg) as staged:
        await engine.update_weights(staged, msg.version)
