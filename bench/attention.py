"""The trainer's packed attention on the CPU: torch's calls per segment against one C call a
layer (asyncrl.train.cpu_fused.AttentionFn), forward and backward.

    python bench/attention.py                      # the long workload's, quickstart's, tools'
    python bench/attention.py --shapes long --threads 2

Each shape is timed on each of ``--threads`` (1 and 2 by default) in turn, and the C
call's time on more threads is printed against its time on the first.

A trainer step's packed row holds a group's prompt once and each of its completions as a
segment of its own that attends to the prompt's keys and its own (``trainer.share_prefix``).
``asyncrl_varlen`` (asyncrl.train.attention) computes that on the CPU with one torch
attention call per segment, after gathering the prompt's keys next to each completion's;
``trainer.cpu_fused`` takes the whole row in one C call each way. For each shape this builds
one layer's queries, keys and values (SmolLM2-135M's heads: 9 of 64, 3 key heads) for a
row of G completions of P prompts (prompt and completion lengths drawn as the workloads
give them), times forward + backward and forward alone of both, in turns, and prints the
medians, the ratio and the FLOP/s each reaches (the causal pairs' multiply-adds: forward
4 × head dim a pair and head, backward 10 ×, the scores computed again). The two agree
to float32 rounding (``tests/test_cpu_fused.py``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from flops import cpu_line

from asyncrl.train import attention, cpu_fused

SHAPES: dict[str, tuple[int, int, int, int, float]] = {
    # name: prompts, completions a prompt, prompt tokens, completion median, its log-sigma
    "long": (8, 4, 51, 13, 0.5),
    "quick": (8, 8, 60, 20, 0.5),
    "tools": (4, 8, 340, 70, 0.5),
}
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def layout(shape: str, seed: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A packed row of ``shape``: ``(T, cu_q, cu_k, key_index, causal pairs)``."""
    prompts, group, plen, median, sigma = SHAPES[shape]
    gen = torch.Generator().manual_seed(seed)
    sq: list[int] = []
    sk: list[int] = []
    index: list[int] = []
    pos = pairs = 0
    for _ in range(prompts):
        p = max(1, plen + int(torch.randint(-6, 7, (1,), generator=gen)))
        start = pos
        sq.append(p)
        sk.append(p)
        index += range(start, start + p)
        pos += p
        pairs += p * (p + 1) // 2
        for _ in range(group):
            draw = math.exp(math.log(median) + sigma * float(torch.randn(1, generator=gen)))
            n = max(1, min(64 if shape != "tools" else 256, int(draw)))
            sq.append(n)
            sk.append(p + n)
            index += [*range(start, start + p), *range(pos, pos + n)]
            pos += n
            pairs += n * p + n * (n + 1) // 2
    cu_q = torch.tensor([0, *torch.tensor(sq).cumsum(0).tolist()])
    cu_k = torch.tensor([0, *torch.tensor(sk).cumsum(0).tolist()])
    return pos, cu_q, cu_k, torch.tensor(index), pairs


class _Attending(torch.nn.Module):
    training = True


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(shape: str, repeats: int) -> tuple[int, int, int, dict[str, float]]:
    """One layer of ``shape``: ``(tokens, segments, causal pairs, median ms)`` of torch's
    and the kernel's forward + backward (``tb``, ``cb``) and forward alone (``tf``,
    ``cf``), timed in turns."""
    T, cu_q, cu_k, key_index, pairs = layout(shape, seed=1)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, T, HEADS, HEAD_DIM, generator=gen).requires_grad_()
    k = torch.randn(1, T, KV_HEADS, HEAD_DIM, generator=gen).requires_grad_()
    v = torch.randn(1, T, KV_HEADS, HEAD_DIM, generator=gen).requires_grad_()
    grad = torch.randn(1, T, HEADS, HEAD_DIM, generator=gen)
    scale = HEAD_DIM**-0.5
    module = _Attending()

    def by_torch(backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            out, _ = attention.varlen_causal_attention(
                module, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
                scaling=scale, cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, key_index=key_index,
            )  # fmt: skip
            if backward:
                out.backward(grad)

    def by_kernel(backward: bool) -> None:
        with torch.set_grad_enabled(backward):
            out = cpu_fused.AttentionFn.apply(q, k, v, cu_q, cu_k, key_index, scale)
            if backward:
                out.backward(grad)

    calls: dict[str, Callable[[], Any]] = {
        "tb": lambda: by_torch(True),
        "cb": lambda: by_kernel(True),
        "tf": lambda: by_torch(False),
        "cf": lambda: by_kernel(False),
    }
    runs: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(3):  # warm-up
        for call in calls.values():
            call()
    for i in range(repeats):
        for name in list(calls) if i % 2 == 0 else list(calls)[::-1]:
            runs[name].append(timed(calls[name]))
    ms = {name: statistics.median(times) * 1e3 for name, times in runs.items()}
    return T, cu_q.numel() - 1, pairs, ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument(
        "--threads", type=int, nargs="+", default=[1, 2], help="torch threads, each in turn"
    )
    ap.add_argument("--repeats", type=int, default=40, help="timed calls of each, in turns")
    args = ap.parse_args()
    if cpu_fused.cpu_linear.kernel() is None:
        sys.exit("the C kernel library cannot run here (see the warning above)")
    print(f"# {cpu_line()}; the kernel shares its work between torch's threads")
    print(
        f"{'shape':>6} {'thr':>3} {'tokens':>6} {'segs':>5} | {'torch f+b':>9} {'C f+b':>7}"
        f" {'ratio':>6} | {'torch fwd':>9} {'C fwd':>7} {'ratio':>6} | GFLOP/s f+b torch / C"
    )
    c_ms: dict[tuple[str, int], float] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in args.shapes:
            T, segments, pairs, ms = measure(shape, args.repeats)
            c_ms[shape, threads] = ms["cb"]
            flops = pairs * HEADS * HEAD_DIM * 14  # forward 4, backward 10 a pair's head dim
            print(
                f"{shape:>6} {threads:>3} {T:>6} {segments:>5} | {ms['tb']:7.2f}ms"
                f" {ms['cb']:5.2f}ms {ms['tb'] / ms['cb']:5.2f}x | {ms['tf']:7.2f}ms"
                f" {ms['cf']:5.2f}ms {ms['tf'] / ms['cf']:5.2f}x"
                f" | {flops / ms['tb'] / 1e6:6.1f} / {flops / ms['cb'] / 1e6:.1f}"
            )
    first = args.threads[0]
    for threads in args.threads[1:]:
        print(
            f"C f+b on {threads} threads against {first}: "
            + ", ".join(
                f"{shape} {c_ms[shape, first] / c_ms[shape, threads]:.2f}x" for shape in args.shapes
            )
        )


if __name__ == "__main__":
    main()
