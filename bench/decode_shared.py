"""The hf engine's decode step with and without cascade attention over a shared prefix.

    python bench/decode_shared.py                       # SmolLM2-135M fp32, 1 thread
    python bench/decode_shared.py --cases 432:100:32 432:100:8 --steps 80

Each case is ``prefix:tail:rows``: a first sequence puts a ``prefix``-token system prompt
into the prefix cache, then ``rows`` sequences join with that prompt and a tail of about
``tail`` tokens of their own, so their first columns are copies of the cached blocks. The
decode batch then steps ``--steps`` times, cascade attention on and off in turns *on the
same batch* (the rows' state moves one token a step either way), so the machine's drift
hits both alike; the median step of each is printed, with whether the engine planned
cascade steps at all (it does not where too few key columns would be spared:
``MIN_SHARED_SAVING`` in :mod:`asyncrl.engines.hf_batch`).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from typing import Any

import torch
from transformers import AutoModelForCausalLM

from asyncrl.api.inference import SamplingParams
from asyncrl.engines.hf_batch import DecodeBatch, Sequence
from asyncrl.models.resolve import resolve_model_path


def sequence(key: int, prompt: list[int], new: int) -> Sequence:
    return Sequence(
        key=key,
        prompt=prompt,
        sampling=SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=()),
        stop_ids=frozenset(),
        max_new=new,
        generator=torch.Generator().manual_seed(key),
    )


def run_case(model: Any, prefix: int, tail: int, rows: int, steps: int) -> str:
    vocab = model.config.vocab_size
    system = [100 + (i * 37) % (vocab - 200) for i in range(prefix)]
    batch = DecodeBatch(model, max_positions=1 << 16, prefix_cache_bytes=512 << 20)
    first = [sequence(0, [*system, 7], 2)]
    while first or batch.active:
        batch.step(first, set(), 0)
        first = []
    joins = [
        sequence(
            1 + i, system + [200 + (i * 13 + j) % 3000 for j in range(tail + i % 5)], steps + 2
        )
        for i in range(rows)
    ]
    batch.step(joins, set(), 0)
    columns = batch.length
    times: dict[bool, list[float]] = {True: [], False: []}
    planned = 0
    for i in range(steps):
        on = i % 2 == 0
        batch.cascade = on
        t0 = time.perf_counter()
        result = batch.step([], set(), 0)
        times[on].append(time.perf_counter() - t0)
        planned += result.shared_rows > 0
    on_s, off_s = statistics.median(times[True]), statistics.median(times[False])
    return (
        f"{prefix:>6} {tail:>5} {rows:>4} {columns:>7} {1000 * on_s:>11.1f} "
        f"{1000 * off_s:>9.1f} {off_s / on_s:>13.2f} {planned:>5}/{len(times[True])}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=60, help="decode steps a case, half each way")
    ap.add_argument(
        "--cases",
        nargs="+",
        default=["432:100:32", "432:100:8", "128:60:32", "48:10:32"],
        help="prefix:tail:rows",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(
        resolve_model_path(args.model), dtype=getattr(torch, args.dtype), attn_implementation="sdpa"
    ).eval()
    print(
        f"# {args.model} {args.dtype}, {platform.processor() or 'cpu'} x{args.threads}, "
        f"torch {torch.__version__}; cascade and plain attention in turns on one batch"
    )
    print(
        f"{'prefix':>6} {'tail':>5} {'rows':>4} {'columns':>7} {'cascade ms':>11} "
        f"{'plain ms':>9} {'plain/cascade':>13} {'planned':>11}"
    )
    for case in args.cases:
        prefix, tail, rows = (int(x) for x in case.split(":"))
        print(run_case(model, prefix, tail, rows, args.steps), flush=True)


if __name__ == "__main__":
    main()
