"""The typed bus: a thin async layer over nats-py that speaks :mod:`asyncrl.messages`.

- ``publish`` / ``subscribe`` (queue groups too) and ``request`` / ``serve`` move one
  :class:`~asyncrl.messages.Message` per NATS message. Plain subjects are at-most-once.
- ``js_publish`` / ``js_consume`` go through JetStream: stored on disk, acked after the
  handler returns (at-least-once), deduplicated by message id.
- ``put_blob`` / ``get_blob`` stream large blobs (weights) through the object store.

Fault tolerance is the point of the receive paths, so they never die of one bad message:
a payload that does not decode, or a handler that raises, is counted in ``Bus.errors``
(``decode:<reason>``, ``handler:<MessageType>``), logged, and the subscription goes on.
The send paths raise: a message over the server's ``max_payload`` is refused with
:class:`PayloadTooLarge` before anything is sent, never dropped on the floor.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import hashlib
import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO, Generic, Literal, TypeVar

import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import api
from nats.js.object_store import ObjectStore

from asyncrl.messages import Ack, DecodeError, Message, decode, encode
from asyncrl.runtime.nats_server import NatsInfo

log = structlog.get_logger("asyncrl.bus")

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)

# A plain subscription buffers at most this much for a handler that falls behind; past
# it NATS drops messages and counts a slow consumer. Plain subjects carry control-plane
# traffic (heartbeats, leases, metrics) that a healthy handler clears in milliseconds, so
# a backlog this deep means the handler is stuck, and durable data goes by JetStream.
SUB_PENDING_MSGS = 65_536
SUB_PENDING_BYTES = 64 * 1024 * 1024

# Object-store reads pull this much per request: the bound on what waits in memory.
BLOB_WINDOW_BYTES = 32 * 1024 * 1024
BLOB_PULL_TIMEOUT_S = 30.0

# Object-store chunk: big enough that the per-chunk round trip is negligible next to the
# transfer, small enough to stay well below any max_payload the server is given.
BLOB_CHUNK_BYTES = 1024 * 1024

RECONNECT_WAIT_S = 2  # nats-py's default pause between reconnect attempts

_STREAM_IN_USE = 10058  # JetStream: "stream name already in use with a different configuration"


class PayloadTooLarge(ValueError):
    """A message larger than the server's ``max_payload``; it was not sent."""

    def __init__(self, subject: str, size: int, max_payload: int) -> None:
        super().__init__(
            f"message of {size} bytes for {subject!r} exceeds the server's max_payload of "
            f"{max_payload} bytes; send large data through the object store (Bus.put_blob)"
        )
        self.subject = subject
        self.size = size
        self.max_payload = max_payload


class BusTimeout(TimeoutError):
    """No reply in time, or nobody listening on the subject."""


class RemoteError(RuntimeError):
    """The responder got the request but failed: it answered ``Ack(ok=False, error=...)``."""


