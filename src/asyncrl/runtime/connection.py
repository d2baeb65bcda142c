"""The bus's connection: connecting, reconnecting, closing, and counting what was swallowed.

This is the one home of the reconnection policy. The first connect fails fast (a wrong
URL or token is an error at once); a connection lost later is retried, every
``RECONNECT_WAIT_S`` seconds, and the disconnected / reconnected callbacks log it.
Subscriptions and JetStream consumers survive a reconnect: nats-py re-subscribes, and a
pull request lost in the gap is asked again by :class:`~asyncrl.runtime.jetstream.JsConsumer`.

The errors of the bus live here too, so that every part raises the same ones.
"""

from __future__ import annotations

import asyncio
import collections
from types import TracebackType
from typing import Any, Self

import nats.errors
import structlog
from nats.aio.client import Client
from nats.js.object_store import ObjectStore

from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.codec import DecodeError
from asyncrl.wire.messages import Message

log = structlog.get_logger("asyncrl.bus")

RECONNECT_WAIT_S = 2  # nats-py's default pause between reconnect attempts
DRAIN_TIMEOUT_S = 10
"""Seconds a closing connection lets its handlers in flight finish before it closes anyway
(nats-py waits 30 s, as long as the supervisor's whole grace before SIGKILL)."""


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


def worth_logging(count: int) -> bool:
    """Log the 1st, 2nd, 4th, 8th... occurrence: a flood of bad input cannot flood the log."""
    return count & (count - 1) == 0


class Connection:
    """One process's NATS connection and the bookkeeping every part of the bus shares.

    ``nc`` is the raw nats-py client for special needs. Two counters tell what the
    receive paths swallowed:

    - ``drops``: each received message that was not handled, by subscription and reason,
      keyed ``<subject>/<reason>``. The subject is the one subscribed to, wildcards and
      all, never the concrete subject a sender chose, so a flood of made-up subjects
      cannot grow the keys: there are at most (subscriptions x reasons) of them. The
      reasons: ``garbage``, ``schema_version``, ``kind``, ``invalid`` (the
      :class:`~asyncrl.wire.codec.DecodeError` reasons), ``handler`` (the handler raised),
      ``no_reply`` (a request without a reply subject), ``reply_too_large`` (the answer
      exceeded ``max_payload``; the requester got an error instead) and ``slow_consumer``
      (NATS dropped it because the handler fell behind). Actors report them.
    - ``errors``: every swallowed failure by kind (``decode:<reason>``,
      ``handler:<MessageType>``, ``nats:<Error>``...), the requester's side included.

    :class:`~asyncrl.runtime.bus.Bus` is the class to use; this base exists so that the
    JetStream and object-store parts can be typed against it.
    """

    def __init__(self, nc: Client, info: NatsInfo) -> None:
        self.nc = nc
        self.info = info
        self.errors: collections.Counter[str] = collections.Counter()
        self.drops: collections.Counter[str] = collections.Counter()
        self.js = nc.jetstream()
        self._stores: dict[str, ObjectStore] = {}
        # requests of concurrent ``serve`` subscriptions being answered (see Bus.serve)
        self._answering: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(
        cls,
        info: NatsInfo | str,
        *,
        name: str = "asyncrl",
        connect_timeout: float = 5.0,
        max_reconnect_attempts: int = 60,
    ) -> Self:
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
            drain_timeout=DRAIN_TIMEOUT_S,
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
                if self._answering:  # their replies are publishes the drain must flush
                    await asyncio.wait(self._answering, timeout=DRAIN_TIMEOUT_S)
                await self.nc.drain()
                return
            except nats.errors.Error as exc:
                log.warning("drain failed, closing", error=repr(exc))
        try:
            await self.nc.close()
        except RuntimeError as exc:
            # The server went away (killed) while publishes waited for a reconnection:
            # nats-py marks the client closed, then flushes them into the dead socket,
            # which uvloop refuses. They had no one left to reach.
            log.warning("closed with publishes unsent: the server is gone", error=repr(exc))

    async def __aenter__(self) -> Self:
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
        if worth_logging(n):
            log.warning("bus error", key=key, count=n, **context)

    def drop(self, pattern: str, reason: str) -> None:
        """Counts one received message of the subscription to ``pattern`` that was not
        handled (logged by whoever calls this, under its ``errors`` key)."""
        self.drops[f"{pattern}/{reason}"] += 1

    def _count_decode(self, exc: DecodeError, subject: str, pattern: str | None = None) -> None:
        """A payload that did not decode; ``pattern`` is the subscription it came in by
        (None for a reply to our own request, which is raised, not dropped)."""
        if pattern is not None:
            self.drop(pattern, exc.reason)
        self.count(f"decode:{exc.reason}", subject=subject, detail=exc.detail[:500])

    def _count_handler(
        self, msg_type: type[Message], subject: str, exc: Exception, pattern: str | None
    ) -> None:
        """A handler that raised; ``pattern`` is the subscription that lost the message
        (None where it is not lost: a JetStream message is redelivered)."""
        if pattern is not None:
            self.drop(pattern, "handler")
        key = f"handler:{msg_type.__name__}"
        self.errors[key] += 1
        if worth_logging(self.errors[key]):
            log.error(
                "handler failed", key=key, count=self.errors[key], subject=subject, exc_info=exc
            )

    def _check_size(self, subject: str, size: int) -> None:
        if size > self.nc.max_payload:
            raise PayloadTooLarge(subject, size, self.nc.max_payload)

    async def _on_client_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.drop(exc.sub.subject, "slow_consumer")
        self.count(f"nats:{type(exc).__name__}", error=str(exc))

    async def _on_disconnected(self) -> None:
        if not self.nc.is_closed:
            log.warning("disconnected from NATS", url=self.info.redacted_url)

    async def _on_reconnected(self) -> None:
        # which server of a cluster took over
        server = self.nc.connected_url.netloc.rpartition("@")[2] if self.nc.connected_url else ""
        log.info("reconnected to NATS", url=self.info.redacted_url, server=server)
