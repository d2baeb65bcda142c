"""The buffer's durable state: one snapshot in the run's object store, and the parts that
hold its groups.

What the buffer holds and nothing else has (the version, the counters, the leases, the
groups in the making and the admitted ones, the batches already served, the dataset
position) is captured as one :class:`~asyncrl.wire.messages.BufferSnapshot` and put in the run's
buffer bucket (JetStream, file storage in the run folder). The rule that makes it durable:
nothing is acknowledged before the snapshot that holds it is written.

- a batch goes out only after the write (a buffer that forgot it could serve its samples
  again in another batch);
- a scored sample is acked on the stream only after the write, so a sample the buffer
  took but never wrote is delivered again to its replacement (and one written but not
  acked arrives again as a counted duplicate).

A lease and an abort's ``Ack`` do not wait: a restarted buffer that never wrote a lease
leases its prompts again (the samples of the run it forgot are dropped as duplicates),
and a return it never wrote leaves that lease out until the actor's heartbeats free it.

Writes are group commits, at most one per ``min_interval`` seconds:
:meth:`DurableState.touch` marks the state changed and :meth:`DurableState.persisted`
waits for the first write that began after it, so a burst of changes shares one write.
A served batch is urgent (``touch(urgent=True)``): the trainer waits for its write, so
it cuts the pause after the last write short and the write starts at once (or as soon
as the one under way ends).
Admitted groups never change, so each is encoded and written once, into a
:class:`~asyncrl.wire.messages.BufferPart` with the others a write found new
(:class:`EncodedParts`); the snapshot names each ready group and each served batch's
groups by their place in a part. A write puts the new part first, then the snapshot,
then deletes the parts the snapshot no longer names. Before, every write carried every
ready group and both kept batches whole: at a few hundred groups a second, twenty
writes a second of 1.5 MB each for 7 MB/s of new groups, and a snapshot that grows with
the batch (a batch of 512 samples of 4,000 tokens is 27 MB). A buffer killed at any
instant restarts from a snapshot that holds everything it ever acknowledged.

The snapshot is for replacements within one ``asyncrl up``: a new ``up`` starts clean
(:func:`forget`), and ``up --resume`` keeps of it only the dataset position that goes with
the trainer's checkpoint (:func:`keep_for_resume`), the one place that position lives.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from asyncrl.actors.buffer.completed import CompletedPrompts
from asyncrl.actors.buffer.leases import LeaseBook, Leased
from asyncrl.runtime.connection import worth_logging
from asyncrl.runtime.log import get_logger
from asyncrl.runtime.loop import raise_if_cancelled
from asyncrl.wire.codec import DecodeError, decode, encode, encode_fields, enveloped
from asyncrl.wire.messages import (
    AnswerRecord,
    BufferPart,
    BufferSnapshot,
    Group,
    LeasedRecord,
    Message,
    ServedRecord,
    TrainBatchRef,
    WeightsUpdated,
)
from asyncrl.wire.unchecked import assembled

if TYPE_CHECKING:
    from asyncrl.actors.buffer.admission import Admission
    from asyncrl.actors.buffer.batching import Batcher
    from asyncrl.runtime.bus import Bus

SNAPSHOT_KEY = "state"
RETRY_PAUSE = 0.5
"""Seconds between tries of a write that failed (the server is restarting, say)."""
FINAL_WRITE_S = 5.0
"""Seconds the stopping buffer gives its last write."""

log = get_logger(role="buffer")

M = TypeVar("M", bound=Message)


class OldSnapshotError(RuntimeError):
    """A snapshot whose groups or batches are in a form this asyncrl does not read."""


class EncodedParts:
    """Where each admitted group is written. A group the snapshot names gets a place,
    ``(part, index)`` in a :class:`BufferPart`, once: the capture that first names it
    encodes it into a new part, which is written before the snapshot that names it, and
    deleted once a written snapshot no longer names it. A group that stays ready for many
    writes, then sits in a served batch, is written once.

    A group is known by its identity (the object itself, held with its place, so its id
    cannot be reused while held). ``fields`` keeps the encoded fields of each group this
    buffer wrote, by that id, while the snapshot names it: a batch is encoded with them
    (:func:`~asyncrl.wire.codec.encode`), not group by group again."""

    def __init__(self) -> None:
        self.next_part = 0
        self._places: dict[int, tuple[Group, tuple[int, int]]] = {}
        self.fields: dict[int, bytes] = {}
        self._unwritten: dict[int, BufferPart] = {}
        """Parts made by captures and not written yet (each write writes them first)."""
        self._written: set[int] = set()
        """Parts in the bucket, as far as this buffer knows (none it may not delete)."""

    def name(
        self, ready: Iterable[Group], served: Iterable[TrainBatchRef]
    ) -> tuple[list[tuple[int, int]], list[ServedRecord]]:
        """The places of the ``ready`` groups, and the ``served`` batches with their groups'
        places; the groups without one go into a new part (numbered ``next_part``)."""
        known, self._places = self._places, {}
        known_fields, self.fields = self.fields, {}
        number = self.next_part
        fresh: list[bytes] = []

        def place(g: Group) -> tuple[int, int]:
            key = id(g)
            hit = self._places.get(key) or known.get(key)
            if hit is not None and hit[0] is g:
                where = hit[1]
                fields = known_fields.get(key) or self.fields.get(key)
            else:
                where = (number, len(fresh))
                fields = encode_fields(g)
                fresh.append(encode(g) if fields is None else enveloped(g, fields))
            self._places[key] = (g, where)
            if fields is not None:
                self.fields[key] = fields
            return where

        places = [place(g) for g in ready]
        records = [ServedRecord.of(b, [place(g) for g in b.groups]) for b in served]
        if fresh:
            self._unwritten[number] = BufferPart(groups=fresh)
            self.next_part = number + 1
        return places, records

    def unwritten(self) -> list[tuple[int, BufferPart]]:
        return sorted(self._unwritten.items())

    def written(self, number: int) -> None:
        self._unwritten.pop(number, None)
        self._written.add(number)

    def unnamed(self, snap: BufferSnapshot) -> list[int]:
        """The written parts that ``snap`` (written) no longer names: to delete."""
        return sorted(self._written - named_parts(snap))

    def deleted(self, number: int) -> None:
        self._written.discard(number)

    def restored(self, next_part: int, places: dict[tuple[int, int], Group]) -> None:
        """A restored buffer's groups, at the places its snapshot named (written)."""
        self.next_part = max(self.next_part, next_part)
        self._places = {id(g): (g, where) for where, g in places.items()}
        self._written |= {number for number, _ in places}


