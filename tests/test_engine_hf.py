"""The hf engine on a tiny random Llama: logprobs, batching, pause/update/resume, sampling."""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import warnings
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from asyncrl.api.inference import GenerateRequest, GenerateResponse, SamplingParams
from asyncrl.engines import cpu_linear
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine, copy_param
from asyncrl.engines.hf_batch import StepResult, cache_keyword
from asyncrl.models.resolve import ModelConfig, load_causal_lm
from asyncrl.models.tiny import tiny_model_dir
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, merged, read_adapter

LOGPROB_ATOL = 1e-4
"""fp32 tolerance between engine logprobs (left-padded, cached, batched) and a fresh
unpadded forward pass: the two differ only by summation order, ~1e-6 in practice."""


@pytest.fixture
async def engine() -> AsyncIterator[HFEngine]:
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig(max_batch_size=16)) as eng:
        yield eng


def prompt_ids(engine: HFEngine, text: str) -> list[int]:
    return list(engine.tokenizer.encode(text, add_special_tokens=False))


def teacher_forced(model: torch.nn.Module, resp: GenerateResponse) -> torch.Tensor:
    """log p(output token | everything before it) from one forward pass, at T = 1."""
    ids = torch.tensor([resp.input_ids + resp.output_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    n = len(resp.input_ids)
    return logp[n - 1 : -1].gather(-1, torch.tensor(resp.output_ids)[:, None]).squeeze(-1)


def sampling(**kw: object) -> SamplingParams:
    kw.setdefault("stop_token_ids", ())
    return SamplingParams(**kw)  # type: ignore[arg-type]


async def test_logprobs_equal_teacher_forced_forward_with_staggered_joins(engine: HFEngine):
    texts = ["hi", "What is 2+2?", "x", "The quick brown fox jumps over", "1+1=", "Hello there"]
    lengths = [30, 12, 25, 8, 40, 17]
    sp = [sampling(temperature=1.0, max_new_tokens=n) for n in lengths]
    started = asyncio.Event()
    steps = 0

    def on_step(_: StepResult) -> None:
        nonlocal steps
        steps += 1
        if steps == 3:
            started.set()

    engine.on_step = on_step
    async with asyncio.TaskGroup() as tg:
        first = [
            tg.create_task(
                engine.agenerate(GenerateRequest(input_ids=prompt_ids(engine, t), sampling=s))
            )
            for t, s in zip(texts[:3], sp[:3], strict=True)
        ]
        await started.wait()  # later requests join a batch that is already decoding
        later = [
            tg.create_task(
                engine.agenerate(GenerateRequest(input_ids=prompt_ids(engine, t), sampling=s))
            )
            for t, s in zip(texts[3:], sp[3:], strict=True)
        ]
    for task, n in zip(first + later, lengths, strict=True):
        resp = task.result()
        assert resp.finish_reason == "length"
        assert len(resp.output_ids) == len(resp.output_logprobs) == n
        assert resp.output_versions == [0] * n
        expected = teacher_forced(engine.model, resp)
        torch.testing.assert_close(
            torch.tensor(resp.output_logprobs), expected, atol=LOGPROB_ATOL, rtol=0
        )
    assert engine.stats.prefill_batch_sizes.total() >= 2


async def test_concurrent_calls_run_in_batches_larger_than_one(engine: HFEngine):
    reqs = [
        GenerateRequest(input_ids=prompt_ids(engine, f"q{i}"), sampling=sampling(max_new_tokens=6))
        for i in range(8)
    ]
    out = await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    assert all(len(r.output_ids) == 6 for r in out)
    assert engine.stats.max_decode_batch == 8
    assert engine.stats.generated_tokens == 48


async def test_a_group_sharing_one_prompt_is_prefilled_once(engine: HFEngine):
    prompt = prompt_ids(engine, "Solve: 12 + 30 = ?")
    req = GenerateRequest(input_ids=prompt, sampling=sampling(max_new_tokens=10))
    out = await asyncio.gather(*(engine.agenerate(req) for _ in range(4)))
    assert engine.stats.prefill_tokens == len(prompt)
    assert len({tuple(r.output_ids) for r in out}) > 1  # the samples still differ
    for resp in out:
        torch.testing.assert_close(
            torch.tensor(resp.output_logprobs),
            teacher_forced(engine.model, resp),
            atol=LOGPROB_ATOL,
            rtol=0,
        )


def perturbed(model: torch.nn.Module, seed: int) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        (name, p.detach() + 0.5 * torch.randn(p.shape, generator=gen))
        for name, p in model.named_parameters()
    ]


async def test_pause_update_resume_gives_two_versions_conditioned_on_partial_tokens(
    engine: HFEngine,
):
    old_model = {k: v.clone() for k, v in engine.model.state_dict().items()}
    reached = asyncio.Event()
    engine.on_step = lambda r: reached.set() if engine.stats.generated_tokens >= 5 else None
    prompt = prompt_ids(engine, "Count with me:")
    # seeded: the tokens (and so the logprob error) do not depend on what ran before
    req = GenerateRequest(input_ids=prompt, sampling=sampling(max_new_tokens=40, seed=11))
    async with asyncio.TaskGroup() as tg:
        gen = tg.create_task(engine.agenerate(req))
        await reached.wait()
        await engine.pause()
        assert not gen.done()  # paused mid-sequence, not finished
        await engine.update_weights(perturbed(engine.model, seed=1), version=1)
        assert engine.version == 1
        await engine.resume()
    resp = gen.result()
    assert resp.finish_reason == "length" and len(resp.output_ids) == 40
    versions = resp.output_versions
    switch = versions.index(1)
    assert 5 <= switch < 40
    assert versions == [0] * switch + [1] * (40 - switch)

    # Tokens before the switch are scored by the old weights, tokens after it by the new
    # weights *given the partial tokens*: a continuation restarted from the prompt, or one
    # reusing the old cache, would not match the teacher-forced pass below.
    new_lp = teacher_forced(engine.model, resp)
    with torch.no_grad():
        new_state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.model.load_state_dict(old_model)
        old_lp = teacher_forced(engine.model, resp)
        engine.model.load_state_dict(new_state)
    got = torch.tensor(resp.output_logprobs)
    torch.testing.assert_close(got[:switch], old_lp[:switch], atol=LOGPROB_ATOL, rtol=0)
    torch.testing.assert_close(got[switch:], new_lp[switch:], atol=LOGPROB_ATOL, rtol=0)
    assert not torch.allclose(old_lp[switch:], new_lp[switch:], atol=1e-2)


async def test_requests_made_while_paused_start_after_resume_under_new_weights(
    engine: HFEngine,
):
    await engine.pause()
    req = GenerateRequest(
        input_ids=prompt_ids(engine, "later"), sampling=sampling(max_new_tokens=4)
    )
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(engine.agenerate(req))
        for _ in range(10):
            await asyncio.sleep(0)  # let it submit, if it were going to
        assert not task.done() and engine.stats.steps == 0
        await engine.update_weights(perturbed(engine.model, seed=3), version=5)
        assert engine.paused  # an update made while paused leaves the engine paused
        await engine.resume()
    assert task.result().output_versions == [5, 5, 5, 5]


async def test_update_from_safetensors_directory_and_bad_updates(engine: HFEngine, tmp_path: Path):
    from safetensors.torch import save_file

    pairs = perturbed(engine.model, seed=2)
    save_file({k: v.contiguous() for k, v in pairs}, str(tmp_path / "model.safetensors"))
    await engine.update_weights(tmp_path, version=3)
    assert engine.version == 3 and not engine.paused
    name, expected = pairs[0]
    torch.testing.assert_close(dict(engine.model.named_parameters())[name].detach(), expected)

    with pytest.raises(KeyError, match="does not have"):
        await engine.update_weights([("no.such.weight", torch.zeros(1))], version=4)
    with pytest.raises(KeyError, match="lacks"):
        await engine.update_weights(pairs[:1], version=4)
    assert engine.version == 3 and not engine.paused
    resp = await engine.agenerate(
        GenerateRequest(input_ids=prompt_ids(engine, "ok"), sampling=sampling(max_new_tokens=3))
    )
    assert resp.output_versions == [3, 3, 3]


async def test_cpu_linears_route_decode_products_to_the_kernel(engine: HFEngine):
    """fp32 on the CPU: every linear a DecodeLinear, the weights as loaded, and an update
    writes them in place."""
    if cpu_linear.kernel() is None:
        pytest.skip("the CPU kernel cannot run here (no C compiler or AVX-512)")
    model = engine.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is cpu_linear.DecodeLinear for m in linears)
    assert all(m.weight.is_contiguous() for m in linears)
    pairs = [(n, t.contiguous()) for n, t in perturbed(model, seed=5)]
    await engine.update_weights(pairs, version=1)
    params = dict(model.named_parameters())
    for name, tensor in pairs:
        assert torch.equal(params[name], tensor)
    # logprobs still those of a teacher-forced forward of the updated weights, decoded
    # on one thread as a rollout actor's engine is (the kernel takes only such calls)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resp = await engine.agenerate(
            GenerateRequest(
                input_ids=prompt_ids(engine, "The quick brown fox"),
                sampling=sampling(temperature=1.0, max_new_tokens=12),
            )
        )
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(
        torch.tensor(resp.output_logprobs), teacher_forced(model, resp), rtol=0, atol=LOGPROB_ATOL
    )


