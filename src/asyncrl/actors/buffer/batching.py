"""Batches: B admitted groups still within η, for one trainer step: those that would go
stale first (the oldest head versions, ties in admission order), so that a group whose
episodes ran long is not left to expire behind groups that started after it.

A repeated request for the same step gets the same batch, so a lost reply loses no data.
The groups are in the order they were admitted (the order their last samples were
scored), or with ``ordered`` (``rollout.deterministic``) by prompt id, so that a batch
whose groups are given (η = 0, where no more than B are ever admitted ahead of the
trainer) is one list whatever order its episodes finished in.
The dataset position at each batch is recorded (for a run resumed from a checkpoint), not
sent: the batch holds what training reads.
A batch too large for one message goes into the run's batch bucket; the trainer deletes
the blob once it has decoded it (a repeat puts it there again).
"""

from __future__ import annotations

from typing import Any

from asyncrl.actors.buffer.admission import Admission
from asyncrl.actors.buffer.journal import Journal
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.messages import BatchWaiting, TrainBatchRef

BLOB_FRACTION = 0.9
"""A batch whose encoding is above this share of ``max_payload`` goes by the object store
(the envelope and headers need the rest)."""


class Batcher:
    def __init__(
        self,
        admission: Admission,
        staleness: StalenessManager,
        journal: Journal,
        *,
        batch_size: int,
        ordered: bool = False,
    ) -> None:
        self.admission = admission
        self.ordered = ordered
        self.staleness = staleness
        self.journal = journal
        self.batch_size = batch_size
        self.served: dict[int, TrainBatchRef] = {}
        """Batches served, inline, by step: the current step and the one before."""
        self.since_checkpoint: dict[int, list[str]] = {}
        """The prompt uids of every batch served after the trainer's latest checkpoint: a
        trainer that restarts from it trains those steps again, so they run again."""
        self.positions: dict[int, dict[str, Any]] = {}
        """The dataset position as each batch was served, from the step before the
        trainer's latest checkpoint on: a run resumed from the checkpoint of step s goes
        on from the position of step s − 1 (what its trained batches had leased)."""

    def checkpointed(self, step: int) -> None:
        """The trainer's latest checkpoint is at ``step``: it holds what the batches of
        steps 0 … step − 1 taught (the batch of step s is trained as step s + 1)."""
        for s in [s for s in self.since_checkpoint if s < step]:
            del self.since_checkpoint[s]
        for s in [s for s in self.positions if s < step - 1]:
            del self.positions[s]

    def counters(self) -> dict[str, int]:
        sm = self.staleness
        return {
            "accepted": sm.accepted,
            "rejected": sm.rejected,
            "running": sm.running,
            **self.journal.counters,
        }

    def waiting(self) -> BatchWaiting:
        """What a batch request waits for, for the trainer's log."""
        return BatchWaiting(
            ready_groups=len(self.admission.ready),
            batch_size=self.batch_size,
            rejected_stale=self.staleness.rejected,
            rejected_invalid=self.journal.counters["invalid_samples"],
            running=self.staleness.running,
            version=self.staleness.version,
        )

    def ready(self) -> bool:
        """Drops what went stale, then says whether a batch can be formed."""
        self.admission.drop_stale()
        return len(self.admission.ready) >= self.batch_size

    def take(self, step: int, position: dict[str, Any]) -> TrainBatchRef:
        """The batch of ``step`` (call only when :meth:`ready`), remembered for repeats;
        ``position`` is the dataset position now, recorded for resume."""
        groups = self.admission.take_first_to_expire(self.batch_size)
        if self.ordered:
            groups.sort(key=lambda g: g.prompt_uid)
        batch = TrainBatchRef(
            step=step,
            version=self.staleness.version,
            groups=groups,
            counters=self.counters(),
        )
        self.served = {s: b for s, b in self.served.items() if s >= step - 1}
        self.served[step] = batch
        self.since_checkpoint[step] = [g.prompt_uid for g in groups]
        self.positions[step] = position
        for g in groups:
            self.journal.event("batch", prompt=g.prompt_uid, step=step)
        return batch


def blob_key(step: int) -> str:
    return f"batch-{step}"


def as_reference(batch: TrainBatchRef) -> TrainBatchRef:
    """The small message that names the blob of ``batch``."""
    return TrainBatchRef(
        step=batch.step,
        version=batch.version,
        blob_key=blob_key(batch.step),
        counters=batch.counters,
    )
