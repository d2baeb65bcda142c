"""The fused LM head (:class:`asyncrl.train.models.FusedLogprobs`): logprobs, entropies and
their gradients against hand-computed values and against the checkpointed chunks it
replaces, and one logits matmul per chunk in a training step."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from train_helpers.tiny import VOCAB, one_torch_thread, random_batch, tiny_engine, train_config

from asyncrl.train import models
from asyncrl.train.models import FusedLogprobs, chunk_logprobs


def fused(*args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    out: tuple[torch.Tensor, torch.Tensor] = FusedLogprobs.apply(*args)  # type: ignore[no-untyped-call]
    return out


def test_hand_computed_logprob_entropy_and_gradients() -> None:
    """One row, H = 1, V = 3, W = [1, 2, 3]ᵀ, h = 1, T = 2: scaled logits s = (0.5, 1, 1.5)."""
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[1.0], [2.0], [3.0]], requires_grad=True)
    lp, ent = fused(h, w, None, torch.tensor([1]), 2.0, 0, 1.0, True, 4)
    s = [0.5, 1.0, 1.5]
    z = sum(math.exp(x) for x in s)
    q = [math.exp(x) / z for x in s]
    logq = [math.log(x) for x in q]
    entropy = -sum(a * b for a, b in zip(q, logq, strict=True))
    assert lp.item() == pytest.approx(logq[1], abs=1e-6)
    assert ent.item() == pytest.approx(entropy, abs=1e-6)
    # loss = 2·log q[y] + 3·H: ∂/∂z_v = (2·(1[v=y] − q_v) − 3·q_v·(log q_v + H)) / T
    (2 * lp + 3 * ent).sum().backward()
    dz = [(2 * ((v == 1) - q[v]) - 3 * q[v] * (logq[v] + entropy)) / 2.0 for v in range(3)]
    assert w.grad is not None and h.grad is not None
    torch.testing.assert_close(w.grad[:, 0], torch.tensor(dz), atol=1e-6, rtol=0)  # · h = 1
    assert h.grad.item() == pytest.approx(dz[0] * 1 + dz[1] * 2 + dz[2] * 3, abs=1e-6)


def test_hand_computed_top_k_cut() -> None:
    """top_k = 2 keeps the two likeliest (v = 1, 2) of s = (0, 1, 2); the target v = 1 is
    scored against those two only, and the dropped token gets no gradient."""
    h = torch.tensor([[1.0]], requires_grad=True)
    w = torch.tensor([[0.0], [1.0], [2.0]], requires_grad=True)
    lp, ent = fused(h, w, None, torch.tensor([1]), 1.0, 2, 1.0, True, 4)
    q1, q2 = 1 / (1 + math.e), math.e / (1 + math.e)
    assert lp.item() == pytest.approx(math.log(q1), abs=1e-6)
    assert ent.item() == pytest.approx(-(q1 * math.log(q1) + q2 * math.log(q2)), abs=1e-6)
    lp.sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad[:, 0], torch.tensor([0.0, 1 - q1, -q2]), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "temperature, top_k, top_p, entropy, bias",
    [
        (1.0, 0, 1.0, False, False),
        (0.7, 0, 1.0, True, True),
        (0.7, 5, 0.9, True, False),
        (1.3, 0, 0.8, True, True),
        (0.9, 7, 1.0, False, True),
    ],
)
def test_fused_equals_checkpointed_chunks(
    temperature: float, top_k: int, top_p: float, entropy: bool, bias: bool
) -> None:
    """Values and gradients (hidden states, weight, bias) of the fused head equal those of
    autograd through :func:`chunk_logprobs` chunk by chunk, to 1e-5 in float32."""
    g = torch.Generator().manual_seed(0)
    rows, hid, vocab, chunk = 11, 16, 50, 4
    h0 = torch.randn(rows, hid, generator=g)
    w0 = torch.randn(vocab, hid, generator=g) * 0.5
    b0 = torch.randn(vocab, generator=g) if bias else None
    targets = torch.randint(vocab, (rows,), generator=g)
    g_lp, g_ent = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    def run(use_fused: bool) -> list[torch.Tensor]:
        h = h0.clone().requires_grad_()
        w = w0.clone().requires_grad_()
        b = None if b0 is None else b0.clone().requires_grad_()
        if use_fused:
            lp, ent = fused(h, w, b, targets, temperature, top_k, top_p, entropy, chunk)
        else:
            parts = []
            for i in range(0, rows, chunk):
                rows_i = slice(i, i + chunk)
                parts.append(
                    chunk_logprobs(
                        h[rows_i], w, b, targets[rows_i], temperature, top_k, top_p, entropy
                    )
                )
            lp = torch.cat([p[0] for p in parts])
            ent = torch.cat([p[1] for p in parts])
        loss = (lp * g_lp).sum() + ((ent * g_ent).sum() if entropy else 0.0)
        loss.backward()
        grads = [h.grad, w.grad] + ([] if b is None else [b.grad])
        return [lp.detach(), ent.detach(), *[x for x in grads if x is not None]]

    want, got = run(False), run(True)
    assert len(want) == len(got) == (5 if bias else 4)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


class CountVocabOps(TorchDispatchMode):
    """Counts ops whose output is ``[rows, vocab]``: passes over a chunk's logits."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab, self.calls = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[-1] == self.vocab:
            self.calls += 1
        return out


