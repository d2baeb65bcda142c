"""The hf engine's prefix cache: a prompt that extends a finished sequence is prefilled only
past the cached blocks, and gives the tokens and logprobs a cold engine gives; weight
updates empty it; its cap holds, least recently used blocks going first."""

from __future__ import annotations

import asyncio
import json
import string
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_engine_hf import LOGPROB_ATOL, perturbed, sampling, teacher_forced

from asyncrl.api.inference import GenerateRequest, GenerateResponse
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.engines.hf_batch import StepResult
from asyncrl.engines.hf_prefix import BLOCK_TOKENS, Prefilled, PrefixCache
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

EXACT_ATOL = 1e-5
"""fp32: cached keys and values were computed in other forward passes (another batch,
one decode step at a time), so they differ from a cold prefill's by summation order."""


@pytest.fixture
async def engines() -> AsyncIterator[tuple[HFEngine, HFEngine]]:
    """The same tiny model with the prefix cache (default size) and without."""
    async with (
        HFEngine(str(tiny_model_dir()), HFEngineConfig(max_batch_size=16)) as warm,
        HFEngine(
            str(tiny_model_dir()), HFEngineConfig(max_batch_size=16, prefix_cache_mb=0)
        ) as cold,
    ):
        yield warm, cold


def ids(engine: HFEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def request(prompt: list[int], new: int, seed: int, temperature: float = 1.0) -> GenerateRequest:
    return GenerateRequest(
        input_ids=prompt, sampling=sampling(max_new_tokens=new, seed=seed, temperature=temperature)
    )


def assert_same(a: GenerateResponse, b: GenerateResponse) -> None:
    assert a.output_ids == b.output_ids
    torch.testing.assert_close(
        torch.tensor(a.output_logprobs), torch.tensor(b.output_logprobs), atol=EXACT_ATOL, rtol=0
    )


def kept(prompt: list[int], new: int) -> int:
    """Tokens a finished sequence leaves in the cache: its prompt and every generated token
    but the last (never fed), in whole blocks."""
    return (len(prompt) + new - 1) // BLOCK_TOKENS * BLOCK_TOKENS


# --- the engine -----------------------------------------------------------------------------


# The generated lengths put the end of what the first turn computed at different places in
# a block: 71 + 10 - 1 = 80 ends a block exactly, so the last generated token (sampled,
# never fed) would start the next one; 71 + 9 - 1 = 79 leaves it one token short.
@pytest.mark.parametrize("new", [9, 10, 25])
async def test_a_continued_prompt_prefills_only_its_tail_and_matches_a_cold_engine(
    engines: tuple[HFEngine, HFEngine], new: int
):
    warm, cold = engines
    first = ids(warm, "You add numbers. " * 4 + "What is 2+2?")[-71:]
    a1, b1 = await asyncio.gather(
        warm.agenerate(request(first, new, seed=1)), cold.agenerate(request(first, new, seed=1))
    )
    assert_same(a1, b1)
    assert warm.stats.prefix_cache_hit_tokens == 0
    assert warm.stats.prefix_cache_bytes > 0 and cold.stats.prefix_cache_bytes == 0

    # the next turn: the previous prompt, the whole reply, a tool's answer, a new template
    second = first + a1.output_ids + ids(warm, "\ntool: 4\nassistant:")
    prefilled = warm.stats.prefill_tokens
    a2 = await warm.agenerate(request(second, 20, seed=2))
    b2 = await cold.agenerate(request(second, 20, seed=2))
    hit = kept(first, new)
    assert warm.stats.prefix_cache_hit_tokens == hit
    assert warm.stats.prefill_tokens - prefilled == len(second) - hit
    # what the rollout actor publishes as engine/... metrics
    published = warm.metrics()
    assert published["prefix_cache_hit_tokens"] == hit
    assert published["prefill_tokens"] == warm.stats.prefill_tokens
    assert_same(a2, b2)
    torch.testing.assert_close(
        torch.tensor(a2.output_logprobs),
        teacher_forced(warm.model, a2),
        atol=LOGPROB_ATOL,
        rtol=0,
    )


async def test_concurrent_three_turn_episodes_match_a_cold_engine(
    engines: tuple[HFEngine, HFEngine],
):
    """Episodes of several lengths join a running batch at different steps, greedy and
    sampled, their prompts sharing a system prompt: every reply matches the cold engine's."""
    warm, cold = engines
    system = ids(warm, "System: you are terse. " * 3)

    async def episode(engine: HFEngine, i: int) -> list[GenerateResponse]:
        prompt = system + ids(warm, f"User: question {i}?" + "!" * i)
        replies = []
        for turn in range(3):
            t = 0.0 if i % 2 else 1.0
            resp = await engine.agenerate(request(prompt, 6 + 3 * i, 100 * i + turn, t))
            replies.append(resp)
            prompt = prompt + resp.output_ids + ids(warm, f"\ntool: {turn}\nA:")
        return replies

    warm_eps = await asyncio.gather(*(episode(warm, i) for i in range(5)))
    cold_eps = await asyncio.gather(*(episode(cold, i) for i in range(5)))
    for w, c in zip(warm_eps, cold_eps, strict=True):
        for a, b in zip(w, c, strict=True):
            assert_same(a, b)
    sent = sum(len(r.input_ids) for ep in warm_eps for r in ep)
    assert warm.stats.prefill_tokens + warm.stats.prefix_cache_hit_tokens == sent
    assert cold.stats.prefill_tokens == sent
    assert warm.stats.prefix_cache_hit_tokens > sent / 2


async def test_prompts_joining_together_prefill_their_common_blocks_once(
    engines: tuple[HFEngine, HFEngine],
):
    """After a weight update empties the cache, a burst of prompts with one system prompt
    joins at once: the first is prefilled whole, the others take its blocks."""
    warm, cold = engines
    system = ids(warm, "System: " + "be brief. " * 8)
    prompts = [system + ids(warm, f"User: question number {i}?") for i in range(4)]
    common = next(i for i in range(len(prompts[0])) if prompts[0][i] != prompts[1][i])
    shared = common // BLOCK_TOKENS * BLOCK_TOKENS
    assert shared >= 5 * BLOCK_TOKENS
    reqs = [request(p, 8, seed=i) for i, p in enumerate(prompts)]
    warm_out = await asyncio.gather(*(warm.agenerate(r) for r in reqs))
    cold_out = await asyncio.gather(*(cold.agenerate(r) for r in reqs))
    assert warm.stats.prefill_batch_sizes == {4: 1}  # they did join together
    for a, b in zip(warm_out, cold_out, strict=True):
        assert_same(a, b)
    assert warm.stats.prefix_cache_hit_tokens == 3 * shared
    assert warm.stats.prefill_tokens == sum(len(p) for p in prompts) - 3 * shared


async def test_a_prompt_that_diverges_reuses_only_the_common_blocks(
    engines: tuple[HFEngine, HFEngine],
):
    warm, cold = engines
    base = ids(warm, string.ascii_letters + string.digits)  # 62 distinct tokens
    await warm.agenerate(request(base, 8, seed=3))
    # the same first 40 tokens, then other ones: blocks 0 and 1 (32 tokens) are common
    other = base[:40] + ids(warm, "something else entirely")
    a = await warm.agenerate(request(other, 12, seed=4))
    b = await cold.agenerate(request(other, 12, seed=4))
    assert warm.stats.prefix_cache_hit_tokens == 2 * BLOCK_TOKENS
    assert_same(a, b)
    # a prompt that differs in its very first token reuses nothing
    before = warm.stats.prefix_cache_hit_tokens
    a = await warm.agenerate(request(ids(warm, "!") + base[1:], 5, seed=5))
    b = await cold.agenerate(request(ids(warm, "!") + base[1:], 5, seed=5))
    assert warm.stats.prefix_cache_hit_tokens == before
    assert_same(a, b)


async def test_a_prompt_in_whole_blocks_still_computes_its_last_token(
    engines: tuple[HFEngine, HFEngine],
):
    """The cached prefix stops one token short of the prompt: the last position's logits
    sample the first token, so it is computed even when every block is cached."""
    warm, cold = engines
    prompt = ids(warm, "x" * 4 * BLOCK_TOKENS)
    assert len(prompt) % BLOCK_TOKENS == 0
    await warm.agenerate(request(prompt + ids(warm, "y"), 3, seed=6))  # leaves its blocks
    a = await warm.agenerate(request(prompt, 10, seed=7))
    b = await cold.agenerate(request(prompt, 10, seed=7))
    assert warm.stats.prefix_cache_hit_tokens == len(prompt) - 1
    assert_same(a, b)


async def test_a_prompt_prefilled_before_is_taken_whole_without_a_forward_pass(
    engines: tuple[HFEngine, HFEngine],
):
    """A request for a prompt the batch prefilled under the same weights (a group's sample
    that joins after its siblings) takes its keys, values and last logits as they were
    kept: nothing is prefilled, and it generates what a cold engine does."""
    warm, cold = engines
    prompt = ids(warm, "Add: 17 + 25 = ? Think step by step.")
    await warm.agenerate(request(prompt, 4, seed=6))
    prefilled = warm.stats.prefill_tokens
    a = await warm.agenerate(request(prompt, 10, seed=7))
    b = await cold.agenerate(request(prompt, 10, seed=7))
    assert warm.stats.prefill_tokens == prefilled
    assert warm.stats.prefix_cache_hit_tokens == len(prompt)
    assert_same(a, b)


async def test_a_weight_update_or_a_release_empties_the_cache(
    engines: tuple[HFEngine, HFEngine],
):
    warm, _ = engines
    first = ids(warm, "Count with me: one two three four five six")
    a1 = await warm.agenerate(request(first, 12, seed=8))
    assert warm._batch is not None and warm._batch.prefix.nbytes > 0
    await warm.update_weights(perturbed(warm.model, seed=1), version=1)
    assert warm._batch.prefix.nbytes == 0 and warm.stats.prefix_cache_bytes == 0
    second = first + a1.output_ids + ids(warm, " seven")
    a2 = await warm.agenerate(request(second, 12, seed=9))
    assert warm.stats.prefix_cache_hit_tokens == 0  # nothing from the old weights
    assert a2.output_versions == [1] * 12
    torch.testing.assert_close(
        torch.tensor(a2.output_logprobs), teacher_forced(warm.model, a2), atol=LOGPROB_ATOL, rtol=0
    )
    assert warm._batch.prefix.nbytes > 0  # filled again, under version 1
    await warm.release_memory()
    assert warm._batch.prefix.nbytes == 0
    await warm.resume_memory()
    await warm.resume()


async def test_an_adapter_empties_the_cache_even_under_the_same_version(
    engines: tuple[HFEngine, HFEngine], tmp_path: Path
):
    """A restarted trainer may publish a version number again: the cache is emptied by the
    load itself, not only by a change of version."""
    warm, _ = engines
    name = "model.layers.0.self_attn.q_proj"
    q = dict(warm.model.named_parameters())[f"{name}.weight"]
    gen = torch.Generator().manual_seed(0)
    save_file(
        {
            f"base_model.model.{name}.lora_A.weight": torch.randn(4, q.shape[1], generator=gen),
            f"base_model.model.{name}.lora_B.weight": torch.randn(q.shape[0], 4, generator=gen),
        },
        str(tmp_path / ADAPTER_WEIGHTS),
    )
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({"r": 4, "lora_alpha": 4}))
    first = ids(warm, "Count with me: one two three four five six")
    a1 = await warm.agenerate(request(first, 12, seed=8))
    assert warm._batch is not None and warm._batch.prefix.nbytes > 0
    await warm.update_weights(tmp_path, version=warm.version)
    assert warm._batch.prefix.nbytes == 0
    a2 = await warm.agenerate(request(first + a1.output_ids, 6, seed=9))
    assert warm.stats.prefix_cache_hit_tokens == 0
    torch.testing.assert_close(
        torch.tensor(a2.output_logprobs), teacher_forced(warm.model, a2), atol=LOGPROB_ATOL, rtol=0
    )