async def test_cpu_linears_are_column_major_and_updates_keep_that_layout():
    """Without the kernel (``cpu_kernel = false``, or where it cannot run): torch's
    products on column-major weights."""
    async with HFEngine(str(tiny_model_dir()), HFEngineConfig(cpu_kernel=False)) as engine:
        model = engine.model
        embedding = model.get_input_embeddings().weight
        linears = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert any(w is embedding for w in linears)  # the tiny model's head is tied
        body = [w for w in linears if w is not embedding]
        assert body and all(w.t().is_contiguous() and not w.is_contiguous() for w in body)
        assert embedding.is_contiguous()  # a lookup table stays row-major
        # the same function as a row-major copy of it, to summation order
        reference = copy.deepcopy(model)
        for p in reference.parameters():
            p.data = p.data.contiguous()
        ids = torch.tensor([prompt_ids(engine, "The quick brown fox jumps over")])
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        # a full update of row-major tensors: its values exactly, the layout as it was
        pairs = [(n, t.contiguous()) for n, t in perturbed(model, seed=4)]
        await engine.update_weights(pairs, version=1)
        params = dict(model.named_parameters())
        for name, tensor in pairs:
            assert torch.equal(params[name], tensor)
        assert all(w.t().is_contiguous() and not w.is_contiguous() for w in body)


