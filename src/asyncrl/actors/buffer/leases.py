"""Leases: which prompts are out, with whom, and how they come back.

A lease request is idempotent by its request id: the actor repeats the id when it asks
again after a timeout, so a reply lost in transit yields the same lease, never a second
one (which would hold budget that nobody runs). A leased prompt comes back to the pool
when its episode is aborted (the abort names the lease, so a late repeat cannot return a
newer lease of the same prompt), when its actor exits or stops heartbeating for
``ttl`` seconds, or when its live actor's heartbeats list it neither as held nor as
delivered (trajectories on the stream) for ``ttl`` seconds while no scored sample of it
has arrived (a lost abort, a lost lease reply).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.actors.buffer.journal import Journal
from asyncrl.data.sampler import ShardSampler
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.messages import Lease, LeaseRequest, Prompt
from asyncrl.wire.unchecked import updated

MAX_EPISODE_ATTEMPTS = 3
"""A prompt whose episode fails this many times is dropped (and counted), so one poison
prompt cannot loop forever."""


class PromptSource:
    """The dataset in a seeded order, epoch after epoch (a :class:`ShardSampler`), plus a
    pool of returned prompts that are handed out first.

    Prompt ids are ``e<epoch>-<record index>``: unique in the run, stable across resume."""

    def __init__(self, records: list[dict[str, Any]], seed: int) -> None:
        if not records:
            raise ValueError("the dataset is empty")
        self.records = records
        self.sampler = ShardSampler(len(records), seed=seed)
        self.pool: deque[Prompt] = deque()

    def take(self) -> Prompt:
        if self.pool:
            return self.pool.popleft()
        epoch, idx = self.sampler.next()
        return Prompt(uid=f"e{epoch}-{idx}", data=self.records[idx])

    def _index(self, uid: str) -> int | None:
        """The record index that ``uid`` names, None if it names none of this dataset."""
        try:
            idx = int(uid.split("-", 1)[1])
        except (IndexError, ValueError):
            return None
        return idx if 0 <= idx < len(self.records) else None

    def prompt(self, uid: str) -> Prompt:
        """The prompt of ``uid`` with its record: samples past scoring carry only the id,
        and a prompt that runs again (a roll-back) gets its record from here."""
        idx = self._index(uid)
        if idx is None:
            raise ValueError(f"{uid!r} is no prompt id of this dataset")
        return Prompt(uid=uid, data=self.records[idx])

    def without_record(self, prompt: Prompt) -> Prompt:
        """``prompt`` as the buffer's state keeps it: a prompt of this dataset (its data the
        record its id names) without the record, which :meth:`with_record` puts back from
        the dataset; any other as it is. A snapshot then holds a prompt in a few bytes,
        not a record a lease: its size no longer grows with the records' length times the
        episodes out (and the leases answered, which hold the same prompts again)."""
        idx = self._index(prompt.uid)
        if idx is not None and prompt.data == self.records[idx]:
            return updated(prompt, {"data": {}})
        return prompt

    def with_record(self, prompt: Prompt) -> Prompt:
        """A prompt of a snapshot as it was: its record put back where
        :meth:`without_record` left it out (a prompt with a record, as an older asyncrl
        kept every one, stays as it is)."""
        if prompt.data:
            return prompt
        idx = self._index(prompt.uid)
        return prompt if idx is None else updated(prompt, {"data": self.records[idx]})

    def lease_without_records(self, lease: Lease) -> Lease:
        """``lease`` with its prompts :meth:`without_record`."""
        return _each_prompt(lease, self.without_record)

    def lease_with_records(self, lease: Lease) -> Lease:
        """``lease`` with its prompts :meth:`with_record`."""
        return _each_prompt(lease, self.with_record)

    def give_back(self, prompt: Prompt) -> None:
        self.pool.appendleft(prompt)

    def discard_from_pool(self, uid: str) -> None:
        self.pool = deque(p for p in self.pool if p.uid != uid)

    def state(self) -> dict[str, Any]:
        return self.sampler.state()

    def restore(self, state: dict[str, Any]) -> None:
        if state:
            self.sampler.restore(state)


def _each_prompt(lease: Lease, change: Callable[[Prompt], Prompt]) -> Lease:
    """``lease`` with ``change`` applied to each of its prompts (itself if it has none)."""
    if not lease.prompts:
        return lease
    return updated(lease, {"prompts": [change(p) for p in lease.prompts]})


@dataclass
class Leased:
    prompt: Prompt
    actor_id: str
    lease_id: str
    missing_since: float | None = None
    """When the actor's heartbeats first stopped listing this prompt (None: listed)."""
    delivered: bool = False
    """The actor said its trajectories are on the stream: only their scores are awaited."""
    kept: Prompt | None = field(default=None, compare=False, repr=False)
    """The prompt as the buffer's state writes it (:meth:`PromptSource.without_record`),
    made by the first write that holds it (:meth:`LeaseBook.kept_prompt`)."""