def _worth_logging(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence: a flood of bad input cannot flood the log."""
    return count & (count - 1) == 0


class Bus:
    """One NATS connection of one process, typed. Build it with :meth:`connect`.

    ``nc`` is the raw nats-py client for special needs; ``errors`` counts what the
    receive paths swallowed.
    """

    def __init__(self, nc: Client, info: NatsInfo) -> None:
        self.nc = nc
        self.info = info
        self.errors: collections.Counter[str] = collections.Counter()
        self.js = nc.jetstream()
        self._stores: dict[str, ObjectStore] = {}

    @classmethod
    async def connect(
        cls,
        info: NatsInfo | str,
        *,
        name: str = "asyncrl",
        connect_timeout: float = 5.0,
        max_reconnect_attempts: int = 60,
    ) -> Bus:
        """Connects to ``info`` (or a URL, credentials in it). A wrong URL or token fails
        at once; a connection lost later is retried ``max_reconnect_attempts`` times."""
        if isinstance(info, str):
            info = NatsInfo.from_url(info)
        bus = cls(Client(), info)
        # The first connection fails fast: with its reconnect options nats-py would retry
        # a refused token or a dead port for minutes (60 attempts, 2 s apart) first.
        await bus.nc.connect(
            **info.connect_kwargs(),
            name=name,
            allow_reconnect=False,
            max_reconnect_attempts=1,
            reconnect_time_wait=0,
            connect_timeout=max(1, round(connect_timeout)),
            error_cb=bus._on_client_error,
            disconnected_cb=bus._on_disconnected,
            reconnected_cb=bus._on_reconnected,
        )
        # nats-py reads these when the connection drops, so later losses are retried.
        bus.nc.options["allow_reconnect"] = True
        bus.nc.options["max_reconnect_attempts"] = max_reconnect_attempts
        bus.nc.options["reconnect_time_wait"] = RECONNECT_WAIT_S
        return bus

    @property
    def max_payload(self) -> int:
        """The largest message the server accepts, headers included (bytes)."""
        return self.nc.max_payload

    async def close(self) -> None:
        """Drains: subscriptions finish what they hold, pending publishes flush, then the
        connection closes. Idempotent."""
        if self.nc.is_closed:
            return
        if self.nc.is_connected:
            try:
                await self.nc.drain()
                return
            except nats.errors.Error as exc:
                log.warning("drain failed, closing", error=repr(exc))
        await self.nc.close()

    async def __aenter__(self) -> Bus:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- bookkeeping -------------------------------------------------------------------------

    def count(self, key: str, **context: Any) -> None:
        """Counts one swallowed failure and logs it (rate-limited per key)."""
        self.errors[key] += 1
        n = self.errors[key]
        if _worth_logging(n):
            log.warning("bus error", key=key, count=n, **context)

    def _count_decode(self, exc: DecodeError, subject: str) -> None:
        self.count(f"decode:{exc.reason}", subject=subject, detail=exc.detail[:500])

    def _count_handler(self, msg_type: type[Message], subject: str, exc: Exception) -> None:
        key = f"handler:{msg_type.__name__}"
        self.errors[key] += 1
        if _worth_logging(self.errors[key]):
            log.error(
                "handler failed", key=key, count=self.errors[key], subject=subject, exc_info=exc
            )

    def _check_size(self, subject: str, size: int) -> None:
        if size > self.nc.max_payload:
            raise PayloadTooLarge(subject, size, self.nc.max_payload)

    async def _on_client_error(self, exc: Exception) -> None:
        self.count(f"nats:{type(exc).__name__}", error=str(exc))

    async def _on_disconnected(self) -> None:
        if not self.nc.is_closed:
            log.warning("disconnected from NATS", url=self.info.redacted_url)

    async def _on_reconnected(self) -> None:
        log.info("reconnected to NATS", url=self.info.redacted_url)

    # -- plain subjects ----------------------------------------------------------------------

    async def publish(self, subject: str, msg: Message) -> None:
        """Sends ``msg``; raises :class:`PayloadTooLarge` before sending if it is too big."""
        data = encode(msg)
        self._check_size(subject, len(data))
        await self.nc.publish(subject, data)

    async def subscribe(
        self,
        subject: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Calls ``handler`` with each message of ``msg_type`` on ``subject`` (wildcards ok).

        Handlers of one subscription run one at a time, in arrival order, so they need no
        lock. With ``queue``, each message goes to one member of the group. A payload that
        does not decode, and a handler exception, are counted and logged; the subscription
        lives on. The interest exists on the server when this returns.
        """

        async def on_msg(raw: Msg) -> None:
            try:
                msg = decode(raw.data, msg_type)
            except DecodeError as exc:
                self._count_decode(exc, raw.subject)
                return
            try:
                await handler(msg)
            except Exception as exc:
                self._count_handler(msg_type, raw.subject, exc)

        return await self._subscribe_raw(subject, queue, on_msg)

    async def request(
        self,
        subject: str,
        msg: Message,
        reply_type: type[R],
        *,
        timeout: float,  # noqa: ASYNC109 - a per-request deadline is part of the contract
    ) -> R:
        """Sends ``msg`` and returns the reply as a ``reply_type``.

        Raises :class:`BusTimeout` if nobody answers in ``timeout`` seconds or nobody
        listens, :class:`RemoteError` if the responder answered ``Ack(ok=False)`` (unless
        ``reply_type`` admits an Ack), :class:`~asyncrl.messages.DecodeError` for any other
        wrong reply (counted too).
        """
        data = encode(msg)
        self._check_size(subject, len(data))
        try:
            # The deadline is ours, not nats-py's: it waits with asyncio.wait_for, which on
            # Python 3.11 swallows a cancellation that arrives as the reply does, and an
            # actor told to stop then went on forever. With no timeout it awaits plainly.
            async with asyncio.timeout(timeout):
                raw = await self.nc.request(subject, data, timeout=None)  # type: ignore[arg-type]
        except nats.errors.NoRespondersError:
            raise BusTimeout(f"no responders on {subject!r}") from None
        except TimeoutError:
            raise BusTimeout(f"no reply on {subject!r} within {timeout} s") from None
        try:
            return decode(raw.data, reply_type)
        except DecodeError as exc:
            if exc.reason == "kind":
                with contextlib.suppress(DecodeError):
                    ack = decode(raw.data, Ack)
                    if not ack.ok:
                        raise RemoteError(f"{subject}: {ack.error}") from None
            self._count_decode(exc, subject)
            raise

    async def serve(
        self,
        subject: str,
        request_type: type[M],
        handler: Callable[[M], Awaitable[Message]],
        *,
        queue: str = "",
    ) -> Subscription:
        """Answers each request on ``subject`` with what ``handler`` returns.

        Requests are handled one at a time, in arrival order. A request that does not
        decode, a handler exception and a reply over ``max_payload`` are counted and
        answered with ``Ack(ok=False, error=...)``, so the requester fails fast with
        :class:`RemoteError` instead of waiting for its timeout.
        """

        async def on_request(raw: Msg) -> None:
            if not raw.reply:
                self.count("serve:no_reply", subject=raw.subject)
                return
            try:
                req = decode(raw.data, request_type)
            except DecodeError as exc:
                self._count_decode(exc, raw.subject)
                data = encode(Ack(ok=False, error=f"bad request: {exc}"))
            else:
                try:
                    data = encode(await handler(req))
                except Exception as exc:  # encode too: a handler that returns no Message
                    self._count_handler(request_type, raw.subject, exc)
                    data = encode(Ack(ok=False, error=f"{type(exc).__name__}: {exc}"))
            if len(data) > self.nc.max_payload:
                too_large = PayloadTooLarge(raw.subject + " (reply)", len(data), self.max_payload)
                self.count("serve:too_large", subject=raw.subject, error=str(too_large))
                data = encode(Ack(ok=False, error=str(too_large)))
            await self.nc.publish(raw.reply, data)

        return await self._subscribe_raw(subject, queue, on_request)

    async def _subscribe_raw(
        self, subject: str, queue: str, cb: Callable[[Msg], Awaitable[None]]
    ) -> Subscription:
        sub = await self.nc.subscribe(
            subject,
            queue=queue,
            cb=cb,
            pending_msgs_limit=SUB_PENDING_MSGS,
            pending_bytes_limit=SUB_PENDING_BYTES,
        )
        # The SUB is only queued by nats-py; the flush round trip makes it real, which is
        # what lets an actor announce "started" right after subscribing.
        await self.nc.flush()
        return sub

    # -- JetStream ---------------------------------------------------------------------------

    async def ensure_stream(
        self,
        name: str,
        subjects: list[str],
        *,
        max_bytes: int = -1,
        retention: Literal["limits", "workqueue", "interest"] = "limits",
        duplicate_window: float = 120.0,
    ) -> None:
        """Creates the file-backed stream, or updates it to this config. Idempotent, also
        when several processes race to create it.

        ``duplicate_window`` (seconds) is how long a ``msg_id`` is remembered for dedup.
        With ``limits`` a full stream discards its oldest messages; with ``workqueue``
        (acked messages leave the stream) a full stream refuses new ones, which reaches
        the publisher as an error instead of losing unconsumed data.
        """
        config = api.StreamConfig(
            name=name,
            subjects=subjects,
            storage=api.StorageType.FILE,
            retention=api.RetentionPolicy(retention),
            max_bytes=max_bytes,
            discard=api.DiscardPolicy.NEW if retention == "workqueue" else api.DiscardPolicy.OLD,
            duplicate_window=duplicate_window,
        )
        try:
            await self.js.add_stream(config)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_IN_USE:
                raise
            await self.js.update_stream(config)

    async def delete_stream(self, name: str) -> bool:
        """Deletes a stream with its messages and consumers; False if there was none."""
        try:
            await self.js.delete_stream(name)
        except nats.js.errors.NotFoundError:
            return False
        return True

    async def js_publish(
        self,
        subject: str,
        msg: Message,
        *,
        msg_id: str,
        timeout: float = 5.0,  # noqa: ASYNC109 - how long to wait for the stream's ack
    ) -> int:
        """Stores ``msg`` in the stream that owns ``subject``; returns its sequence number.

        Publishing the same ``msg_id`` again within the stream's duplicate window stores
        nothing and returns the first copy's sequence, so retrying is always safe.
        """
        data = encode(msg)
        headers = {"Nats-Msg-Id": msg_id}
        # The server's limit covers the header block too: "NATS/1.0\r\n", lines, "\r\n".
        header_size = 10 + len(f"Nats-Msg-Id: {msg_id}\r\n".encode()) + 2
        self._check_size(subject, len(data) + header_size)
        try:
            ack = await self.js.publish(subject, data, timeout=timeout, headers=headers)
        except nats.errors.TimeoutError:
            raise BusTimeout(f"JetStream did not ack {subject!r} within {timeout} s") from None
        return int(ack.seq)

    async def js_consume(
        self,
        stream: str,
        subject: str,
        durable: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        *,
        ack_wait: float = 30.0,
        batch: int = 16,
        concurrency: int = 1,
        max_deliver: int = -1,
        nak_delay: float = 1.0,
    ) -> JsConsumer[M]:
        """Creates (or updates) the durable pull consumer ``durable`` on ``stream``,
        filtered to ``subject``, and returns a :class:`JsConsumer`; run it with
        ``tg.create_task(consumer.run())``.

        Every process that consumes with the same ``durable`` shares its messages (work
        queue). A message is acked only after ``handler`` returns. One that is not acked
        within ``ack_wait`` seconds (its consumer died) is delivered again, to whoever
        asks; ``max_deliver`` caps deliveries (-1: no cap). Up to ``concurrency`` handler
        calls run at once (each message still acked only after its own handler returns),
        and at most ``batch`` messages are fetched and not yet acked: what this process
        holds back from the others sharing ``durable``. The consumer exists on the
        server when this returns: messages published from then on wait for it.
        """
        if concurrency < 1 or batch < concurrency:
            raise ValueError(f"need 1 <= concurrency <= batch, got {concurrency=} {batch=}")
        config = api.ConsumerConfig(
            name=durable,
            durable_name=durable,
            filter_subject=subject,
            ack_policy=api.AckPolicy.EXPLICIT,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
        )
        await self.js.add_consumer(stream, config)
        return JsConsumer(
            self,
            stream,
            durable,
            msg_type,
            handler,
            ack_wait=ack_wait,
            batch=batch,
            concurrency=concurrency,
            nak_delay=nak_delay,
        )

    # -- object store ------------------------------------------------------------------------

    async def _store(self, bucket: str, *, create: bool) -> ObjectStore | None:
        store = self._stores.get(bucket)
        if store is None:
            try:
                store = await self.js.object_store(bucket)
            except nats.js.errors.BucketNotFoundError:
                if not create:
                    return None
                config = api.ObjectStoreConfig(storage=api.StorageType.FILE)
                store = await self.js.create_object_store(bucket, config=config)
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

    async def delete_blob(self, bucket: str, key: str) -> None:
        """Deletes the blob; a blob or bucket that does not exist is not an error."""
        store = await self._store(bucket, create=False)
        if store is None:
            return
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError):
            await store.delete(key)