def test_copy_param_fills_either_layout_exactly() -> None:
    source = torch.randn(70, 90, dtype=torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        column_major = torch.empty(90, 70, dtype=dtype).t()
        copy_param(column_major, source)
        assert torch.equal(column_major, source.to(dtype)) and column_major.t().is_contiguous()
        row_major = torch.empty(70, 90, dtype=dtype)
        copy_param(row_major, source.t().contiguous().t())  # a column-major source
        assert torch.equal(row_major, source.to(dtype)) and row_major.is_contiguous()
    vector = torch.empty(5)
    copy_param(vector, torch.arange(5.0))
    assert vector.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]


async def test_greedy_seeded_and_stop_tokens(engine: HFEngine):
    prompt = prompt_ids(engine, "abc")
    greedy = sampling(temperature=0.0, max_new_tokens=12)
    a, b = await asyncio.gather(
        engine.agenerate(GenerateRequest(input_ids=prompt, sampling=greedy)),
        engine.agenerate(GenerateRequest(input_ids=prompt, sampling=greedy)),
    )
    assert a.output_ids == b.output_ids
    # top_k=1 keeps only the argmax: the same tokens at any temperature
    top1 = await engine.agenerate(
        GenerateRequest(input_ids=prompt, sampling=sampling(top_k=1, max_new_tokens=12))
    )
    assert top1.output_ids == a.output_ids

    stop_at = a.output_ids[4]
    first = a.output_ids.index(stop_at)
    stopped = await engine.agenerate(
        GenerateRequest(
            input_ids=prompt, sampling=greedy.model_copy(update={"stop_token_ids": (stop_at,)})
        )
    )
    assert stopped.finish_reason == "stop"
    assert stopped.output_ids == a.output_ids[: first + 1]

    seeded = sampling(max_new_tokens=16, seed=1234)
    s1 = await engine.agenerate(GenerateRequest(input_ids=prompt, sampling=seeded))
    s2 = await engine.agenerate(GenerateRequest(input_ids=prompt, sampling=seeded))
    assert s1.output_ids == s2.output_ids


