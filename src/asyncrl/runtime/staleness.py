"""The staleness manager: how many episodes may start now, and which may be trained on.

With B episodes per training batch, C the most concurrent episodes, η the
``max_head_offpolicyness``, v the current policy version, and counters of accepted and
running episodes::

    capacity = min(C − running, (η + v + 1)·B − (accepted + running))

An episode starts only while capacity > 0. A scored episode whose oldest token came from
version h is admitted only if v − h ≤ η; a rejected episode gives its budget back (it does
not count as accepted). After a restore at version v, accepted = v·B. With η = 0 at most
one batch's worth of episodes is ever in flight ahead of the trainer: synchronous RL.

Pure bookkeeping: no I/O, no clock, so it is tested by hand-computed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessManager:
    batch_size: int
    """B: episodes (prompt groups) per training batch."""
    max_concurrent: int
    """C: episodes running at once across every rollout actor."""
    max_head_offpolicyness: int
    """η: how many versions the oldest token of a trained episode may lag behind."""
    version: int = 0
    accepted: int = 0
    running: int = 0
    rejected: int = 0

    def capacity(self) -> int:
        """Episodes that may start now (never negative)."""
        by_concurrency = self.max_concurrent - self.running
        by_staleness = (self.max_head_offpolicyness + self.version + 1) * self.batch_size - (
            self.accepted + self.running
        )
        return max(0, min(by_concurrency, by_staleness))

    def admissible(self, head_version: int) -> bool:
        """v − h ≤ η, at the current version v."""
        return self.version - head_version <= self.max_head_offpolicyness

    def on_start(self, n: int = 1) -> None:
        self.running += n

    def on_abort(self, n: int = 1) -> None:
        """Episodes that ended without a sample (failure, lease expiry): budget returned."""
        self.running = max(0, self.running - n)

    def on_scored(self, head_version: int) -> bool:
        """A finished episode arrives; admits it if fresh enough. Returns whether admitted."""
        self.running = max(0, self.running - 1)
        if self.admissible(head_version):
            self.accepted += 1
            return True
        self.rejected += 1
        return False

    def drop_accepted(self, n: int = 1) -> None:
        """Accepted episodes that will never be trained (dynamic filtering): their budget
        returns, so the run still gathers B trainable episodes per version."""
        self.accepted = max(0, self.accepted - n)

    def set_version(self, version: int) -> None:
        self.version = version

    def restore(self, version: int) -> None:
        """State after resuming from a checkpoint at ``version``: accepted = v·B."""
        self.version = version
        self.accepted = version * self.batch_size
        self.running = 0