@pytest.mark.parametrize("top_k", [0, 5])
def test_an_entropy_the_loss_does_not_use_costs_no_pass_in_backward(top_k: int) -> None:
    """The entropy is computed for the step's report; without an entropy bonus its
    gradient is not needed, and backward takes no pass over the logits for it: the
    gradients of a loss of the logprobs alone equal autograd's through the chunks, with
    fewer ``[rows, V]`` ops than a loss that uses the entropy. Without a cut (and no
    never-sampled ids) ``log q`` has no −inf, and the entropy skips the finite mask: the
    same values as with it, to the bit."""
    g = torch.Generator().manual_seed(1)
    rows, hid, vocab, chunk = 9, 8, 40, 4
    h0, w0 = torch.randn(rows, hid, generator=g), torch.randn(vocab, hid, generator=g)
    targets = torch.randint(vocab, (rows,), generator=g)

    def backward_ops(use_entropy: bool) -> tuple[int, list[torch.Tensor]]:
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        lp, ent = fused(h, w, None, targets, 0.8, top_k, 1.0, True, chunk)
        loss = lp.sum() + (ent.sum() if use_entropy else 0.0)
        counter = CountVocabOps(vocab)
        with counter:
            loss.backward()
        assert h.grad is not None and w.grad is not None
        return counter.calls, [lp.detach(), ent.detach(), h.grad, w.grad]

    unused, got = backward_ops(False)
    used, _ = backward_ops(True)
    assert unused < used
    h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    parts = [
        chunk_logprobs(h[i : i + chunk], w, None, targets[i : i + chunk], 0.8, top_k, 1.0)
        for i in range(0, rows, chunk)
    ]
    lp = torch.cat([p[0] for p in parts])
    lp.sum().backward()
    want = [lp.detach(), torch.cat([p[1] for p in parts]).detach(), h.grad, w.grad]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    logq = torch.log_softmax(h0 @ w0.T, dim=-1)
    assert torch.equal(models._entropy(logq, finite=True), models._entropy(logq, finite=False))

    def finite(top_k: int, top_p: float, never_sampled: torch.Tensor | None) -> bool:
        return models._chunk_logq(h0, w0, None, targets, 1.0, top_k, top_p, never_sampled)[1]

    assert finite(0, 1.0, None)
    assert not finite(5, 1.0, None) and not finite(0, 0.9, None)
    assert not finite(0, 1.0, torch.tensor([3]))