async def test_the_cache_goes_in_under_the_keyword_the_model_names(engine: HFEngine):
    """transformers renamed the forward's ``past_key_values`` to ``cache`` and will drop
    the old name (5.24 warns: removed in 5.40); the engine passes whichever the installed
    model's forward takes, so generation neither warns now nor breaks then."""
    kw = cache_keyword(engine.model)
    assert kw in inspect.signature(engine.model.forward).parameters
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resp = await engine.agenerate(
            GenerateRequest(
                input_ids=prompt_ids(engine, "abc"),
                sampling=sampling(temperature=0.0, max_new_tokens=6),
            )
        )
    assert len(resp.output_ids) == 6
    assert not [w for w in caught if "past_key_values" in str(w.message)]


async def test_default_stop_is_eos_and_processed_logprobs(tmp_path: Path):
    async with HFEngine(str(tiny_model_dir()), logprob_mode="processed") as eng:
        eos = eng.tokenizer.eos_token_id
        assert eos in eng._eos_ids
        resp = await eng.agenerate(
            GenerateRequest(
                input_ids=prompt_ids(eng, "hi"),
                sampling=SamplingParams(top_k=1, max_new_tokens=5),
            )
        )
        # a point mass: the processed distribution gives the only kept token logprob 0
        assert resp.output_logprobs == [0.0] * len(resp.output_ids)


async def test_cancelled_caller_frees_its_row_and_stop_aborts(engine: HFEngine):
    reached = asyncio.Event()
    engine.on_step = lambda r: reached.set() if engine.stats.steps >= 2 else None
    long = GenerateRequest(input_ids=prompt_ids(engine, "a"), sampling=sampling(max_new_tokens=400))
    async with asyncio.TaskGroup() as tg:
        victim = tg.create_task(engine.agenerate(long))
        other = tg.create_task(
            engine.agenerate(
                GenerateRequest(
                    input_ids=prompt_ids(engine, "b"), sampling=sampling(max_new_tokens=30)
                )
            )
        )
        await reached.wait()
        victim.cancel()
    assert victim.cancelled()
    assert len(other.result().output_ids) == 30
    assert not engine._running

    pending = asyncio.create_task(engine.agenerate(long))
    reached.clear()
    await reached.wait()
    await engine.stop()
    resp = await pending
    assert resp.finish_reason == "abort" and 0 < len(resp.output_ids) < 400


