"""bench/flops.py's FLOP count against hand computations on a tiny shape, against the
model's own weights and a brute-force attention count, and the floor's arithmetic. No
timing is asserted."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load(name: str) -> ModuleType:
    sys.path.insert(0, str(BENCH))  # the bench scripts import each other, as run from bench/
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while decorating
    spec.loader.exec_module(module)
    return module


flops = load("flops")
# d 8, f 16, 2 layers, 2 query heads and 1 key/value head of 4, vocabulary 10
DIMS = flops.Dims(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, head_dim=4, vocab=10)


def test_per_token_terms_by_hand() -> None:
    # 2·ℓ·(d·h·e + 2·d·k·e + h·e·d + 3·d·f) = 4·(64 + 64 + 64 + 384)
    assert DIMS.linear_per_token == 2304
    assert DIMS.head_per_token == 2 * 8 * 10
    # 4·ℓ·h·e = 64 per key attended; positions 0, 1, 2 attend to 1 + 2 + 3 keys
    assert DIMS.attention(0, 3) == 64 * 6
    assert DIMS.attention(3, 5) == 64 * (4 + 5)
    assert DIMS.attention(4, 4) == 0


def test_attention_matches_a_brute_force_count() -> None:
    for start, end in [(0, 1), (0, 17), (5, 9), (30, 64)]:
        brute = sum(
            2 * 2 * DIMS.layers * DIMS.heads * DIMS.head_dim * (i + 1) for i in range(start, end)
        )
        assert DIMS.attention(start, end) == brute
    # a whole sequence of L tokens: 2·ℓ·h·e·L·(L + 1)
    assert DIMS.attention(0, 50) == 2 * 2 * 2 * 4 * 50 * 51


def test_step_of_one_group_by_hand() -> None:
    group = flops.Group(prompt=3, completions=(2, 1))
    prompt = 2304 * 3 + 64 * (1 + 2 + 3)  # 7296
    first = 2304 * 2 + 64 * (4 + 5) + 160 * 2  # 5504
    second = 2304 * 1 + 64 * 4 + 160 * 1  # 2720
    forward = prompt + first + second
    assert flops.forward_flops(DIMS, [group]) == forward == 15520
    # generation: the prompt prefilled once; completion positions but the last fed back
    generate = prompt + (2304 + 64 * 4 + 160 * 2) + 160
    assert flops.generation_flops(DIMS, [group]) == generate == 10336
    parts = flops.step_flops(DIMS, [group], generate=True, extra_forwards=1)
    assert parts == {
        "train": 3 * forward,
        "forwards": forward,
        "generate": generate,
        "total": 3 * forward + forward + generate,
    }
    assert flops.step_flops(DIMS, [group])["total"] == 3 * forward


def test_shared_prompt_counted_once_and_unscored_tokens_skip_the_head() -> None:
    shared = flops.forward_flops(DIMS, [flops.Group(3, (2, 1))])
    apart = flops.forward_flops(DIMS, [flops.Group(3, (2,)), flops.Group(3, (1,))])
    assert apart - shared == 2304 * 3 + 64 * 6  # the second copy of the prompt
    # a group of one sharing nothing is a plain sequence: prompt 0 gives the same count
    assert flops.forward_flops(DIMS, [flops.Group(3, (2,), (2,))]) == flops.forward_flops(
        DIMS, [flops.Group(0, (5,), (2,))]
    )
    # tool output inside a completion: computed, not scored
    assert (
        flops.forward_flops(DIMS, [flops.Group(3, (4,), (1,))])
        == 2304 * 7 + 64 * sum(range(1, 8)) + 160
    )


def test_dims_of_a_model_count_its_linear_weights() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config)
    dims = flops.Dims.of(config)
    body = sum(
        m.weight.numel()
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")
    )
    assert dims.linear_per_token == 2 * body  # a multiply-add per weight and token
    assert dims.head_per_token == 2 * model.lm_head.weight.numel()


def test_floor_and_share() -> None:
    assert flops.floor_columns(6e9, 3e9, 4.0) == "floor 2.00 s (50% reached)"
    shapes = flops.matmul_shapes(DIMS, 64)
    assert shapes == [(64, 8, 16), (64, 16, 8)]
    peak = flops.matmul_peak(torch.float32, shapes, reps=2, min_s=0.01)
    assert peak > 0 and peak != float("inf")


def test_decode_step_by_hand() -> None:
    # two rows attending to 4 and 6 keys: each row's linear layers (2304) and head (160),
    # 64 attention FLOPs a key
    assert flops.decode_step_flops(DIMS, [4, 6]) == 2 * (2304 + 160) + 64 * 10
    # the weights once, (2304 + 160) / 2 = 1232 numbers, then each row's keys and values
    # at every layer: 2·ℓ·k·e = 16 numbers a key
    assert flops.decode_step_bytes(DIMS, [4, 6], 4) == 4 * (1232 + 16 * 10)
    # a row more adds all of a row's FLOPs but only its own keys and values to the bytes:
    # the weights are read once however many rows multiply them
    one, many = [4], [4] * 64
    assert flops.decode_step_flops(DIMS, many) == 64 * flops.decode_step_flops(DIMS, one)
    more = flops.decode_step_bytes(DIMS, many, 4) - flops.decode_step_bytes(DIMS, one, 4)
    assert more == 63 * 4 * 16 * 4
    assert flops.read_bandwidth(megabytes=8, reps=2) > 0
    if Path("/proc/cpuinfo").is_file():
        assert "family" in flops.cpu_line()


def test_decode_floor_bench_steps_a_real_batch() -> None:
    transformers = pytest.importorskip("transformers")
    decode_floor = load("decode_floor")
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=300, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    steps = decode_floor.decode_steps(model, rows=3, group=2, prompt=5, new=4)
    # the joining step prefills (the first token) and decodes once (the second); two
    # decode steps follow, each row attending to its prompt and all it has made so far
    assert [keys for _, keys in steps] == [[7, 7, 7], [8, 8, 8]]
    dims = flops.Dims.of(config)
    r = decode_floor.row(dims, 4, steps, peak=1e9, bandwidth=1e9)
    seconds = sum(s for s, _ in steps)
    assert r["rows"] == 3 and r["keys"] == 7.5
    assert r["compute_reached"] == pytest.approx(
        sum(flops.decode_step_flops(dims, k) for _, k in steps) / 1e9 / seconds
    )
    assert r["roofline_reached"] >= max(r["compute_reached"], r["memory_reached"])
    assert r["serial_reached"] == pytest.approx(r["compute_reached"] + r["memory_reached"])
    assert r["serial_reached"] >= r["roofline_reached"]
    assert 0 < r["compute_bound_at_most"] <= 1


def test_stream_overlap_models_by_hand() -> None:
    overlap = load("stream_overlap")
    # 8 GB at 4 GB/s: 2 s; 300 GFLOP at 100 GFLOP/s: 3 s
    assert overlap.predict(8e9, 3e11, 4e9, 1e11) == (3.0, 5.0)
    assert overlap.overlap(3.0, 3.0, 5.0) == 1.0  # as fast as the slower of the two
    assert overlap.overlap(5.0, 3.0, 5.0) == 0.0  # the sum: nothing overlapped
    assert overlap.overlap(4.5, 3.0, 5.0) == 0.25
    assert overlap.overlap(2.0, 2.0, 2.0) == 1.0  # no multiply-adds: nothing to overlap


@pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)
def test_stream_overlap_probe_runs_each_pass() -> None:
    overlap = load("stream_overlap")
    seconds, peak = overlap.measure(megabytes=4, reps=1, fmas=[0, 32])
    assert sorted(seconds) == [0, 32] and min(seconds.values()) > 0 and peak > 0


def test_attention_bench_counts_the_pairs_its_row_holds() -> None:
    """bench/attention.py's row: segments covering it, each completion's keys its prompt's
    then its own, and the causal pairs its FLOP/s stand on counted as a query sees keys."""
    bench = load("attention")
    T, cu_q, cu_k, key_index, pairs = bench.layout("long", seed=1)
    nq, nk = cu_q.diff().tolist(), cu_k.diff().tolist()
    assert cu_q[-1] == T and key_index.numel() == cu_k[-1] and bool((key_index < T).all())
    assert len(nq) == 8 * (1 + 4) and all(q <= k for q, k in zip(nq, nk, strict=True))
    # query i of a segment of nq queries and nk keys sees i + nk - nq + 1 of them
    seen = sum(i + k - q + 1 for q, k in zip(nq, nk, strict=True) for i in range(q))
    assert pairs == seen


def test_trainer_bench_groups_its_batch() -> None:
    from asyncrl.train.batch import Sample

    trainer = load("trainer")

    def sample(ids: list[int], prompt: int, group: int | None) -> Sample:
        mask = torch.arange(len(ids)) >= prompt
        return Sample(torch.tensor(ids), mask, torch.zeros(len(ids)), 1.0, group=group)

    batch = [
        sample([1, 2, 3, 4, 5], 3, 0),
        sample([1, 2, 3, 4, 6, 7], 3, 0),  # its first answer token is the other's: not shared
        sample([9, 8, 7, 6], 2, None),
    ]
    assert trainer.sample_groups(batch) == [
        flops.Group(3, (2, 3), (2, 3)),
        flops.Group(2, (2,), (2,)),
    ]


def test_vs_trl_floors_from_each_systems_records(tmp_path: Path) -> None:
    vs_trl = load("vs_trl")
    samples = [
        {"step": 1, "prompt_uid": "a", "tokens": 5, "response_tokens": 2},
        {"step": 1, "prompt_uid": "b", "tokens": 4, "response_tokens": 2},
        {"step": 1, "prompt_uid": "a", "tokens": 6, "response_tokens": 3},
        {"step": 2, "prompt_uid": "c", "tokens": 7, "response_tokens": 1},
    ]
    metrics = [{"step": 1, "train/time/proximal_s": 0.5}, {"step": 2}]
    for name, rows in (("trained_samples", samples), ("metrics", metrics)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    asyncrl = vs_trl.asyncrl_steps(tmp_path)
    assert asyncrl == [
        ([flops.Group(3, (2, 3), (2, 3)), flops.Group(2, (2,), (2,))], 1),
        ([flops.Group(6, (1,), (1,))], 0),
    ]
    trl = vs_trl.trl_steps([3, 2, 7], [[2, 3, 2, 1], [4, 4]], group_size=2)
    assert trl == [
        ([flops.Group(3, (2, 3)), flops.Group(2, (2, 1))], 0),
        ([flops.Group(7, (4, 4))], 0),
    ]
    peak = 1e4
    figures = vs_trl.floor_figures(DIMS, asyncrl, [30.0, 32.0], peak)
    totals = [
        flops.step_flops(DIMS, g, generate=True, extra_forwards=n)["total"] for g, n in asyncrl
    ]
    assert figures["flops"] == totals
    assert figures["floor_s"] == [t / peak for t in totals]
    assert figures["took_s"] == [30.0, 2.0]  # the first step from launch
    assert figures["reached"] == pytest.approx(totals[1] / peak / 2.0)
    lines = vs_trl.floor_lines(
        {
            "asyncrl": {"floor": figures},
            "trl": {"floor": vs_trl.floor_figures(DIMS, trl, [9.0, 12.0], peak)},
        }
    )
    assert len(lines) == 2 + 2 + 1 and lines[-1].startswith("steps 2..N: asyncrl floor")
    # with the cores each side kept busy: their means over steps 2..N, the first left out
    cores = {"trainer": [2.0, 1.2, 1.0], "rollout": [0.1, 0.9, 0.8]}
    lines = vs_trl.floor_lines(
        {"asyncrl": {"floor": figures, "cores": cores}, "trl": {"floor": figures}}
    )
    assert lines[-1].endswith("trainer 1.10, generation 0.85 (the rollout actors' processes)")


def test_profile_ops_sorted_into_time_sinks() -> None:
    kinds = {
        op: flops.time_sink(op)
        for op in [
            "aten::mm",
            "aten::addmm_",
            "aten::linear",
            "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
            "aten::mul",
            "aten::_log_softmax",
            "aten::view",
            "aten::_foreach_add_",
            "optimizer::aten::mul",
        ]
    }
    assert kinds == {
        "aten::mm": "matmul",
        "aten::addmm_": "matmul",
        "aten::linear": "matmul",
        "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "attention",
        "aten::mul": "elementwise",
        "aten::_log_softmax": "elementwise",
        "aten::view": "views",
        "aten::_foreach_add_": "optimizer",
        "optimizer::aten::mul": "optimizer",
    }
    ops = [("aten::mm", 2.0), ("aten::add", 0.5), ("MulBackward0", 0.25), ("aten::mm", 1.0)]
    assert flops.time_sinks(ops, 4.0) == {"matmul": 3.0, "elementwise": 0.5, "other": 0.5}
