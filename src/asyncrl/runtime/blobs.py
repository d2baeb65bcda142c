"""The bus's object-store part: large blobs (weights, big batches) in chunks.

``put_blob`` reads a file or stream chunk by chunk, ``get_blob`` pulls the chunks a
window at a time and checks the size and the SHA-256 digest, so neither side holds a
whole blob in memory and a reader never sees half a blob.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import nats.errors
import nats.js.errors
from nats.js import api
from nats.js.object_store import ObjectStore

from asyncrl.runtime.connection import Connection
from asyncrl.runtime.jetstream import until_placed

# Object-store reads pull this much per request: the bound on what waits in memory.
BLOB_WINDOW_BYTES = 32 * 1024 * 1024
BLOB_PULL_TIMEOUT_S = 30.0

# Object-store chunk: big enough that the per-chunk round trip is negligible next to the
# transfer, small enough to stay well below any max_payload the server is given.
BLOB_CHUNK_BYTES = 1024 * 1024


class BlobMixin(Connection):
    """Object-store buckets of blobs; part of :class:`~asyncrl.runtime.bus.Bus`."""

    async def _store(self, bucket: str, *, create: bool) -> ObjectStore | None:
        store = self._stores.get(bucket)
        if store is None:
            try:
                store = await self.js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    return None
                config = api.ObjectStoreConfig(
                    storage=api.StorageType.FILE, replicas=self.info.replicas
                )
                store = await until_placed(
                    lambda: self.js.create_object_store(bucket, config=config)
                )
            self._stores[bucket] = store
        return store

    async def put_blob(
        self, bucket: str, key: str, source: Path | bytes | bytearray | BinaryIO
    ) -> int:
        """Stores ``source`` under ``key`` (replacing any older blob); returns its size.

        Files and streams are read chunk by chunk, never whole into memory. The bucket is
        created on first use.
        """
        store = await self._store(bucket, create=True)
        assert store is not None
        chunk = min(BLOB_CHUNK_BYTES, self.max_payload // 2)
        meta = api.ObjectMeta(name=key, options=api.ObjectMetaOptions(max_chunk_size=chunk))
        if isinstance(source, Path | str):
            f = await asyncio.to_thread(open, source, "rb")
            with f:
                info = await store.put(key, f, meta=meta)
        elif isinstance(source, bytes | bytearray | memoryview):
            info = await store.put(key, bytes(source), meta=meta)
        else:
            info = await store.put(key, source, meta=meta)  # type: ignore[arg-type]
        return int(info.size or 0)

    async def get_blob(self, bucket: str, key: str, dest: Path | BinaryIO) -> int:
        """Streams the blob into ``dest``; returns its size. Raises FileNotFoundError.

        A path is written under a temporary name and renamed at the end, so it never
        holds half a blob. The size and the SHA-256 digest are checked.
        """
        store = await self._store(bucket, create=False)
        if store is None:
            raise FileNotFoundError(f"no object-store bucket {bucket!r}")
        try:
            info = await store.get_info(key)
        except nats.js.errors.ObjectNotFoundError:
            raise FileNotFoundError(f"no blob {key!r} in bucket {bucket!r}") from None
        if isinstance(dest, Path | str):
            dest = Path(dest)
            tmp = dest.with_name(f".{dest.name}.part")
            try:
                f = await asyncio.to_thread(open, tmp, "wb")
                with f:
                    await self._read_chunks(bucket, key, info, f.write)
                os.replace(tmp, dest)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()
        else:
            await self._read_chunks(bucket, key, info, dest.write)
        return int(info.size or 0)

    async def _read_chunks(
        self, bucket: str, key: str, info: api.ObjectInfo, write: Callable[[bytes], Any]
    ) -> None:
        """Pulls the chunks window by window through an ephemeral consumer.

        nats-py's own ``get()`` delivers through a flow-controlled push consumer: 1.4 s
        for 64 MB here, and without ``writeinto=`` its buffer grows quadratically (21 s
        for 100 MB). A pull of a whole window at a time moves the same 64 MB in about
        0.15 s, and the window bounds what waits in memory.
        """
        if info.is_link():
            raise ValueError(f"blob {key!r} in {bucket!r} is a link; links are not supported")
        if not info.size:
            return
        stream = f"OBJ_{bucket}"
        chunk = (info.options.max_chunk_size if info.options else None) or 128 * 1024
        window = max(1, BLOB_WINDOW_BYTES // chunk)
        config = api.ConsumerConfig(
            filter_subject=f"$O.{bucket}.C.{info.nuid}",
            ack_policy=api.AckPolicy.NONE,
            deliver_policy=api.DeliverPolicy.ALL,
            mem_storage=True,
            inactive_threshold=60.0,  # the server drops it if this process dies mid-read
        )
        consumer = await self.js.add_consumer(stream, config)
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(
            inbox, pending_msgs_limit=2 * window, pending_bytes_limit=2 * window * chunk
        )
        digest = hashlib.sha256()

        def sink(data: bytes) -> None:
            digest.update(data)
            write(data)

        received, chunks, total = 0, 0, int(info.chunks or 0)
        try:
            messages = sub.messages
            next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer.name}"
            while chunks < total:
                want = min(window, total - chunks)
                # All chunks are stored before the meta names them, so no_wait is right:
                # a missing chunk answers 404 at once instead of after an expiry.
                request = {"batch": want, "no_wait": True}
                await self.nc.publish(next_subject, json.dumps(request).encode(), reply=inbox)
                for _ in range(want):
                    async with asyncio.timeout(BLOB_PULL_TIMEOUT_S):
                        msg = await anext(messages)
                    if msg.headers and msg.headers.get("Status"):
                        raise RuntimeError(
                            f"blob {key!r} in {bucket!r}: chunk {chunks + 1}/{total} "
                            f"missing ({msg.headers.get('Description', msg.headers)})"
                        )
                    # Hashing and writing a chunk take milliseconds: off the event loop.
                    await asyncio.to_thread(sink, msg.data)
                    received += len(msg.data)
                    chunks += 1
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
                await self.js.delete_consumer(stream, consumer.name)
        expected = (info.digest or "").split("=", 1)[-1]
        if received != info.size or base64.urlsafe_b64encode(digest.digest()).decode() != expected:
            raise ValueError(
                f"blob {key!r} in {bucket!r} is corrupt: {received} of {info.size} bytes, "
                "or a SHA-256 mismatch"
            )

    async def delete_bucket(self, bucket: str) -> None:
        """Deletes the bucket with every blob in it; one that does not exist is not an
        error. The next :meth:`put_blob` to it creates it again."""
        self._stores.pop(bucket, None)
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await self.js.delete_object_store(bucket)

    async def delete_blob(self, bucket: str, key: str) -> None:
        """Deletes the blob; a blob or bucket that does not exist is not an error."""
        store = await self._store(bucket, create=False)
        if store is None:
            return
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
            await store.delete(key)
