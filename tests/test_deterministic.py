"""``rollout.deterministic``: generation that depends only on (run seed, prompt id, sample
index, attempt). The hf engine runs each sequence alone, so its logits are the same bits
whatever else is in flight; the workflows seed each sample from its key; the buffer numbers
attempts and orders batches; the rollout actor starts a lease's episodes under the lease's
weights. The whole run is tests/test_e2e_deterministic.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from actor_helpers.buffer_kit import context, recipe
from test_buffer import lease, make_buffer, sample

from asyncrl.actors.rollout import RolloutActor
from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.hf_batch import DecodeBatch, Sequence
from asyncrl.engines.instant import InstantEngine
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.messages import EpisodeAborted, Lease, Prompt, WeightsUpdated
from asyncrl.workflows.rlvr import RLVRWorkflow, sample_seed

Logits = dict[tuple[tuple[int, ...], int | None, int], bytes]
"""Every logits row an engine sampled from, by (prompt, seed, tokens generated before)."""


@pytest.fixture
async def engine() -> AsyncIterator[HFEngine]:
    # the config asks for batches of 16 and a prefix cache: deterministic overrides both
    config = HFEngineConfig(max_batch_size=16, prefix_cache_mb=64)
    async with HFEngine(str(tiny_model_dir()), config, deterministic=True) as eng:
        yield eng


@pytest.fixture
def logits(monkeypatch: pytest.MonkeyPatch) -> Logits:
    """Records the logits of every token the engines sample."""
    seen: Logits = {}
    sample = DecodeBatch._sample

    def recording(
        self: DecodeBatch, logits_NV: torch.Tensor, seqs: list[Sequence], *args: Any
    ) -> int:
        for row_V, s in zip(logits_NV, seqs, strict=True):
            key = (tuple(s.prompt), s.sampling.seed, len(s.out_ids))
            seen[key] = row_V.float().numpy().tobytes()
        return sample(self, logits_NV, seqs, *args)

    monkeypatch.setattr(DecodeBatch, "_sample", recording)
    return seen


def request(engine: HFEngine, text: str, n: int, seed: int | None) -> GenerateRequest:
    ids = list(engine.tokenizer.encode(text, add_special_tokens=False))
    sp = SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed, stop_token_ids=())
    return GenerateRequest(input_ids=ids, sampling=sp)


async def test_a_request_computes_the_same_bits_alone_and_among_others(
    engine: HFEngine, logits: Logits
) -> None:
    target = request(engine, "What is 13 - 17? Answer:", 12, seed=7)
    alone = await engine.agenerate(target)
    alone_logits = dict(logits)
    logits.clear()
    # others of other lengths, one of the same prompt (a group), unseeded ones, some that
    # join while the target decodes, and a prompt extending a finished sequence (which the
    # prefix cache would serve)
    others = [
        request(engine, "hi", 16, seed=None),
        request(engine, "What is 13 - 17? Answer:", 8, seed=8),
        request(engine, "The quick brown fox jumps over the lazy dog, again", 20, seed=3),
    ]
    extended = request(
        engine, "What is 13 - 17? Answer:" + engine.tokenizer.decode(alone.output_ids), 4, None
    )
    async with asyncio.TaskGroup() as tg:
        early = [tg.create_task(engine.agenerate(r)) for r in others[:2]]
        among = tg.create_task(engine.agenerate(target))
        await asyncio.sleep(0)  # a yield: these come while the first ones run
        late = [tg.create_task(engine.agenerate(r)) for r in [*others[2:], extended]]
    together: GenerateResponse = among.result()
    assert all(t.result().finish_reason == "length" for t in early + late)
    assert together.output_ids == alone.output_ids
    assert together.output_logprobs == alone.output_logprobs  # floats, compared exactly
    mine = {k: v for k, v in logits.items() if k[:2] == (tuple(target.input_ids), 7)}
    assert len(mine) == 12 and mine == alone_logits  # every logits row, bit for bit
    assert engine.stats.max_decode_batch == 1
    assert engine.stats.prefix_cache_hit_tokens == 0 and engine.stats.prefix_cache_bytes == 0


async def test_a_fresh_engine_gives_the_same_bits(engine: HFEngine) -> None:
    target = request(engine, "What is 2 + 2?", 16, seed=11)
    first = await engine.agenerate(target)
    async with HFEngine(str(tiny_model_dir()), deterministic=True) as fresh:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(fresh.agenerate(request(fresh, "hello there", 20, seed=1)))
            again = tg.create_task(fresh.agenerate(target))
    assert again.result().output_ids == first.output_ids
    assert again.result().output_logprobs == first.output_logprobs


def test_a_sample_seed_is_its_key_and_a_retry_draws_anew() -> None:
    assert sample_seed(None, "e0-1", 0) is None
    seeds = {
        sample_seed(seed, uid, index, attempt)
        for seed in (1, 2)
        for uid in ("e0-1", "e0-2")
        for index in (0, 1)
        for attempt in (1, 2)
    }
    assert len(seeds) == 16
    assert sample_seed(1, "e0-1", 0) == sample_seed(1, "e0-1", 0, attempt=1)


async def episode_tokens(
    engine: HFEngine, seed: int, item: dict[str, Any], *, beside: int = 0
) -> list[list[int]]:
    """The tokens of ``item``'s group from the rlvr workflow with run seed ``seed``,
    while ``beside`` other episodes run at once."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed)
    workflow = RLVRWorkflow(engine.tokenizer, sp, group_size=3)
    async with asyncio.TaskGroup() as tg:
        for i in range(beside):
            tg.create_task(workflow.arun_episode(engine, {"uid": f"e0-{i + 10}", "prompt": "2+2?"}))
        task = tg.create_task(workflow.arun_episode(engine, item))
    trajectories = task.result()
    assert trajectories is not None
    return [t.input_ids.numpy().tolist() for t in trajectories]