async def test_the_cap_holds_and_the_least_recently_used_go_first():
    """1 MiB holds 128 blocks of the tiny model (8 KiB each): 8 prompts of 400 tokens that
    share no block (200 blocks) overflow it."""
    config = HFEngineConfig(max_batch_size=4, prefix_cache_mb=1)
    async with HFEngine(str(tiny_model_dir()), config) as engine:
        assert engine._batch is not None
        cache = engine._batch.prefix
        assert cache.max_blocks == 128
        peak = 0

        def on_step(_: StepResult) -> None:
            nonlocal peak
            peak = max(peak, cache.nbytes)

        engine.on_step = on_step
        letters = string.ascii_letters
        prompts = [ids(engine, letters[i] + letters[i + 1 :] * 12)[:400] for i in range(8)]
        for prompt in prompts:
            await engine.agenerate(request(prompt, 1, seed=0))
        assert 0 < peak <= 1 << 20
        assert cache.evicted_blocks == 8 * 25 - 128
        # the first prompts went first; the last one is still whole
        first_hits = engine.stats.prefix_cache_hit_tokens
        await engine.agenerate(request(prompts[-1], 1, seed=0))
        assert engine.stats.prefix_cache_hit_tokens - first_hits == len(prompts[-1]) - 1
        before = engine.stats.prefix_cache_hit_tokens
        await engine.agenerate(request(prompts[0], 1, seed=0))
        assert engine.stats.prefix_cache_hit_tokens == before


