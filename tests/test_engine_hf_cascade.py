"""Cascade attention in the hf engine's decode: rows that share cached prefix blocks read
one copy of them, and every row's tokens and logprobs are those of plain attention over its
own columns. The model runs in float64, so the two differ only in the order of the sums;
the logprobs the engine records are float32, hence their tolerance (an ulp or two)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from asyncrl.api.inference import SamplingParams
from asyncrl.engines import hf_batch, hf_cascade
from asyncrl.engines.hf_batch import DecodeBatch, Sequence, StepResult
from asyncrl.engines.hf_prefix import BLOCK_TOKENS
from asyncrl.models.tiny import tiny_model_dir

SYSTEM = [5 + (7 * i) % 40 for i in range(3 * BLOCK_TOKENS + 5)]
"""A system prompt of three whole blocks and a few tokens."""


def model() -> torch.nn.Module:
    m = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir(), dtype=torch.float64, attn_implementation="sdpa"
    )
    return m.eval()


def seq(key: int, prompt: list[int], new: int, seed: int) -> Sequence:
    return Sequence(
        key=key,
        prompt=prompt,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=()),
        stop_ids=frozenset(),
        max_new=new,
        generator=torch.Generator().manual_seed(seed),
    )


def run(batch: DecodeBatch, waves: list[list[Sequence]]) -> tuple[list[Sequence], list[StepResult]]:
    """Admits each wave once the previous one finished; steps until all are done."""
    done: list[Sequence] = []
    results: list[StepResult] = []
    for wave in waves:
        admit = wave
        while admit or batch.active:
            result = batch.step(admit, set(), version=0)
            admit = []
            results.append(result)
            done.extend(result.finished)
    return sorted(done, key=lambda s: s.key), results


def assert_same_samples(want: list[Sequence], got: list[Sequence]) -> None:
    """The same tokens, and float32 logprobs within an ulp or two, sequence by sequence."""
    for a, b in zip(want, got, strict=True):
        assert a.out_ids == b.out_ids, a.key
        torch.testing.assert_close(
            torch.tensor(a.out_logprobs), torch.tensor(b.out_logprobs), rtol=0, atol=2e-6
        )


def waves() -> list[list[Sequence]]:
    """A first episode fills the cache with the system prompt; then rows that share it
    (questions of different lengths, one a copy of another) beside a row that does not."""
    first = [seq(0, [*SYSTEM, 9, 9, 9], 6, seed=0)]
    questions = [[11, 12], [13] * 9, [14, 15, 16] * 7, [11, 12], [17] * 30]
    shared = [seq(1 + i, SYSTEM + q, 12 + 3 * i, seed=1 + i) for i, q in enumerate(questions)]
    other = [seq(9, [30 + i % 7 for i in range(20)], 14, seed=9)]
    return [first, shared + other]


@pytest.fixture
def any_saving(monkeypatch: pytest.MonkeyPatch) -> None:
    """Cascade on for any prefix: the tiny model's rows are far shorter than the prefixes
    the default threshold asks for."""
    monkeypatch.setattr(hf_batch, "MIN_SHARED_SAVING", 0)


def test_shared_rows_decode_as_plain_attention_gives(any_saving: None):
    m = model()
    plain_batch = DecodeBatch(
        m, max_positions=4096, prefix_cache_bytes=64 << 20, shared_prefix_attention=False
    )
    assert not plain_batch.cascade
    plain, plain_results = run(plain_batch, waves())
    m2 = model()
    batch = DecodeBatch(m2, max_positions=4096, prefix_cache_bytes=64 << 20)
    assert batch.cascade and m2.config._attn_implementation == hf_cascade.ATTN_IMPLEMENTATION
    shared, results = run(batch, waves())
    assert not any(r.shared_rows for r in plain_results)
    used = [r for r in results if r.shared_rows]
    # the five rows of the second wave share the system prompt's three whole blocks; the
    # row outside the group reads all of its columns
    assert used and max(r.shared_rows for r in used) == 5
    assert {r.shared_tokens for r in used} == {3 * BLOCK_TOKENS}
    assert_same_samples(plain, shared)


def test_a_group_leader_shares_its_own_prefill(any_saving: None):
    """With the cache empty (after a weight update), prompts that begin alike join
    together: the first is prefilled and its blocks cached, the others copy them, and
    all of them, the first included, share the prefix in decode."""
    batch = DecodeBatch(model(), max_positions=4096, prefix_cache_bytes=64 << 20)
    rows = [seq(i, SYSTEM + [20 + i] * (i + 1), 8, seed=i) for i in range(4)]
    _, results = run(batch, [rows])
    assert max(r.shared_rows for r in results) == 4


def test_a_group_of_one_prompt_shares_it_whole(any_saving: None):
    """G samples of one prompt, the cache empty: prefilled once and copied, then decoded
    against one copy of the whole prompt, as plain attention decodes them."""
    prompt = [*SYSTEM, 21, 22, 23]
    group = [seq(i, prompt, 10, seed=i) for i in range(6)]
    plain, _ = run(
        DecodeBatch(
            model(), max_positions=4096, prefix_cache_bytes=64 << 20, shared_prefix_attention=False
        ),
        [group],
    )
    again = [seq(i, prompt, 10, seed=i) for i in range(6)]
    shared, results = run(
        DecodeBatch(model(), max_positions=4096, prefix_cache_bytes=64 << 20), [again]
    )
    assert {r.shared_tokens for r in results if r.shared_rows} == {len(prompt)}
    assert max(r.shared_rows for r in results) == 6
    assert_same_samples(plain, shared)


def test_a_group_split_across_steps_takes_its_prompt_whole(any_saving: None):
    """A group's samples that find the batch full join as rows free up: the later ones take
    the prompt as its prefill left it (keys, values, the last position's logits) with no
    forward pass, sample what they would have sampled joining with it, and decode sharing
    it. Under another policy version the prompt is prefilled again."""
    prompt = [*SYSTEM, 21, 22, 23]
    together, _ = run(
        DecodeBatch(
            model(), max_positions=4096, prefix_cache_bytes=64 << 20, shared_prefix_attention=False
        ),
        [[seq(i, prompt, 10, seed=i) for i in range(4)]],
    )
    batch = DecodeBatch(model(), max_positions=4096, prefix_cache_bytes=64 << 20)
    group = [seq(i, prompt, 10, seed=i) for i in range(4)]
    results = [batch.step(group[:1], set(), 0), batch.step([], set(), 0)]
    late = batch.step(group[1:], set(), 0)
    assert results[0].prefill_tokens == len(prompt)
    assert (late.prefill_rows, late.prefill_tokens, late.prefix_hit_tokens) == (3, 0, len(prompt))
    results.append(late)
    while batch.active:
        results.append(batch.step([], set(), 0))
    assert max(r.shared_rows for r in results) == 4
    assert {r.shared_tokens for r in results if r.shared_rows} == {len(prompt)}
    assert_same_samples(together, group)

    assert batch.step([seq(4, prompt, 2, seed=4)], set(), 1).prefill_tokens == len(prompt)


def test_a_short_shared_prefix_keeps_plain_attention():
    """Six rows sharing three blocks spare too few columns for a second kernel call."""
    batch = DecodeBatch(model(), max_positions=4096, prefix_cache_bytes=64 << 20)
    _, results = run(batch, waves())
    assert batch.cascade and not any(r.shared_rows for r in results)


def test_the_plan_splits_the_columns_exactly():
    """cascade_attention on random keys against softmax attention over each row's columns:
    a group of rows whose first columns are one copy, rows outside it, padding rows."""
    g = torch.Generator().manual_seed(0)
    rows, kv_heads, per_kv, dim, cols = 5, 2, 3, 8, 40
    key = torch.randn(rows, kv_heads, cols, dim, generator=g, dtype=torch.float64)
    value = torch.randn(rows, kv_heads, cols, dim, generator=g, dtype=torch.float64)
    query = torch.randn(rows, kv_heads * per_kv, 1, dim, generator=g, dtype=torch.float64)
    start = torch.tensor([4, 10, 0, 39, 7])  # row 3: padding (only the last column)
    mask = torch.arange(cols)[None, :] >= start[:, None]
    prefix, group = 16, [0, 1, 4]
    for r in group[1:]:  # the group's prefixes are the same bits, at their own columns
        key[r, :, start[r] : start[r] + prefix] = key[0, :, 4 : 4 + prefix]
        value[r, :, start[r] : start[r] + prefix] = value[0, :, 4 : 4 + prefix]
    end = start.clone()
    end[group] += prefix
    w0 = int(end.min())
    window = mask[:, w0:] & (torch.arange(w0, cols)[None, :] >= end[:, None])
    bias = torch.zeros(window.shape, dtype=torch.float64).masked_fill(~window, float("-inf"))
    plan = hf_cascade.CascadePlan(
        group_G=torch.tensor(group), ref=0, ref_start=4, prefix=prefix, w0=w0,
        window_bias=bias[:, None, None, :],
    )  # fmt: skip
    got = hf_cascade.cascade_attention(plan, query, key, value, scale=dim**-0.5)
    k = key.repeat_interleave(per_kv, dim=1)
    v = value.repeat_interleave(per_kv, dim=1)
    scores = (query @ k.transpose(-1, -2)) * dim**-0.5
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    want = (scores.softmax(-1) @ v).transpose(1, 2)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_grouped_prefill_is_transformers_sdpa_bit_for_bit(dtype: torch.dtype):
    """A CPU prefill's attention reads each key head once for its group of query heads and
    gives exactly what transformers' SDPA gives after copying the heads: left-padded rows,
    keys from a wider buffer (a cached prefix), queries right-aligned, a padding query
    attending to itself."""
    g = torch.Generator().manual_seed(1)
    rows, kv_heads, per_kv, dim, tail, cols = 4, 3, 3, 16, 6, 20

    class Layer(torch.nn.Module):
        num_key_value_groups = per_kv
        is_causal = True

    buf = torch.randn(rows + 2, kv_heads, cols + 5, dim, generator=g).to(dtype)
    key, value = buf[1 : rows + 1, :, 2 : 2 + cols], buf[1 : rows + 1, :, 3 : 3 + cols]
    query = torch.randn(rows, tail, kv_heads * per_kv, dim, generator=g).to(dtype).transpose(1, 2)
    tails, wholes = torch.tensor([6, 2, 4, 1]), torch.tensor([20, 9, 15, 1])
    q_col = torch.arange(cols - tail, cols)[:, None]
    k_col = torch.arange(cols)[None, :]
    real_key = k_col >= (cols - wholes)[:, None]  # [rows, cols]
    real_query = torch.arange(tail)[None, :] >= (tail - tails)[:, None]  # [rows, tail]
    mask = ((k_col <= q_col)[None] & real_key[:, None]) | (k_col == q_col)[None]
    mask = mask & (real_query[:, :, None] | (k_col == q_col)[None])
    mask = mask[:, None]
    layer = Layer()
    assert hf_cascade._grouped_prefill(layer, query, mask, 0.0, {})
    got, _ = hf_cascade.decode_attention(layer, query, key, value, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(layer, query, key, value, mask, scaling=0.3)
    assert got.shape == (rows, tail, kv_heads * per_kv, dim)
    assert torch.equal(got, want)
    # what it leaves to SDPA: one query (decode without a plan), no mask, a softcap
    assert not hf_cascade._grouped_prefill(layer, query[:, :, -1:], mask[:, :, -1:], 0.0, {})
    assert not hf_cascade._grouped_prefill(layer, query, None, 0.0, {})
    assert not hf_cascade._grouped_prefill(layer, query, mask, 0.0, {"softcap": 30.0})


def test_no_column_is_read_before_it_is_written(any_saving: None, monkeypatch: pytest.MonkeyPatch):
    """The batch's key and value buffers are not initialised: every column a kernel reads
    left of L is a row's keys or zeros, and every column from L on is written first. With
    the buffers' memory full of NaN, the rebuilds, prefills after cached prefixes, group
    copies and cascade and plain decode steps give what they give on clean memory."""
    clean, _ = run(DecodeBatch(model(), max_positions=4096, prefix_cache_bytes=64 << 20), waves())
    monkeypatch.setattr(
        hf_batch, "_uninitialised", lambda shape, **kw: torch.full(shape, float("nan"), **kw)
    )
    for cascade in (True, False):
        poisoned, _ = run(
            DecodeBatch(
                model(),
                max_positions=4096,
                prefix_cache_bytes=64 << 20,
                shared_prefix_attention=cascade,
            ),
            waves(),
        )
        assert_same_samples(clean, poisoned)
