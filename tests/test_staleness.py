"""The capacity rule and admission, against hand-computed sequences."""

from __future__ import annotations

from asyncrl.runtime.staleness import StalenessManager, versions_ahead


def test_capacity_formula_by_hand() -> None:
    # B=4, C=10, η=1, v=0: min(10 − 0, (1 + 0 + 1)·4 − 0) = 8
    sm = StalenessManager(batch_size=4, max_concurrent=10, max_head_offpolicyness=1)
    assert sm.capacity() == 8
    sm.on_start(8)
    assert sm.capacity() == 0  # min(2, 8 − 8)
    for _ in range(4):
        assert sm.on_scored(head_version=0)
    # accepted=4, running=4: min(10 − 4, 8 − 8) = 0
    assert sm.capacity() == 0
    sm.set_version(1)
    # min(6, (1+1+1)·4 − (4+4)) = min(6, 4) = 4
    assert sm.capacity() == 4


def test_concurrency_bound_wins_when_smaller() -> None:
    sm = StalenessManager(batch_size=16, max_concurrent=3, max_head_offpolicyness=4)
    assert sm.capacity() == 3
    sm.on_start(3)
    assert sm.capacity() == 0


def test_eta_zero_is_synchronous() -> None:
    sm = StalenessManager(batch_size=2, max_concurrent=100, max_head_offpolicyness=0)
    assert sm.capacity() == 2  # exactly one batch ahead of the trainer
    sm.on_start(2)
    assert sm.on_scored(0) and sm.on_scored(0)
    assert sm.capacity() == 0
    sm.set_version(1)
    assert sm.capacity() == 2
    assert not sm.admissible(0) and sm.admissible(1)


def test_rejected_episodes_return_their_budget() -> None:
    sm = StalenessManager(batch_size=2, max_concurrent=100, max_head_offpolicyness=1, version=3)
    assert sm.capacity() == 2 * (1 + 3 + 1)  # nothing accepted yet
    sm.on_start(2)
    assert not sm.on_scored(head_version=1)  # 3 − 1 = 2 > η
    assert sm.on_scored(head_version=2)  # 3 − 2 = 1 ≤ η
    assert (sm.accepted, sm.rejected, sm.running) == (1, 1, 0)
    assert sm.capacity() == 10 - 1


def test_abort_and_filtering_give_budget_back() -> None:
    sm = StalenessManager(batch_size=2, max_concurrent=4, max_head_offpolicyness=0)
    sm.on_start(2)
    sm.on_abort(1)
    assert sm.running == 1 and sm.capacity() == 1
    assert sm.on_scored(0)
    sm.drop_accepted(1)
    assert sm.accepted == 0 and sm.capacity() == 2


def test_restore_sets_accepted_to_v_times_b() -> None:
    sm = StalenessManager(batch_size=8, max_concurrent=64, max_head_offpolicyness=2)
    sm.on_start(5)
    sm.restore(version=3)
    assert (sm.version, sm.accepted, sm.running) == (3, 24, 0)
    assert sm.capacity() == (2 + 3 + 1) * 8 - 24


def test_versions_ahead_by_hand() -> None:
    # k·(⌊η/k⌋ + 1)
    assert versions_ahead(1, 1) == 2  # AReaL's η + 1
    assert versions_ahead(0, 1) == 1
    assert versions_ahead(1, 3) == 3  # 3·(0 + 1)
    assert versions_ahead(2, 2) == 4  # 2·(1 + 1)
    assert versions_ahead(5, 2) == 6  # 2·(2 + 1)


def test_update_every_beyond_eta_plus_one_still_feeds_every_step() -> None:
    """k = 3, η = 1, B = 2: the trainer takes 3 batches from weights v = 0 before it
    publishes v = 3. Judged against the published version, every one of them is fresh
    and the budget lets all of them start."""
    sm = StalenessManager(
        batch_size=2, max_concurrent=100, max_head_offpolicyness=1, update_every=3
    )
    assert sm.capacity() == (0 + 3) * 2
    sm.on_start(6)
    assert all(sm.on_scored(head_version=0) for _ in range(6))
    assert sm.capacity() == 0
    sm.set_version(3)  # published after the trainer's third step
    assert not sm.admissible(0)  # 3 − 0 > η
    assert sm.admissible(2)
    # min(100, (3 + 3)·2 − 6) = 6: the next three steps can be fed
    assert sm.capacity() == 6


def test_an_older_version_never_moves_the_manager_back() -> None:
    sm = StalenessManager(batch_size=2, max_concurrent=8, max_head_offpolicyness=1)
    sm.set_version(4)
    sm.set_version(2)  # a late WeightsUpdated
    assert sm.version == 4