async def test_the_run_seed_and_the_attempt_change_the_draws_and_nothing_else_does(
    engine: HFEngine,
) -> None:
    item = {"uid": "e0-3", "prompt": "What is 1 + 2?"}
    first = await episode_tokens(engine, 1, item)
    assert len({tuple(t) for t in first}) == 3  # the group's samples are drawn apart
    assert await episode_tokens(engine, 1, item, beside=1) == first
    assert await episode_tokens(engine, 1, {**item, "attempt": 1}) == first
    assert await episode_tokens(engine, 2, item) != first
    assert await episode_tokens(engine, 1, {**item, "attempt": 2}) != first


async def test_leases_number_the_attempts_of_a_prompt(tmp_path: Path) -> None:
    buf = make_buffer(tmp_path)
    got = await lease(buf, 1)
    (prompt,) = got.prompts
    assert prompt.attempt == 1
    await buf.on_aborted(
        EpisodeAborted(actor_id="r0", prompt_uid=prompt.uid, lease_id=got.lease_id)
    )
    (again,) = (await lease(buf, 1)).prompts
    assert again.uid == prompt.uid and again.attempt == 2


async def test_a_deterministic_buffer_orders_each_batch_by_prompt_id(tmp_path: Path) -> None:
    for deterministic in (False, True):
        buf = make_buffer(tmp_path, f"rollout.deterministic={str(deterministic).lower()}")
        uids = [p.uid for p in (await lease(buf, 2)).prompts]
        for uid in sorted(uids, reverse=True):  # the later prompt id is admitted first
            for i in range(2):
                await buf.on_scored(sample(uid, i, 0, float(i)))
        batch = buf.batcher.take(1, {})
        order = [g.prompt_uid for g in batch.groups]
        assert order == (sorted(uids) if deterministic else sorted(uids, reverse=True))


async def test_a_lease_waits_for_the_weights_of_its_version(tmp_path: Path) -> None:
    r = recipe("rollout.deterministic=true", "rollout.engine.type=instant")
    actor = RolloutActor(context(tmp_path, NatsInfo(url="nats://127.0.0.1:1"), r, "r0"))
    engine = actor.engine = InstantEngine()
    # announced already (the weights loop is loading it): no need to ask the buffer
    actor._pending_weights = WeightsUpdated(version=1, kind="dir", location="")
    leased = Lease(lease_id="l", actor_id="r0", version=1, prompts=[Prompt(uid="e0-1", data={})])
    waiting = asyncio.create_task(actor._weights_of(leased))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not waiting.done()
    await engine.update_weights([], 1)
    actor._version_changed.set()
    await asyncio.wait_for(waiting, 5)
    # weights as new as the lease's: nothing to wait for
    await asyncio.wait_for(actor._weights_of(leased), 5)
