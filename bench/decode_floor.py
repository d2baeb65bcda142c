"""The hf engine's decode step against both of its floors: compute and memory.

    python bench/decode_floor.py                        # SmolLM2-135M fp32, 1 thread
    python bench/decode_floor.py --rows 32 64 --dtype bfloat16

A decode step multiplies each of the batch's rows by every weight of the model once, so
its FLOPs grow with the rows and the bytes it must read do not, or barely: the weights
once for all rows, plus each row's own keys and values. At few rows a step is bound by
how fast memory streams into the core, not by how fast the core multiplies. This prints,
for batches of ``--rows`` rows (GRPO groups of ``--group`` rows sharing a prompt of
``--prompt`` tokens, each decoding ``--new`` tokens), the mean decode step from the
batch's first to its last and the share it reached, over all those steps, of

- its **compute floor**: the step's FLOPs (bench/flops.py's ``decode_step_flops``) over
  the matmul peak measured here, on these threads, at the model's MLP shapes on 2,048
  rows (the peak ``bench/vs_trl.py`` and ``bench/trainer.py`` take);
- its **memory floor**: the bytes it cannot avoid reading (``decode_step_bytes``: the
  matmul weights once, each row's keys and values) over the read bandwidth measured here
  (a sum over 512 MB);

and the **roofline floor**, the larger of the two at each step: no kernel can take a step
faster. ``compute bound at most`` is compute floor / roofline floor: the largest share of
its compute floor such a batch's decode can ever reach. The **serial floor** is the two
floors' sum: what a step takes on a core that cannot stream memory while it multiplies
(bench/stream_overlap.py measures whether this one can; on a 2-core Intel Xeon with AMX at
the multiply-adds of 32 rows it cannot). The engine runs as it does in a rollout actor:
rows right-aligned in one buffer, plain attention (no prefix cache here; the long
workload's groups spare too few keys for cascade attention anyway), its linear layers as
the engine has them on the CPU (``--layout engine``: in fp32 asyncrl's kernel for products
of a few rows on the weights as loaded and each decoder layer in C around them,
``--torch-layers`` the layers by torch's operations; else torch's products on column-major
weights; ``column``:
torch's on column-major weights; ``row``: torch's on the weights as loaded), mimalloc preloaded as ``asyncrl up`` has it
for its actors (``--allocator system``: the C library's malloc, whose fresh pages cost a
few thousand page faults a step here).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_shared import sequence
from flops import (
    Dims,
    cpu_line,
    decode_step_bytes,
    decode_step_flops,
    matmul_peak,
    matmul_shapes,
    read_bandwidth,
)

from asyncrl.engines.hf import column_major_linears, cpu_linears
from asyncrl.engines.hf_batch import DecodeBatch
from asyncrl.models.resolve import resolve_model_path
from asyncrl.runtime.allocator import use_mimalloc


def decode_steps(
    model: Any, rows: int, group: int, prompt: int, new: int, decode_layers: bool = False
) -> list[tuple[float, list[int]]]:
    """Join ``rows`` sequences (``rows / group`` prompts of ``prompt`` tokens, ``group``
    rows each) and decode until they finish: each decode step's seconds and the keys
    each of its rows attended to (the step they join in, a prefill and one decode, is
    left out)."""
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(rows)
    prompts = [
        torch.randint(100, vocab - 100, (prompt,), generator=g).tolist()
        for _ in range(-(-rows // group))
    ]
    batch = DecodeBatch(model, max_positions=prompt + new + 1, decode_layers=decode_layers)
    joins = [sequence(i, prompts[i // group], new) for i in range(rows)]
    batch.step(joins, set(), 0)  # the prefill (every row's first token) and one decode
    steps = []
    while batch.active:
        keys = [len(s.prompt) + len(s.out_ids) for s in batch.rows if s is not None]
        t0 = time.perf_counter()
        batch.step([], set(), 0)
        steps.append((time.perf_counter() - t0, keys))
    return steps


def row(
    dims: Dims, element: int, steps: list[tuple[float, list[int]]], peak: float, bandwidth: float
) -> dict[str, float]:
    """``steps`` (a batch's decode steps from its first to its last) against their floors,
    summed over the steps: the mean step and the shares of each floor reached."""
    seconds = sum(s for s, _ in steps)
    step_flops = [decode_step_flops(dims, keys) for _, keys in steps]
    step_bytes = [decode_step_bytes(dims, keys, element) for _, keys in steps]
    flops, nbytes = sum(step_flops), sum(step_bytes)
    compute, memory = flops / peak, nbytes / bandwidth  # the sums of each step's floors
    roofline = sum(
        max(f / peak, b / bandwidth) for f, b in zip(step_flops, step_bytes, strict=True)
    )
    return {
        "rows": max(len(keys) for _, keys in steps),
        "keys": statistics.mean(statistics.mean(keys) for _, keys in steps),
        "step_ms": 1e3 * seconds / len(steps),
        "gflops": flops / seconds / 1e9,
        "gbs": nbytes / seconds / 1e9,
        "compute_ms": 1e3 * compute / len(steps),
        "memory_ms": 1e3 * memory / len(steps),
        "compute_reached": compute / seconds,
        "memory_reached": memory / seconds,
        "roofline_reached": roofline / seconds,
        "serial_reached": (compute + memory) / seconds,
        "compute_bound_at_most": compute / roofline,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--group", type=int, default=4, help="rows sharing a prompt")
    ap.add_argument("--prompt", type=int, default=51, help="prompt tokens")
    ap.add_argument("--new", type=int, default=64, help="tokens each row decodes")
    ap.add_argument(
        "--layout",
        choices=["engine", "column", "row"],
        default="engine",
        help="the linear layers as the engine has them on the CPU, torch's products on"
        " column-major weights, or torch's on the weights as loaded",
    )
    ap.add_argument(
        "--torch-layers",
        action="store_true",
        help="with --layout engine: every decoder layer through the model's own (torch's"
        " operations around the kernel's products), not the engine's C layer",
    )
    ap.add_argument(
        "--allocator",
        choices=["mimalloc", "system"],
        default="mimalloc",
        help="mimalloc preloaded (the rollout actors of asyncrl up have it) or the C library's",
    )
    args = ap.parse_args()
    allocator = use_mimalloc() if args.allocator == "mimalloc" else "the C library's malloc"
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(args.model), dtype=dtype, attn_implementation="sdpa"
    ).eval()
    layers = False
    if args.layout == "engine":
        layout = cpu_linears(model)
        layers = layout == "kernel" and not args.torch_layers
        layout += ", decoder layers in C" if layers else ", decoder layers by torch"
    elif args.layout == "column":
        column_major_linears(model)
        layout = "column-major"
    else:
        layout = "row-major"
    dims = Dims.of(model.config)
    element = torch.empty((), dtype=dtype).element_size()
    peak = matmul_peak(dtype, matmul_shapes(dims, 2048))
    bandwidth = read_bandwidth()
    print(
        f"# {args.model} {args.dtype}, {cpu_line()}, {args.threads} thread(s),"
        f" torch {torch.__version__}; groups of {args.group} on a {args.prompt}-token prompt,"
        f" {args.new} new tokens a row; linear layers: {layout}; {allocator}"
    )
    print(
        f"# matmul peak {peak / 1e9:.1f} GFLOP/s ({args.dtype}, MLP shapes, 2,048 rows);"
        f" read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"{'rows':>4} {'keys':>5} {'step ms':>8} {'GFLOP/s':>8} {'GB/s':>6} {'compute ms':>11}"
        f" {'memory ms':>10} {'compute':>8} {'memory':>7} {'roofline':>9} {'serial':>7}"
        f" {'compute bound':>14}"
    )
    print(
        f"{'':>4} {'mean':>5} {'mean':>8} {'':>8} {'':>6} {'floor':>11} {'floor':>10}"
        f" {'reached':>8} {'reached':>7} {'reached':>9} {'reached':>7} {'at most':>14}"
    )
    decode_steps(model, args.rows[0], args.group, args.prompt, 8, layers)  # warm-up, not shown
    for rows in args.rows:
        # the rows' state differs step by step; the peak and bandwidth are taken between
        # cases again so that a machine whose speed drifts is caught at its best
        steps = decode_steps(model, rows, args.group, args.prompt, args.new, layers)
        peak = max(peak, matmul_peak(dtype, matmul_shapes(dims, 2048)))
        bandwidth = max(bandwidth, read_bandwidth())
        r = row(dims, element, steps, peak, bandwidth)
        print(
            f"{r['rows']:>4.0f} {r['keys']:>5.0f} {r['step_ms']:>8.1f} {r['gflops']:>8.1f}"
            f" {r['gbs']:>6.1f} {r['compute_ms']:>11.1f} {r['memory_ms']:>10.1f}"
            f" {r['compute_reached']:>8.0%} {r['memory_reached']:>7.0%}"
            f" {r['roofline_reached']:>9.0%} {r['serial_reached']:>7.0%}"
            f" {r['compute_bound_at_most']:>14.0%}",
            flush=True,
        )
    print(
        f"# at the end: peak {peak / 1e9:.1f} GFLOP/s, bandwidth {bandwidth / 1e9:.1f} GB/s"
        " (the best of every measurement, used for all rows)"
    )


if __name__ == "__main__":
    main()