class CountLogits(TorchDispatchMode):
    """Counts matmuls whose output is ``[rows, VOCAB]``: the LM head's logits."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        name = str(func)
        if any(k in name for k in ("aten.mm", "aten.addmm", "aten.linear", "aten.matmul")):
            if isinstance(out, torch.Tensor) and out.ndim == 2 and out.shape[-1] == VOCAB:
                self.calls += 1
        return out


@pytest.mark.parametrize("recompute", [False, True])
def test_one_logits_matmul_per_chunk_unless_recomputed(recompute: bool) -> None:
    """A training step computes each chunk's logits once (twice with lm_head_recompute),
    and both forms train to the same weights."""
    batch = random_batch(3, lengths=(9, 14))
    with one_torch_thread():
        engines = {}
        for flag in (recompute, not recompute):
            config = train_config(
                max_tokens_per_microbatch=4096, lm_head_chunk_tokens=5, lm_head_recompute=flag
            )
            engine = tiny_engine(config)
            engine.config.loss.entropy_coef = 0.01
            counter = CountLogits()
            with counter:
                engine.train_step(batch)
            engines[flag] = (engine, counter.calls)
    chunks = math.ceil(sum(int(s.loss_mask.sum()) for s in batch) / 5)
    assert engines[recompute][1] == chunks * (2 if recompute else 1)
    a = dict(engines[True][0].lm.named_parameters())
    for name, p in engines[False][0].lm.named_parameters():
        torch.testing.assert_close(p, a[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("grad", [False, True])
def test_per_row_sampling_equals_each_row_scored_alone(grad: bool) -> None:
    """Rows sampled with different temperatures and cuts (calls that chose their own
    sampling): the head given one (T, top_k, top_p) per row returns, for every row, what
    it returns for that row alone with scalars, and so do the gradients of the fused head
    (chunks of 2 rows: the per-row settings are cut with the rows)."""
    torch.manual_seed(0)
    settings = [(0.5, 5, 1.0), (1.3, 0, 0.8), (0.7, 3, 0.6), (1.0, 0, 1.0), (2.0, 10, 0.9)]
    rows, hidden, vocab = len(settings), 6, 17
    h = torch.randn(rows, hidden, dtype=torch.float64)
    w = torch.randn(vocab, hidden, dtype=torch.float64)
    y = torch.randint(0, vocab, (rows,))
    temperature = torch.tensor([s[0] for s in settings])
    top_k = torch.tensor([s[1] for s in settings])
    top_p = torch.tensor([s[2] for s in settings], dtype=torch.float64)

    def leaves() -> tuple[torch.Tensor, torch.Tensor]:
        return h.clone().requires_grad_(grad), w.clone().requires_grad_(grad)

    h_all, w_all = leaves()
    if grad:
        lp, ent = fused(h_all, w_all, None, y, temperature, top_k, top_p, True, 2)
        (lp.sum() + 0.5 * ent.sum()).backward()
    else:
        lp, ent = chunk_logprobs(h_all, w_all, None, y, temperature, top_k, top_p)
    for r, (t, k, p) in enumerate(settings):
        h_one, w_one = leaves()
        lp_r, ent_r = chunk_logprobs(h_one[r : r + 1], w_one, None, y[r : r + 1], t, k, p)
        torch.testing.assert_close(lp[r : r + 1], lp_r, rtol=0, atol=1e-6)
        torch.testing.assert_close(ent[r : r + 1], ent_r, rtol=0, atol=1e-6)
        if grad:
            (lp_r.sum() + 0.5 * ent_r.sum()).backward()
            assert h_all.grad is not None and h_one.grad is not None
            torch.testing.assert_close(h_all.grad[r], h_one.grad[r], rtol=0, atol=1e-6)
    if grad:
        # The weight's gradient is the sum of the rows' own.
        total = torch.zeros_like(w)
        for r, (t, k, p) in enumerate(settings):
            h_one, w_one = leaves()
            lp_r, ent_r = chunk_logprobs(h_one[r : r + 1], w_one, None, y[r : r + 1], t, k, p)
            (lp_r.sum() + 0.5 * ent_r.sum()).backward()
            assert w_one.grad is not None
            total += w_one.grad
        assert w_all.grad is not None
        torch.testing.assert_close(w_all.grad.double(), total, rtol=0, atol=1e-5)


def test_head_matmuls_sets_tf32_on_cuda_only_and_restores_it() -> None:
    """``tf32`` switches CUDA's float32 matmuls to tensor cores inside the head and puts the
    process's own setting back after, an error included; the CPU and ``float32`` leave it."""
    flags = torch.backends.cuda.matmul
    before = flags.fp32_precision
    with models.head_matmuls("tf32", torch.device("cpu")):
        assert flags.fp32_precision == before
    with models.head_matmuls("float32", torch.device("cuda")):
        assert flags.fp32_precision == before
    with pytest.raises(RuntimeError, match="inside"):
        with models.head_matmuls("tf32", torch.device("cuda")):
            assert flags.fp32_precision == "tf32"
            raise RuntimeError("inside")
    assert flags.fp32_precision == before
    assert isinstance(flags.allow_tf32, bool)  # the legacy flag still reads: no mixed state


@pytest.mark.parametrize("recompute", [False, True])
def test_the_head_precision_reaches_forward_and_the_fused_backward(
    recompute: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lm_head_precision`` decides every head matmul of a step: each chunk's forward, and
    the fused backward (which runs after the forward's context has ended)."""
    seen: list[tuple[str, bool]] = []
    real = models.head_matmuls

    @contextlib.contextmanager
    def recording(precision: models.HeadPrecision, device: torch.device) -> Iterator[None]:
        seen.append((precision, torch.is_grad_enabled()))
        with real(precision, device):
            yield

    monkeypatch.setattr(models, "head_matmuls", recording)
    batch = random_batch(2, lengths=(9, 14))
    config = train_config(
        max_tokens_per_microbatch=4096, lm_head_chunk_tokens=5, lm_head_recompute=recompute,
        lm_head_precision="tf32",
    )  # fmt: skip
    with one_torch_thread():
        engine = tiny_engine(config)
        assert engine.head_precision == "tf32"
        engine.train_step(batch)
    chunks = math.ceil(sum(int(s.loss_mask.sum()) for s in batch) / 5)
    assert {p for p, _ in seen} == {"tf32"}
    # forward once a chunk; then the fused backward once, or each chunk recomputed
    assert len(seen) == (2 * chunks if recompute else chunks + 1)


def test_auto_head_precision_is_tf32_only_on_cuda_under_a_16_bit_forward() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    choose = models.choose_head_precision
    assert choose("auto", torch.bfloat16, cuda) == "tf32"
    assert choose("auto", torch.float16, cuda) == "tf32"
    assert choose("auto", torch.float32, cuda) == "float32"
    assert choose("auto", torch.bfloat16, cpu) == "float32"
    assert choose("float32", torch.bfloat16, cuda) == "float32"
    assert choose("tf32", torch.float32, cuda) == "tf32"
    with one_torch_thread():
        assert tiny_engine(train_config()).head_precision == "float32"