async def test_the_prefill_budget_counts_only_the_tokens_to_compute():
    config = HFEngineConfig(max_batch_size=4, max_prefill_tokens=120)
    async with HFEngine(str(tiny_model_dir()), config) as engine:
        firsts = [ids(engine, f"Episode {i}: " + "go on. " * 12) for i in range(2)]
        assert all(60 < len(p) <= 120 for p in firsts)  # two of them are over the budget
        outs = await asyncio.gather(
            *(engine.agenerate(request(p, 8, seed=i)) for i, p in enumerate(firsts))
        )
        assert engine.stats.prefill_batch_sizes == {1: 2}
        # the next turns are longer than the budget, but most of each is cached
        seconds = [
            p + o.output_ids + ids(engine, " and then some more")
            for p, o in zip(firsts, outs, strict=True)
        ]
        assert all(len(p) > 120 for p in seconds)
        await asyncio.gather(*(engine.agenerate(request(p, 4, seed=0)) for p in seconds))
        assert engine.stats.prefill_batch_sizes == {1: 2, 2: 1}
        # three new prompts over the budget together, but sharing 4 blocks: the first
        # costs all its tokens, the others their last 18
        system = ids(engine, "Rules: " + "be kind. " * 8)
        burst = [system + ids(engine, f"Q{i}?") for i in range(3)]
        assert [len(p) for p in burst] == [82] * 3
        await asyncio.gather(*(engine.agenerate(request(p, 4, seed=0)) for p in burst))
        assert engine.stats.prefill_batch_sizes == {1: 2, 2: 1, 3: 1}


