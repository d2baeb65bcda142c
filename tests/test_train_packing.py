"""Micro-batch planning and packed layout: packed logprobs equal per-sequence forwards."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from train_helpers.tiny import (
    one_torch_thread,
    random_batch,
    tiny_config,
    tiny_engine,
    train_config,
)

from asyncrl.train.engine import TrainEngine
from asyncrl.train.packing import build_micro_batch, plan_micro_batches, split_minibatches


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 64), min_size=0, max_size=40),
    max_tokens=st.integers(8, 128),
    world=st.integers(1, 4),
    padded=st.booleans(),
)
def test_plan_covers_each_sequence_once_within_budget(
    lengths: list[int], max_tokens: int, world: int, padded: bool
) -> None:
    plan = plan_micro_batches(lengths, max_tokens, world, padded=padded)
    assert len(plan) == world
    assert len({len(rank) for rank in plan}) == 1  # same count on every rank
    seen = sorted(i for rank in plan for mb in rank for i in mb)
    assert seen == list(range(len(lengths)))
    if world == 1 and lengths:
        assert all(plan[0]), "an empty micro-batch is only there to even out ranks"
    for rank in plan:
        for mb in rank:
            if len(mb) > 1:
                cost = (
                    len(mb) * max(lengths[i] for i in mb) if padded else sum(lengths[i] for i in mb)
                )
                assert cost <= max_tokens


def test_plan_uses_few_micro_batches_when_packing() -> None:
    lengths = [30, 30, 20, 10, 10, 5, 5, 5, 5]  # 120 tokens
    plan = plan_micro_batches(lengths, 60, 2)
    assert [len(rank) for rank in plan] == [1, 1]
    loads = [sum(lengths[i] for i in rank[0]) for rank in plan]
    assert sorted(loads) == [60, 60]
    # An oversized sequence goes alone and does not inflate the count for the rest.
    assert plan_micro_batches([20, 3, 3], 8) == [[[0], [1, 2]]]


def test_packed_layout_restarts_positions() -> None:
    batch = random_batch(0, (3, 5, 2))
    mb = build_micro_batch(batch, [0, 1, 2], packed=True)
    assert mb.input_ids.shape == (1, 10)
    assert mb.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    assert mb.attention_mask is None
    assert torch.equal(mb.input_ids[0, 3:8], batch[1].input_ids)
    # targets are the loss positions: t ≥ n // 2 of each sequence
    assert mb.target_index.tolist() == [1, 2, 5, 6, 7, 9]
    assert mb.loss_mask_BT.shape == (3, 5)
    padded = build_micro_batch(batch, [0, 1, 2], packed=False)
    assert padded.input_ids.shape == (3, 5)
    assert padded.attention_mask is not None and padded.attention_mask.sum() == 10
    assert padded.target_index.tolist() == [1, 2, 7, 8, 9, 11]


def _reference_logprobs(engine: TrainEngine, ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """One unpadded sequence alone through the HF model, with transformers' eager
    attention (independent of the backend under test)."""
    engine.lm.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            logits = engine.lm(input_ids=ids[None]).logits[0, :-1] / temperature
    finally:
        engine.lm.set_attn_implementation(engine.config.attn_implementation)
    picked = torch.log_softmax(logits.float(), -1).gather(-1, ids[1:, None])[:, 0]
    return torch.cat([torch.zeros(1), picked])


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize(
    ("packing", "attn"),
    [(True, "asyncrl_varlen"), (True, "sdpa"), (False, "asyncrl_varlen"), (False, "sdpa")],
)
def test_packed_logprobs_equal_per_sequence_forwards(kind: str, packing: bool, attn: str) -> None:
    """Both ways of isolating packed sequences: per-sequence attention from the
    boundaries (asyncrl_varlen), and transformers' block-diagonal mask from the position
    restarts (sdpa); and right-padding with each."""
    temperature = 0.7
    engine = tiny_engine(
        train_config(
            attn_implementation=attn,
            packing=packing,
            max_tokens_per_microbatch=40,
            temperature=temperature,
            lm_head_chunk_tokens=7,  # several chunks per micro-batch
        ),
        architecture=tiny_config(kind),
    )
    batch = random_batch(1, (9, 1, 17, 4, 30, 2, 11))
    packed = engine.compute_logprobs(batch, all_positions=True)
    for sample, lp in zip(batch, packed, strict=True):
        expected = _reference_logprobs(engine, sample.input_ids, temperature)
        torch.testing.assert_close(lp, expected, rtol=0, atol=1e-5)
    only_loss = engine.compute_logprobs(batch)
    for sample, lp, full in zip(batch, only_loss, packed, strict=True):
        torch.testing.assert_close(lp, torch.where(sample.loss_mask, full, 0.0), rtol=0, atol=1e-6)


def test_a_sequence_longer_than_the_budget_gets_its_own_micro_batch() -> None:
    engine = tiny_engine(train_config(max_tokens_per_microbatch=8))
    batch = random_batch(2, (20, 3, 3))
    lps = engine.compute_logprobs(batch, all_positions=True)
    torch.testing.assert_close(
        lps[0], _reference_logprobs(engine, batch[0].input_ids, 1.0), rtol=0, atol=1e-5
    )
    assert engine.train_step(batch)["micro_batches"] == 2


def test_varlen_attention_refuses_what_it_does_not_implement() -> None:
    config = tiny_config("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=0)
    engine = tiny_engine(architecture=config)
    with pytest.raises(NotImplementedError, match="attn_implementation='sdpa'"):
        engine.compute_logprobs(random_batch(3))
    sdpa = tiny_engine(train_config(attn_implementation="sdpa"), architecture=config)
    assert all(torch.isfinite(lp).all() for lp in sdpa.compute_logprobs(random_batch(3)))


def _fake_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    *,
    scale: float | None = None,
    window_size: tuple[int, int] | None = None,
    is_causal: bool | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """A reference varlen kernel on the CPU, [T, H, D] in and out, with both API flavours."""
    assert window_size in (None, (-1, 0)) and is_causal in (None, True)
    outs = []
    for s, e in itertools.pairwise(cu_q.tolist()):
        qs, ks, vs = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=enable_gqa
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "params",
    [{"scale", "window_size", "enable_gqa"}, {"is_causal"}],
    ids=["torch-2.13-api", "older-api"],
)
def test_flash_varlen_plumbing(monkeypatch: pytest.MonkeyPatch, params: set[str]) -> None:
    """The CUDA path's reshaping, GQA and scale handling, against the per-sequence loop
    (the flash kernel itself needs a GPU; a reference stands in for it)."""
    from asyncrl.train import attention

    monkeypatch.setattr(attention, "_VARLEN", _fake_varlen)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", params)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 11, 8, generator=g)
    k, v = (torch.randn(1, 2, 11, 8, generator=g) for _ in range(2))
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    module = torch.nn.Module().eval()
    expected, _ = attention.varlen_causal_attention(
        module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu
    )
    got = attention._varlen_cuda(q, k, v, (cu, cu), (7, 7), 0.3)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_flash_varlen_gets_autocast_s_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model over float32 master weights hands attention float32 q/k/v (the rotary
    embedding's float32 cos/sin promote them) under bf16 autocast: the flash kernel must
    still take the call, in bf16, not the per-segment loop."""
    from asyncrl.train import attention

    seen: list[torch.dtype] = []

    def recording_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: object,
                         **kwargs: object) -> torch.Tensor:  # fmt: skip
        seen.extend(t.dtype for t in (q, k, v))
        return _fake_varlen(q.float(), k.float(), v.float(), *args, **kwargs).to(q.dtype)

    monkeypatch.setattr(attention, "_VARLEN", recording_varlen)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", {"scale", "window_size", "enable_gqa"})
    # the CPU stands in for CUDA: the kernel applies wherever compute is in bf16
    monkeypatch.setattr(attention, "_flash_applies", lambda q, dtype, p: dtype == torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 11, 8, generator=g)
    k, v = (torch.randn(1, 2, 11, 8, generator=g) for _ in range(2))
    cu = torch.tensor([0, 3, 4, 11], dtype=torch.int32)
    module = torch.nn.Module().eval()
    assert attention.compute_dtype(q) == torch.float32
    out, _ = attention.varlen_causal_attention(module, q, k, v, None, cu_seq_lens_q=cu)
    assert seen == [] and out.dtype == torch.float32  # float32 compute: the loop
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert attention.compute_dtype(q) == torch.bfloat16
        got, _ = attention.varlen_causal_attention(module, q, k, v, None, cu_seq_lens_q=cu)
    assert seen == [torch.bfloat16] * 3 and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), out, rtol=0, atol=3e-2)


