"""Where the rollout actor publishes a finished episode's samples: unscored ones to the raw
subject for the reward actors, those its workflow scored straight to the scored subject
(the buffer's), never through the reward actors; a whole group of a workflow that makes
them as one message, on the group subjects. Real nats-server and JetStream stream;
the workflow is a stub that returns fixed samples (no engine: nothing is generated)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from actor_helpers.buffer_kit import context, recipe
from scripted_engine import ScriptedEngine

from asyncrl.actors.rollout import RolloutActor
from asyncrl.api.workflow import RolloutWorkflow
from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.models.tiny import build_tokenizer
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.codec import decode, encode
from asyncrl.wire.messages import Array, Prompt, Trajectory, TrajectoryGroup


def sample(index: int, reward: float | None) -> Trajectory:
    return Trajectory(
        uid=f"?/{index}",
        prompt_uid="?",
        group_index=index,
        group_size=2,
        input_ids=Array.of([1, 2, 3], "int32"),
        loss_mask=Array.of([0, 1, 1], "bool"),
        logprobs=Array.of([0.0, -1.0, -1.0], "float32"),
        versions=Array.of([-1, 0, 0], "int32"),
        reward=reward,
        completion="the answer",
    )


class FixedWorkflow(RolloutWorkflow):
    """Returns the same samples for every prompt."""

    def __init__(self, samples: list[Trajectory]) -> None:
        self.samples = samples

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> list[Trajectory]:
        return [
            t.model_copy(update={"uid": f"{data['uid']}/{t.group_index}"}) for t in self.samples
        ]


async def published(
    tmp_path: Path,
    nats: NatsInfo,
    bus: Bus,
    samples: list[Trajectory],
    *,
    whole_groups: bool = False,
    max_payload: int | None = None,
) -> dict[str, list[tuple[str, Trajectory | TrajectoryGroup]]]:
    """Runs one episode of ``samples`` through the real publish path; returns, by stage
    (``raw``, ``scored``), the (dedup id, message) pairs the trajectory stream stored, read
    back by sequence once the episode returned (each publish returns after the stream's
    ack, so nothing is waited for). ``whole_groups``: as a workflow that returns whole
    groups (RLVR) publishes; else as one that does not (agent code). ``max_payload``: the
    largest message the actor's connection lets through."""
    r = recipe("rollout.group_size=2")
    actor = RolloutActor(context(tmp_path, nats, r, "r0"))
    actor._bus = await Bus.connect(nats, name="r0")
    if max_payload is not None:
        actor._bus.nc._max_payload = max_payload
    actor.engine = ScriptedEngine(build_tokenizer(), lambda prompt: "")  # never asked
    actor.workflow = FixedWorkflow(samples)
    actor._whole_groups = whole_groups
    s = actor.subjects
    await ensure_trajectory_stream(bus, s)
    try:
        prompt = Prompt(uid="e0-7", data={"question": "1+1", "answer": "2"})
        await actor._episode(prompt, "lease-1")
    finally:
        await actor.bus.close()
    seen: dict[str, list[tuple[str, Trajectory | TrajectoryGroup]]] = {"raw": [], "scored": []}
    routes: dict[str, tuple[str, type[Trajectory] | type[TrajectoryGroup]]] = {
        s.trajectories: ("raw", Trajectory),
        s.trajectory_groups: ("raw", TrajectoryGroup),
        s.scored: ("scored", Trajectory),
        s.scored_groups: ("scored", TrajectoryGroup),
    }
    state = (await bus.js.stream_info(s.stream)).state
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(s.stream, seq)
        stage, kind = routes[msg.subject]
        assert msg.headers is not None and msg.data is not None
        seen[stage].append((msg.headers["Nats-Msg-Id"], decode(msg.data, kind)))
    return seen


async def test_a_sample_its_workflow_scored_skips_the_reward_actor(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    seen = await published(tmp_path, nats_server, bus, [sample(0, 1.0), sample(1, 0.0)])
    assert seen["raw"] == []
    assert [i for i, _ in seen["scored"]] == ["scored/lease-1/e0-7/0", "scored/lease-1/e0-7/1"]
    for _, t in seen["scored"]:
        # stamped like any sample, but past scoring: no prompt record, no completion text
        assert isinstance(t, Trajectory)
        assert (t.prompt_uid, t.actor_id, t.attempt) == ("e0-7", "r0", "lease-1")
        assert t.data == {} and t.completion == ""
    assert [t.reward for _, t in seen["scored"]] == [1.0, 0.0]  # type: ignore[union-attr]


async def test_an_unscored_sample_goes_to_the_reward_actor_with_its_prompt_record(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    seen = await published(tmp_path, nats_server, bus, [sample(0, None), sample(1, None)])
    assert seen["scored"] == []
    assert [i for i, _ in seen["raw"]] == ["raw/lease-1/e0-7/0", "raw/lease-1/e0-7/1"]
    for _, t in seen["raw"]:
        assert isinstance(t, Trajectory)
        assert t.data == {"question": "1+1", "answer": "2"} and t.completion == "the answer"


async def test_a_whole_group_goes_as_one_message_with_its_prompt_record_once(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    seen = await published(
        tmp_path, nats_server, bus, [sample(0, None), sample(1, None)], whole_groups=True
    )
    assert seen["scored"] == []
    [(msg_id, group)] = seen["raw"]
    assert msg_id == "raw/lease-1/e0-7/group" and isinstance(group, TrajectoryGroup)
    assert (group.prompt_uid, group.attempt) == ("e0-7", "lease-1")
    assert group.data == {"question": "1+1", "answer": "2"}
    assert [t.uid for t in group.samples] == ["e0-7/0", "e0-7/1"]
    for t in group.samples:
        assert t.data == {} and t.completion == "the answer" and t.actor_id == "r0"
    # scored by its workflow: one message to the buffer, past scoring
    seen = await published(
        tmp_path / "scored", nats_server, bus, [sample(0, 1.0), sample(1, 0.0)], whole_groups=True
    )
    [(msg_id, group)] = seen["scored"]
    assert msg_id == "scored/lease-1/e0-7/group" and isinstance(group, TrajectoryGroup)
    assert group.data == {} and [t.completion for t in group.samples] == ["", ""]
    assert [t.reward for t in group.samples] == [1.0, 0.0]


async def test_a_group_too_large_for_one_message_goes_sample_by_sample(
    tmp_path: Path, nats_server: NatsInfo, bus: Bus
) -> None:
    one = len(encode(sample(0, None).model_copy(update={"uid": "e0-7/0", "prompt_uid": "e0-7"})))
    seen = await published(
        tmp_path,
        nats_server,
        bus,
        [sample(0, None), sample(1, None)],
        whole_groups=True,
        max_payload=one + 200,  # room for a sample and its headers, not for two
    )
    assert [i for i, _ in seen["raw"]] == ["raw/lease-1/e0-7/0", "raw/lease-1/e0-7/1"]