def named_parts(snap: BufferSnapshot) -> set[int]:
    """The parts whose groups ``snap`` names."""
    return {p for p, _ in snap.ready} | {p for r in snap.served for p, _ in r.groups}


def part_key(number: int) -> str:
    return f"part-{number}"


def capture(
    leases: LeaseBook,
    admission: Admission,
    batcher: Batcher,
    *,
    epoch: int,
    weights: WeightsUpdated | None,
    parts: EncodedParts | None = None,
) -> BufferSnapshot:
    """The state as it is now (synchronous: nothing changes while it is taken)."""
    parts = parts or EncodedParts()
    ready, served = parts.name(admission.ready, batcher.served.values())
    sm = leases.staleness
    full, partial = admission.completed.epochs()
    source = leases.source
    return BufferSnapshot(
        epoch=epoch,
        version=sm.version,
        accepted=sm.accepted,
        running=sm.running,
        rejected=sm.rejected,
        counters=dict(leases.journal.counters),
        sampler=source.state(),
        pool=[source.without_record(p) for p in source.pool],
        leased=[
            # of the types the record's fields have (the lease book's own): not validated
            assembled(
                LeasedRecord,
                {
                    "prompt": leases.kept_prompt(e),
                    "actor_id": e.actor_id,
                    "lease_id": e.lease_id,
                    "delivered": e.delivered,
                },
            )
            for e in leases.leased.values()
        ],
        attempts=dict(leases.attempts),
        issued=leases.issued,
        answers=[
            AnswerRecord(actor_id=a, request_id=rid, lease=leases.kept_answer(a, lease))
            for a, (rid, lease) in leases.answers.items()
        ],
        partial=[t for group in admission.groups.values() for t in group.values()],
        completed=admission.completed.others(),
        completed_epochs=full,
        completed_bits=partial,
        refused=sorted((a, p) for p, attempts in admission.refused.items() for a in attempts),
        ready=ready,
        served=served,
        next_part=parts.next_part,
        since_checkpoint=sorted(batcher.since_checkpoint.items()),
        positions=sorted(batcher.positions.items()),
        weights=weights,
    )