def test_split_minibatches_whole_sequences_even_tokens() -> None:
    lengths = [7, 12, 5, 16, 9, 3, 10, 14]
    parts = split_minibatches(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(8))  # each sequence once
    assert all(p and p == sorted(p) for p in parts)
    loads = [sum(lengths[i] for i in p) for p in parts]
    assert max(loads) - min(loads) <= 3  # 76 tokens: 19 each at best
    assert split_minibatches(lengths, 4) == parts  # deterministic: every rank agrees
    assert split_minibatches(lengths, 1) == [list(range(8))]
    assert split_minibatches([4, 4, 4], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="3 sequences into 4"):
        split_minibatches([1, 2, 3], 4)


def packed_qkv(
    lengths: list[int], g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A packed row of ``lengths`` sequences: float32 ``q`` (4 heads of 8), ``k`` and ``v``
    (2 heads: grouped-query), each requiring grad, and its ``cu_seq_lens_q``."""
    n = sum(lengths)
    q = torch.randn(1, 4, n, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 2, n, 8, generator=g, requires_grad=True)
    return q, k, v, torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def test_varlen_attention_backward_is_linear_in_the_row() -> None:
    """Per-sequence attention on the CPU: values and gradients equal those of each sequence
    attended alone, and backward writes no whole-row gradient per sequence (slicing the
    row did: one zero-filled row per sequence, per tensor, per layer)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from asyncrl.train import attention

    class CountSliceBackward(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            if "slice_backward" in str(func):
                CountSliceBackward.calls += 1
            return func(*args, **(kwargs or {}))

    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 8, 1]
    q, k, v, cu = packed_qkv(lengths, g)
    module = torch.nn.Module()
    out, _ = attention.varlen_causal_attention(module, q, k, v, None, cu_seq_lens_q=cu)
    weight = torch.randn(out.shape, generator=g)
    with CountSliceBackward():
        grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    assert CountSliceBackward.calls == 0
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        qs, ks, vs = (t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        want, _ = attention.varlen_causal_attention(module, qs, ks, vs, None)
        torch.testing.assert_close(out[:, rows], want, atol=1e-6, rtol=1e-5)
        want_grads = torch.autograd.grad((want * weight[:, rows]).sum(), (qs, ks, vs))
        for got_g, want_g in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got_g[:, :, rows], want_g, atol=1e-6, rtol=1e-5)
        start += length


@pytest.mark.parametrize("float32_keys", [5, 100])  # some segments, every segment
def test_cpu_bf16_attention_takes_float32_for_short_segments(
    monkeypatch: pytest.MonkeyPatch, float32_keys: int
) -> None:
    """Under bf16 autocast on the CPU, a segment of at most ``CPU_FLOAT32_KEYS`` keys
    attends in float32 (faster there for short segments) and a longer one in bf16, each
    output in bf16: the values those two computations give alone, and gradients that reach
    every position's q, k and v. The grouped-query heads are sdpa's to group."""
    from asyncrl.train import attention

    monkeypatch.setattr(attention, "CPU_FLOAT32_KEYS", float32_keys)
    calls: list[tuple[int, torch.dtype, int]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(
        q: torch.Tensor, k: torch.Tensor, *args: object, **kwargs: object
    ) -> torch.Tensor:
        calls.append((q.shape[2], q.dtype, k.shape[1]))
        return sdpa(q, k, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording_sdpa)
    g = torch.Generator().manual_seed(0)
    lengths = [3, 9, 5, 7]
    # float32 q/k/v, as a bf16 model's rotary embedding hands them over under autocast
    q, k, v, cu = packed_qkv(lengths, g)
    module = torch.nn.Module().eval()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention.varlen_causal_attention(module, q, k, v, None, cu_seq_lens_q=cu)
    assert out.dtype == torch.bfloat16
    wide = [n_k <= float32_keys for n_k in lengths]
    # (the keys' 2 heads as they are: sdpa groups the 4 query heads over them)
    assert calls == [
        (n_k, torch.float32 if w else torch.bfloat16, 2)
        for n_k, w in zip(lengths, wide, strict=True)
    ]
    weight = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out.float() * weight).sum(), (q, k, v))
    start = 0
    for length, as_float32 in zip(lengths, wide, strict=True):
        rows = slice(start, start + length)
        dtype = torch.float32 if as_float32 else torch.bfloat16
        qs, ks, vs = (t.detach()[:, :, rows].clone().requires_grad_() for t in (q, k, v))
        want = sdpa(
            qs.to(dtype),
            ks.to(dtype).repeat_interleave(2, 1),
            vs.to(dtype).repeat_interleave(2, 1),
            is_causal=True,
        ).to(torch.bfloat16)
        torch.testing.assert_close(out[:, rows], want.transpose(1, 2), rtol=0, atol=0)
        want_grads = torch.autograd.grad(
            (want.transpose(1, 2).float() * weight[:, rows]).sum(), (qs, ks, vs)
        )
        # (the row's bf16 gradients are summed in another order than one segment's alone)
        tol = 1e-6 if as_float32 else 1e-2
        for got_g, want_g in zip(grads, want_grads, strict=True):
            torch.testing.assert_close(got_g[:, :, rows], want_g, rtol=tol, atol=tol)
        start += length
