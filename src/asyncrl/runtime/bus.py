"""The typed bus: a thin async layer over nats-py that speaks :mod:`asyncrl.wire.messages`
(encoded by :mod:`asyncrl.wire.codec`).

:class:`Bus` is the one class callers use. Its jobs live in one module each:

- here, plain subjects: ``publish`` / ``subscribe`` (queue groups too) and ``request`` /
  ``serve`` move one :class:`~asyncrl.wire.messages.Message` per NATS message, at most once;
- :mod:`asyncrl.runtime.connection`: connecting, the reconnection policy, closing, the
  error counters and the bus's exceptions;
- :mod:`asyncrl.runtime.jetstream`: ``js_publish`` / ``js_consume`` through JetStream,
  stored on disk, acked after the handler returns (at-least-once), deduplicated by id;
- :mod:`asyncrl.runtime.blobs`: ``put_blob`` / ``get_blob`` stream large blobs (weights)
  through the object store.

Fault tolerance is the point of the receive paths, so they never die of one bad message:
a payload that does not decode, or a handler that raises, is counted in ``Bus.drops`` (by
subscription and reason) and ``Bus.errors`` (by kind), logged, and the subscription goes
on.
The send paths raise: a message over the server's ``max_payload`` is refused with
:class:`PayloadTooLarge` before anything is sent, never dropped on the floor.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from asyncrl.runtime.blobs import BlobMixin
from asyncrl.runtime.connection import BusTimeout, PayloadTooLarge, RemoteError
from asyncrl.runtime.jetstream import JetStreamMixin, JsConsumer
from asyncrl.wire.codec import DecodeError, decode, encode
from asyncrl.wire.messages import Ack, Message

__all__ = ["Bus", "BusTimeout", "Encoded", "JsConsumer", "PayloadTooLarge", "RemoteError"]

M = TypeVar("M", bound=Message)
R = TypeVar("R", bound=Message)

# A plain subscription buffers at most this much for a handler that falls behind; past
# it NATS drops messages and counts a slow consumer. Plain subjects carry control-plane
# traffic (heartbeats, leases, metrics) that a healthy handler clears in milliseconds, so
# a backlog this deep means the handler is stuck, and durable data goes by JetStream.
SUB_PENDING_MSGS = 65_536
SUB_PENDING_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Encoded:
    """A reply a ``serve`` handler has encoded already (with :func:`encode`, to measure
    it, say): sent as it is, not encoded a second time."""

    data: bytes


class Bus(JetStreamMixin, BlobMixin):
    """One NATS connection of one process, typed. Build it with :meth:`connect`.

    ``nc`` is the raw nats-py client for special needs; ``errors`` counts what the
    receive paths swallowed.
    """

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
                self._count_decode(exc, raw.subject, subject)
                return
            try:
                await handler(msg)
            except Exception as exc:
                self._count_handler(msg_type, raw.subject, exc, subject)

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
        ``reply_type`` admits an Ack), :class:`~asyncrl.wire.codec.DecodeError` for any other
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
        handler: Callable[[M], Awaitable[Message | Encoded]],
        *,
        queue: str = "",
        concurrent: bool = False,
    ) -> Subscription:
        """Answers each request on ``subject`` with what ``handler`` returns.

        Requests are handled one at a time, in arrival order; with ``concurrent``, each in
        a task of its own, started in arrival order, so a handler may wait (a long poll)
        without holding the requests behind it. A request that does not decode, a handler
        exception and a reply over ``max_payload`` are counted and answered with
        ``Ack(ok=False, error=...)``, so the requester fails fast with
        :class:`RemoteError` instead of waiting for its timeout.
        """

        async def on_request(raw: Msg) -> None:
            if not raw.reply:
                self.drop(subject, "no_reply")
                self.count("serve:no_reply", subject=raw.subject)
                return
            try:
                req = decode(raw.data, request_type)
            except DecodeError as exc:
                self._count_decode(exc, raw.subject, subject)
                data = encode(Ack(ok=False, error=f"bad request: {exc}"))
            else:
                try:
                    reply = await handler(req)
                    data = reply.data if isinstance(reply, Encoded) else encode(reply)
                except Exception as exc:  # encode too: a handler that returns no Message
                    self._count_handler(request_type, raw.subject, exc, subject)
                    data = encode(Ack(ok=False, error=f"{type(exc).__name__}: {exc}"))
            if len(data) > self.nc.max_payload:
                too_large = PayloadTooLarge(raw.subject + " (reply)", len(data), self.max_payload)
                self.drop(subject, "reply_too_large")
                self.count("serve:too_large", subject=raw.subject, error=str(too_large))
                data = encode(Ack(ok=False, error=str(too_large)))
            await self.nc.publish(raw.reply, data)

        if not concurrent:
            return await self._subscribe_raw(subject, queue, on_request)

        async def start(raw: Msg) -> None:
            task = asyncio.create_task(on_request(raw), name=f"answer {subject}")
            self._answering.add(task)
            task.add_done_callback(self._answering.discard)

        return await self._subscribe_raw(subject, queue, start)

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
