"""The instant engine: fixed-length instant responses that the real workflow and the
buffer's sense checks accept, and weight updates that change only the version."""

from __future__ import annotations

from asyncrl.actors.buffer.admission import invalid_reason
from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.config.recipe import load_recipe
from asyncrl.config.workflow import WorkflowParts
from asyncrl.engines import build_engine
from asyncrl.engines.config import InstantEngineConfig
from asyncrl.engines.instant import RESPONSE_TOKEN, InstantEngine


async def test_responses_have_the_fixed_length_capped_by_the_budget() -> None:
    async with InstantEngine(config=InstantEngineConfig(response_tokens=5)) as engine:
        full = await engine.agenerate(GenerateRequest(input_ids=[1, 2]))
        short = await engine.agenerate(
            GenerateRequest(input_ids=[1], sampling=SamplingParams(max_new_tokens=3))
        )
    assert full.output_ids == [RESPONSE_TOKEN] * 5 and full.finish_reason == "length"
    assert full.output_logprobs == [-1.0] * 5 and full.output_versions == [0] * 5
    assert len(short.output_ids) == 3


async def test_a_weight_update_changes_the_version_of_new_tokens() -> None:
    async with InstantEngine(config=InstantEngineConfig(response_tokens=2)) as engine:
        await engine.update_weights("unused", 3)
        resp = await engine.agenerate(GenerateRequest(input_ids=[1]))
    assert engine.version == 3 and resp.output_versions == [3, 3]


async def test_the_recipe_builds_it_and_rlvr_episodes_pass_the_buffer_checks() -> None:
    r = load_recipe(
        None,
        ["rollout.engine.type=instant", "rollout.engine.response_tokens=4", "rollout.group_size=3"],
    )
    engine = build_engine(r)
    assert isinstance(engine, InstantEngine) and engine.response_tokens == 4
    await engine.start()
    ro = r.rollout
    parts = WorkflowParts(engine.tokenizer, ro.sampling.params(), ro.group_size)
    workflow = ro.workflow.build(ro, parts)
    trajectories = await workflow.arun_episode(engine, {"uid": "p0", "prompt": "1+1?"})
    await engine.stop()
    assert trajectories is not None and len(trajectories) == 3
    for i, t in enumerate(trajectories):
        assert t.uid == f"p0/{i}" and t.completion == "7777"
        assert int(t.loss_mask.numpy().sum()) == 4
        scored = t.model_copy(update={"reward": 0.0})
        assert invalid_reason(scored, group_size=3, version=0) is None