def restore(
    snap: BufferSnapshot,
    leases: LeaseBook,
    admission: Admission,
    batcher: Batcher,
    now: float,
    *,
    run_dir: Path,
    parts: Mapping[int, BufferPart] | None = None,
    encoded: EncodedParts | None = None,
) -> None:
    """Puts ``snap`` back into the buffer's parts, its groups read from ``parts`` (the
    :class:`BufferPart` objects it names, by number); ``encoded`` learns where they are
    written. Lease clocks start again at ``now``: an actor that died with the buffer is
    found out by the usual heartbeat timeout.

    Raises :class:`OldSnapshotError`, naming ``run_dir``, before changing anything when
    the snapshot's groups do not decode (an older asyncrl kept a group as a bare list of
    samples, without its shaped rewards) or a part it names is missing."""
    parts = parts or {}
    places: dict[tuple[int, int], Group] = {}

    def group_at(where: tuple[int, int]) -> Group:
        if where not in places:
            number, index = where
            part = parts.get(number)
            if part is None or not 0 <= index < len(part.groups):
                raise OldSnapshotError(
                    f"the buffer state of the run in {run_dir} names group {index} of part "
                    f"{number}, which its bucket does not hold. Start the run anew, or resume "
                    "it from the trainer's checkpoint with `asyncrl up --resume`"
                )
            places[where] = _decode_part(part.groups[index], Group, run_dir)
        return places[where]

    ready = [group_at(w) for w in snap.ready]
    served = [r.batch([group_at(w) for w in r.groups]) for r in snap.served]
    if encoded is not None:
        encoded.restored(snap.next_part, places)
    sm = leases.staleness
    sm.version, sm.accepted, sm.running, sm.rejected = (
        snap.version,
        snap.accepted,
        snap.running,
        snap.rejected,
    )
    leases.journal.counters = Counter(snap.counters)
    source = leases.source
    source.restore(snap.sampler)
    source.pool = deque(source.with_record(p) for p in snap.pool)
    leases.leased = {
        r.prompt.uid: Leased(
            source.with_record(r.prompt), r.actor_id, r.lease_id, delivered=r.delivered
        )
        for r in snap.leased
    }
    leases.last_seen = {r.actor_id: now for r in snap.leased}
    leases.attempts = Counter(snap.attempts)
    leases.issued = snap.issued
    leases.answers = {
        a.actor_id: (a.request_id, source.lease_with_records(a.lease)) for a in snap.answers
    }
    admission.groups = {}
    for t in snap.partial:
        admission.hold(t)
    admission.completed = CompletedPrompts.restored(
        len(leases.source.records), snap.completed_epochs, snap.completed_bits, snap.completed
    )
    admission.refused = {}
    for attempt, prompt_uid in snap.refused:
        admission.refused.setdefault(prompt_uid, set()).add(attempt)
    admission.ready = deque(ready)
    batcher.served = {b.step: b for b in served}
    batcher.since_checkpoint = dict(snap.since_checkpoint)
    batcher.positions = dict(snap.positions)


def _decode_part(data: bytes, kind: type[M], run_dir: Path) -> M:
    try:
        return decode(data, kind)
    except DecodeError as exc:
        raise OldSnapshotError(
            f"the buffer state of the run in {run_dir} holds a {kind.KIND} this asyncrl "
            f"does not read ({exc.reason}: {exc.detail[:200]}); an older asyncrl wrote it. "
            "Start the run anew, or resume it from the trainer's checkpoint with "
            "`asyncrl up --resume`, which keeps only the dataset position of that state"
        ) from None


