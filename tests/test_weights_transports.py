"""The weight transports (:mod:`asyncrl.weights`): the wire layout of a version, what
``auto`` picks and why, the recipe's refusals, and the broadcast between a publisher and
receivers over a real gloo group and a real NATS server: join, receive, a dropped
engine re-joining, and the object store when the group cannot form."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from weights_kit import gloo_publisher, tensor_weights

from asyncrl.config.checks import recipe_problems
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.engines.instant import InstantEngine
from asyncrl.runtime.bus import Bus
from asyncrl.weights import choose
from asyncrl.weights.collective import CollectivePublisher
from asyncrl.weights.engine_side import CollectiveEngineSide
from asyncrl.weights.receiver import EngineWeights
from asyncrl.weights.version import PolicyWeights, Wanted
from asyncrl.weights.wire import BucketPool, pack, unpack
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects


def test_pack_lays_tensors_out_in_buckets_and_unpack_gives_them_back() -> None:
    a = torch.arange(6, dtype=torch.float32).reshape(2, 3)  # 24 bytes
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)  # 4 bytes
    c = torch.arange(10, dtype=torch.int64)  # 80 bytes: larger than a bucket
    d = torch.ones(3, dtype=torch.float16)  # 6 bytes
    packed = pack([("a", a), ("b", b), ("c", c), ("d", d)], 32, version=7, epoch=2)
    manifest = json.loads(packed.manifest)
    # a and b share the first bucket (24 + 4 <= 32); c alone (80 > 32); d starts a new one
    assert manifest["buckets"] == [28, 80, 6]
    assert [(e["bucket"], e["offset"], e["nbytes"]) for e in manifest["tensors"]] == [
        (0, 0, 24),
        (0, 24, 4),
        (1, 0, 80),
        (2, 0, 6),
    ]
    assert (packed.version, packed.epoch, packed.nbytes) == (7, 2, 114)
    out = dict(unpack(packed.manifest, packed.buckets))
    for name, t in (("a", a), ("b", b), ("c", c), ("d", d)):
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)
    # the unpacked tensors are views of the buckets: no copy on the receiving side
    assert out["a"].untyped_storage().data_ptr() == packed.buckets[0].data_ptr()
    # a later version of the same layout is written into the same buckets; another
    # layout gets buckets of its own
    again = pack([("a", a + 1), ("b", b), ("c", c), ("d", d)], 32, 8, 2, into=packed.buckets)
    assert [x.data_ptr() for x in again.buckets] == [x.data_ptr() for x in packed.buckets]
    assert torch.equal(dict(unpack(again.manifest, again.buckets))["a"], a + 1)
    other = pack([("a", a)], 32, 9, 2, into=packed.buckets)
    assert other.buckets[0].data_ptr() != packed.buckets[0].data_ptr()


def test_receive_buffers_are_taken_again_for_the_same_layout() -> None:
    pool = BucketPool(keep=1)
    first = pool.take([8, 4], "cpu")
    pool.give(first)
    assert pool.take([8, 4], "cpu") is first  # given back once loaded: taken again
    assert pool.take([8, 4], "cpu") is not first  # lent out: a fresh set
    pool.give(first)
    pool.give(pool.take([2], "cpu"))  # the pool keeps one set at most
    assert pool.take([2], "cpu") is not first and pool.take([8, 4], "cpu") is first


def test_auto_picks_a_transport_and_says_why() -> None:
    kind, why = choose(load_recipe(None, ["trainer.device=cpu", "rollout.engine.device=cpu"]))
    assert kind == "collective" and "gloo" in why
    kind, why = choose(load_recipe(None, ["rollout.engine.type=vllm", "trainer.device=cpu"]))
    assert kind == "collective" and "vllm server" in why
    kind, why = choose(load_recipe(None, ["rollout.engine.type=vllm", "rollout.engine.servers=2"]))
    assert kind == "object_store" and "rollout.engine.servers = 2" in why
    kind, why = choose(load_recipe(None, ["rollout.engine.type=sglang", "trainer.device=cpu"]))
    assert kind == "collective" and "sglang server" in why
    kind, why = choose(load_recipe(None, ["trainer.lora.rank=8"]))
    assert kind == "object_store" and "adapter" in why
    kind, why = choose(load_recipe(None, ["weights.transport=dir"]))
    assert (kind, why) == ("dir", "set by weights.transport")


def test_the_old_key_names_the_new_one_and_bad_combinations_are_refused() -> None:
    with pytest.raises(RecipeError, match=r"trainer.weights_transport is now weights.transport"):
        load_recipe(None, ["trainer.weights_transport=object_store"])
    sglang = ["rollout.engine.type=sglang", "weights.transport=collective", "trainer.device=cpu"]
    for extra in ("rollout.engine.cpu=true", 'rollout.engine.urls=["http://h:1"]'):
        errors, _ = recipe_problems(load_recipe(None, [*sglang, extra]))
        assert not [e for e in errors if "weights.transport" in e], (extra, errors)
    for extra, named in (
        ('rollout.engine.args=["--tp-size","2"]', "--tp-size 2"),
        ('rollout.engine.args=["--dp-size=2"]', "--dp-size 2"),
        ('rollout.engine.urls=["http://h:1","http://h:2"]', "rollout.engine.urls has 2"),
    ):
        errors, _ = recipe_problems(load_recipe(None, [*sglang, extra]))
        assert any('"collective"' in e and named in e for e in errors), (extra, errors)
    errors, _ = recipe_problems(load_recipe(None, ["weights.transport=cuda_ipc"]))
    assert any("same CUDA device" in e for e in errors)
    vllm = ["rollout.engine.type=vllm", "weights.transport=collective", "trainer.device=cpu"]
    errors, _ = recipe_problems(load_recipe(None, vllm))
    assert not [e for e in errors if "weights.transport" in e]
    for extra, named in (
        ("rollout.engine.servers=2", "rollout.engine.servers = 2"),
        ('rollout.engine.urls=["http://h:1"]', "rollout.engine.urls"),
        ('rollout.engine.args=["--tensor-parallel-size","2"]', "--tensor-parallel-size 2"),
        ('rollout.engine.args=["-tp=2"]', "-tp 2"),
    ):
        errors, _ = recipe_problems(load_recipe(None, [*vllm, extra]))
        assert any('"collective"' in e and named in e for e in errors), (extra, errors)


def _model(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("embed.weight", torch.randn(64, 16, generator=g)),
        ("layer.bias", torch.randn(16, generator=g)),
    ]


async def _publisher(bus: Bus, subjects: Subjects, **config: object) -> CollectivePublisher:
    pub = gloo_publisher(bus, subjects, **config)
    await pub.start()
    return pub


async def _received(receiver: EngineWeights) -> tuple[int, str, dict[str, torch.Tensor]]:
    async with asyncio.timeout(30):
        async with receiver.receive() as got:
            return got.version, got.via, dict(got.source)


async def test_engines_join_receive_every_version_and_rejoin_when_dropped(
    tmp_path: Path, bus: Bus
) -> None:
    subjects = Subjects("collective")
    pub = await _publisher(bus, subjects)
    receivers = [
        EngineWeights(InstantEngine(), bus, subjects, f"rollout-{i}", device="cpu")
        for i in range(2)
    ]
    for r in receivers:
        await r.listen()

    # the first version reaches nobody by broadcast: the engines join on its announcement
    # and the join brings it
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    for r in receivers:
        version, via, got = await _received(r)
        assert (version, via) == (1, "collective")
        assert all(torch.equal(got[n], t) for n, t in _model(1))
    assert pub.stats.joins == 2

    msg = await pub.publish(tensor_weights(2, _model(2), tmp_path))
    assert sorted(msg.members) == ["rollout-0", "rollout-1"]
    assert pub.delivery()["sent_to"] == ["rollout-0", "rollout-1"]
    for r in receivers:
        version, via, got = await _received(r)
        assert (version, via) == (2, "collective")
        assert all(torch.equal(got[n], t) for n, t in _model(2))

    # the buffer's answer to "which weights are the latest?" repeats an announcement: it
    # is not received twice (that receive would wait for the next version's bytes)
    for r in receivers:
        r.announce(msg)
    # the trainer drops an engine (as after a failed send): the next version is announced
    # without it, it notices, joins again, and the join brings that version
    pub._drop(pub.members["rollout-1"], "test")
    msg = await pub.publish(tensor_weights(3, _model(3), tmp_path))
    assert msg.members == ["rollout-0"]
    for r in receivers:
        version, via, got = await _received(r)
        assert (version, via) == (3, "collective")
        assert all(torch.equal(got[n], t) for n, t in _model(3))
    assert pub.stats.joins == 3 and pub.stats.dropped == 1
    msg = await pub.publish(tensor_weights(4, _model(4), tmp_path))
    assert sorted(msg.members) == ["rollout-0", "rollout-1"]
    for r in receivers:
        assert (await _received(r))[:2] == (4, "collective")


async def test_an_engine_is_sent_only_the_versions_it_loads(tmp_path: Path, bus: Bus) -> None:
    """An eval engine (versions 0, every 2nd and the last, 5) says so in its join: the
    trainer sends it those alone, lists it as skipped for the others, and it stays in the
    group (it does not take a skipped version for a drop and join again); a rollout
    engine beside it gets every version."""
    subjects = Subjects("wanted")
    pub = await _publisher(bus, subjects)
    rollout = EngineWeights(InstantEngine(), bus, subjects, "rollout-0", device="cpu")
    evals = EngineWeights(
        InstantEngine(),
        bus,
        subjects,
        "eval-0",
        device="cpu",
        want=Wanted(every=2, last=5),
        in_order=True,
    )
    for r in (rollout, evals):
        await r.listen()
    # the joins bring version 1: the eval engine lets it go (not one it loads)
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    assert (await _received(rollout))[:2] == (1, "collective")
    assert pub.stats.joins == 2
    for version in (2, 3, 4, 5):
        msg = await pub.publish(tensor_weights(version, _model(version), tmp_path))
        due = version in (2, 4, 5)
        assert sorted(msg.members) == (["eval-0", "rollout-0"] if due else ["rollout-0"])
        assert msg.skipped == ([] if due else ["eval-0"])
        delivery = pub.delivery()
        assert delivery["skipped"] == msg.skipped and delivery["dropped"] == []
        assert (await _received(rollout))[:2] == (version, "collective")
        if due:
            version_got, via, got = await _received(evals)
            assert (version_got, via) == (version, "collective")
            assert all(torch.equal(got[n], t) for n, t in _model(version))
    assert pub.stats.joins == 2 and pub.stats.dropped == 0
    assert pub.stats.sent == 2 + 4 + 3  # the joins' sends, then rollout 4, eval 3
    assert not evals._pending  # nothing of version 3 was queued


async def test_a_begun_version_arrives_whole_while_the_trainer_changes_its_parameters(
    tmp_path: Path, bus: Bus
) -> None:
    """``begin`` returns once the version is copied out and announced: the trainer's next
    step may then change the very tensors it gathered (live parameters, no clone) and the
    engine still gets the version as it was; the next ``begin`` settles the one before,
    and each version's delivery is what ``delivery`` says after its ``settle``."""
    subjects = Subjects("overlap")
    pub = await _publisher(bus, subjects)
    receiver = EngineWeights(InstantEngine(), bus, subjects, "rollout-0", device="cpu")
    await receiver.listen()
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    assert (await _received(receiver))[:2] == (1, "collective")

    live = _model(2)
    weights = PolicyWeights(
        2, 0, 2, tmp_path / "v2", export=lambda _: None, gather=lambda dtype: live
    )
    msg = await pub.begin(weights)
    assert msg.members == ["rollout-0"]
    for _, t in live:
        t.add_(100.0)  # the next step's optimizer, in place
    version, via, got = await _received(receiver)
    assert (version, via) == (2, "collective")
    assert all(torch.equal(got[n], t) for n, t in _model(2))
    await pub.settle()
    assert pub.delivery()["sent_to"] == ["rollout-0"] and pub.stats.sent == 2

    await pub.begin(tensor_weights(3, _model(3), tmp_path))
    await pub.begin(tensor_weights(4, _model(4), tmp_path))  # settles version 3 first
    assert pub.stats.sent == 3
    await pub.settle()
    assert pub.stats.sent == 4 and pub.stats.dropped == 0
    seen = [0]
    while seen[-1] < 4:  # 3 may be taken before 4 has arrived: each is the newest then
        version, _, got = await _received(receiver)
        seen.append(version)
    assert seen[1:] in ([3, 4], [4]) and all(torch.equal(got[n], t) for n, t in _model(4))


