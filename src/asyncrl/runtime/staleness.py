"""The staleness manager: how many episodes may start now, and which may be trained on.

The version ``v`` here is the version of the newest *published* weights: the only
weights a rollout actor can generate with. The trainer's own version runs ahead of it by
up to ``k − 1`` steps when it publishes every ``k = trainer.update_every`` steps; judging
samples against that unpublished version rejects every group once ``k ≥ η + 2`` (no
rollout can ever catch up), which is why the trainer tells the buffer both.

With B episodes per training batch, C the most concurrent episodes, η the
``max_head_offpolicyness`` and counters of accepted and running episodes::

    ahead    = k·(⌊η / k⌋ + 1)                       (= η + 1 when k = 1)
    capacity = min(C − running, (v + ahead)·B − (accepted + running))

``ahead`` counts the trainer steps that episodes started under weights v can still feed:
published versions after v come k apart, so v stays admissible through the ⌊η/k⌋ next
publications, and the trainer consumes B episodes per step until the one after. With
k = 1 this is AReaL's rule, ``(η + v + 1)·B − (accepted + running)``.

An episode starts only while capacity > 0. A scored episode whose oldest token came from
version h is admitted only if v − h ≤ η; a rejected episode gives its budget back (it does
not count as accepted). After a restore at version v, accepted = v·B. With η = 0 and k = 1
at most one batch's worth of episodes is ever in flight ahead of the trainer: synchronous
RL.

Pure bookkeeping: no I/O, no clock, so it is tested by hand-computed sequences.
"""

from __future__ import annotations

from dataclasses import dataclass


def versions_ahead(max_head_offpolicyness: int, update_every: int = 1) -> int:
    """``k·(⌊η/k⌋ + 1)``: how many trainer steps episodes started under the newest
    published weights may feed before a publication makes them too stale."""
    if update_every < 1 or max_head_offpolicyness < 0:
        raise ValueError(f"need k ≥ 1 and η ≥ 0, got {update_every=} {max_head_offpolicyness=}")
    return update_every * (max_head_offpolicyness // update_every + 1)


@dataclass
class StalenessManager:
    batch_size: int
    """B: episodes (prompt groups) per training batch."""
    max_concurrent: int
    """C: episodes running at once across every rollout actor."""
    max_head_offpolicyness: int
    """η: how many versions the oldest token of a trained episode may lag behind."""
    update_every: int = 1
    """k: the trainer publishes weights every k steps."""
    version: int = 0
    """v: the newest published version (what rollouts can generate with)."""
    accepted: int = 0
    running: int = 0
    rejected: int = 0

    def capacity(self) -> int:
        """Episodes that may start now (never negative)."""
        by_concurrency = self.max_concurrent - self.running
        ahead = versions_ahead(self.max_head_offpolicyness, self.update_every)
        by_staleness = (self.version + ahead) * self.batch_size - (self.accepted + self.running)
        return max(0, min(by_concurrency, by_staleness))

    def admissible(self, head_version: int) -> bool:
        """v − h ≤ η, at the current version v. A head of -1 (no generated token: an
        episode of greedy calls only) trains nothing, so it is never stale."""
        return head_version < 0 or self.version - head_version <= self.max_head_offpolicyness

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

    def expire_accepted(self, n: int = 1) -> None:
        """Accepted episodes that went stale while they waited for a batch: their budget
        returns and they count as rejected."""
        self.drop_accepted(n)
        self.rejected += n

    def set_version(self, version: int) -> None:
        """Moves to a newer published version; an older one (a late message) is ignored."""
        self.version = max(self.version, version)

    def restore(self, version: int) -> None:
        """State after resuming from a checkpoint at ``version``: accepted = v·B."""
        self.version = version
        self.accepted = version * self.batch_size
        self.running = 0