class DurableState:
    """Group-committed writes of one snapshot; with ``enabled`` False, a no-op."""

    def __init__(
        self,
        bus: Bus,
        bucket: str,
        take: Callable[[], BufferSnapshot],
        *,
        enabled: bool = True,
        min_interval: float = 0.05,
        parts: EncodedParts | None = None,
    ) -> None:
        """``take`` captures the snapshot, its groups placed in ``parts`` (see
        :func:`capture`)."""
        self.bus = bus
        self.min_interval = min_interval
        self.bucket = bucket
        self.take = take
        self.parts = parts or EncodedParts()
        self.enabled = enabled
        self.writes = 0
        self.write_failures = 0
        self.bytes_written = 0
        self._changes = 0
        self._written = 0
        self._changed = asyncio.Event()
        self._urgent = asyncio.Event()
        self._cond = asyncio.Condition()
        self._closed = False

    def touch(self, urgent: bool = False) -> None:
        """The state changed: the next write holds the change. ``urgent``: someone waits
        for it (a trainer for its batch), so the next write does not wait out
        ``min_interval``."""
        if self.enabled:
            self._changes += 1
            self._changed.set()
            if urgent:
                self._urgent.set()

    async def persisted(self) -> None:
        """Returns once a write that includes every change so far has finished."""
        if not self.enabled:
            return
        target = self._changes
        async with self._cond:
            await self._cond.wait_for(lambda: self._written >= target or self._closed)
        if self._written < target:
            raise RuntimeError("the buffer stopped before its state was written")

    async def close(self) -> None:
        """After :meth:`run` has been cancelled: writes what changed since its last write
        (within ``FINAL_WRITE_S``), then releases every :meth:`persisted` waiter, each with an
        error if the state it waits for is not written. Idempotent."""
        if self._closed:
            return
        self._closed = True
        target = self._changes
        if self.enabled and self._written < target:
            snap = self.take()
            try:
                async with asyncio.timeout(FINAL_WRITE_S):
                    await self._write(snap)
            except Exception as exc:  # the server may be gone: the snapshot stays older
                log.warning("last buffer state write failed", error=repr(exc))
            else:
                self.writes += 1
                self._written = target
        async with self._cond:
            self._cond.notify_all()

    async def load(self) -> BufferSnapshot | None:
        """The last snapshot written in this run, or None."""
        data = await self._read(SNAPSHOT_KEY)
        return None if data is None else decode(data, BufferSnapshot)

    async def load_parts(self, snap: BufferSnapshot) -> dict[int, BufferPart]:
        """The parts ``snap`` names, by number (one that is missing is left out: restore
        names it)."""
        parts = {}
        for number in sorted(named_parts(snap)):
            data = await self._read(part_key(number))
            if data is not None:
                parts[number] = decode(data, BufferPart)
        return parts

    async def _read(self, key: str) -> bytes | None:
        buf = io.BytesIO()
        try:
            await self.bus.get_blob(self.bucket, key, buf)
        except FileNotFoundError:
            return None
        return buf.getvalue()

    async def _write(self, snap: BufferSnapshot) -> None:
        """Writes the parts not written yet, then ``snap``, then deletes the parts that no
        longer any snapshot names: a snapshot is never written before a part it names, and
        a part is deleted only once the snapshot in the bucket no longer names it."""
        for number, part in self.parts.unwritten():
            data = encode(part)
            await self.bus.put_blob(self.bucket, part_key(number), data)
            self.parts.written(number)
            self.bytes_written += len(data)
        data = encode(snap)
        await self.bus.put_blob(self.bucket, SNAPSHOT_KEY, data)
        self.bytes_written += len(data)
        for number in self.parts.unnamed(snap):
            await self.bus.delete_blob(self.bucket, part_key(number))
            self.parts.deleted(number)

    async def load_quietly(self) -> BufferSnapshot | None:
        """:meth:`load`, with a snapshot that does not decode (one written by another
        asyncrl) taken as none."""
        try:
            return await self.load()
        except DecodeError as exc:
            log.warning("buffer state unreadable, ignored", error=str(exc))
            return None

    async def run(self) -> None:
        """Writes whenever something changed, one write at a time, until cancelled."""
        while True:
            await self._changed.wait()
            self._changed.clear()
            self._urgent.clear()  # this write holds the urgent change too
            target = self._changes
            snap = self.take()
            while True:
                try:
                    await self._write(snap)
                    raise_if_cancelled()
                    break
                except Exception as exc:  # the server may be restarting: try again
                    raise_if_cancelled()
                    self.write_failures += 1
                    n = self.write_failures
                    if worth_logging(n):
                        log.warning("buffer state write failed", error=repr(exc), count=n)
                    await asyncio.sleep(RETRY_PAUSE)
            self.writes += 1
            async with self._cond:
                self._written = target
                self._cond.notify_all()
            # what changes meanwhile waits for the next write, many changes in one, unless
            # an urgent one comes
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.min_interval):
                    await self._urgent.wait()


async def forget(bus: Bus, bucket: str) -> None:
    """Deletes the snapshot and its parts: a run that starts anew starts clean."""
    await bus.delete_bucket(bucket)


async def keep_for_resume(
    bus: Bus, bucket: str, *, step: int, version: int, batch_size: int
) -> dict[str, Any] | None:
    """Replaces the snapshot with the state a run resumed from the trainer's checkpoint
    of ``step`` (at ``version``) starts from: the accounting of ``version`` (accepted =
    v·B, nothing running) and the dataset position recorded when the batch of step
    ``step − 1`` was served, so the resumed run leases on from where its checkpoint's
    batches stood. Returns that position; None when the snapshot holds none (no
    snapshot, a buffer without ``buffer.durable``, an unreadable one): the dataset then
    starts from its beginning, and that is logged."""
    old = await DurableState(bus, bucket, take=BufferSnapshot).load_quietly()
    position = dict(old.positions).get(step - 1) if old is not None else None
    await forget(bus, bucket)
    if position is None:
        log.warning("no dataset position recorded for the checkpoint", step=step)
        return None
    fresh = BufferSnapshot(
        version=version,
        accepted=version * batch_size,
        sampler=position,
        positions=[(step - 1, position)],
    )
    await bus.put_blob(bucket, SNAPSHOT_KEY, encode(fresh))
    return position