async def test_a_fallback_to_a_dead_trainer_gives_way_to_its_replacements_group(
    tmp_path: Path, bus: Bus
) -> None:
    """A trainer killed in mid-send: the engine's receive fails and it asks the trainer for
    the object store, which nobody answers (the trainer is dead). Its replacement announces
    a new group: the engine gives up the fallback at once rather than after
    ``2 × timeout_s + 30`` s, and the join queued behind it brings the new weights."""
    subjects = Subjects("superseded")
    asked = asyncio.Event()

    async def nobody_answers(reason: str) -> Any:
        asked.set()
        await asyncio.Event().wait()  # the dead trainer's reply never comes

    side = CollectiveEngineSide(
        bus,
        subjects,
        "rollout-0",
        device="cpu",
        loop=asyncio.get_running_loop(),
        fallback=nobody_answers,
        engine=InstantEngine(),
    )
    side.group_id, side.timeout_s = "the-dead-trainers", 120.0
    stuck = side.lane.submit(lambda: side._fall_back("receive failed (connection reset)"))
    await asyncio.wait_for(asked.wait(), 10)
    pub = await _publisher(bus, subjects)  # the replacement
    msg = await pub.publish(tensor_weights(1, _model(1), tmp_path))
    join = side.announce(msg)
    assert join is not None
    async with asyncio.timeout(30):
        with pytest.raises(TimeoutError, match="another group was announced"):
            await asyncio.wrap_future(stuck)
        version, _, got, via, release = await asyncio.wrap_future(join)
    assert (version, via) == (1, "collective")
    assert all(torch.equal(dict(got)[n], t) for n, t in _model(1))
    assert release is not None
    release()