async def test_other_architecture_qwen2(tmp_path: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    tok = build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    async with HFEngine(str(tmp_path)) as eng:
        reqs = [
            GenerateRequest(input_ids=prompt_ids(eng, t), sampling=sampling(max_new_tokens=80))
            for t in ("one", "three words here")
        ]
        out = await asyncio.gather(*(eng.agenerate(r) for r in reqs))
    for resp in out:
        # the context (64 positions) ends generation before max_new_tokens
        assert resp.finish_reason == "length"
        assert len(resp.input_ids) + len(resp.output_ids) <= 64
        torch.testing.assert_close(
            torch.tensor(resp.output_logprobs),
            teacher_forced(eng.model, resp),
            atol=LOGPROB_ATOL,
            rtol=0,
        )


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.5), (5, 0.9)])
async def test_engine_and_trainer_report_the_cut_distribution_that_sampled(
    engine: HFEngine, top_k: int, top_p: float
) -> None:
    """One definition of a behaviour logprob: temperature, then the top-k/top-p cut,
    renormalised. The engine reports it, the trainer recomputes it from its own logits."""
    from asyncrl.algo.truncation import kept_mask
    from asyncrl.models.resolve import ModelConfig
    from asyncrl.train import TrainerConfig
    from asyncrl.train.batch import Sample
    from asyncrl.train.engine import TrainEngine

    temperature = 0.7
    sp = sampling(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=3)
    prompts = [prompt_ids(engine, t) for t in ("hi", "What is 2+2?", "1+1=")]
    outs = await asyncio.gather(
        *(engine.agenerate(GenerateRequest(input_ids=p, sampling=sp)) for p in prompts)
    )
    trainer = TrainEngine(
        TrainerConfig(
            device="cpu",
            max_tokens_per_microbatch=8192,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
        ),
        ModelConfig(path=str(tiny_model_dir())),
    )
    samples = []
    for o in outs:
        ids = torch.tensor(o.input_ids + o.output_ids)
        mask = torch.arange(len(ids)) >= len(o.input_ids)
        behav = torch.zeros(len(ids))
        behav[mask] = torch.tensor(o.output_logprobs)
        samples.append(Sample(ids, mask, behav, 0.0))
    for o, s, lp in zip(outs, samples, trainer.compute_logprobs(samples), strict=True):
        got = torch.tensor(o.output_logprobs)
        torch.testing.assert_close(lp[s.loss_mask], got, atol=LOGPROB_ATOL, rtol=0)
        # by hand, from the model's logits: the cut and renormalised distribution
        ids = torch.tensor([o.input_ids + o.output_ids])
        with torch.no_grad():
            logits = engine.model(ids).logits[0, len(o.input_ids) - 1 : -1].float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        n = len(o.output_ids)
        keep = kept_mask(logp, torch.full((n,), top_k), torch.full((n,), top_p))
        logq = torch.log_softmax(logp.masked_fill(~keep, float("-inf")), dim=-1)
        chosen = torch.tensor(o.output_ids)[:, None]
        torch.testing.assert_close(
            got, logq.gather(-1, chosen).squeeze(-1), atol=LOGPROB_ATOL, rtol=0
        )
        assert (got > logp.gather(-1, chosen).squeeze(-1) + 1e-3).all()  # not the uncut one


def gradient_adapter(model: torch.nn.Module, ids: torch.Tensor, size: float, rank: int = 4):
    """A peft adapter (``lora_alpha`` = 2·rank: scale 2) on every 2-d decoder weight of
    ``model``: the top-``rank`` part of the gradient of :func:`sequence_logprob` (``B =
    U·S``, ``A = Vᵀ``), scaled so the largest merged entry ``|2·B@A|`` is ``size``: the
    update one ascent step on those tokens makes, as a trainer publishes it."""
    model.zero_grad()
    sequence_logprob(model, ids).backward()
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if ".layers." in name and param.dim() == 2:
            u, s, vh = torch.linalg.svd(param.grad)
            factors[name] = (vh[:rank].contiguous(), (u[:, :rank] * s[:rank]).contiguous())
    peak = max((2 * b @ a).abs().max().item() for a, b in factors.values())
    tensors = {}
    for name, (a, b) in factors.items():
        key = "base_model.model." + name.removesuffix(".weight")
        tensors[f"{key}.lora_A.weight"] = a
        tensors[f"{key}.lora_B.weight"] = b * (size / peak)
    model.zero_grad()
    return tensors, {"r": rank, "lora_alpha": 2 * rank}


