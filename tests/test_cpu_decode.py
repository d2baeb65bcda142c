"""The hf engine's decode step a decoder layer at a time in C (asyncrl.engines.cpu_decode)
against the model's own layers: the same logits and cache columns up to the order of float
sums, each row's logits the same bits whatever rows it is stepped with, the same samples
through the engine, and the steps and models it leaves to the model."""

from __future__ import annotations

import pytest
import torch
import transformers

from asyncrl.api.inference import SamplingParams
from asyncrl.engines import cpu_decode, cpu_linear
from asyncrl.engines.hf_batch import DecodeBatch, Sequence

pytestmark = [
    pytest.mark.skipif(
        cpu_linear.kernel() is None, reason="the kernel cannot run here (no C compiler or AVX-512)"
    ),
    pytest.mark.usefixtures("one_thread"),
]


def tiny(kind: str, dtype: torch.dtype = torch.float32, **extra: object) -> torch.nn.Module:
    """A random decoder of ``kind`` with grouped-query heads of 16 (the C layer's smallest)
    and biases where the kind has them; its linear layers the kernel's."""
    common = dict(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, max_position_embeddings=256,
    )  # fmt: skip
    common.update(extra)
    if kind == "llama":
        config: transformers.PretrainedConfig = transformers.LlamaConfig(
            attention_bias=True, tie_word_embeddings=True, **common
        )
        model = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen2Config(tie_word_embeddings=False, **common)
        model = transformers.Qwen2ForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    m = model(config).to(dtype).eval()
    cpu_linear.install(m)
    return m


def seq(key: int, prompt: list[int], new: int, temperature: float = 1.0) -> Sequence:
    return Sequence(
        key=key,
        prompt=prompt,
        sampling=SamplingParams(temperature=temperature, max_new_tokens=new, stop_token_ids=()),
        stop_ids=frozenset(),
        max_new=new,
        generator=torch.Generator().manual_seed(key),
    )


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 3 to 20 tokens: rows left-padded by different amounts."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(5, 295, (int(torch.randint(3, 21, (), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def joined(model: torch.nn.Module, rows: int, steps: int = 3) -> DecodeBatch:
    """A batch of ``rows`` rows (shorter prompts padded) a few decode steps in."""
    batch = DecodeBatch(model, max_positions=200, decode_layers=True)
    with torch.inference_mode():
        batch.step([seq(i, p, 30) for i, p in enumerate(prompts(rows))], set(), 0)
        for _ in range(steps):
            batch.step([], set(), 0)
    return batch


