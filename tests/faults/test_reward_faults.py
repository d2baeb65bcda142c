"""A reward function that raises, hangs, or returns NaN, an infinity or no number at all:
the reward actor records a zero with the reason, counts it, and goes on scoring.

The actor runs in this process on a real nats-server with real reward worker processes;
each case sends the bad trajectory first and a good one after it, so the good one's score
proves the actor (and, for the hang, its replaced worker) lives on."""

from __future__ import annotations

import pytest
from test_reward_actor import raw, reward_actor, score_all

from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.wire.subjects import Subjects

HANG_TIMEOUT_S = 2.0


@pytest.mark.parametrize(
    ("behaviour", "reason"),
    [
        ("raise", "raised: ValueError: cannot score 'answer 0'"),
        ("hang", f"timeout: no result after {HANG_TIMEOUT_S:g}s"),
        ("nan", "bad_value: returned nan"),
        ("inf", "bad_value: returned -inf"),
        ("text", "bad_value: returned str '1.0'"),
    ],
)
async def test_a_failing_reward_scores_a_recorded_zero_and_the_actor_goes_on(
    embedded_nats: EmbeddedNats, bus: Bus, behaviour: str, reason: str
) -> None:
    subjects = Subjects("t")
    await ensure_trajectory_stream(bus, subjects)
    # one worker: the good trajectory waits for the bad one's worker to be free again
    actor = reward_actor(embedded_nats, workers=1, timeout=HANG_TIMEOUT_S)
    sent = [raw(0, {"behaviour": behaviour}), raw(1, {"behaviour": "one"})]
    scored = await score_all(bus, subjects, actor, sent)  # the actor then stops with 0
    bad, good = scored["p0/0"], scored["p1/0"]
    assert bad.reward == 0.0 and bad.reward_info["ok"] is False
    assert bad.reward_info["reason"].startswith(reason)
    assert good.reward == 1.0 and good.reward_info == {"ok": True, "reason": ""}
    kind = reason.split(":")[0]
    assert actor.counters["scored"] == 2 and actor.counters[f"failed:{kind}"] == 1
    assert actor.pool.failures == {kind: 1}
