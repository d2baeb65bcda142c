"""The trainer's elementwise parts in C (asyncrl.train.cpu_fused): each function's forward
and backward against torch's operations, a train step's gradients with them against
without (llama and qwen2, shared prefixes, a KL reference, LoRA, checkpointing), and the
dtypes, models and settings left to transformers."""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from train_helpers.tiny import (
    assert_within,
    prefix_batch,
    prefix_config,
    step_gradients,
    tiny_config,
    tiny_engine,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from asyncrl.engines import cpu_linear
from asyncrl.train import attention, cpu_fused
from asyncrl.train.config import LoraConfig

pytestmark = [
    pytest.mark.skipif(
        cpu_linear.kernel() is None, reason="the kernel cannot run here (no C compiler or AVX-512)"
    ),
    pytest.mark.usefixtures("one_thread"),
]

REL = 1e-5
"""float32: the fused passes round differently from torch's several (sums in another
order, e^x by a polynomial), by a few units in the last place."""


def assert_rel(got: torch.Tensor, want: torch.Tensor, what: str = "") -> None:
    assert_within(got, want, REL, what)


def grads(out: torch.Tensor, inputs: tuple[torch.Tensor, ...], seed: int) -> tuple[Any, ...]:
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    return torch.autograd.grad(out, inputs, g)


@pytest.mark.parametrize("d", [576, 100, 7])
def test_rms_norm_forward_and_backward_match_transformers(d: int) -> None:
    torch.manual_seed(d)
    norm = LlamaRMSNorm(d, eps=1e-5)
    norm.weight.data = torch.randn(d)
    x = (3 * torch.randn(2, 33, d)).requires_grad_()
    want = norm(x)
    got = cpu_fused.RMSNormFn.apply(x, norm.weight, norm.variance_epsilon)
    assert_rel(got, want, "output")
    for a, b, name in zip(
        grads(got, (x, norm.weight), 1), grads(want, (x, norm.weight), 1), ("x", "w"), strict=True
    ):
        assert_rel(a, b, f"d{name}")


@pytest.mark.parametrize("n", [(40, 1536), (3, 37)])
def test_swiglu_forward_and_backward_match_torch(n: tuple[int, int]) -> None:
    torch.manual_seed(0)
    gate = (6 * torch.randn(n)).requires_grad_()  # deep into both tails of the sigmoid
    up = torch.randn(n).requires_grad_()
    want = F.silu(gate) * up
    got = cpu_fused.SwiGLUFn.apply(gate, up)
    assert_rel(got, want, "output")
    for a, b, name in zip(
        grads(got, (gate, up), 2), grads(want, (gate, up), 2), ("gate", "up"), strict=True
    ):
        assert_rel(a, b, f"d{name}")


@pytest.mark.parametrize(("batch", "cos_batch", "hd"), [(1, 1, 64), (2, 1, 20), (2, 2, 8)])
def test_rotary_positions_forward_and_backward_match_transformers(
    batch: int, cos_batch: int, hd: int
) -> None:
    """On a projection's transposed view, as transformers makes it; head dims whose half
    is not a multiple of 16 (the kernel's masked tail); cos/sin per batch row or shared."""
    torch.manual_seed(hd)
    T, H = 29, 3
    x = torch.randn(batch, T, H * hd).view(batch, T, H, hd).transpose(1, 2).requires_grad_()
    angle = torch.randn(cos_batch, T, hd // 2)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    want, _ = apply_rotary_pos_emb(x, x, cos, sin)
    got = cpu_fused.RopeFn.apply(x, cos, sin)
    assert got.shape == want.shape and got.stride() == want.stride()
    assert_rel(got, want, "output")
    assert_rel(grads(got, (x,), 3)[0], grads(want, (x,), 3)[0], "dx")


def packed_layout(
    prompts: list[int], answers: list[list[int]], share: bool
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A packed row of groups, each a prompt then its answers: ``(T, cu_q, cu_k,
    key_index)``. Shared (the trainer's ``share_prefix``): each answer a segment of its own
    whose keys are its prompt's, where they are in the row, then its own; unshared: the
    prompt and each answer one segment each, attending to themselves (a plain packed row)."""
    sq: list[int] = []
    sk: list[int] = []
    index: list[int] = []
    pos = 0
    for prompt, group in zip(prompts, answers, strict=True):
        start = pos
        sq.append(prompt)
        sk.append(prompt)
        index += range(start, start + prompt)
        pos += prompt
        for n in group:
            sq.append(n)
            sk.append(prompt + n if share else n)
            index += [*range(start, start + prompt)] if share else []
            index += range(pos, pos + n)
            pos += n
    cu_q = torch.tensor([0, *torch.tensor(sq).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(sk).cumsum(0).tolist()])
    return pos, cu_q, cu_k, torch.tensor(index) if share else None


class _Attending(torch.nn.Module):
    """What the packed attention function reads of its module."""

    training = True


@pytest.mark.parametrize(
    ("heads", "kv_heads", "hd", "prompts", "answers", "share"),
    [
        (9, 3, 64, [51, 47], [[13, 1, 30, 64], [7, 7, 2, 40]], True),
        (9, 3, 64, [51, 47], [[13, 1, 30, 64], [7, 7, 2, 40]], False),
        (4, 2, 8, [5, 3, 9], [[1, 2], [4], [1, 1, 1, 1, 1, 1, 1, 1]], True),
        (4, 4, 20, [40], [[33, 1, 17]], True),
        (2, 1, 100, [70, 1], [[90], [1]], True),
        (6, 2, 16, [1, 4], [[], [1, 2]], True),
    ],
    ids=["smollm-shared", "smollm-unshared", "hd8-g8", "hd20-mha", "hd100", "one-token"],
)
def test_attention_forward_and_backward_match_the_packed_attention(
    heads: int, kv_heads: int, hd: int, prompts: list[int], answers: list[list[int]], share: bool
) -> None:
    """One C call over a packed row against the trainer's attention function (one torch
    call per segment after a gather of the prompts' keys) in float64: the output and the
    gradients of the queries, keys and values (a prompt's keys get every answer's share),
    for grouped and plain heads, head dims off the kernel's 16 lanes, segments of one
    token and of more keys than a block of 32."""
    T, cu_q, cu_k, key_index = packed_layout(prompts, answers, share)
    gen = torch.Generator().manual_seed(hd + heads)
    q, k, v = (
        torch.randn(1, T, n, hd, generator=gen, dtype=torch.float64)
        for n in (heads, kv_heads, kv_heads)
    )
    scale = hd**-0.5
    shared = {"cu_seq_lens_k": cu_k, "key_index": key_index} if share else {}
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = attention.varlen_causal_attention(
        _Attending(), *(t.transpose(1, 2) for t in ref), None,
        scaling=scale, cu_seq_lens_q=cu_q, **shared,
    )  # fmt: skip
    mine = [t.float().requires_grad_() for t in (q, k, v)]
    got = cpu_fused.AttentionFn.apply(*mine, cu_q, cu_k, key_index, scale)
    assert got.shape == want.shape == (1, T, heads, hd)
    assert_rel(got.double(), want, "output")
    for a, b, name in zip(
        grads(got, tuple(mine), 4), grads(want, tuple(ref), 4), "qkv", strict=True
    ):
        assert_rel(a.double(), b, f"d{name}")


@pytest.mark.parametrize(
    ("change", "what"),
    [
        ({"key": 10**6}, "a key index past the row"),
        ({"key": -1}, "a negative key index"),
        ({"cu_q_end": 1}, "segments that stop short of the row"),
        ({"more_queries": True}, "a segment of more queries than keys"),
    ],
)
def test_attention_declines_a_layout_it_cannot_read(change: dict[str, Any], what: str) -> None:
    """The kernel checks the layout before it reads a key: a bad one is an error, not a
    read past the tensors."""
    T, cu_q, cu_k, key_index = packed_layout([6, 4], [[3, 2], [5]], True)
    assert key_index is not None
    if "key" in change:
        key_index[7] = change["key"]
    if "cu_q_end" in change:
        cu_q[-1] -= change["cu_q_end"]
    if change.get("more_queries"):
        cu_k = cu_q.clone()
        cu_k[1] -= 1
    q, k, v = torch.randn(1, T, 4, 16), torch.randn(1, T, 2, 16), torch.randn(1, T, 2, 16)
    with pytest.raises(RuntimeError, match="declined"):
        cpu_fused.AttentionFn.apply(q, k, v, cu_q, cu_k, key_index, 0.25)


def on_threads(n: int, run: Callable[[], Any]) -> Any:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return run()
    finally:
        torch.set_num_threads(before)


def every_pass(layout: tuple[Any, ...], heads: int = 9, kv_heads: int = 3) -> list[torch.Tensor]:
    """Each C pass's output and input gradients, forward and backward, on inputs of many
    tasks (300 rows: ten of RMSNorm's and of the rotary map's tasks, 57 of SwiGLU's) and
    attention over ``layout`` (:func:`packed_layout`'s)."""
    gen = torch.Generator().manual_seed(7)
    out: list[torch.Tensor] = []

    def run(fn: Any, inputs: list[torch.Tensor], *rest: Any) -> None:
        got = fn.apply(*inputs, *rest)
        out.extend([got, *grads(got, tuple(inputs), 5)])

    x, w = torch.randn(1, 300, 576, generator=gen), torch.randn(576, generator=gen)
    run(cpu_fused.RMSNormFn, [x.requires_grad_(), w.requires_grad_()], 1e-5)
    gate, up = (4 * torch.randn(300, 1536, generator=gen) for _ in range(2))
    run(cpu_fused.SwiGLUFn, [gate.requires_grad_(), up.requires_grad_()])
    angle = torch.randn(1, 300, 32, generator=gen)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    rot = torch.randn(1, 300, heads * 64, generator=gen).view(1, 300, heads, 64).transpose(1, 2)
    run(cpu_fused.RopeFn, [rot.requires_grad_()], cos, sin)
    T, cu_q, cu_k, key_index = layout
    q, k, v = (torch.randn(1, T, n, 64, generator=gen) for n in (heads, kv_heads, kv_heads))
    run(
        cpu_fused.AttentionFn, [t.requires_grad_() for t in (q, k, v)], cu_q, cu_k, key_index, 0.125
    )
    return out


def reads_an_earlier_group() -> tuple[Any, ...]:
    """A row whose last segment reads keys of the group before its own (its first prompt's
    and its own prompt's): the backward cannot give each group's keys to one task, and
    takes the whole row a key head a task."""
    # prompt A (rows 0-5), its answer (6-8); prompt B (9-12), an answer reading A and B (13-15)
    cu_q = torch.tensor([0, 6, 9, 13, 16])
    index = [*range(6), *range(6), 6, 7, 8, *range(9, 13), *range(6), *range(9, 13), 13, 14, 15]
    cu_k = torch.tensor([0, 6, 15, 19, 32])
    return 16, cu_q, cu_k, torch.tensor(index)


@pytest.mark.parametrize(
    "layout",
    [
        packed_layout([51, 47, 90], [[13, 1, 30, 64], [7, 7, 2, 40], [20] * 8], True),
        packed_layout([51, 47], [[13, 1, 30, 64], [7, 7, 2, 40]], False),
        reads_an_earlier_group(),
    ],
    ids=["shared", "unshared", "reads-an-earlier-group"],
)
def test_two_threads_give_the_bits_of_one(layout: tuple[Any, ...]) -> None:
    """The passes share their work between torch's threads, each thread taking the next
    task when it is free; a task writes only its own rows (the backward's attention one
    key head of one group: its prompt's keys get its answers' shares in segment order, as
    on one thread), so every output and gradient is the same to the bit on two threads."""
    one, two = on_threads(1, lambda: every_pass(layout)), on_threads(2, lambda: every_pass(layout))
    assert len(one) == len(two) == 12
    for i, (a, b) in enumerate(zip(one, two, strict=True)):
        assert torch.equal(a, b), f"tensor {i} differs on two threads"


def test_a_row_reading_an_earlier_group_matches_the_packed_attention() -> None:
    T, cu_q, cu_k, key_index = reads_an_earlier_group()
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, T, n, 16, generator=gen, dtype=torch.float64) for n in (4, 2, 2))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want, _ = attention.varlen_causal_attention(
        _Attending(), *(t.transpose(1, 2) for t in ref), None,
        scaling=0.25, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, key_index=key_index,
    )  # fmt: skip
    mine = [t.float().requires_grad_() for t in (q, k, v)]
    got = on_threads(2, lambda: cpu_fused.AttentionFn.apply(*mine, cu_q, cu_k, key_index, 0.25))
    assert_rel(got.double(), want, "output")
    for a, b, name in zip(
        on_threads(2, lambda: grads(got, tuple(mine), 4)),
        grads(want, tuple(ref), 4),
        "qkv",
        strict=True,
    ):
        assert_rel(a.double(), b, f"d{name}")


def test_the_passes_run_on_torchs_own_openmp_threads() -> None:
    """The library is built with OpenMP against the libgomp torch loaded: one runtime and
    one pool of threads in the process, not a second pool competing with torch's."""
    fn = cpu_linear.kernel()
    assert fn is not None and fn.shares_threads
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(runtimes) == 1, runtimes


def architecture(kind: str) -> Any:
    """Heads of 16 (a half of 8: the rotary kernel's masked lanes), biases where the kind
    has them."""
    extra = {"attention_bias": True} if kind == "llama" else {}
    return tiny_config(kind, hidden_size=64, num_attention_heads=4, **extra)


def fused_pair(kind: str, **overrides: Any) -> tuple[Any, Any]:
    config = prefix_config(**overrides)
    fused = tiny_engine(config, architecture=architecture(kind))
    plain = tiny_engine(
        config.model_copy(update={"cpu_fused": False}), architecture=architecture(kind)
    )
    return fused, plain


@pytest.mark.parametrize(
    ("kind", "overrides"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("llama", {"gradient_checkpointing": True, "share_prefix": False}),
        ("qwen2", {"lora": LoraConfig(rank=4, alpha=8), "loss_kl": False}),
    ],
    ids=["llama", "qwen2", "checkpointing-unshared", "lora"],
)
def test_a_fused_engine_takes_the_same_step(kind: str, overrides: dict[str, Any]) -> None:
    """The shared-prefix steps' batch (groups, multi-turn samples, per-sample sampling)
    with two minibatches (a proximal forward), a KL reference and an entropy bonus: the
    same statistics and every gradient of both minibatches with the fused parts as
    without."""
    if overrides.pop("loss_kl", True) is False:
        loss = prefix_config().loss.model_copy(update={"kl_coef": 0.0})
        overrides["loss"] = loss
    fused, plain = fused_pair(kind, **overrides)
    assert fused.fused_layers == 2 and plain.fused_layers == 0
    for name, param in fused.module.named_parameters():
        torch.testing.assert_close(
            param, dict(plain.module.named_parameters())[name], rtol=0, atol=0
        )
    batch = prefix_batch()
    got_stats, got = step_gradients(fused, lambda: fused.train_step(batch))
    want_stats, want = step_gradients(plain, lambda: plain.train_step(batch))
    assert len(got) == len(want) == 2
    for key in ("loss", "pg_loss", "entropy", "kl_ref", "grad_norm"):
        assert got_stats[key] == pytest.approx(want_stats[key], rel=1e-4, abs=1e-6), key
    for g_step, w_step in zip(got, want, strict=True):
        assert g_step.keys() == w_step.keys()
        for name in w_step:
            assert_rel(g_step[name], w_step[name], name)


def model(kind: str, attn: str = "sdpa", **extra: Any) -> Any:
    cfg = architecture(kind)
    for key, value in extra.items():
        setattr(cfg, key, value)
    cfg._attn_implementation = attn
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.Qwen2ForCausalLM
    torch.manual_seed(0)
    return cls(cfg)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_other_dtypes_go_through_the_modules_own_forwards(dtype: torch.dtype) -> None:
    fused, plain = model("llama"), model("llama")
    assert cpu_fused.install(fused) == 2
    fused, plain = fused.to(dtype), plain.to(dtype)
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    assert torch.equal(fused(ids).logits, plain(ids).logits)


def test_more_than_two_torch_threads_go_through_the_modules_own_forwards() -> None:
    """With torch on more threads than the C passes were measured on, its own operations
    run."""
    fused, plain = model("llama"), model("llama")
    assert cpu_fused.install(fused) == 2
    ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(0))
    before = torch.get_num_threads()
    torch.set_num_threads(cpu_fused.MAX_THREADS + 1)
    try:
        assert torch.equal(fused(ids, use_cache=False).logits, plain(ids, use_cache=False).logits)
    finally:
        torch.set_num_threads(before)
    assert not torch.equal(
        fused(ids, use_cache=False).logits, plain(ids, use_cache=False).logits
    )  # one thread: the C path
    torch.testing.assert_close(
        fused(ids, use_cache=False).logits, plain(ids, use_cache=False).logits, rtol=1e-5, atol=1e-6
    )


def test_install_keeps_a_forward_set_on_the_instance_for_other_dtypes() -> None:
    """A forward given to a norm before (the float64 tests' own RMSNorm) is the one its
    fallback calls, and a second install changes nothing."""
    m = model("qwen2")
    norm = m.model.norm
    calls = []

    def own(self: Any, hidden: torch.Tensor) -> torch.Tensor:
        calls.append(hidden.dtype)
        return hidden

    norm.forward = types.MethodType(own, norm)
    assert cpu_fused.install(m) == 2 and cpu_fused.install(m) == 2
    m.double()(torch.zeros(1, 5, dtype=torch.long))
    assert calls == [torch.float64]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attn": "eager"}, "eager attention"),
        ({"use_sliding_window": True, "sliding_window": 8}, "sliding-window"),
    ],
)
def test_models_it_cannot_take_are_named_and_left_alone(extra: dict[str, Any], reason: str) -> None:
    attn = extra.pop("attn", "sdpa")
    m = model("qwen2" if "sliding_window" in extra else "llama", attn=attn, **extra)
    why = cpu_fused.unsupported(m)
    assert why is not None and reason in why
    assert cpu_fused.install(m) == 0
    assert "_asyncrl_forward" not in m.model.norm.__dict__


def test_the_engine_leaves_compiled_and_bfloat16_layers_to_transformers() -> None:
    compiled = tiny_engine(prefix_config(compile=True), architecture=architecture("llama"))
    assert compiled.fused_layers == 0
    bf16 = tiny_engine(prefix_config(), architecture=architecture("llama"), dtype="bfloat16")
    assert bf16.fused_layers == 0