# --- the cache alone ------------------------------------------------------------------------


def fake_kv(tokens: list[int]) -> Callable[[int, int], torch.Tensor]:
    """Keys and values whose every entry is the token id at that position."""

    def read(a: int, b: int) -> torch.Tensor:
        return (
            torch.tensor(tokens[a:b], dtype=torch.float32)
            .view(1, 1, 1, -1, 1)
            .expand(2, 2, 1, -1, 1)
        )

    return read


def block_bytes() -> int:
    return 2 * 2 * 1 * BLOCK_TOKENS * 1 * 4


def seq(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BLOCK_TOKENS))


def test_lookup_returns_the_cached_values_of_the_longest_common_prefix():
    cache = PrefixCache(100 * block_bytes(), block_bytes())
    a = [*seq(0, 3), 7, 7, 7]  # the partial block is not kept
    cache.insert(a, fake_kv(a))
    assert len(cache.blocks) == 3
    n, kv = cache.lookup(a[:40] + [999] * 30)
    assert n == 2 * BLOCK_TOKENS and kv is not None
    assert kv.shape == (2, 2, 1, n, 1)
    assert kv[1, 0, 0, :, 0].tolist() == a[:n]
    assert cache.lookup([999, *a[1:]]) == (0, None)
    n, _ = cache.lookup(a)
    assert n == 3 * BLOCK_TOKENS
    # two sequences sharing their first block share its storage
    b = seq(0, 1) + seq(500, 2)
    cache.insert(b, fake_kv(b))
    assert len(cache.blocks) == 5
    n, kv = cache.lookup([*b, 1])
    assert n == 3 * BLOCK_TOKENS and kv is not None and kv[0, 1, 0, :, 0].tolist() == b


