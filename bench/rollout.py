"""Generation throughput of the rollout engines at several concurrency levels, side by side.

    python bench/rollout.py                       # SmolLM2 fp32: hf and vllm at 8 32 128
    python bench/rollout.py --engines hf          # only the in-process engine
    python bench/rollout.py --device cuda --dtype bfloat16 --concurrency 1 8 32 128
    python bench/rollout.py --baseline            # also HF generate() at the same batch sizes
    python bench/rollout.py --group-size 8        # GRPO-like: 8 requests share each prompt

Engines: ``hf`` (in process, on ``--device``), ``hf-cuda`` (added by default when a CUDA
device is present) and ``vllm`` (a vLLM server from ``.venv-vllm``: ``make vllm``; on a CPU
its threads bind as ``--vllm-bind`` says, ``auto`` leaving one core to its front end).

Each level runs ``concurrency`` clients; each client sends ``--rounds`` requests one after
another (a GSM8K test question in the chat template, sampled at T = 1); with
``--group-size n``, n clients at a time send the same question, as a GRPO group does. Generation ignores
end-of-sequence so every request makes exactly ``--max-new-tokens`` tokens and the levels
compare like for like. tokens/s = generated tokens / wall seconds of the level; on a
shared machine, where other work steals the cores, the CPU seconds this process used
(``cpu s``) show the engine's own cost, and ``--repeats`` keeps the fastest of k runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k" / "test.jsonl"


def chat_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    lines = DATA.read_text().splitlines() if DATA.is_file() else []
    questions = [json.loads(line)["question"] for line in lines[:n]] or [
        f"What is {i} times {i + 3}? Explain step by step." for i in range(n)
    ]
    while len(questions) < n:
        questions += questions
    out = []
    for q in questions[:n]:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer.encode(text, add_special_tokens=False))
    return out


async def run_level(
    engine: Any, prompts: list[list[int]], concurrency: int, rounds: int, new: int, group: int = 1
) -> tuple[int, float, float, float]:
    from asyncrl.api.inference import GenerateRequest, SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=())
    stats = getattr(engine, "stats", None)  # the hf engine counts its batches
    if stats is not None:
        stats.decode_batch_sizes.clear()
    tokens = 0

    async def client(i: int) -> None:
        nonlocal tokens
        for r in range(rounds):
            p = prompts[((i // group) * rounds + r) % len(prompts)]
            resp = await engine.agenerate(GenerateRequest(input_ids=p, sampling=sp))
            tokens += len(resp.output_ids)

    t0, c0 = time.perf_counter(), time.process_time()
    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(client(i))
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    if stats is None:
        return tokens, dt, cpu, float("nan")
    sizes = stats.decode_batch_sizes
    mean_batch = sum(k * v for k, v in sizes.items()) / max(1, sizes.total())
    return tokens, dt, cpu, mean_batch


def run_baseline(
    engine: Any, prompts: list[list[int]], batch: int, new: int
) -> tuple[int, float, float]:
    """HF ``generate`` on one left-padded batch of the same prompts, for reference."""
    import torch

    model, tok = engine.model, engine.tokenizer
    rows = prompts[:batch]
    width = max(len(p) for p in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in rows], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in rows], device=model.device)
    with torch.inference_mode():
        t0, c0 = time.perf_counter(), time.process_time()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=pad,
        )
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    return (out.shape[1] - width) * len(rows), dt, cpu


def build(kind: str, args: argparse.Namespace) -> tuple[Any, str]:
    """An unstarted engine of ``kind`` and a line describing where it runs."""
    import platform

    import torch

    if kind == "vllm":
        from asyncrl.engines.config import VLLMEngineConfig
        from asyncrl.engines.vllm import VLLMEngine
        from asyncrl.models.resolve import ModelConfig

        config = VLLMEngineConfig(
            python=args.vllm_python,
            cpu_kvcache_gib=args.vllm_kvcache_gib,
            cpu_threads_bind=args.vllm_bind,
            max_model_len=2048,
        )
        model = ModelConfig(path=args.model, dtype=args.dtype)
        engine = VLLMEngine(model, config, log_dir="runs/bench-logs")
        return engine, f"vllm server, threads bind {args.vllm_bind} (log runs/bench-logs)"
    from asyncrl.engines.config import HFEngineConfig
    from asyncrl.engines.hf import HFEngine
    from asyncrl.models.resolve import ModelConfig

    device = "cuda" if kind == "hf-cuda" else args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = (
        torch.cuda.get_device_name()
        if device.startswith("cuda")
        else f"{platform.processor() or 'cpu'} x{torch.get_num_threads()} threads"
    )
    engine = HFEngine(
        ModelConfig(path=args.model, dtype=args.dtype),
        HFEngineConfig(device=device, max_batch_size=max(args.concurrency)),
    )
    return engine, f"hf on {where}"


async def bench_engine(kind: str, args: argparse.Namespace) -> dict[int, float]:
    """Runs every level on one engine; returns tokens/s per concurrency."""
    engine, where = build(kind, args)
    t0 = time.perf_counter()
    results: dict[int, float] = {}
    async with engine:
        print(
            f"# {kind}: {args.model} {args.dtype}, {where}; up in {time.perf_counter() - t0:.1f}s"
        )
        prompts = chat_prompts(engine.tokenizer, max(args.concurrency) * args.rounds)
        plen = sum(len(p) for p in prompts) / len(prompts)
        print(
            f"# prompts: {len(prompts)} GSM8K questions, mean {plen:.0f} tokens; "
            f"{args.max_new_tokens} new tokens each, T=1.0"
        )
        await run_level(engine, prompts, 1, 1, 4)  # warm-up: first-call allocations
        print(
            f"{'concurrency':>11} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} "
            f"{'cpu s':>7} {'mean batch':>10}"
        )
        for c in args.concurrency:
            runs = [
                await run_level(
                    engine, prompts, c, args.rounds, args.max_new_tokens, args.group_size
                )
                for _ in range(args.repeats)
            ]
            tokens, dt, cpu, mean_batch = min(runs, key=lambda r: r[1])
            results[c] = tokens / dt
            print(
                f"{c:>11} {c * args.rounds:>8} {tokens:>7} {dt:>8.2f} {tokens / dt:>8.1f} "
                f"{cpu:>7.1f} {mean_batch:>10.1f}",
                flush=True,
            )
        if args.baseline and kind.startswith("hf"):
            for c in args.concurrency:
                base_runs = [
                    await asyncio.to_thread(run_baseline, engine, prompts, c, args.max_new_tokens)
                    for _ in range(args.repeats)
                ]
                tokens, dt, cpu = min(base_runs, key=lambda r: r[1])
                print(
                    f"# HF generate() batch {c:>3}: {tokens} tokens in {dt:.2f}s = "
                    f"{tokens / dt:.1f} tok/s ({cpu:.1f} cpu s)",
                    flush=True,
                )
    return results


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="cpu", help="device of the hf engine: cpu, cuda, auto")
    ap.add_argument("--engines", nargs="+", default=None, help="hf, hf-cuda, vllm")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 128])
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1, help="requests per client, in sequence")
    ap.add_argument("--repeats", type=int, default=1, help="runs per level; the fastest counts")
    ap.add_argument("--group-size", type=int, default=1, help="clients sharing one prompt")
    ap.add_argument("--baseline", action="store_true", help="also time HF generate()")
    ap.add_argument("--vllm-python", default=".venv-vllm/bin/python")
    ap.add_argument("--vllm-bind", default="auto", help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--vllm-kvcache-gib", type=int, default=2)
    args = ap.parse_args()

    import torch

    engines = args.engines
    if engines is None:
        engines = ["hf", "vllm"] + (["hf-cuda"] if torch.cuda.is_available() else [])
    table = {kind: await bench_engine(kind, args) for kind in engines}
    print(f"\n# tokens/s, {args.model} {args.dtype}, {args.max_new_tokens} new tokens per request")
    print(f"{'concurrency':>11} " + " ".join(f"{k:>9}" for k in engines))
    for c in args.concurrency:
        print(f"{c:>11} " + " ".join(f"{table[k].get(c, float('nan')):>9.1f}" for k in engines))


if __name__ == "__main__":
    asyncio.run(main())
