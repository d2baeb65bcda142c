"""The staleness bound, checked from the raw data rather than the trainer's own records.

A whole ``asyncrl up recipes/ci.toml`` run whose answers are long enough (up to 128
tokens) that weight updates land while a sample is being generated, so one sample carries
tokens of two policy versions. The test reads every raw trajectory the rollout actor published, as it
was published, and recomputes from their per-token versions what the buffer and the
trainer claim in ``trained_samples.jsonl``.

How the raw trajectories are read: the run's trajectory stream is a work queue, so a raw
trajectory leaves it as soon as a reward actor has acknowledged it. The test therefore
brings its own nats-server (``run.nats_url``), creates the run's stream exactly as
``asyncrl up`` does, and adds a mirror of it (limits retention: it keeps everything)
before the run starts; the mirror copies each message as it is stored, without taking
part in the work queue.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from e2e_kit import CI_RECIPE
from nats.js import api
from test_e2e import read_jsonl, run, up_args

from asyncrl.launch.up import ensure_trajectory_stream
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.wire.codec import decode
from asyncrl.wire.messages import Trajectory, TrajectoryGroup
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow

ETA = 1  # recipes/ci.toml's buffer.max_head_offpolicyness
STEPS = 4  # every update lands mid-sequence (see below), so a few suffice
MIRROR_LIMIT_S = 30.0


async def mirror_run_stream(bus: Bus, subjects: Subjects) -> str:
    """Creates the run's trajectory stream as ``asyncrl up`` will, and a mirror of it;
    returns the mirror's name once the mirror is copying."""
    await ensure_trajectory_stream(bus, subjects)
    mirror = f"{subjects.stream}_MIRROR"
    config = api.StreamConfig(
        name=mirror, mirror=api.StreamSource(name=subjects.stream), storage=api.StorageType.FILE
    )
    await bus.js.add_stream(config)
    # The server sets up the mirror's consumer in the background and offers no event for
    # it; a message acknowledged before that would never reach the mirror.
    async with asyncio.timeout(MIRROR_LIMIT_S):
        while not await copying(bus, mirror):  # noqa: ASYNC110 - a server state, no event
            await asyncio.sleep(0.05)
    return mirror


async def copying(bus: Bus, mirror: str) -> bool:
    """Whether the mirror's consumer on its origin is up (``active`` is -1 until then)."""
    source = (await bus.js.stream_info(mirror)).mirror
    return source is not None and source.active is not None and source.active >= 0


async def last_seq(bus: Bus, stream: str) -> int:
    return int((await bus.js.stream_info(stream)).state.last_seq)


async def read_mirror(bus: Bus, subjects: Subjects, mirror: str) -> list[Trajectory]:
    """Every raw trajectory of the run, in the order the stream stored them (the samples
    of a group message in their order in it, each with the group's prompt record)."""
    origin = (await bus.js.stream_info(subjects.stream)).state
    async with asyncio.timeout(MIRROR_LIMIT_S):  # the mirror catches up asynchronously
        while await last_seq(bus, mirror) < origin.last_seq:  # noqa: ASYNC110 - as above
            await asyncio.sleep(0.05)
    state = (await bus.js.stream_info(mirror)).state
    assert state.messages == origin.last_seq, "the mirror missed messages"
    raw = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await bus.js.get_msg(mirror, seq)
        if msg.subject == subjects.trajectories:
            assert msg.data is not None
            raw.append(decode(msg.data, Trajectory))
        elif msg.subject == subjects.trajectory_groups:  # the rlvr workflow's: a group each
            assert msg.data is not None
            group = decode(msg.data, TrajectoryGroup)  # its prompt record given back to each
            raw.extend(t.model_copy(update={"data": group.data}) for t in group.samples)
    return raw


async def mirrored_run(
    tmp_path: Path,
    name: str,
    monkeypatch: pytest.MonkeyPatch,
    *sets: str,
    recipe: Path = CI_RECIPE,
) -> list[Trajectory]:
    """``asyncrl up`` of ``recipe`` as the run ``tmp_path/name`` with ``sets``, on a
    nats-server of the test's own whose trajectory stream is mirrored from the start;
    asserts the run exits 0 and returns every raw trajectory it published
    (:func:`read_mirror`)."""
    subjects = Subjects(name)
    async with EmbeddedNats(tmp_path / "nats") as server:
        assert server.info.token
        # the credentials of an external server come from up's environment, never the recipe
        monkeypatch.setenv("ASYNCRL_NATS_TOKEN", server.info.token)
        bus = await Bus.connect(server.info, name="test")
        try:
            mirror = await mirror_run_stream(bus, subjects)
            argv = up_args(tmp_path, name, f"run.nats_url={server.info.url}", *sets, recipe=recipe)
            code, out = await run(argv)
            assert code == 0, out
            return await read_mirror(bus, subjects, mirror)
        finally:
            await bus.close()