def step_both(
    batch: DecodeBatch,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """The batch's next decode step through the model's layers and through the C layer,
    each on a copy of the cache: both logits, and each copy's keys after the step."""
    col = batch.length
    mask_RC = batch.valid_RC[:, : col + 1].clone()
    mask_RC[:, col] = True
    keys, values = batch.keys, batch.values
    mine_k, mine_v = [k.clone() for k in keys], [v.clone() for v in values]
    theirs_k, theirs_v = [k.clone() for k in keys], [v.clone() for v in values]
    with torch.inference_mode():
        batch.keys, batch.values = theirs_k, theirs_v
        try:
            want = batch._model_logits(mask_RC, None)
        finally:
            batch.keys, batch.values = keys, values
        assert batch.layers is not None
        got = batch.layers.logits(batch.next_R, batch.pos_R, mask_RC, mine_k, mine_v)
    assert got is not None
    return want, got, theirs_k + theirs_v, mine_k + mine_v


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("rows", [1, 5, 24, 25, 32])
def test_a_step_matches_the_models_layers(kind: str, rows: int) -> None:
    # 24 rows: the products' packed weights; 25 and more: the weights as loaded
    batch = joined(tiny(kind), rows)
    want, got, want_cache, got_cache = step_both(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    col = batch.length
    for w, g in zip(want_cache, got_cache, strict=True):
        torch.testing.assert_close(g[:, :, col], w[:, :, col], rtol=0, atol=1e-6)
        # nothing else of the cache written
        assert torch.equal(g[:, :, :col], w[:, :, :col])


def test_a_rows_logits_are_the_same_bits_whatever_rows_share_its_step() -> None:
    model = tiny("llama")
    batch = joined(model, 12)
    assert batch.layers is not None
    col = batch.length
    mask_RC = batch.valid_RC[:, : col + 1].clone()
    mask_RC[:, col] = True
    with torch.inference_mode():
        whole = batch.layers.logits(
            batch.next_R, batch.pos_R, mask_RC,
            [k.clone() for k in batch.keys], [v.clone() for v in batch.values],
        )  # fmt: skip
        for part in (slice(0, 1), slice(3, 7), slice(4, 12)):
            alone = batch.layers.logits(
                batch.next_R[part], batch.pos_R[part], mask_RC[part].contiguous(),
                [k[part].clone() for k in batch.keys], [v[part].clone() for v in batch.values],
            )  # fmt: skip
            assert alone is not None and whole is not None
            assert torch.equal(alone, whole[part])


def generate(model: torch.nn.Module, decode_layers: bool) -> list[Sequence]:
    """Twelve sampled sequences, joining in two waves (rows freed and refilled)."""
    batch = DecodeBatch(model, max_positions=200, decode_layers=decode_layers)
    assert (batch.layers is not None) == decode_layers
    ps = prompts(12, seed=1)
    waves = [[seq(i, p, 6 + 3 * (i % 5)) for i, p in enumerate(ps[:7])]]
    waves.append([seq(7 + i, p, 9) for i, p in enumerate(ps[7:])])
    done: list[Sequence] = []
    with torch.inference_mode():
        for wave in waves:
            admit = wave
            while admit or batch.active:
                done.extend(batch.step(admit, set(), 0).finished)
                admit = []
    return sorted(done, key=lambda s: s.key)


def test_the_engine_samples_the_same_tokens_through_either() -> None:
    model = tiny("llama")
    want, got = generate(model, False), generate(model, True)
    assert [s.key for s in got] == list(range(12))
    for a, b in zip(want, got, strict=True):
        assert a.out_ids == b.out_ids, a.key
        torch.testing.assert_close(
            torch.tensor(b.out_logprobs), torch.tensor(a.out_logprobs), rtol=0, atol=1e-5
        )


def test_steps_and_models_it_does_not_take() -> None:
    model = tiny("llama")
    layers = cpu_decode.DecodeLayers(model)
    with torch.no_grad():
        assert layers.ready(1) and layers.ready(32)
        assert not layers.ready(33)  # more rows than the kernel's products take
        torch.set_num_threads(2)  # torch's products spread over threads; the C layer's do not
        assert not layers.ready(8)
        torch.set_num_threads(1)
    assert not layers.ready(8)  # autograd on
    # models it does not compute: the batch keeps the model's layers for every step
    assert "kernel" in str(cpu_decode.unsupported(tiny("llama", torch.bfloat16)))
    assert "silu" in str(cpu_decode.unsupported(tiny("llama", hidden_act="gelu")))
    assert "head_dim" in str(cpu_decode.unsupported(tiny("llama", num_attention_heads=8)))
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=50)
    )
    assert "model_type 'gpt2'" in str(cpu_decode.unsupported(gpt2))
    batch = DecodeBatch(tiny("llama", hidden_act="gelu"), max_positions=64, decode_layers=True)
    assert batch.layers is None
    with pytest.raises(ValueError, match="silu"):
        cpu_decode.DecodeLayers(tiny("llama", hidden_act="gelu"))


def test_a_weight_update_reaches_the_next_step() -> None:
    """The C layer reads the packed copies, made again when a weight changes in place."""
    model = tiny("llama")
    batch = joined(model, 6)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    want, got, _, _ = step_both(batch)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)


def test_a_strided_weight_sends_the_step_to_the_model() -> None:
    """The C layer reads weights as contiguous rows; one replaced by a strided tensor (a
    column-major copy, say) makes it decline, and the batch steps through the model."""
    model = tiny("llama")
    batch = joined(model, 6)
    q = model.model.layers[1].self_attn.q_proj
    q.weight.data = q.weight.data.t().contiguous().t()
    assert batch.layers is not None
    col = batch.length
    mask_RC = batch.valid_RC[:, : col + 1].clone()
    mask_RC[:, col] = True
    with torch.inference_mode():
        keys = [k.clone() for k in batch.keys]
        values = [v.clone() for v in batch.values]
        assert batch.layers.logits(batch.next_R, batch.pos_R, mask_RC, keys, values) is None
        batch.step([], set(), 0)  # through the model's own layers
