"""The hf engine's CPU product of a few rows (asyncrl.engines.cpu_linear) against float64
products, row by row against itself, and the calls it leaves to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from asyncrl.engines import cpu_linear

pytestmark = [
    pytest.mark.skipif(
        cpu_linear.kernel() is None, reason="the kernel cannot run here (no C compiler or AVX-512)"
    ),
    pytest.mark.usefixtures("one_thread"),
]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("rows", [1, 3, 4, 8, 12, 13, 24, 25, 31, 32, 33, 64])
def test_products_equal_float64_ones_at_every_block_edge(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    # outputs around the blocks of 32 weight rows (two vectors of 16), inputs of 1 to 70
    # features; rows around the kernel's chunks of 12 and the calls it leaves to torch
    with torch.inference_mode():
        for n in (1, 5, 15, 16, 17, 31, 32, 33, 48, 100):
            for k in (1, 7, 70):
                x = torch.randn(rows, k, generator=g)
                w = torch.randn(n, k, generator=g)
                b = torch.randn(n, generator=g)
                for bias in (None, b):
                    want = F.linear(x.double(), w.double(), None if bias is None else b.double())
                    got = cpu_linear.linear(x, w, bias)
                    assert got.shape == (rows, n) and got.dtype == torch.float32
                    assert relative_error(got, want) < 1e-5, (rows, n, k, bias is None)


def test_a_row_is_the_same_bits_alone_or_with_others() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 96, generator=g)
    w = torch.randn(150, 96, generator=g)
    b = torch.randn(150, generator=g)
    others = torch.randn(cpu_linear.MIN_ROWS - 1, 96, generator=g)
    with torch.inference_mode():  # each row with the fewest companions the kernel takes
        alone = torch.cat(
            [cpu_linear.linear(torch.cat([x[i : i + 1], others]), w, b)[:1] for i in range(64)]
        )
        for rows in (5, 12, 13, 24, 25, 32):  # one chunk of rows or several
            assert torch.equal(cpu_linear.linear(x[:rows], w, b), alone[:rows])


def test_the_packed_weight_holds_32_rows_side_by_side() -> None:
    w = torch.randn(70, 5)
    packed = cpu_linear.pack(w)
    assert packed.shape == (3, 5, 32) and packed.is_contiguous()
    for n in (0, 31, 32, 69):
        assert torch.equal(packed[n // 32, :, n % 32], w[n])
    assert not packed[2, :, 6:].any()  # zero rows past the weight's 70


def test_a_layer_packs_its_weight_once_and_again_after_it_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    layer = torch.nn.Linear(40, 70)
    layer.__class__ = cpu_linear.DecodeLinear
    packs: list[torch.Tensor] = []
    real = cpu_linear.pack
    monkeypatch.setattr(cpu_linear, "pack", lambda w, out=None: packs.append(w) or real(w, out))
    x = torch.randn(6, 40)

    def product() -> torch.Tensor:
        with torch.inference_mode():
            return layer(x)

    first = product()
    assert torch.equal(product(), first) and len(packs) == 1  # kept from the first call
    torch.testing.assert_close(first, F.linear(x, layer.weight, layer.bias), rtol=0, atol=1e-5)
    with torch.no_grad():  # written in place, as an engine's weight update does
        layer.weight.copy_(torch.randn(70, 40))
    updated = product()
    assert len(packs) == 2

    def packed_now() -> torch.Tensor:  # the same kernel on the weight packed afresh
        with torch.inference_mode():
            return cpu_linear.product(x, 6, layer.weight, layer.bias, lambda: real(layer.weight))

    assert torch.equal(updated, packed_now())
    layer.weight.data = torch.randn(70, 40)  # replaced
    replaced = product()
    assert len(packs) == 3
    assert torch.equal(replaced, packed_now())
    assert product() is not replaced and len(packs) == 3


def test_batch_and_sequence_dims_are_kept() -> None:
    x = torch.randn(4, 1, 32)  # a decode step's [rows, 1 token, features]
    w = torch.randn(48, 32)
    with torch.inference_mode():
        got = cpu_linear.linear(x, w, None)
    assert got.shape == (4, 1, 48)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_calls_it_does_not_take_are_torchs_exactly() -> None:
    x, w, b = torch.randn(8, 32), torch.randn(40, 32), torch.randn(40)
    many = torch.randn(cpu_linear.MAX_ROWS + 1, 32)
    few = torch.randn(cpu_linear.MIN_ROWS - 1, 32)
    with torch.inference_mode():
        assert torch.equal(cpu_linear.linear(many, w, b), F.linear(many, w, b))  # a prefill
        assert torch.equal(cpu_linear.linear(few, w, b), F.linear(few, w, b))  # MKL's gemv
        half = (x.bfloat16(), w.bfloat16(), b.bfloat16())
        assert torch.equal(cpu_linear.linear(*half), F.linear(*half))
        column_major = w.t().contiguous().t()
        assert torch.equal(cpu_linear.linear(x, column_major, b), F.linear(x, column_major, b))
        torch.set_num_threads(2)  # MKL spreads the product; the kernel would not
        assert torch.equal(cpu_linear.linear(x, w, b), F.linear(x, w, b))
        torch.set_num_threads(1)
    # with autograd: torch's product, whose gradient flows
    wg = w.clone().requires_grad_()
    cpu_linear.linear(x, wg, b).sum().backward()
    assert wg.grad is not None and torch.equal(wg.grad, x.sum(0).expand(40, 32))


def tiny_llama(dtype: torch.dtype) -> transformers.PreTrainedModel:
    config = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, attention_bias=True, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(dtype).eval()


def test_install_routes_a_models_linears_and_keeps_its_function() -> None:
    model = tiny_llama(torch.float32)
    reference = tiny_llama(torch.float32)
    names = list(model.state_dict())
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert cpu_linear.install(model) == len(linears) == 2 * 7 + 1  # 7 a layer, the head
    assert all(type(m) is cpu_linear.DecodeLinear for m in linears)
    assert list(model.state_dict()) == names
    assert model.lm_head.weight is model.get_input_embeddings().weight  # still tied
    ids = torch.randint(0, 300, (6, 5))
    with torch.inference_mode():  # 6 rows of 5 tokens: 30 rows a product, the kernel's
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
    # training through it: torch's products and their gradients, as before
    model(ids).logits.sum().backward()
    assert model.lm_head.weight.grad is not None


def test_install_leaves_other_dtypes_and_a_missing_kernel_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = tiny_llama(torch.bfloat16)
    assert cpu_linear.install(model) == 0
    assert all(
        type(m) is torch.nn.Linear for m in model.modules() if isinstance(m, torch.nn.Linear)
    )
    monkeypatch.setattr(cpu_linear, "_loaded", [None])  # as where it cannot be compiled
    model = tiny_llama(torch.float32)
    assert cpu_linear.install(model) == 0
    assert not any(isinstance(m, cpu_linear.DecodeLinear) for m in model.modules())