def sequence_logprob(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Σ log p(ids[t] | ids[:t]) over the rows of ``ids``, computed in float32 logits."""
    logp = model(ids).logits.float().log_softmax(-1)[:, :-1]
    return logp.gather(-1, ids[:, 1:, None]).sum()


async def test_a_small_adapter_moves_a_bf16_engine_as_it_moves_the_fp32_model(tmp_path: Path):
    """A bf16 engine merges an adapter into float32 base weights and rounds once.

    bf16 keeps 8 significant bits: near |W| ≈ 0.02 (in [2⁻⁶, 2⁻⁵)) its grid step is
    2⁻¹³ ≈ 1.22e-4, so an update of ≤ 5e-5 added to the *rounded* weight never moves it
    (5e-5 < half a step, 6.1e-5). E.g. W = 0.02006 rounds to 164·2⁻¹³ = 0.0200195;
    W + 5e-5 = 0.02011 is 9.05e-5 above it, past half a step, so the float32 merge gives
    165·2⁻¹³ = 0.0201416, while 0.0200195 + 5e-5 rounds back to 0.0200195. Merged from
    float32, each entry moves with probability ≈ |ΔW|/step, so the expected weight is
    W + ΔW and a coherent update (one ascent step on a token sequence) moves the
    sequence's logprob as in float32. Measured: fp32 Δ = 0.051; engine Δ = 0.045 merged
    from float32, 0.012 (a quarter) added to the rounded weights. Asserted: within 30%.
    """
    reference = load_causal_lm(str(tiny_model_dir()), "float32")
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
    tensors, config = gradient_adapter(reference, ids, size=5e-5)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / ADAPTER_WEIGHTS))
    adapter = read_adapter(tmp_path)
    checkpoint = {n: p.detach().clone() for n, p in reference.named_parameters()}
    with torch.no_grad():
        fp32_before = sequence_logprob(reference, ids).item()
        for name, (a, b) in adapter.factors.items():
            dict(reference.named_parameters())[name].copy_(merged(checkpoint[name], a, b, 2.0))
        fp32_after = sequence_logprob(reference, ids).item()

    engine = HFEngine(ModelConfig(path=str(tiny_model_dir()), dtype="bfloat16"))
    async with engine:
        with torch.no_grad():
            before = sequence_logprob(engine.model, ids).item()
            await engine.update_weights(tmp_path, version=1)
            after = sequence_logprob(engine.model, ids).item()
            weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
            await engine.update_weights(tmp_path, version=2)  # replaces, never adds up
            again = {n: p.detach().clone() for n, p in engine.model.named_parameters()}

    fp32_change, engine_change = fp32_after - fp32_before, after - before
    assert fp32_change > 0.04  # the ascent step raised the sequence's logprob
    assert abs(engine_change - fp32_change) < 0.3 * fp32_change, (engine_change, fp32_change)
    for name, (a, b) in adapter.factors.items():
        want = (checkpoint[name] + 2.0 * b @ a).to(torch.bfloat16)  # rounded once
        assert weights[name].dtype == torch.bfloat16
        assert torch.equal(weights[name], want), name
        assert torch.equal(again[name], want), name


async def test_after_a_full_update_a_bf16_engine_merges_into_its_float32_tensors(
    tmp_path: Path,
):
    """A full update becomes the base: the next adapter merges into the update's float32
    tensors, not into their bf16 copy, so ``W = bf16(W_update + 2·B@A)`` exactly (the
    same arithmetic as above, with the update's weights for the checkpoint's)."""
    reference = load_causal_lm(str(tiny_model_dir()), "float32")
    ids = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(1))
    tensors, config = gradient_adapter(reference, ids, size=5e-5)
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / ADAPTER_WEIGHTS))
    adapter = read_adapter(tmp_path)
    update = dict(perturbed(reference, seed=3))
    async with HFEngine(ModelConfig(path=str(tiny_model_dir()), dtype="bfloat16")) as engine:
        await engine.update_weights(tmp_path, version=1)
        await engine.update_weights(list(update.items()), version=2)
        await engine.update_weights(tmp_path, version=3)
        weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    for name, (a, b) in adapter.factors.items():
        assert torch.equal(weights[name], (update[name] + 2.0 * b @ a).to(torch.bfloat16)), name