async def test_an_engine_that_cannot_form_the_group_takes_the_object_store(
    tmp_path: Path, bus: Bus, caplog: pytest.LogCaptureFixture
) -> None:
    subjects = Subjects("fallback")
    pub = await _publisher(bus, subjects, timeout_s=3)
    pub.host = "256.0.0.1"  # the grant names an address no engine can reach
    receiver = EngineWeights(InstantEngine(), bus, subjects, "rollout-0", device="cpu")
    await receiver.listen()
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    version, via, got = await _received(receiver)
    assert (version, via) == (1, "object_store")
    assert all(torch.equal(got[n], t) for n, t in _model(1))
    assert receiver.counters["fallbacks"] == 1
    # the group is known not to form: later versions come from the object store at once
    await pub.publish(tensor_weights(2, _model(2), tmp_path))
    assert (await _received(receiver))[:2] == (2, "object_store")
    assert pub.stats.fallbacks == 2


async def test_an_engine_whose_join_went_unanswered_asks_again(tmp_path: Path, bus: Bus) -> None:
    """No trainer answers the first join (and no fallback either): that version is
    counted as not received, and the next announcement of the group asks again."""
    subjects = Subjects("unanswered")
    pub = gloo_publisher(bus, subjects)  # not started: nobody serves joins yet
    receiver = EngineWeights(InstantEngine(), bus, subjects, "rollout-0", device="cpu")
    await receiver.listen()
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    async with asyncio.timeout(30):
        while receiver.counters.get("failed", 0) < 1:
            if receiver._pending:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.5), receiver.receive():
                        pass
            await asyncio.sleep(0.05)
    await pub.start()
    await pub.publish(tensor_weights(2, _model(2), tmp_path))
    version, via, got = await _received(receiver)
    assert (version, via) == (2, "collective")
    assert all(torch.equal(got[n], t) for n, t in _model(2))