class _Stopped(Exception):
    """Raised inside :meth:`JsConsumer.run` to end its task group on ``stop()``."""


class JsConsumer(Generic[M]):
    """A running share of a durable JetStream pull consumer. Made by ``Bus.js_consume``.

    ``run()`` loops until cancelled or until ``stop()``: it keeps one pull request open
    for as many messages as it has room for (``batch``: fetched but not yet acked),
    hands them to up to ``concurrency`` handler calls at once, and acks each one after
    its handler returns. A handler exception naks the message (redelivered after
    ``nak_delay`` seconds) and is counted; a payload that does not decode is terminated
    (never redelivered) and counted. While a message is held, the consumer tells the
    server every ``ack_wait / 3`` seconds that it is still in progress, so a slow handler
    keeps its message and only a dead consumer's messages go to others. On cancellation
    the messages it holds are nak'ed so that they go to others at once.
    """

    def __init__(
        self,
        bus: Bus,
        stream: str,
        durable: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        *,
        ack_wait: float,
        batch: int,
        concurrency: int,
        nak_delay: float,
        pull_expires: float = 5.0,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.msg_type = msg_type
        self.handler = handler
        self.ack_wait = ack_wait
        self.batch = batch
        self.concurrency = concurrency
        self.nak_delay = nak_delay
        self.pull_expires = pull_expires
        self.acked = 0
        self.pull_requests = 0
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}"
        # Bounded by the room semaphore: at most `batch` messages are fetched and unacked.
        self._room = asyncio.Semaphore(batch)
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        # Keyed by id(): nats-py's Msg is an unhashable dataclass.
        self._held: dict[int, Msg] = {}
        self._stop = asyncio.Event()
        self._done = asyncio.Event()
        self._started = False

    async def run(self) -> None:
        """Consumes until cancelled or stopped. Single use. Errors of the connection or of
        the consumer itself (deleted, stream gone) propagate."""
        if self._started:
            raise RuntimeError("JsConsumer.run() is single use")
        self._started = True
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._pull())
                for _ in range(self.concurrency):
                    tg.create_task(self._work())
                tg.create_task(self._keep_alive())
                tg.create_task(self._raise_on_stop())
        except* _Stopped:
            pass
        finally:
            await self._hand_back()
            self._done.set()

    async def stop(self) -> None:
        """Ends ``run()`` (handlers in flight are cancelled, their messages nak'ed) and
        waits for it. Does nothing if ``run()`` never started."""
        self._stop.set()
        if self._started:
            await self._done.wait()

    async def _raise_on_stop(self) -> None:
        await self._stop.wait()
        raise _Stopped

    async def _take_room(self) -> int:
        """Waits for room for one message, then takes all the room there is (<= batch)."""
        await self._room.acquire()
        n = 1
        while n < self.batch and not self._room.locked():
            await self._room.acquire()
            n += 1
        return n

    async def _pull(self) -> None:
        """One pull request at a time, for as many messages as there is room for.

        nats-py's ``fetch(n)`` waits until it has all n or the request expires, so a lone
        message would wait out the expiry; reading the request's inbox directly hands
        each message on as it arrives.
        """
        nc = self.bus.nc
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
        messages = sub.messages
        try:
            while True:
                want = await self._take_room()
                request = {"batch": want, "expires": int(self.pull_expires * 1e9)}
                await nc.publish(self._next_subject, json.dumps(request).encode(), reply=inbox)
                self.pull_requests += 1
                got = 0
                while got < want:
                    try:
                        # A request lost in a reconnect never answers; then ask again.
                        async with asyncio.timeout(self.pull_expires + 2.0):
                            msg = await anext(messages)
                    except TimeoutError:
                        break
                    except StopAsyncIteration:
                        raise nats.errors.ConnectionClosedError from None
                    status = msg.headers.get("Status") if msg.headers else None
                    if status is None:
                        got += 1
                        self._held[id(msg)] = msg
                        self._queue.put_nowait(msg)
                    elif status in ("404", "408"):  # no messages / request expired
                        break
                    elif status == "409" and "Consumer Deleted" not in str(msg.headers):
                        # e.g. too many waiting pulls or a leader change: ask again soon,
                        # not at once, or a lasting condition would spin this loop.
                        log.info("pull request ended", stream=self.stream, headers=msg.headers)
                        await asyncio.sleep(0.1)
                        break
                    elif status != "100":  # 100 is an idle heartbeat
                        raise RuntimeError(
                            f"pull from {self.stream}/{self.durable} failed: {msg.headers}"
                        )
                for _ in range(want - got):
                    self._room.release()
        finally:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()

    async def _work(self) -> None:
        while True:
            msg = await self._queue.get()
            try:
                await self._handle(msg)
            finally:
                self._held.pop(id(msg), None)
                self._room.release()

    async def _handle(self, raw: Msg) -> None:
        try:
            msg = decode(raw.data, self.msg_type)
        except DecodeError as exc:
            self.bus._count_decode(exc, raw.subject)
            await raw.term()
            return
        try:
            await self.handler(msg)
        except asyncio.CancelledError:
            with contextlib.suppress(nats.errors.Error):
                await raw.nak()
            raise
        except Exception as exc:
            self.bus._count_handler(self.msg_type, raw.subject, exc)
            await raw.nak(delay=self.nak_delay)
            return
        await raw.ack()
        self.acked += 1

    async def _keep_alive(self) -> None:
        while True:
            await asyncio.sleep(self.ack_wait / 3)
            for msg in list(self._held.values()):
                await msg.in_progress()

    async def _hand_back(self) -> None:
        """Naks what was fetched but never handled, so it is redelivered at once."""
        while not self._queue.empty():
            msg = self._queue.get_nowait()
            self._held.pop(id(msg), None)
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
