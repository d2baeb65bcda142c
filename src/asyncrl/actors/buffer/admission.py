"""Admission: scored samples become whole groups, and groups are judged.

A sample is first checked for sense (:func:`invalid_reason`); one that makes none is
refused with a counted reason, its attempt's group is abandoned and the prompt goes back
to the pool, so a bad message never reaches (and never kills) the trainer.

A group is complete when each of its ``group_size`` episodes is *whole*: one attempt (the
lease it ran under) delivered all of that episode's samples (``episode_samples``: one,
except for agent code whose calls do not all continue one another). An episode is never
pieced together from two attempts: a prompt run again after its lease expired may give
other continuations, versions, even another number of samples. So samples are held by
(attempt, sample id), and:

- a sample whose (attempt, sample id) is held, or whose episode is already whole (from
  any attempt), or whose prompt's group is finished, is a duplicate (counted, dropped);
- when an attempt makes an episode whole, the other attempts' samples of that episode
  are dropped (counted ``superseded_partial_samples``);
- an attempt whose samples of one episode disagree on ``episode_samples`` is refused
  (``invalid_episode_samples_mismatch``).

Different episodes of one group may come from different attempts: each is a whole sample
of the same prompt, and GRPO's group needs only that its episodes be independent draws.

A complete group is admitted if v − h ≤ η (h: its oldest generated token's version; a
group without one is never stale), else rejected without using the budget. A whole group's rewards are shaped here, once (the buffer's
``shape``, :func:`asyncrl.algo.shaping.shaped_sample_rewards`): the trainer's advantages
use those numbers, and with the dynamic filter a group whose episodes' shaped rewards are
all equal is dropped, so a group of equal raw rewards that shaping tells apart keeps its
signal.

An admitted group is kept as a :class:`~asyncrl.wire.messages.Group`, what training reads
from here to the loss: the prompt record is the buffer's (by prompt id,
:meth:`PromptSource.prompt`), and the lease and group size were checked here.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from asyncrl.actors.buffer.completed import CompletedPrompts
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.messages import Array, Group, TrainSample, Trajectory

Shaping = Callable[[Sequence[TrainSample]], Sequence[float]]
"""The rewards the advantages use, one per sample of a group, from its samples."""


def invalid_reason(
    traj: Trajectory, *, group_size: int, version: int, epoch: int = 0
) -> str | None:
    """Why ``traj`` cannot be trained on, as a short countable tag, or None if it can.

    - ``length_mismatch``: the four arrays are not 1-d arrays of one length;
    - ``group_size_mismatch``: its group size is not the run's;
    - ``group_index_out_of_range``: not 0 ≤ group_index < group_size;
    - ``episode_sample_out_of_range``: not 0 ≤ episode_sample < episode_samples;
    - ``missing_reward`` / ``nonfinite_reward``: unscored, or NaN/inf;
    - ``no_token``: no token at all;
    - ``loss_on_prompt_token``: the loss mask covers the first token or a token that no
      policy produced (version −1: prompt or environment tokens);
    - ``old_epoch`` / ``future_epoch``: generated with weights of another trainer epoch
      than the buffer's ``epoch`` (a lineage the restarted trainer rolled back, or one the
      buffer has not heard of yet);
    - ``future_version``: a token of a version newer than the buffer's ``version``;
    - ``bad_logprobs``: a behaviour logprob on a loss token that is NaN/inf or positive;
    - ``negative_token_id``.

    :func:`group_head_if_valid` applies the same rules to a whole group message at once:
    a rule changed here changes there too.
    """
    arrays = [traj.input_ids, traj.loss_mask, traj.logprobs, traj.versions]
    if any(len(a.shape) != 1 for a in arrays) or len({a.shape for a in arrays}) != 1:
        return "length_mismatch"
    if traj.group_size != group_size:
        return "group_size_mismatch"
    if not 0 <= traj.group_index < group_size:
        return "group_index_out_of_range"
    if not 0 <= traj.episode_sample < traj.episode_samples:
        return "episode_sample_out_of_range"
    if traj.reward is None:
        return "missing_reward"
    if not math.isfinite(traj.reward):
        return "nonfinite_reward"
    mask = traj.loss_mask.numpy()
    if mask.dtype != np.bool_:
        mask = mask.astype(bool)
    versions = traj.versions.numpy()
    # an empty loss mask is allowed: agent code's greedy calls (per_call sampling) are
    # context, and an episode of them keeps its place in its group's baseline, untrained
    if not mask.size:
        return "no_token"
    if mask[0] or bool((versions[mask] < 0).any()):
        return "loss_on_prompt_token"
    if traj.epoch != epoch:
        return "old_epoch" if traj.epoch < epoch else "future_epoch"
    if int(versions.max()) > version:
        return "future_version"
    logprobs = traj.logprobs.numpy()[mask].astype(np.float64)
    # a logprob is ≤ 0; a little slack for the rounding of a float16/bfloat16 engine
    if not np.isfinite(logprobs).all() or bool((logprobs > 1e-3).any()):
        return "bad_logprobs"
    if bool((traj.input_ids.numpy() < 0).any()):
        return "negative_token_id"
    return None


def _joined(arrays: Sequence[Array]) -> np.ndarray:
    """The 1-d ``arrays`` (of one dtype, each of it) end to end, as one read-only array."""
    return np.frombuffer(b"".join(a.data for a in arrays), dtype=arrays[0].numpy().dtype)


def group_head_if_valid(
    samples: Sequence[Trajectory], *, group_size: int, version: int, epoch: int
) -> int | None:
    """For a group message that is one attempt's whole group of one-sample episodes: the
    group's head version (its oldest generated token's, −1 for none) when every sample
    passes every check of :func:`invalid_reason`, checked over the group's arrays end to
    end instead of sample by sample; None when any check fails or the group is of another
    form, where the caller judges the samples one by one (and names the reason).

    The same rules as :func:`invalid_reason`, in a few numpy calls a group instead of a
    dozen a sample (``tests/test_buffer.py`` holds the two to the same outcomes)."""
    if len(samples) != group_size:
        return None
    first = samples[0]
    dtypes = (
        first.loss_mask.dtype,
        first.logprobs.dtype,
        first.versions.dtype,
        first.input_ids.dtype,
    )
    indices = set()
    for t in samples:
        n = t.input_ids.shape
        if (
            len(n) != 1
            or not n[0]
            or t.loss_mask.shape != n
            or t.logprobs.shape != n
            or t.versions.shape != n
            or t.group_size != group_size
            or t.episode_samples != 1
            or t.episode_sample != 0
            or t.attempt != first.attempt
            or t.prompt_uid != first.prompt_uid
            or t.epoch != epoch
            or (t.loss_mask.dtype, t.logprobs.dtype, t.versions.dtype, t.input_ids.dtype) != dtypes
            or t.reward is None
            or not math.isfinite(t.reward)
        ):
            return None
        indices.add(t.group_index)
    if indices != set(range(group_size)) or len({t.uid for t in samples}) != group_size:
        return None
    mask = _joined([t.loss_mask for t in samples])
    versions = _joined([t.versions for t in samples])
    logprobs = _joined([t.logprobs for t in samples])
    input_ids = _joined([t.input_ids for t in samples])
    if mask.dtype != np.bool_:
        mask = mask.astype(bool)
    starts = np.cumsum([0] + [t.input_ids.shape[0] for t in samples[:-1]])
    if bool(mask[starts].any()) or bool((versions[mask] < 0).any()):
        return None
    if int(versions.max()) > version:
        return None
    scored = logprobs[mask].astype(np.float64)
    if not np.isfinite(scored).all() or bool((scored > 1e-3).any()):
        return None
    if bool((input_ids < 0).any()):
        return None
    generated = versions[versions >= 0]
    return int(generated.min()) if generated.size else -1


def whole_episodes(samples: Iterable[Trajectory]) -> dict[int, str]:
    """The episodes that one attempt delivered whole among ``samples`` (valid: 0 ≤
    ``episode_sample`` < ``episode_samples``), as group index → that attempt.

    Attempt a made episode i whole when its samples of episode i all say the same
    ``episode_samples`` n and hold n distinct ``episode_sample`` values (so 0 … n−1, all of
    them). Samples of another attempt never fill a gap. Where two attempts both did, the
    first one met in ``samples`` is named."""
    parts: dict[tuple[int, str], dict[int, int]] = {}
    for t in samples:
        parts.setdefault((t.group_index, t.attempt), {})[t.episode_sample] = t.episode_samples
    whole: dict[int, str] = {}
    for (index, attempt), got in parts.items():
        counts = set(got.values())
        if len(counts) == 1 and len(got) == counts.pop():
            whole.setdefault(index, attempt)
    return whole


def group_complete(samples: Iterable[Trajectory], group_size: int) -> bool:
    """Whether every one of the ``group_size`` episodes is whole in ``samples`` (see
    :func:`whole_episodes`)."""
    return len(whole_episodes(samples)) == group_size


def raw_rewards(samples: Sequence[TrainSample]) -> list[float]:
    """The identity :data:`Shaping`: each sample's own reward."""
    return [t.reward for t in samples]