async def test_an_engine_that_missed_an_announcement_gets_the_next_copy(
    tmp_path: Path, bus: Bus
) -> None:
    """An announcement published while the engine's connection was down never reaches it
    (plain NATS keeps nothing): the trainer's send to that engine would wait out the whole
    ``weights.timeout_s`` and drop it. The trainer announces the version again while its
    sends are under way, and the engine takes the copy."""
    subjects = Subjects("missed")
    pub = await _publisher(bus, subjects, timeout_s=30)
    receiver = EngineWeights(InstantEngine(), bus, subjects, "rollout-0", device="cpu")
    heard: list[int] = []

    async def lossy(msg: WeightsUpdated) -> None:
        heard.append(msg.version)
        if heard.count(2) == 1 and msg.version == 2:
            return  # the first announcement of version 2 is lost
        receiver.announce(msg)

    await bus.subscribe(subjects.weights, WeightsUpdated, lossy)
    await pub.publish(tensor_weights(1, _model(1), tmp_path))
    assert (await _received(receiver))[:2] == (1, "collective")

    msg = await pub.publish(tensor_weights(2, _model(2), tmp_path))
    assert msg.members == ["rollout-0"]
    delivery = pub.delivery()
    assert delivery["sent_to"] == ["rollout-0"] and delivery["dropped"] == []
    assert pub.stats.dropped == 0 and pub.stats.repeats >= 1
    assert heard.count(2) >= 2
    version, via, got = await _received(receiver)
    assert (version, via) == (2, "collective")
    assert all(torch.equal(got[n], t) for n, t in _model(2))