class LeaseBook:
    """The leased prompts and the actors holding them. Times are passed in (``now``,
    monotonic seconds), so the rules are tested without a clock."""

    def __init__(
        self,
        source: PromptSource,
        staleness: StalenessManager,
        journal: Journal,
        *,
        ttl: float,
        incarnation: str,
    ) -> None:
        self.source = source
        self.staleness = staleness
        self.journal = journal
        self.ttl = ttl
        # lease ids must not repeat across restarts of the buffer (a resumed run)
        self.incarnation = incarnation
        self.leased: dict[str, Leased] = {}
        self.attempts: Counter[str] = Counter()
        self.last_seen: dict[str, float] = {}
        # one request in flight per actor, so its last lease is all a retry can need
        self.answers: dict[str, tuple[str, Lease]] = {}
        self._kept_answers: dict[str, tuple[Lease, Lease]] = {}
        """Each answer's lease and that lease as the state writes it (``kept_answer``)."""
        self.issued = 0
        self.on_drop: Callable[[str], None] = lambda uid: None
        """Called with a prompt dropped after its last failed attempt (the admission's)."""

    def grant(self, req: LeaseRequest, now: float) -> Lease:
        """Up to ``req.max_episodes`` prompts, as many as the capacity allows; the same
        lease again for a repeated request id."""
        self.last_seen[req.actor_id] = now
        answered = self.answers.get(req.actor_id)
        if req.request_id and answered is not None and answered[0] == req.request_id:
            self.journal.count("lease_repeats")
            return answered[1]
        n = min(req.max_episodes, self.staleness.capacity())
        self.issued += 1
        lease_id = f"{self.incarnation}:{req.actor_id}:{self.issued}"
        prompts = []
        for _ in range(n):
            p = self.source.take()
            self.attempts[p.uid] += 1
            p = p.model_copy(update={"attempt": self.attempts[p.uid]})
            prompts.append(p)
            self.leased[p.uid] = Leased(p, req.actor_id, lease_id)
            self.journal.event("lease", prompt=p.uid, actor=req.actor_id, lease=lease_id)
        self.staleness.on_start(n)
        self.journal.count("leased", n)
        lease = Lease(
            lease_id=lease_id,
            actor_id=req.actor_id,
            version=self.staleness.version,
            prompts=prompts,
            retry_after=0.0 if n else 0.5,
        )
        if req.request_id and prompts:
            # an empty answer is not kept: a repeat of it may be granted what is free now
            self.answers[req.actor_id] = (req.request_id, lease)
        return lease

    def return_prompt(self, uid: str, why: str, lease_id: str = "") -> bool:
        """Gives a leased prompt's budget back and the prompt to the pool (or drops it
        after :data:`MAX_EPISODE_ATTEMPTS`). With ``lease_id``, only that lease of the
        prompt is returned. Returns whether anything was returned."""
        entry = self.leased.get(uid)
        if entry is None or (lease_id and entry.lease_id != lease_id):
            return False
        del self.leased[uid]
        self.staleness.on_abort(1)
        if self.attempts[uid] >= MAX_EPISODE_ATTEMPTS:
            self.journal.count("dropped_prompts")
            self.journal.event("drop", prompt=uid, why=why)
            self.on_drop(uid)
            return True
        self.source.give_back(entry.prompt)
        self.journal.count("returned")
        self.journal.event("return", prompt=uid, actor=entry.actor_id, why=why)
        return True

    def release_actor(self, actor_id: str, why: str) -> int:
        """Returns every prompt ``actor_id`` holds; how many."""
        uids = [u for u, e in self.leased.items() if e.actor_id == actor_id]
        for uid in uids:
            self.return_prompt(uid, why)
        self.last_seen.pop(actor_id, None)
        self.answers.pop(actor_id, None)
        self._kept_answers.pop(actor_id, None)
        return len(uids)

    def kept_prompt(self, entry: Leased) -> Prompt:
        """``entry``'s prompt as the buffer's state writes it, without its record: made
        once a lease, not at every write (twenty a second) that holds it."""
        if entry.kept is None:
            entry.kept = self.source.without_record(entry.prompt)
        return entry.kept

    def kept_answer(self, actor_id: str, lease: Lease) -> Lease:
        """``lease``, the answer kept for ``actor_id``, as the state writes it (its prompts
        without their records), made once an answer."""
        hit = self._kept_answers.get(actor_id)
        if hit is None or hit[0] is not lease:
            hit = self._kept_answers[actor_id] = (lease, self.source.lease_without_records(lease))
        return hit[1]

    def reconcile(
        self,
        actor_id: str,
        holding: list[str] | None,
        now: float,
        reported: Callable[[str], bool],
        delivered: Iterable[str] = (),
    ) -> list[str]:
        """A heartbeat: ``holding`` lists the prompts the actor runs (None: it does not
        say), ``delivered`` those whose trajectories it put on the stream. A prompt leased
        to it that is neither held, nor delivered, nor ``reported`` (a scored sample of it
        arrived) for longer than ``ttl`` is returned. Returns those prompts."""
        self.last_seen[actor_id] = now
        if holding is None:
            return []
        held = set(holding)
        for uid in delivered:
            entry = self.leased.get(uid)
            if entry is not None and entry.actor_id == actor_id:
                entry.delivered = True
        freed = []
        for uid, entry in list(self.leased.items()):
            if entry.actor_id != actor_id:
                continue
            if uid in held or entry.delivered or reported(uid):
                entry.missing_since = None
            elif entry.missing_since is None:
                entry.missing_since = now
            elif now - entry.missing_since > self.ttl:
                self.journal.count("unheld_leases")
                self.return_prompt(uid, f"not held by its actor for {self.ttl:.0f}s")
                freed.append(uid)
        return freed

    def expire(self, now: float) -> list[str]:
        """Releases the actors that stopped heartbeating ``ttl`` seconds ago; their ids."""
        silent = {
            e.actor_id
            for e in self.leased.values()
            if now - self.last_seen.get(e.actor_id, now) > self.ttl
        }
        for actor_id in silent:
            self.journal.count("expired_leases")
            self.release_actor(actor_id, f"no heartbeat for {self.ttl:.0f}s")
        return sorted(silent)

    def rerun(self, prompt: Prompt) -> None:
        """A prompt whose finished group was rolled back runs again; that run is not one
        more failed attempt."""
        self.attempts[prompt.uid] = max(0, self.attempts[prompt.uid] - 1)
        self.source.give_back(prompt)

    def end_rerun(self, uid: str, lease_id: str) -> bool:
        """A sample of ``uid``'s lease ``lease_id`` arrived while its group is already
        admitted: a replacement buffer that never wrote the first lease leased the prompt
        again (its dataset position rewound), and this run's samples are duplicates. The
        lease ends here with its budget, the prompt not back in the pool (it would wait
        forever for a group that cannot be admitted twice). Whether a lease ended."""
        entry = self.leased.get(uid)
        if entry is None or entry.lease_id != lease_id:
            return False
        del self.leased[uid]
        self.staleness.on_abort(1)
        self.journal.count("rerun_leases_ended")
        self.journal.event("end", prompt=uid, lease=lease_id, why="group already admitted")
        return True

    def finish(self, uid: str) -> None:
        """A prompt's group is complete. If its lease had already been returned (a slow
        actor, not a dead one), it runs again as far as the budget knows and must not be
        leased a second time. A prompt leased once is forgotten here (the count would grow
        with the run, in every snapshot): a rerun counts from 0 either way (:meth:`rerun`)."""
        if self.attempts.get(uid) == 1:
            del self.attempts[uid]
        if self.leased.pop(uid, None) is None:
            self.source.discard_from_pool(uid)
            self.staleness.on_start(1)