def generated_versions(t: Trajectory) -> np.ndarray:
    """The policy versions of the generated tokens, in order."""
    return t.versions.numpy()[t.loss_mask.numpy().astype(bool)]


@pytest.mark.timeout(600)  # generation here is slow on purpose
async def test_head_version_and_staleness_hold_on_the_raw_per_token_versions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    name = "stale"
    raw = await mirrored_run(
        tmp_path,
        name,
        monkeypatch,
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=1000",
        # Weight updates must land while a sequence is running, so generating
        # a step's samples has to take longer than training on them: were
        # generation as fast, the rollout would reach the staleness bound just
        # before each update and wait for it between samples. So one row
        # decodes at a time, answers run up to 128 tokens, and the trainer
        # keeps to one thread: with two, its threads wait on the core that
        # decodes, and a step of this tiny model took ~1 s instead of ~0.05 s,
        # as long as generating the batch (the test failed every time once
        # the trainer's allocator made its steps faster).
        "rollout.sampling.max_new_tokens=128",
        "rollout.engine.max_batch_size=1",
        "rollout.group_size=4",
        "trainer.threads=1",
    )

    run_dir = tmp_path / name
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    recipe = json.loads((run_dir / "recipe.json").read_text())
    assert recipe["buffer"]["max_head_offpolicyness"] == ETA
    assert len(trained) == STEPS * recipe["buffer"]["batch_size"] * recipe["rollout"]["group_size"]

    copies: dict[str, list[Trajectory]] = {}
    for t in raw:
        copies.setdefault(t.uid, []).append(t)
        gen = generated_versions(t)
        assert gen.size > 0, f"{t.uid}: no generated token"
        assert (t.versions.numpy()[~t.loss_mask.numpy().astype(bool)] == -1).all(), t.uid
        # a sample's tokens come in order, so its versions never go back
        assert (np.diff(gen) >= 0).all(), f"{t.uid}: versions {gen.tolist()}"

    # (a) weight updates landed mid-sequence: some samples carry two versions or more
    mixed = [t for t in raw if len(set(generated_versions(t).tolist())) >= 2]
    assert mixed, "no raw trajectory carries two policy versions"

    mismatched: list[dict[str, Any]] = []
    too_stale: list[dict[str, Any]] = []
    for record in trained:
        assert record["uid"] in copies, f"{record['uid']} was trained but never published raw"
        heads = [int(generated_versions(t).min()) for t in copies[record["uid"]]]
        # a prompt leased twice (an expired lease) has a raw copy per attempt, and one of
        # them is what was trained; normally there is exactly one
        h = heads[0] if len(heads) == 1 else record["head_version"]
        # (b) the buffer's head version is the oldest version over the generated tokens
        if h not in heads or record["head_version"] != h:
            mismatched.append({**record, "raw_heads": heads})
        # (c) η holds for the version it was trained at, with h from the raw versions
        if record["trained_version"] - h > ETA:
            too_stale.append({**record, "raw_head": h})
    assert not mismatched, f"head_version is not the raw minimum: {mismatched[:3]}"
    assert not too_stale, f"trained beyond η={ETA}: {too_stale[:3]}"
    # without trained samples of two versions, (b) could not tell the first token's
    # version, or the last one's, from the minimum
    trained_mixed = {r["uid"] for r in trained} & {t.uid for t in mixed}
    assert trained_mixed, "no trained sample carries two versions: " + str(
        [(t.uid, sorted(set(generated_versions(t).tolist()))) for t in mixed]
    )
    print(
        f"raw {len(raw)} (uids with several attempts: "
        f"{sum(len(c) > 1 for c in copies.values())}), with two versions or more "
        f"{len(mixed)}; trained {len(trained)}, with two versions or more {len(trained_mixed)}"
    )
