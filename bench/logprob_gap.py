"""How far the rollout engines' logprobs are from the trainer's recomputation of the same tokens.

    python bench/logprob_gap.py                        # vllm and hf, SmolLM2 fp32, T = 0.7
    python bench/logprob_gap.py --engines vllm --temperature 1.0 --prompts 64
    python bench/logprob_gap.py --engines hf --top-k 5 --top-p 0.9
    python bench/logprob_gap.py --engines sglang --prompts 8  # SGLang on the CPU (make sglang)
    python bench/logprob_gap.py --dtype bfloat16           # engines and trainer in bf16

Each engine samples ``--new`` tokens for ``--prompts`` GSM8K questions (chat template) at
``--temperature``, cut by ``--top-k``/``--top-p`` (default: no cut); the train engine
(:class:`asyncrl.train.TrainEngine`, fp32, same temperature and cut) then scores prompt +
completion in one forward pass, in ``--dtype`` like the engine. Engines and trainer report
the same distribution: the sampled one (temperature, then the cut, renormalised). Printed
per engine: the mean and maximum absolute difference |engine − trainer| over all generated
tokens, the mean signed difference, and ``mismatch/kl`` as the trainer's version-0 gate
computes it (mean k3, :func:`asyncrl.algo.mismatch.mismatch_stats`; the gate's default
limit, ``trainer.mismatch_limit``, is chosen from these). The behaviour/proximal importance ratio of a token
is exp(trainer − engine), so these bound how far from 1 it drifts on unchanged weights.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rollout import chat_prompts


def build(kind: str, model: Any) -> Any:
    if kind == "sglang":
        from asyncrl.engines.config import SGLangEngineConfig
        from asyncrl.engines.sglang import SGLangEngine

        config = SGLangEngineConfig(
            python=".venv-sglang/bin/python", cpu=True, max_total_tokens=16384
        )
        return SGLangEngine(model, config, log_dir="runs/bench-logs")
    if kind == "vllm":
        from asyncrl.engines.config import VLLMEngineConfig
        from asyncrl.engines.vllm import VLLMEngine

        return VLLMEngine(model, VLLMEngineConfig(max_model_len=2048), log_dir="runs/bench-logs")
    from asyncrl.engines.config import HFEngineConfig
    from asyncrl.engines.hf import HFEngine

    return HFEngine(model, HFEngineConfig(max_batch_size=64))


async def generate(kind: str, args: argparse.Namespace) -> list[Any]:
    from asyncrl.api.inference import GenerateRequest, SamplingParams

    sp = SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.new,
        seed=None,
    )
    from asyncrl.models.resolve import ModelConfig

    async with build(kind, ModelConfig(path=args.model, dtype=args.dtype)) as engine:
        prompts = chat_prompts(engine.tokenizer, args.prompts)
        return list(
            await asyncio.gather(
                *(engine.agenerate(GenerateRequest(input_ids=p, sampling=sp)) for p in prompts)
            )
        )


def gap(outs: list[Any], trainer: Any) -> tuple[float, float, float, int, float]:
    import torch

    from asyncrl.algo.mismatch import MISMATCH_KL, mismatch_stats
    from asyncrl.train.batch import Sample

    samples = []
    for o in outs:
        ids = torch.tensor(o.input_ids + o.output_ids)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[len(o.input_ids) :] = True
        behav = torch.zeros(len(ids))
        behav[len(o.input_ids) :] = torch.tensor(o.output_logprobs)
        samples.append(Sample(ids, mask, behav, 0.0))
    recomputed = trainer.compute_logprobs(samples)
    diffs = torch.cat(
        [(s.behav_logprobs - r)[s.loss_mask] for s, r in zip(samples, recomputed, strict=True)]
    )
    kl = mismatch_stats(-diffs, torch.zeros_like(diffs), torch.ones_like(diffs, dtype=torch.bool))
    return (
        float(diffs.abs().mean()),
        float(diffs.abs().max()),
        float(diffs.mean()),
        int(diffs.numel()),
        float(kl[MISMATCH_KL]),
    )


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"], help="vllm, sglang, hf")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="new tokens per prompt (at most)")
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-k", type=int, default=0, help="0: no top-k cut")
    ap.add_argument("--top-p", type=float, default=1.0, help="1: no top-p cut")
    ap.add_argument("--dtype", default="float32", help="engines' and trainer's: float32, bfloat16")
    args = ap.parse_args()

    from asyncrl.models.resolve import ModelConfig, resolve_model_path
    from asyncrl.train import TrainerConfig
    from asyncrl.train.engine import TrainEngine

    outputs = {kind: await generate(kind, args) for kind in args.engines}
    trainer = TrainEngine(
        TrainerConfig(
            max_tokens_per_microbatch=8192,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
        ),
        ModelConfig(path=resolve_model_path(args.model), dtype=args.dtype),
    )
    print(
        f"# {args.model} {args.dtype}, T={args.temperature}, top_k={args.top_k}, top_p={args.top_p}, "
        f"{args.prompts} GSM8K prompts, "
        f"<= {args.new} new tokens; trainer: TrainEngine.compute_logprobs ({args.dtype})"
    )
    head = f"{'engine':>8} {'tokens':>7} {'mean |d|':>10} {'max |d|':>10} {'mean d':>10}"
    print(f"{head} {'mismatch/kl':>12}")
    for kind, outs in outputs.items():
        mean_abs, max_abs, mean, n, kl = gap(outs, trainer)
        print(f"{kind:>8} {n:>7} {mean_abs:>10.2e} {max_abs:>10.2e} {mean:>10.2e} {kl:>12.2e}")


if __name__ == "__main__":
    asyncio.run(main())