def admitted_group(samples: Iterable[Trajectory], shape: Shaping) -> Group:
    """The whole group of ``samples`` (scored, of one prompt) as training reads it: in
    episode order, with the rewards ``shape`` gives them."""
    ordered = sorted(samples, key=lambda t: (t.group_index, t.episode_sample))
    train = [t.to_train_sample() for t in ordered]
    return Group(prompt_uid=train[0].prompt_uid, samples=train, shaped_rewards=list(shape(train)))


class Admission:
    """Groups in the making, and the admitted groups that wait for a batch (``ready``)."""

    def __init__(
        self,
        staleness: StalenessManager,
        leases: LeaseBook,
        journal: Journal,
        *,
        group_size: int,
        dynamic_filter: bool,
        shape: Shaping = raw_rewards,
    ) -> None:
        """``shape`` gives a group's rewards for its advantages (the recipe's
        ``trainer.shaping``), which the dynamic filter compares too."""
        self.staleness = staleness
        self.leases = leases
        self.journal = journal
        self.group_size = group_size
        self.dynamic_filter = dynamic_filter
        self.shape = shape
        self.groups: dict[str, dict[tuple[str, str], Trajectory]] = {}
        """The groups in the making: by prompt id, their samples by (attempt, sample id)
        (:meth:`hold`); a finished group is known by its prompt (``completed``)."""
        self.completed = CompletedPrompts(len(leases.source.records))
        leases.on_drop = self._dropped
        self.refused: dict[str, set[str]] = {}
        """The attempts (lease ids) whose group was abandoned for an invalid sample, by
        prompt id; forgotten when the prompt's group completes (a later sample of it is
        then a duplicate), so it holds only prompts still to complete."""
        self.ready: deque[Group] = deque()
        self._heads: dict[str, int] = {}
        """The head version of ready groups by prompt id, as admission found it (a group
        restored from a snapshot has none here: its own is read)."""
        self._fresh_at = -1
        """The version at which every ready group was last found admissible."""
        self.epoch = 0
        """The trainer's epoch: how many times it restarted from a checkpoint in this run."""

    def _dropped(self, prompt_uid: str) -> None:
        """A prompt dropped after its last failed attempt is never leased again: it counts
        as complete, so a late sample of it (an expired lease's actor was slow, not dead)
        is a duplicate rather than the start of a group that never fills, and what is held
        of it goes (counted ``dropped_prompt_samples``)."""
        self.completed.add(prompt_uid)
        self.refused.pop(prompt_uid, None)
        held = self.groups.pop(prompt_uid, {})
        if held:
            self.journal.count("dropped_prompt_samples", len(held))

    def reported(self, prompt_uid: str) -> bool:
        """Whether a scored sample of this prompt has arrived (its group is under way)."""
        return prompt_uid in self.groups or prompt_uid in self.completed

    def hold(self, traj: Trajectory) -> None:
        """Puts ``traj`` in its group in the making, as the sample of its attempt."""
        self.groups.setdefault(traj.prompt_uid, {})[(traj.attempt, traj.uid)] = traj

    def on_scored(self, traj: Trajectory) -> str:
        """Takes one scored sample; returns what became of it: ``duplicate``, ``invalid``,
        ``pending`` (its group is not complete), ``rejected``, ``filtered`` or ``admitted``.
        The rules for samples of several attempts are the module's."""
        if traj.prompt_uid in self.completed:
            # a lease that ran the admitted group again (a replacement buffer's) ends here
            self.leases.end_rerun(traj.prompt_uid, traj.attempt)
            self.journal.count("duplicates")
            return "duplicate"
        held = self.groups.get(traj.prompt_uid, {})
        whole = whole_episodes(held.values()) if held else {}
        if (traj.attempt, traj.uid) in held or traj.group_index in whole:
            self.journal.count("duplicates")
            return "duplicate"
        if traj.attempt in self.refused.get(traj.prompt_uid, ()):
            self.journal.count("invalid_group_rest")
            return "invalid"
        reason = invalid_reason(
            traj, group_size=self.group_size, version=self.staleness.version, epoch=self.epoch
        )
        if reason is None and any(
            t.attempt == traj.attempt
            and t.group_index == traj.group_index
            and t.episode_samples != traj.episode_samples
            for t in held.values()
        ):
            reason = "episode_samples_mismatch"
        if reason is not None:
            self._refuse(traj, reason)
            return "invalid"
        self.hold(traj.past_scoring())  # the record is the buffer's, by prompt id
        group = self.groups[traj.prompt_uid]
        if traj.episode_samples == 1:
            # a one-sample episode is whole by itself, and holding it made no other whole
            # or not (its index was in none, else it were a duplicate): no recount
            whole[traj.group_index] = traj.attempt
        else:
            whole = whole_episodes(group.values())
        if whole.get(traj.group_index) == traj.attempt:
            self._supersede(group, traj)
        if len(whole) < self.group_size:
            return "pending"
        del self.groups[traj.prompt_uid]
        return self._complete(traj.prompt_uid, group.values())

    def _complete(
        self, prompt_uid: str, samples: Iterable[Trajectory], head: int | None = None
    ) -> str:
        """The group of ``samples`` is whole: admits, rejects or filters it (``head``: its
        head version, when the caller has it)."""
        self.completed.add(prompt_uid)  # from now on the prompt tells duplicates
        self.refused.pop(prompt_uid, None)  # its samples are duplicates before refused
        self.leases.finish(prompt_uid)
        admitted = admitted_group(samples, self.shape)
        if head is None:
            head = admitted.head_version
        version = self.staleness.version
        if not self.staleness.on_scored(head):
            self.journal.count("rejected_samples", len(admitted.samples))
            self.journal.event("reject", prompt=prompt_uid, head=head, version=version)
            return "rejected"
        # judged on the episodes' rewards (their final samples'), as the advantages are
        finals = {admitted.shaped_rewards[i] for i in admitted.final_positions}
        if self.dynamic_filter and len(finals) == 1:
            self.staleness.drop_accepted(1)
            self.journal.count("filtered_groups")
            self.journal.event("filter", prompt=prompt_uid)
            return "filtered"
        self.ready.append(admitted)
        self._heads[prompt_uid] = head
        self.journal.event("admit", prompt=prompt_uid, head=head, version=version)
        return "admitted"

    def on_scored_group(self, samples: Sequence[Trajectory]) -> list[str]:
        """Takes the samples of one group message, in order, each judged as
        :meth:`on_scored` judges a sample that came alone; their outcomes.

        The common message, one attempt's whole group of one-sample episodes of a prompt
        nothing is held of, all of it valid, is judged in one go
        (:func:`group_head_if_valid`) to the same outcomes: ``pending`` for all but the
        last sample, then the group's."""
        if samples:
            first = samples[0]
            uid = first.prompt_uid
            fresh = (
                uid not in self.completed
                and uid not in self.groups
                and first.attempt not in self.refused.get(uid, ())
            )
            head = (
                group_head_if_valid(
                    samples,
                    group_size=self.group_size,
                    version=self.staleness.version,
                    epoch=self.epoch,
                )
                if fresh
                else None
            )
            if head is not None:
                taken = [t.past_scoring() for t in samples]  # as `hold` keeps them
                outcome = self._complete(uid, taken, head)
                return ["pending"] * (len(samples) - 1) + [outcome]
        return [self.on_scored(t) for t in samples]

    def _supersede(self, group: dict[tuple[str, str], Trajectory], traj: Trajectory) -> None:
        """``traj``'s attempt made its episode whole: drops the other attempts' samples of
        that episode (counted), so the group holds it from that attempt alone."""
        stale = [
            key
            for key, t in group.items()
            if t.group_index == traj.group_index and t.attempt != traj.attempt
        ]
        for key in stale:
            del group[key]
        if stale:
            self.journal.count("superseded_partial_samples", len(stale))
            self.journal.event(
                "supersede",
                prompt=traj.prompt_uid,
                episode=traj.group_index,
                attempt=traj.attempt,
                dropped=len(stale),
            )

    def _refuse(self, traj: Trajectory, reason: str) -> None:
        """Counts the reason, abandons this attempt's group (its samples may come again
        from the next attempt) and returns the prompt to the pool."""
        self.journal.count("invalid_samples")
        self.journal.count(f"invalid_{reason}")
        self.journal.event(
            "invalid", prompt=traj.prompt_uid, uid=traj.uid, actor=traj.actor_id, reason=reason
        )
        self.refused.setdefault(traj.prompt_uid, set()).add(traj.attempt)
        group = self.groups.get(traj.prompt_uid, {})
        for key in [k for k, t in group.items() if t.attempt == traj.attempt]:
            del group[key]
        if not group:
            self.groups.pop(traj.prompt_uid, None)
        self.leases.return_prompt(traj.prompt_uid, f"invalid: {reason}", lease_id=traj.attempt)

    def take_first_to_expire(self, n: int) -> list[Group]:
        """Takes the ``n`` ready groups that go stale first: the oldest head versions (a
        group without one, never stale, last), ties in admission order; returned in
        admission order.

        Groups finish out of order: one leased early whose episodes ran long is admitted
        behind groups leased after it. The capacity rule lets each group start only if
        it can be trained within η when groups are taken in the order they *started*;
        taken in the order they were admitted, such a late group waits behind younger
        ones and expires. Its head version is when its generation started."""
        if n >= len(self.ready):
            taken = list(self.ready)
            self.ready.clear()
            return taken
        groups = list(self.ready)
        by_expiry = sorted(range(len(groups)), key=lambda i: (self._expiry(groups[i]), i))
        chosen = set(by_expiry[:n])
        self.ready = deque(g for i, g in enumerate(groups) if i not in chosen)
        return [g for i, g in enumerate(groups) if i in chosen]

    def _expiry(self, group: Group) -> float:
        head = self._head(group)
        return math.inf if head < 0 else head

    def _head(self, group: Group) -> int:
        """A ready group's head version: as admission found it, else its own (read)."""
        head = self._heads.get(group.prompt_uid)
        return group.head_version if head is None else head

    def drop_stale(self) -> int:
        """Rejects the ready groups that became too stale at the current version (their
        budget returns); how many. A group is admitted only if admissible at the version
        of its admission, so only a newer version can make one stale: the scan (a look
        at every token's version) runs once per version, not once per admitted group."""
        if self.staleness.version == self._fresh_at:
            return 0
        self._fresh_at = self.staleness.version
        fresh: deque[Group] = deque()
        heads: dict[str, int] = {}
        dropped = 0
        for group in self.ready:
            head = self._head(group)
            if self.staleness.admissible(head):
                fresh.append(group)
                heads[group.prompt_uid] = head
                continue
            dropped += 1
            self.staleness.expire_accepted(1)
            self.journal.count("rejected_samples", len(group.samples))
            self.journal.event(
                "reject", prompt=group.prompt_uid, head=head, version=self.staleness.version
            )
        self.ready, self._heads = fresh, heads
        return dropped

    def roll_back(
        self,
        version: int,
        epoch: int,
        served: Sequence[Group],
        rerun: Sequence[str] = (),
    ) -> int:
        """The trainer restarted from its checkpoint at ``version`` (a new ``epoch``): the
        versions after it never happened. Judges again every group that was admitted or
        served (``served``: the groups of batches for steps after ``version``, which the
        restarted trainer will ask for again):

        - a group whose every token comes from a version ≤ ``version`` is admitted again
          (those weights are the restarted trainer's too);
        - the prompt uids of ``rerun`` (batches served earlier since the checkpoint, whose
          samples are no longer held) go back to the pool, counted like dropped groups;
        - any other group is dropped (counted ``rolled_back_groups``) and its prompt goes
          back to the pool to be run again;
        - groups still in the making are abandoned like an invalid attempt; their later
          samples, and every sample of the old epoch still in flight, are refused as
          ``old_epoch`` and their prompts return through their leases.

        ``accepted`` is recounted as ``version·B`` plus the groups kept. Returns how many
        groups were dropped."""
        self.epoch = epoch
        self.staleness.version = version
        self._fresh_at = -1
        keep: deque[Group] = deque()
        dropped = 0
        for group in [*served, *self.ready]:
            if group.newest_version <= version:
                keep.append(group)
                continue
            dropped += 1
            uid = group.prompt_uid
            self.completed.discard(uid)
            self.leases.rerun(self.leases.source.prompt(uid))
            self.journal.count("rolled_back_groups")
            self.journal.count("rolled_back_samples", len(group.samples))
            self.journal.event("roll_back", prompt=uid, version=version, epoch=epoch)
        for uid in rerun:
            dropped += 1
            self.completed.discard(uid)
            self.leases.rerun(self.leases.source.prompt(uid))
            self.journal.count("rolled_back_groups")
            self.journal.event("roll_back", prompt=uid, version=version, epoch=epoch)
        self.ready = keep
        for prompt_uid, partial in list(self.groups.items()):
            del self.groups[prompt_uid]  # before its lease goes: that may drop the prompt
            for attempt in {t.attempt for t in partial.values()}:
                self.refused.setdefault(prompt_uid, set()).add(attempt)
                self.leases.return_prompt(prompt_uid, "rolled back", lease_id=attempt)
        self.staleness.accepted = version * self.staleness.batch_size + len(keep)
        return dropped
