"""The bus's JetStream part: streams, ``js_publish`` and the :class:`JsConsumer`.

JetStream subjects are stored on disk and acked after the handler returns
(at-least-once), deduplicated by message id. A payload that does not decode is
terminated, never redelivered, and counted like any other swallowed input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Literal, TypeVar

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import api

from asyncrl.runtime.connection import BusTimeout, Connection, log
from asyncrl.runtime.loop import raise_if_cancelled
from asyncrl.wire.codec import DecodeError, decode, encode
from asyncrl.wire.messages import Message

M = TypeVar("M", bound=Message)

_STREAM_IN_USE = 10058  # JetStream: "stream name already in use with a different configuration"
_NO_PEERS = 10005  # JetStream: "no suitable peers for placement"
_STORAGE_SHORT = 10047  # JetStream: "insufficient storage resources available"
PLACEMENT_WAIT_S = 30.0
"""Seconds a stream or bucket creation waits for a cluster's servers to be placeable."""

R = TypeVar("R")


class StreamStorageError(RuntimeError):
    """A stream's byte bound exceeds what its server can still reserve on disk."""


async def until_placed(create: Callable[[], Awaitable[R]]) -> R:
    """``create()`` (a stream or bucket creation), asked again while a cluster cannot place
    its replicas yet: the servers have elected a meta leader but not every peer has joined
    (just started, or one restarting), which JetStream answers with "no suitable peers" or
    503. Other errors, and these past :data:`PLACEMENT_WAIT_S`, are raised."""
    deadline = time.monotonic() + PLACEMENT_WAIT_S
    delay = 0.1
    while True:
        try:
            return await create()
        except (nats.js.errors.BadRequestError, nats.js.errors.ServiceUnavailableError) as exc:
            placing = isinstance(exc, nats.js.errors.ServiceUnavailableError) or (
                exc.err_code == _NO_PEERS
            )
            if not placing or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


UNAVAILABLE_GRACE_S = 30.0
"""How long a pull consumer asks again while its requests find no responder (503): on a
cluster, the consumer has no leader until the servers elect another after a loss. A
consumer still without one after this long (its stream deleted, say) fails."""


class JetStreamMixin(Connection):
    """Streams, stored publishes and durable pull consumers; part of :class:`~asyncrl.runtime.bus.Bus`."""

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

        The stream keeps ``info.replicas`` copies (one per server of a cluster).
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
            num_replicas=self.info.replicas,
        )
        try:
            try:
                await until_placed(lambda: self.js.add_stream(config))
            except nats.js.errors.BadRequestError as exc:
                if exc.err_code != _STREAM_IN_USE:
                    raise
                await self.js.update_stream(config)
        except nats.js.errors.APIError as exc:
            if exc.err_code != _STORAGE_SHORT:
                raise
            bound = "no bound" if max_bytes < 0 else f"up to {max_bytes / 2**30:.2f} GiB"
            raise StreamStorageError(
                f"JetStream cannot reserve the disk for stream {name!r} ({bound}): its "
                "server has too little file storage left. nats-server sizes its store from "
                "the disk space free under its store directory (a run's nats/ folder) when "
                "it starts: free space on that disk and start the run again"
            ) from exc

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
            subject=subject,
            ack_wait=ack_wait,
            batch=batch,
            concurrency=concurrency,
            nak_delay=nak_delay,
        )


class _Stopped(Exception):
    """Raised inside :meth:`JsConsumer.run` to end its task group on ``stop()``."""


class JsConsumer(Generic[M]):
    """A running share of a durable JetStream pull consumer. Made by ``Bus.js_consume``.

    ``run()`` loops until cancelled or until ``stop()``: it keeps one pull request open
    for as many messages as it has room for (``batch``: fetched but not yet acked),
    hands them to up to ``concurrency`` handler calls at once, and acks each one after
    its handler returns. A handler exception naks the message (redelivered after
    ``nak_delay`` seconds) and is counted in ``errors``; a payload that does not decode is
    terminated (never redelivered) and counted as a drop under ``subject``. While a message is held, the consumer tells the
    server every ``ack_wait / 3`` seconds that it is still in progress, so a slow handler
    keeps its message and only a dead consumer's messages go to others. On cancellation
    or ``stop()`` the messages it holds are nak'ed, once its pull request is withdrawn, so
    that they go to others at once.
    """

    def __init__(
        self,
        bus: Connection,
        stream: str,
        durable: str,
        msg_type: type[M],
        handler: Callable[[M], Awaitable[None]],
        *,
        subject: str,
        ack_wait: float,
        batch: int,
        concurrency: int,
        nak_delay: float,
        pull_expires: float = 5.0,
    ) -> None:
        self.bus = bus
        self.stream = stream
        self.durable = durable
        self.subject = subject  # the consumer's filter: what its drops are counted under
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
        unavailable_since: float | None = None
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
                    if status != "503":
                        unavailable_since = None
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
                    elif status == "503":  # no responder: no consumer leader (yet)
                        now = time.monotonic()
                        if unavailable_since is None:
                            unavailable_since = now
                            log.info(
                                "consumer unavailable", stream=self.stream, durable=self.durable
                            )
                        if now - unavailable_since > UNAVAILABLE_GRACE_S:
                            raise RuntimeError(
                                f"pull from {self.stream}/{self.durable}: no consumer leader "
                                f"for {UNAVAILABLE_GRACE_S:.0f} s: {msg.headers}"
                            )
                        await asyncio.sleep(0.25)
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
            # cancelled in the handler, the message stays held: run() hands it back
            await self._handle(msg)
            self._held.pop(id(msg), None)
            self._room.release()
            # the handler may have swallowed its cancellation: end as asked, or the task
            # group that cancelled this worker waits for it forever
            raise_if_cancelled()

    async def _handle(self, raw: Msg) -> None:
        try:
            msg = decode(raw.data, self.msg_type)
        except DecodeError as exc:
            self.bus._count_decode(exc, raw.subject, self.subject)
            await raw.term()
            return
        try:
            await self.handler(msg)
        except Exception as exc:
            # not a drop: the message is redelivered, to this consumer or another
            self.bus._count_handler(self.msg_type, raw.subject, exc, None)
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
        """Naks every message fetched and not acked (queued, or its handler cancelled), so
        it is redelivered at once. Only once the pull request's inbox is gone (``run()``'s
        tasks have all ended): the server redelivers a nak'ed message to a waiting pull
        request, and one whose inbox still listens would take it back into this consumer,
        which drops it, for the whole ``ack_wait``."""
        held = list(self._held.values())
        self._held.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        for msg in held:
            with contextlib.suppress(nats.errors.Error):
                await msg.nak()