def test_eviction_is_least_recently_used_leaves_first_within_the_cap():
    cache = PrefixCache(4 * block_bytes() + 5, block_bytes())
    assert cache.max_blocks == 4
    a, b = seq(0, 2), seq(1000, 2)
    cache.insert(a, fake_kv(a))
    cache.insert(b, fake_kv(b))
    cache.lookup([*a, 1])  # a is now the most recent
    c = seq(2000, 1)
    cache.insert(c, fake_kv(c))
    assert cache.nbytes <= 4 * block_bytes() + 5 and cache.evicted_blocks == 1
    # b's second block went (its leaf), not its first, nor anything of a
    assert cache.lookup([*b, 1])[0] == BLOCK_TOKENS
    assert cache.lookup([*a, 1])[0] == 2 * BLOCK_TOKENS
    # a sequence longer than the cap keeps its first blocks only
    d = seq(3000, 6)
    cache.insert(d, fake_kv(d))
    assert len(cache.blocks) == 4 and cache.lookup([*d, 1])[0] == 4 * BLOCK_TOKENS
    assert cache.lookup([*a, 1]) == (0, None)


def test_the_cache_is_off_at_zero_and_cleared_for_another_version():
    off = PrefixCache(0, block_bytes())
    a = seq(0, 2)
    off.insert(a, fake_kv(a))
    assert not off.blocks and off.lookup([*a, 1]) == (0, None)
    cache = PrefixCache(10 * block_bytes(), block_bytes())
    cache.at_version(0)
    cache.insert(a, fake_kv(a))
    cache.at_version(0)
    assert cache.lookup([*a, 1])[0] == 2 * BLOCK_TOKENS
    cache.at_version(1)
    assert cache.lookup([*a, 1]) == (0, None)


def test_held_tokens_probes_without_making_anything_recent():
    cache = PrefixCache(4 * block_bytes(), block_bytes())
    a, b = seq(0, 2), seq(1000, 2)
    cache.insert(a, fake_kv(a))
    cache.insert(b, fake_kv(b))
    assert cache.held_tokens([*a, 1]) == 2 * BLOCK_TOKENS
    assert cache.held_tokens(a) == 2 * BLOCK_TOKENS - 1  # the last token is left to compute
    c = seq(2000, 1)
    cache.insert(c, fake_kv(c))
    assert cache.held_tokens([*a, 1]) == BLOCK_TOKENS  # a was still the least recent
    assert cache.held_tokens([*b, 1]) == 2 * BLOCK_TOKENS


def prefilled(tokens: list[int]) -> Prefilled:
    """A prompt kept whole: its keys and values the token ids, as :func:`fake_kv` makes
    them, and four logits."""
    return Prefilled(fake_kv(tokens)(0, len(tokens)), torch.zeros(4), (), 0)


def test_whole_prompts_take_a_quarter_at_most_and_give_way_to_blocks():
    cache = PrefixCache(16 * block_bytes(), block_bytes())
    prompts = [[*seq(1000 * i, 1), i] for i in range(4)]
    each = prefilled(prompts[0]).nbytes
    assert 3 * each <= 16 * block_bytes() // 4 < 4 * each  # a quarter holds three
    for p in prompts:
        cache.keep_prompt(p, prefilled(p))
    assert list(cache.prompts) == [tuple(p) for p in prompts[1:]]  # the first kept went
    assert cache.nbytes == 3 * each
    assert cache.held_tokens(prompts[1]) == len(prompts[1])  # nothing to prefill
    assert cache.held_tokens(prompts[0]) == 0
    got = cache.prompt(prompts[1])
    assert got is not None and torch.equal(got.kv[0, 0, 0, :, 0], torch.tensor(prompts[1]) * 1.0)
    # blocks that need their bytes evict them; the cap holds throughout
    a = seq(5000, 15)
    cache.insert(a, fake_kv(a))
    assert not cache.prompts and cache.nbytes == 15 * block_bytes()
    # with the blocks near the cap, a prompt that does not fit beside them is not kept
    cache.keep_prompt(prompts[0], prefilled(prompts[0]))
    assert not cache.prompts and cache.lookup([*a, 1])[0] == 15 * BLOCK_TOKENS
    cache.at_version(1)
    assert cache.nbytes == 0
