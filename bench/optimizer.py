"""One AdamW step over a model's parameters, in each of torch's implementations.

    python bench/optimizer.py                                  # SmolLM2-135M shape, CPU
    python bench/optimizer.py --shape qwen2.5-1.5b --device cuda

The trainer builds its AdamW with ``fused=True`` on the CPU and CUDA; this measures what
that buys over torch's defaults (a loop of per-tensor ops on the CPU, the multi-tensor
``foreach`` form on CUDA). The model is random-initialised from its shape's config
(bench/trainer.py's ``SHAPES``), every parameter gets a random gradient, and each
implementation takes one untimed step, then ``--steps`` timed ones; the implementations
take turns for ``--rounds`` rounds, and the median step of each is printed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch
from trainer import SHAPES, model_config  # bench/trainer.py, beside this file
from transformers import AutoModelForCausalLM

KINDS: dict[str, dict[str, Any]] = {
    "default": {},
    "for-loop": {"foreach": False},
    "foreach": {"foreach": True},
    "fused": {"fused": True},
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(model_config(args.shape, 64)).to(args.device)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    count = sum(p.numel() for p in params)
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind, options in KINDS.items():
            opt = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **options)
            opt.step()
            for _ in range(args.steps):
                if args.device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                opt.step()
                if args.device == "cuda":
                    torch.cuda.synchronize()
                times[kind].append(time.perf_counter() - t0)
            del opt
    where = f"{args.device}, {torch.get_num_threads()} threads" if args.device == "cpu" else "cuda"
    print(f"AdamW step, {args.shape} shape ({count / 1e6:.1f} M parameters), {where}\n")
    print("| implementation | step ms | vs fused |\n|---|---|---|")
    fused = statistics.median(times["fused"])
    for kind, ts in times.items():
        step = statistics.median(ts)
        print(f"| {kind} | {step * 1e3:.0f} | {step / fused:.2f}× |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
