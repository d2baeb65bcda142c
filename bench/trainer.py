"""Train-engine throughput: tokens/s of packed vs padded micro-batches, the cost of a
separate proximal forward, MFU on CUDA, the share of the CPU's measured GEMM peak, and the
batch hand-off between trainer ranks.

    python bench/trainer.py                                  # tiny shape on the CPU, ~1 min
    python bench/trainer.py --shape smollm2-135m --seqs 32 --resp-median 64 --resp-sigma 0 \
        --max-new 64 --modes packed --steps 2               # the CPU trainer against its peak
    python bench/trainer.py --shape qwen2.5-1.5b --seqs 256 --grad-ckpt   # on a GPU
    python bench/trainer.py --modes handoff --seqs 256 --steps 10        # 2 ranks, gloo
    python bench/trainer.py --shape smollm2-135m --seqs 32 --resp-median 64 --resp-sigma 0 \
        --max-new 64 --modes compile --steps 4              # eager against torch.compile
    python bench/trainer.py --shape smollm2-135m --seqs 32 --resp-median 13 --resp-sigma 0.5 \
        --max-new 64 --modes fused --steps 8 --threads 1    # elementwise parts by torch or in C
    python bench/trainer.py --shape smollm2-135m --modes lora --seqs 8 --resp-median 64 \
        --resp-sigma 0 --max-new 64 --steps 2               # full fine-tuning against LoRA
    python bench/trainer.py --shape smollm2-135m --seqs 32 --resp-median 64 --resp-sigma 0 \
        --max-new 64 --steps 4 --in-thread --compare-malloc # glibc against mimalloc
    python bench/trainer.py --shape smollm2-135m --modes share_prefix --max-tokens 2048 \
        --steps 2                                           # a group's prompt once, or per sample

The model is randomly initialised at the chosen shape (no download). Every step trains on
a GRPO-like batch with GSM8K-like lengths: prompt lengths from the GSM8K questions
(characters / 4 plus a chat-template overhead), response lengths lognormal (median
``--resp-median``, σ ``--resp-sigma``, clipped to ``--max-new``). Every mode sees the same
batches. The loss is decoupled PPO with one minibatch, whose proximal logprobs are the
training forward's own (detached), so a step is one forward and one backward. Mode
``proximal`` times packed steps both ways on one engine, interleaved: as above, and with
the proximal logprobs recomputed by a separate no-grad forward first (what a step cost
before that shortcut, and still costs with ``ppo_minibatches`` > 1); it prints the two step
times side by side with their ratio.

tokens/s counts real tokens (prompt + response), never padding. MFU = model FLOPs / (step
time · peak), with model FLOPs = 3 × forward as bench/flops.py counts them: the linear
layers at every token, causal attention, the LM head at loss tokens only, a group's
shared prompt once. Padding and the separate proximal forward are not counted as useful
work.

Every step's line and the packed / padded table also give the step's **compute floor**:
its FLOPs (bench/flops.py; mode ``proximal`` adds the separate forward where it runs one)
over the matmul peak measured in this run in the step's dtype, with the step's threads,
at the model's MLP shapes on ``--peak-rows`` rows (on CUDA the data-sheet peak or
``--peak-tflops``), and the share of that floor the step reached (floor / step time). The
per-step lines use the peak measured before the steps; the table the better of before
and after.

On the CPU the peak is this machine's own, measured in the same run with the same torch
threads: the best of a few ``--peak-size``² square matmuls in float32 (and in bfloat16
where the CPU has AVX512-BF16 or AMX, per /proc/cpuinfo). The packed mode's model FLOP/s
over the fp32 peak is printed as ``trainer: N% of measured fp32 peak``; for bf16 compute
(``--dtype bfloat16``) the line gives the share of the bf16 peak, the reference for it,
first, then the fp32 share (which can pass 100%).

Mode ``lora`` trains the same batches with every weight and with LoRA adapters
(``--lora-rank``, alpha = rank, the default projections), one engine after the other (two
at once would not fit beside a shared machine's other work), and prints side by side: step
time, trainable parameters, optimizer state bytes (AdamW's two moments, all that
``optimizer.state`` holds) and the bytes of one weight update (all weights in the model
dtype, against the adapter).

Mode ``fused`` trains the same batches with ``trainer.cpu_fused`` off and on (RMSNorm,
rotary positions, SiLU(gate) · up and the packed attention as torch's operations, or one C
pass each on the CPU in float32), engines stepped in turns, and prints the median step
times, their ratio and the share of the floor each reached; on more than one thread also
the C passes on the calling thread alone against shared between torch's threads.

Mode ``compile`` trains the same batches eager and with ``trainer.compile`` (every decoder
layer under ``torch.compile``, dynamic shapes), one engine after the other, and prints the
steady step times, their ratio, the first step of each (the compiled one's holds the
compilation) and after how many steps the compilation has paid for itself.

Every step's line gives its kernel CPU time, page faults and resident memory, where the
cost of fresh memory shows: glibc's malloc maps each large block afresh and unmaps it when
freed, and the kernel zeroes every fresh page. ``--allocator`` picks the bench process's
allocator: ``system`` (the C library's, as it comes), ``keep-freed`` (glibc with no
per-block ``mmap`` and no trimming) or ``mimalloc`` (what the CPU trainer runs under,
``trainer.allocator = "auto"``: the same command again with it preloaded, freed memory
handed back lazily);
``--compare-malloc`` runs the packed mode under each, a process each, and prints the step
times. ``--in-thread`` runs the steps in a worker thread, as the trainer actor does
(``asyncio.to_thread``): a thread's glibc arena maps any block over 64 MB afresh whatever
the setting, so ``keep-freed`` does not reach the trainer; mimalloc does.

Mode ``share_prefix`` trains GRPO groups of two recipes' shapes, each with
``trainer.share_prefix`` off and on, interleaved on one engine (alternating which goes
first): the quickstart's (8 prompts × 8 samples, prompts of ~60 tokens, answers of ~20)
and the tools recipe's (8 × 4, ~340 and ~70). A group's samples share its prompt's tokens
(random, as are the answers'; each prompt's length within ±20% of the shape's, each
answer's within ±50%). It prints, per shape, the tokens the model computed without and
with sharing, their ratio, the step times and their ratio; ``--seqs`` and the response
options do not apply to it.

Mode ``profile`` trains the warm-up batches, then profiles one packed step with
``torch.profiler`` and prints its time by kind (bench/flops.py): ``matmul``, ``attention``
(the fused attention kernels), ``elementwise`` (pointwise work and reductions, copies and
casts, the LM head's softmax), ``optimizer``, ``views`` and ``other`` (the wall time no op
accounts for: Python, the autograd engine), beside its compute floor, then the 15 ops of
most self time: where a step stays far from its floor.

Mode ``handoff`` needs no model: two gloo ranks on this machine, and per step the time from
rank 0 holding the batch to every rank holding what it trains on (the trainer actor's
batch hand-off, the same code), median over ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from flops import (
    Dims,
    Group,
    floor_columns,
    matmul_peak,
    matmul_shapes,
    step_flops,
    time_sink,
    time_sinks,
)

from asyncrl.models.resolve import ModelConfig
from asyncrl.train import LossConfig, OptimConfig, TrainerConfig
from asyncrl.train import cpu_fused as c_passes
from asyncrl.train.batch import Sample
from asyncrl.train.config import LoraConfig
from asyncrl.train.engine import TrainEngine
from asyncrl.train.packing import common_prefix

REPO = Path(__file__).resolve().parents[1]
GSM8K = next(
    (
        p / "shared" / "data" / "gsm8k" / "train.jsonl"
        for p in REPO.parents
        if (p / "shared" / "data" / "gsm8k" / "train.jsonl").is_file()
    ),
    REPO.parent / "shared" / "data" / "gsm8k" / "train.jsonl",
)  # beside the checkout, or above a worktree of it
TEMPLATE_TOKENS = 40  # a chat template and a one-line instruction around the question

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        arch="llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=4096, tie_word_embeddings=True,
    ),
    "smollm2-135m": dict(
        arch="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
        num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
    "qwen2.5-1.5b": dict(
        arch="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
        num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
    ),
}  # fmt: skip

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0}
"""Dense bf16 tensor-core peaks from the vendors' data sheets."""


def model_config(shape: str, max_len: int) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    fields = dict(SHAPES[shape])
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config}[fields.pop("arch")]
    return cls(max_position_embeddings=max(4096, max_len), **fields)


def prompt_lengths(n: int, g: torch.Generator) -> list[int]:
    if GSM8K.is_file():
        lines = GSM8K.read_text().splitlines()
        pool = [len(json.loads(line)["question"]) // 4 + TEMPLATE_TOKENS for line in lines]
    else:
        print(f"note: {GSM8K} not found; lognormal prompt lengths instead", file=sys.stderr)
        pool = (torch.randn(4096, generator=g) * 0.35 + math.log(90)).exp().long().tolist()
    picks = torch.randint(len(pool), (n,), generator=g).tolist()
    return [pool[i] for i in picks]


def make_batch(args: argparse.Namespace, vocab: int, g: torch.Generator) -> list[Sample]:
    prompts = prompt_lengths(args.seqs, g)
    resp = (
        torch.randn(args.seqs, generator=g) * args.resp_sigma + math.log(args.resp_median)
    ).exp()
    responses = resp.clamp(8, args.max_new).long().tolist()
    batch = []
    for p, r in zip(prompts, responses, strict=True):
        n = p + r
        mask = torch.zeros(n, dtype=torch.bool)
        mask[p:] = True
        behav = torch.where(mask, -1.0, 0.0)
        adv = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
        batch.append(Sample(torch.randint(vocab, (n,), generator=g), mask, behav, adv))
    return batch


def sample_groups(batch: list[Sample]) -> list[Group]:
    """``batch`` as :class:`flops.Group` s: the samples of one ``group`` share their common
    prefix up to the first loss token of any of them; a sample without a group is a group
    of its own (sharing nothing)."""
    by_group: dict[object, list[Sample]] = {}
    for i, s in enumerate(batch):
        by_group.setdefault(("group", s.group) if s.group is not None else i, []).append(s)
    groups = []
    for members in by_group.values():
        starts = [int(s.loss_mask.nonzero()[0]) if s.num_loss_tokens else len(s) for s in members]
        prompt = min(starts)
        if len(members) > 1:
            prompt = min(prompt, common_prefix([s.input_ids for s in members]))
        groups.append(
            Group(
                prompt,
                tuple(len(s) - prompt for s in members),
                tuple(s.num_loss_tokens for s in members),
            )
        )
    return groups


def model_flops(engine: TrainEngine, batch: list[Sample], extra_forwards: int = 0) -> float:
    """Training FLOPs of one step on ``batch``, plus ``extra_forwards`` no-grad forwards
    (bench/flops.py counts them: a group's prompt once, the LM head at loss tokens)."""
    dims = Dims.of(engine.lm.config)
    return float(step_flops(dims, sample_groups(batch), extra_forwards=extra_forwards)["total"])


def peak_flops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops:
        return float(args.peak_tflops) * 1e12
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def floor_peak(args: argparse.Namespace, cuda: bool) -> float | None:
    """The FLOP/s a step's compute floor is taken at: on the CPU the matmul peak measured
    now in the step's dtype at the model's MLP shapes (``--peak-rows`` rows) on torch's
    current threads; on CUDA the data-sheet (or ``--peak-tflops``) peak."""
    if cuda or args.peak_tflops:
        return peak_flops(args)
    dims = Dims.of(model_config(args.shape, 4096))
    return matmul_peak(getattr(torch, args.dtype), matmul_shapes(dims, args.peak_rows))


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def has_bf16_gemm(flags: set[str]) -> bool:
    """Whether the CPU multiplies bf16 natively (AVX512-BF16 or AMX), rather than by
    converting to fp32 first."""
    return "avx512_bf16" in flags or "amx_bf16" in flags


def measured_gemm_peak(dtype: torch.dtype, size: int, reps: int = 5) -> float:
    """FLOP/s of the fastest of ``reps`` ``size``² matmuls in ``dtype`` (after one
    untimed), with torch's current threads: this machine's practical GEMM peak."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(dtype)
    b = torch.randn(size, size, generator=g).to(dtype)
    out = torch.empty(size, size, dtype=dtype)
    torch.mm(a, b, out=out)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - t0)
    return 2.0 * size**3 / best


def build_engine(
    args: argparse.Namespace,
    packing: bool,
    batches: list[list[Sample]],
    lora_rank: int = 0,
    compile: bool = False,
    cpu_fused: bool = True,
) -> Any:
    max_len = max(len(s) for b in batches for s in b)
    lora = LoraConfig(rank=lora_rank, alpha=max(1, lora_rank))
    return TrainEngine(
        TrainerConfig(
            device=args.device,
            attn_implementation=args.attn,
            gradient_checkpointing=args.grad_ckpt,
            max_tokens_per_microbatch=args.max_tokens,
            lm_head_chunk_tokens=args.head_chunk,
            packing=packing,
            compile=compile,
            cpu_fused=cpu_fused,
            optim=OptimConfig(lr=1e-6),
            loss=LossConfig(behav_imp_weight_cap=None),
            lora=lora,
        ),
        ModelConfig(path=args.shape, dtype=args.dtype),
        architecture=model_config(args.shape, max_len),
    )


def timed_steps(
    engine: Any,
    batches: list[list[Sample]],
    label: str,
    warmup: int,
    in_thread: bool = False,
    peak: float | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Trains ``engine`` on each batch in turn, in one worker thread if ``in_thread``;
    returns every step's seconds (printed as each ends, the first ``warmup`` marked as not
    counted, with the step's compute floor at ``peak`` FLOP/s where given) and the last
    step's stats."""
    from concurrent.futures import ThreadPoolExecutor

    worker = ThreadPoolExecutor(max_workers=1) if in_thread else None
    times: list[float] = []
    stats: dict[str, float] = {}
    for i, batch in enumerate(batches):
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        if worker is None:
            stats = engine.train_step(batch)
        else:
            stats = worker.submit(engine.train_step, batch).result()
        times.append(time.perf_counter() - t0)  # train_step synchronises on CUDA
        after = resource.getrusage(resource.RUSAGE_SELF)
        note = " (warm-up, not counted)" if i < warmup else ""
        if peak:
            note += f"; {floor_columns(model_flops(engine, batch), peak, times[-1])}"
        print(
            f"  {label} step {i}: {times[-1]:.2f} s{note}; kernel CPU "
            f"{after.ru_stime - before.ru_stime:.1f} s, "
            f"{(after.ru_minflt - before.ru_minflt) / 1e3:.0f}k page faults, RSS {rss_gib():.2f} GiB",
            flush=True,
        )
    if worker is not None:
        worker.shutdown()
    return times, stats


def run_lora(args: argparse.Namespace, batches: list[list[Sample]]) -> dict[str, dict[str, float]]:
    """Packed steps with full fine-tuning, then with LoRA: step time, trainable
    parameters, optimizer state bytes and the bytes of one published weight update."""
    out = {}
    for name, rank in (("full", 0), (f"lora r={args.lora_rank}", args.lora_rank)):
        engine = build_engine(args, True, batches, lora_rank=rank)
        times = timed_steps(
            engine, batches, name, args.warmup, args.in_thread, peak=args.floor_peak
        )[0][args.warmup :]
        itemsize = torch.empty((), dtype=engine.param_dtype).element_size()
        trainable = [p for p in engine.lm.parameters() if p.requires_grad]
        optim_bytes = sum(
            t.numel() * t.element_size()
            for state in engine.optimizer.state.values()
            for t in state.values()
            if isinstance(t, torch.Tensor) and t.ndim > 0
        )
        # an update carries what is trained (the adapters) or every weight, tied ones once
        published = trainable if rank else list(engine.lm.parameters())
        out[name] = {
            "step_s": statistics.median(times),
            "trainable": float(sum(p.numel() for p in trainable)),
            "optim_bytes": float(optim_bytes),
            "update_bytes": float(sum(p.numel() for p in published) * itemsize),
        }
        del engine
    return out


def run_compile(args: argparse.Namespace, batches: list[list[Sample]]) -> dict[str, float]:
    """Packed steps eager, then with ``trainer.compile`` (each decoder layer compiled with
    dynamic shapes), one engine after the other on the same batches: each one's first
    step (the compiled one's includes compilation) and the median of the rest."""
    out = {}
    for name, compiled in (("eager", False), ("compiled", True)):
        engine = build_engine(args, True, batches, compile=compiled)
        times, _ = timed_steps(
            engine, batches, name, args.warmup, args.in_thread, peak=args.floor_peak
        )
        out[f"{name}_first_s"] = times[0]
        out[f"{name}_s"] = statistics.median(times[args.warmup :])
        out["flops"] = statistics.mean(model_flops(engine, b) for b in batches[args.warmup :])
        del engine
    return out


def run_fused(args: argparse.Namespace, batches: list[list[Sample]]) -> dict[str, float]:
    """Packed steps with ``trainer.cpu_fused`` off and on (the decoder layers' elementwise
    parts and attention as torch's operations, or one C pass each), engines of the same
    weights stepped in turns on each batch (rotating which goes first), so that all see
    the same batches, warm caches and machine load: the median step time of each. On more
    than one thread a third engine runs the C passes on the calling thread alone (as they
    were before they shared their work between torch's threads; the same bits)."""
    variants = {"torch": False, "fused": True}
    if torch.get_num_threads() > 1:
        variants["fused_one"] = True
    engines = {
        name: build_engine(args, True, batches, cpu_fused=on) for name, on in variants.items()
    }
    if not engines["fused"].fused_layers:
        raise SystemExit("mode fused: trainer.cpu_fused does not apply here (see the log)")
    times: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    shared_threads = c_passes._threads
    for i, batch in enumerate(batches):
        for name in names[i % len(names) :] + names[: i % len(names)]:
            c_passes._threads = (lambda: 1) if name == "fused_one" else shared_threads
            try:
                t0 = time.perf_counter()
                engines[name].train_step(batch)
                elapsed = time.perf_counter() - t0
            finally:
                c_passes._threads = shared_threads
            if i >= args.warmup:
                times[name].append(elapsed)
    out = {f"{name}_s": statistics.median(t) for name, t in times.items()}
    out["flops"] = statistics.mean(model_flops(engines["fused"], b) for b in batches[args.warmup :])
    return out


def run_proximal(args: argparse.Namespace, batches: list[list[Sample]]) -> dict[str, float]:
    """Packed steps with the proximal logprobs from the training forward and from a
    separate forward, interleaved on one engine (alternating which goes first), so that
    both see the same batches, warm caches and machine load."""
    engine = build_engine(args, True, batches)
    times: dict[bool, list[float]] = {False: [], True: []}
    proximal = []
    for i, batch in enumerate(batches):
        for separate in (False, True) if i % 2 == 0 else (True, False):
            engine.config.loss.separate_proximal_forward = separate
            t0 = time.perf_counter()
            stats = engine.train_step(batch)
            if i >= args.warmup:
                times[separate].append(time.perf_counter() - t0)
                if separate:
                    proximal.append(stats["time/proximal_s"])
    measured = batches[args.warmup :]
    flops = {
        separate: statistics.mean(model_flops(engine, b, int(separate)) for b in measured)
        for separate in (False, True)
    }
    del engine
    return {
        "free_s": statistics.median(times[False]),
        "separate_s": statistics.median(times[True]),
        "proximal_s": statistics.median(proximal),
        "free_flops": flops[False],
        "separate_flops": flops[True],
    }


def run_head(args: argparse.Namespace, batches: list[list[Sample]]) -> dict[str, float]:
    """Packed steps with the LM head once per chunk (log q kept for backward) and with
    checkpointed chunks (logits recomputed in backward), interleaved on one engine
    (alternating which goes first): the same batches, warm caches and machine load."""
    engine = build_engine(args, True, batches)
    module: Any = engine.module
    times: dict[bool, list[float]] = {False: [], True: []}
    for i, batch in enumerate(batches):
        for recompute in (False, True) if i % 2 == 0 else (True, False):
            module.recompute_head = recompute
            t0 = time.perf_counter()
            engine.train_step(batch)
            if i >= args.warmup:
                times[recompute].append(time.perf_counter() - t0)
                print(
                    f"  step {i} head {'recomputed' if recompute else 'once'}:"
                    f" {times[recompute][-1]:.2f} s",
                    flush=True,
                )
    measured = batches[args.warmup :]
    flops = statistics.mean(model_flops(engine, b) for b in measured)
    del engine
    once, again = statistics.median(times[False]), statistics.median(times[True])
    return {"once_s": once, "recompute_s": again, "flops": flops}


PREFIX_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "quickstart 8x8": (8, 8, 60, 20),
    "tools 8x4": (8, 4, 340, 70),
}
"""Mode ``share_prefix``'s workloads: (prompts, samples per prompt, prompt tokens, answer
tokens), from recipes/quickstart.toml and recipes/tools.toml."""


def group_batch(shape: tuple[int, int, int, int], vocab: int, g: torch.Generator) -> list[Sample]:
    """A GRPO batch of ``shape`` (:data:`PREFIX_SHAPES`): each prompt's samples share its
    tokens (``group`` set as :func:`~asyncrl.train.batch.build_samples` sets it), each
    with an answer of its own, the loss on the answer."""
    prompts, per_prompt, prompt_len, answer_len = shape
    batch = []
    for k in range(prompts):
        p = max(1, round(prompt_len * (0.8 + 0.4 * float(torch.rand((), generator=g)))))
        head = torch.randint(vocab, (p,), generator=g)
        for _ in range(per_prompt):
            n = max(1, round(answer_len * (0.5 + float(torch.rand((), generator=g)))))
            ids = torch.cat([head, torch.randint(vocab, (n,), generator=g)])
            mask = torch.arange(p + n) >= p
            adv = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
            batch.append(Sample(ids, mask, torch.where(mask, -1.0, 0.0), adv, group=k))
    return batch


def run_share_prefix(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Per :data:`PREFIX_SHAPES` workload, packed steps with ``trainer.share_prefix`` off
    and on, interleaved on one engine (alternating which goes first) so that both see the
    same batches, warm caches and machine load: median step times and tokens computed."""
    out = {}
    vocab = SHAPES[args.shape]["vocab_size"]
    for name, shape in PREFIX_SHAPES.items():
        g = torch.Generator().manual_seed(args.seed)
        batches = [group_batch(shape, vocab, g) for _ in range(args.warmup + args.steps)]
        engine = build_engine(args, True, batches)
        times: dict[bool, list[float]] = {False: [], True: []}
        computed: dict[bool, list[float]] = {False: [], True: []}
        for i, batch in enumerate(batches):
            for share in (False, True) if i % 2 == 0 else (True, False):
                engine.config.share_prefix = share
                t0 = time.perf_counter()
                stats = engine.train_step(batch)
                seconds = time.perf_counter() - t0
                note = " (warm-up, not counted)" if i < args.warmup else ""
                if args.floor_peak:
                    note += (
                        f"; {floor_columns(model_flops(engine, batch), args.floor_peak, seconds)}"
                    )
                print(
                    f"  {name} step {i} {'shared' if share else 'plain '}: {seconds:.2f} s,"
                    f" {stats['input_tokens']:.0f} tokens computed{note}",
                    flush=True,
                )
                if i >= args.warmup:
                    times[share].append(seconds)
                    computed[share].append(stats["input_tokens"])
        flops = statistics.mean(model_flops(engine, b) for b in batches[args.warmup :])
        del engine
        out[name] = {
            "flops": flops,
            "tokens": statistics.mean(sum(len(s) for s in b) for b in batches[args.warmup :]),
            "plain_tokens": statistics.mean(computed[False]),
            "shared_tokens": statistics.mean(computed[True]),
            "plain_s": statistics.median(times[False]),
            "shared_s": statistics.median(times[True]),
        }
    return out


def run_mode(
    args: argparse.Namespace, packing: bool, batches: list[list[Sample]]
) -> dict[str, float]:
    engine = build_engine(args, packing, batches)
    if engine.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    label = "packed" if packing else "padded"
    times, stats = timed_steps(
        engine, batches, label, args.warmup, args.in_thread, peak=args.floor_peak
    )
    step_s = statistics.median(times[args.warmup :])
    measured = batches[args.warmup :]
    tokens = statistics.mean(sum(len(s) for s in b) for b in measured)
    flops = statistics.mean(model_flops(engine, b) for b in measured)
    peak = peak_flops(args)
    out = {
        "tokens_per_s": tokens / step_s,
        "step_s": step_s,
        "micro_batches": stats["micro_batches"],
        "padding": 1.0 - stats["tokens"] / stats["input_tokens"],
        "tflops": flops / step_s / 1e12,
        "mfu": flops / step_s / peak if peak else math.nan,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30
        if engine.device.type == "cuda"
        else math.nan,
        "params": float(engine.num_params()),
        "flops": flops,
    }
    del engine
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def optimizer_scoped(event: Any) -> str:
    """A profiled op's name, as ``optimizer::<name>`` where the optimizer's step ran it
    (under torch's ``Optimizer.step#…`` scope)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("Optimizer.step"):
            return f"optimizer::{event.name}"
        parent = parent.cpu_parent
    return str(event.name)


def run_profile(args: argparse.Namespace, batches: list[list[Sample]]) -> None:
    """Packed steps on the warm-up batches, then one step under ``torch.profiler`` (CPU
    ops): its time by kind (bench/flops.py's :func:`~flops.time_sinks`: matmul,
    attention, elementwise, optimizer, views, other) against its compute floor, and the
    ops that took the most."""
    from torch.profiler import ProfilerActivity, profile

    engine = build_engine(args, True, batches)
    for batch in batches[: args.warmup]:
        engine.train_step(batch)
    batch = batches[args.warmup]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        engine.train_step(batch)
        wall = time.perf_counter() - t0
    ops: dict[str, list[float]] = {}  # name (optimizer-scoped) -> [self seconds, calls]
    for event in prof.events():
        entry = ops.setdefault(optimizer_scoped(event), [0.0, 0])
        entry[0] += event.self_cpu_time_total / 1e6
        entry[1] += 1
    sinks = time_sinks(((name, v[0]) for name, v in ops.items()), wall)
    line = f"profiled packed step ({args.dtype}, {torch.get_num_threads()} threads): {wall:.2f} s"
    if args.floor_peak:
        line += f"; {floor_columns(model_flops(engine, batch), args.floor_peak, wall)}"
    print(line)
    for kind, seconds in sorted(sinks.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:12} {seconds:8.2f} s {seconds / wall:6.1%}")
    print("  top ops by self time:")
    for name, (seconds, calls) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:15]:
        kind = time_sink(name) if name.startswith(("aten::", "optimizer::")) else "other"
        print(f"    {name:60} {seconds:7.2f} s {calls:6.0f} calls  ({kind})")
    del engine


def hand_off(batch: list[Sample] | None, rank: int, config: TrainerConfig) -> Any:
    """What the trainer ranks do to get a step's batch from rank 0: rank 0 plans every
    rank's shard and sends each its own as tensors; the others receive theirs."""
    from asyncrl.train.commands import lead_train, next_command

    if rank == 0:
        assert batch is not None
        return lead_train(batch, config, 2)
    return next_command()[1]


def _handoff_rank(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(args.seed)
    vocab = SHAPES[args.shape]["vocab_size"]
    batches = [make_batch(args, vocab, g) for _ in range(args.warmup + args.steps)]
    config = TrainerConfig(max_tokens_per_microbatch=args.max_tokens)
    times = []
    for batch in batches:
        dist.barrier()
        t0 = time.perf_counter()
        got = hand_off(batch if rank == 0 else None, rank, config)
        dist.barrier()  # every rank holds its part
        times.append(time.perf_counter() - t0)
        assert got is not None
    if rank == 0:
        measured = times[args.warmup :]
        tokens = statistics.mean(sum(len(s) for s in b) for b in batches[args.warmup :])
        print(
            f"hand-off, {world} ranks, gloo: {args.seqs} seqs, {tokens:.0f} tokens per step;"
            f" p50 {statistics.median(measured) * 1e3:.1f} ms, max {max(measured) * 1e3:.1f} ms"
            f" over {len(measured)} steps"
        )
    dist.destroy_process_group()


def run_handoff(args: argparse.Namespace, world: int = 2) -> None:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_handoff_rank, args=(world, f"{tmp}/init", args), nprocs=world)


def rss_gib() -> float:
    """This process's resident memory now (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * resource.getpagesize() / 2**30


def keep_freed_memory() -> bool:
    """Has glibc's malloc in this process serve every block from its heaps (no per-block
    ``mmap``) and never trim them, so freed memory is reused without page faults. Call it
    before torch starts its threads. False where the C library is not glibc.

    Not the trainer's setting: on glibc 2.36 an aligned allocation (torch's) cannot reuse
    a freed block of its own size, so with no ``mmap`` the heap grows on variable shapes
    (bench/README.md)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h; a threshold of -1 turns trimming off
    return mallopt(m_mmap_max, 0) == 1 and mallopt(m_trim_threshold, -1) == 1


def without_option(argv: list[str], name: str) -> list[str]:
    """``argv`` without option ``name`` and its value, given as ``name value`` or
    ``name=value``."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == name:
            skip = True
        elif not a.startswith(name + "="):
            out.append(a)
    return out


ALLOCATORS = {
    "system": "the C library's defaults",
    "keep-freed": "glibc keeping freed memory",
    "mimalloc": "mimalloc (the trainer's)",
}


def compare_malloc(argv: list[str], names: list[str]) -> None:
    """Runs this bench's packed mode under each allocator of ``names``, one process each (a
    process's malloc is set once, before its threads start), and prints the step times
    against the first's."""
    import subprocess

    from asyncrl.runtime.allocator import mimalloc_library

    for name in ("--allocator", "--modes"):
        argv = without_option(argv, name)
    step_s = {}
    for name in names:
        label = ALLOCATORS[name]
        if name == "mimalloc" and mimalloc_library() is None:
            print("== malloc: mimalloc skipped (the cmeel-mimalloc wheel is not installed)")
            continue
        print(f"== malloc: {label}", flush=True)
        proc = subprocess.Popen(
            [sys.executable, __file__, *argv, "--modes", "packed", "--allocator", name],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            print("  " + line, end="", flush=True)
            if line.startswith("packed "):
                step_s[name] = float(line.split()[2])
        if proc.wait() != 0:
            raise SystemExit(f"the run with malloc as {label!r} failed ({proc.returncode})")
    first = step_s[names[0]]
    print(
        "malloc: packed step "
        + ", ".join(f"{ALLOCATORS[k]} {v:.2f} s ({first / v:.2f}x)" for k, v in step_s.items())
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--seqs", type=int, default=32, help="sequences per step (prompts × group)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument(
        "--modes",
        default="packed,padded,proximal",
        help="comma list of packed, padded, proximal, head, handoff, lora, compile,"
        " share_prefix, profile",
    )
    parser.add_argument("--lora-rank", type=int, default=16, help="adapter rank of mode lora")
    parser.add_argument("--max-tokens", type=int, default=8192, help="micro-batch token budget")
    parser.add_argument(
        "--head-chunk", type=int, default=TrainerConfig().lm_head_chunk_tokens,
        help="tokens per LM-head chunk (trainer.lm_head_chunk_tokens)",
    )  # fmt: skip
    parser.add_argument("--resp-median", type=float, default=200.0, help="median response tokens")
    parser.add_argument("--resp-sigma", type=float, default=0.7, help="lognormal σ of responses")
    parser.add_argument("--max-new", type=int, default=1024, help="response length cap")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto")
    parser.add_argument("--attn", default="asyncrl_varlen", help="attention implementation")
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing")
    parser.add_argument("--peak-tflops", type=float, default=0.0, help="override the MFU peak")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    parser.add_argument("--peak-size", type=int, default=2048, help="matmul size of the CPU peak")
    parser.add_argument(
        "--peak-rows", type=int, default=2048,
        help="rows of the MLP-shaped matmuls whose peak the compute floor is taken at",
    )  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--allocator", choices=sorted(ALLOCATORS), default="system",
        help="system: the C library's malloc as it comes; keep-freed: glibc's keeping freed"
        " memory for reuse; mimalloc: this process's own command again with it preloaded",
    )  # fmt: skip
    parser.add_argument(
        "--compare-malloc", nargs="?", const=",".join(ALLOCATORS), default="",
        metavar="A,B,...", help="run the packed mode under each of these --allocator values"
        f" (default {','.join(ALLOCATORS)}), a process each; print the step times",
    )  # fmt: skip
    parser.add_argument(
        "--in-thread", action="store_true",
        help="run the timed steps in a worker thread, as the trainer actor does",
    )  # fmt: skip
    args = parser.parse_args()
    if args.compare_malloc:
        names = args.compare_malloc.split(",")
        if set(names) - ALLOCATORS.keys():
            parser.error(
                f"--compare-malloc {args.compare_malloc!r}: allowed {', '.join(ALLOCATORS)}"
            )
        argv = [a for a in sys.argv[1:] if not a.startswith("--compare-malloc")]
        if args.compare_malloc in argv:
            argv.remove(args.compare_malloc)  # its value, given as a separate word
        compare_malloc(argv, names)
        return
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.allocator == "mimalloc":
        from asyncrl.runtime.allocator import use_mimalloc

        chosen = use_mimalloc()  # runs this command again with it preloaded
        if chosen != "mimalloc":
            raise SystemExit(f"--allocator mimalloc: {chosen}")
    elif args.allocator == "keep-freed" and not keep_freed_memory():  # before torch's threads
        raise SystemExit("--allocator keep-freed: this C library is not glibc")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if cuda else "float32"

    g = torch.Generator().manual_seed(args.seed)
    vocab = SHAPES[args.shape]["vocab_size"]
    batches = [make_batch(args, vocab, g) for _ in range(args.warmup + args.steps)]
    lengths = sorted(len(s) for s in batches[0])
    device = torch.cuda.get_device_name() if cuda else f"cpu ({torch.get_num_threads()} threads)"
    malloc = ALLOCATORS[args.allocator]
    thread = "a worker thread" if args.in_thread else "the main thread"
    print(
        f"shape {args.shape}  device {device}  dtype {args.dtype}  attn {args.attn}"
        f"  malloc: {malloc}, steps in {thread}"
    )
    print(
        f"batch: {args.seqs} seqs, {sum(lengths)} tokens; length p50 {lengths[len(lengths) // 2]}"
        f" p90 {lengths[int(len(lengths) * 0.9)]} max {lengths[-1]};"
        f" micro-batch budget {args.max_tokens} tokens"
    )
    peaks: dict[str, float] = {}
    if not cuda:
        flags = cpu_flags()
        peaks["float32"] = measured_gemm_peak(torch.float32, args.peak_size)
        if has_bf16_gemm(flags):
            peaks["bfloat16"] = measured_gemm_peak(torch.bfloat16, args.peak_size)
        isa = " ".join(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags)
        print(
            f"cpu flags: {isa or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}; measured GEMM peak "
            + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
            + f" ({args.peak_size}² matmuls, {torch.get_num_threads()} threads)"
        )
    args.floor_peak = floor_peak(args, cuda)
    if args.floor_peak:
        where = "data sheet" if cuda else f"{torch.get_num_threads()} threads"
        print(
            f"compute floor at {args.floor_peak / 1e9:.1f} GFLOP/s: {args.dtype} matmul peak at"
            f" the model's MLP shapes, {args.peak_rows} rows ({where})"
        )
    modes = args.modes.split(",")
    allowed = {
        "packed", "padded", "proximal", "head", "handoff", "lora", "compile", "fused", "share_prefix",
        "profile",
    }  # fmt: skip
    if set(modes) - allowed:
        parser.error(f"--modes {args.modes!r}: allowed {', '.join(sorted(allowed))}")
    head = run_head(args, batches) if "head" in modes else None
    results = {}
    if "handoff" in modes:
        run_handoff(args)
    for mode in modes:
        if mode in ("packed", "padded"):
            results[mode] = run_mode(args, mode == "packed", batches)
    if results:
        print(f"params {results[next(iter(results))]['params'] / 1e6:.1f}M")
    if results and args.floor_peak and not cuda:
        # again after the steps, keeping the better: on a shared machine either may be slowed
        args.floor_peak = max(args.floor_peak, floor_peak(args, cuda))
    if results:
        print(
            f"{'mode':8} {'tokens/s':>10} {'step_s':>8} {'micro':>6} {'padding':>8} {'TFLOP/s':>8}"
            f" {'MFU':>6} {'mem GiB':>8} {'floor_s':>8} {'reached':>8}"
        )
    for mode, r in results.items():
        mfu = "n/a" if math.isnan(r["mfu"]) else f"{r['mfu']:.1%}"
        mem = "n/a" if math.isnan(r["peak_mem_gib"]) else f"{r['peak_mem_gib']:.2f}"
        floor, reached = "n/a", "n/a"
        if args.floor_peak:
            floor_s = r["flops"] / args.floor_peak
            floor, reached = f"{floor_s:.3f}", f"{floor_s / r['step_s']:.1%}"
        print(
            f"{mode:8} {r['tokens_per_s']:10.0f} {r['step_s']:8.3f} {r['micro_batches']:6.0f}"
            f" {r['padding']:8.1%} {r['tflops']:8.3f} {mfu:>6} {mem:>8} {floor:>8} {reached:>8}"
        )
    if results and args.floor_peak:
        print(
            f"compute floor: the step's FLOPs over {args.floor_peak / 1e9:.1f} GFLOP/s"
            f" ({args.dtype}); reached = floor / step_s"
        )
    if peaks:
        # again after the steps, keeping the better: on a shared machine either may be slowed
        for key in peaks:
            again = measured_gemm_peak(getattr(torch, key), args.peak_size)
            peaks[key] = max(peaks[key], again)
        print(
            "measured GEMM peak, best of before and after: "
            + ", ".join(f"{k} {v / 1e9:.1f} GFLOP/s" for k, v in peaks.items())
        )
    if head is not None:
        line = (
            f"packed step time, LM head once per chunk {head['once_s']:.3f} s | recomputed in"
            f" backward {head['recompute_s']:.3f} s | recomputed / once"
            f" {head['recompute_s'] / head['once_s']:.2f}x"
        )
        if peaks:
            share = [
                head["flops"] / t / peaks["float32"] for t in (head["once_s"], head["recompute_s"])
            ]
            line += f" | trainer: {share[0]:.0%} vs {share[1]:.0%} of measured fp32 peak"
        print(line)
    if peaks and "packed" in results:
        achieved = results["packed"]["tflops"] * 1e12
        fp32_share = f"{achieved / peaks['float32']:.0%} of measured fp32 peak"
        if args.dtype == "bfloat16" and "bfloat16" in peaks:
            # bf16 compute is held against the bf16 peak; its fp32 share can pass 100%
            line = (
                f"trainer: {achieved / peaks['bfloat16']:.0%} of measured bf16 peak, {fp32_share}"
            )
        else:
            line = f"trainer: {fp32_share}"
        print(line + f" ({achieved / 1e9:.1f} GFLOP/s, packed)")
    if {"packed", "padded"} <= results.keys():
        ratio = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
        print(f"packed / padded tokens/s: {ratio:.2f}x")
    if "lora" in modes:
        lora = run_lora(args, batches)
        print(f"{'training':12} {'step_s':>8} {'trainable':>11} {'optim MB':>10} {'update MB':>10}")
        for name, r in lora.items():
            print(
                f"{name:12} {r['step_s']:8.3f} {r['trainable'] / 1e6:10.2f}M"
                f" {r['optim_bytes'] / 2**20:10.1f} {r['update_bytes'] / 2**20:10.2f}"
            )
        full, low = lora["full"], lora[f"lora r={args.lora_rank}"]
        print(
            f"LoRA / full: step time {low['step_s'] / full['step_s']:.2f}x, optimizer state"
            f" {low['optim_bytes'] / full['optim_bytes']:.4f}x, update bytes"
            f" {low['update_bytes'] / full['update_bytes']:.4f}x"
        )
    if "compile" in modes:
        r = run_compile(args, batches)
        line = (
            f"packed step time, eager {r['eager_s']:.3f} s | compiled {r['compiled_s']:.3f} s"
            f" | eager / compiled {r['eager_s'] / r['compiled_s']:.2f}x | first step (compiling)"
            f" {r['compiled_first_s']:.1f} s against eager's {r['eager_first_s']:.1f} s"
        )
        extra = r["compiled_first_s"] - r["eager_first_s"]
        saved = r["eager_s"] - r["compiled_s"]
        line += (
            f" | compilation paid back after {extra / saved:.0f} steps"
            if saved > 0
            else " | never paid back"
        )
        if peaks:
            line += (
                f" | trainer: {r['flops'] / r['eager_s'] / peaks['float32']:.0%} eager vs"
                f" {r['flops'] / r['compiled_s'] / peaks['float32']:.0%} compiled, of measured"
                " fp32 peak"
            )
        print(line)
    if "fused" in modes:
        r = run_fused(args, batches)
        line = (
            f"packed step time, elementwise parts by torch {r['torch_s']:.3f} s | in C"
            f" (trainer.cpu_fused) {r['fused_s']:.3f} s | {r['torch_s'] / r['fused_s']:.2f}x"
            f" (medians of {args.steps} rotated steps, {torch.get_num_threads()} threads)"
        )
        if "fused_one_s" in r:
            line += (
                f" | the C passes on one thread {r['fused_one_s']:.3f} s, shared"
                f" {r['fused_one_s'] / r['fused_s']:.2f}x faster"
            )
        if args.floor_peak:
            line += (
                f" | floor reached {r['flops'] / r['torch_s'] / args.floor_peak:.0%} by torch,"
                f" {r['flops'] / r['fused_s'] / args.floor_peak:.0%} in C"
            )
        print(line)
    if "share_prefix" in modes:
        shared = run_share_prefix(args)
        print(
            f"share_prefix, {args.shape}, {args.max_tokens}-token micro-batches, median of"
            f" {args.steps} steps:"
        )
        print(
            f"{'workload':15} {'tokens':>7} {'computed plain':>15} {'shared':>7} {'ratio':>6}"
            f" {'step plain':>11} {'shared':>8} {'speedup':>8} {'floor':>8} {'reached':>15}"
        )
        for name, r in shared.items():
            floor, reached = "n/a", "n/a"
            if args.floor_peak:
                floor_s = r["flops"] / args.floor_peak
                reached = f"{floor_s / r['plain_s']:.0%} / {floor_s / r['shared_s']:.0%}"
                floor = f"{floor_s:.2f}s"
            print(
                f"{name:15} {r['tokens']:7.0f} {r['plain_tokens']:15.0f}"
                f" {r['shared_tokens']:7.0f} {r['shared_tokens'] / r['plain_tokens']:6.2f}"
                f" {r['plain_s']:10.2f}s {r['shared_s']:7.2f}s"
                f" {r['plain_s'] / r['shared_s']:7.2f}x {floor:>8} {reached:>15}"
            )
    if "profile" in modes:
        run_profile(args, batches)
    if "proximal" in modes:
        r = run_proximal(args, batches)
        print(
            f"packed step time, proximal logprobs from the training forward {r['free_s']:.3f} s"
            f" | from a separate forward {r['separate_s']:.3f} s (that forward"
            f" {r['proximal_s']:.3f} s) | separate / free {r['separate_s'] / r['free_s']:.2f}x"
            + (
                f" | floor {r['free_flops'] / args.floor_peak:.3f} s"
                f" ({r['free_flops'] / args.floor_peak / r['free_s']:.0%} reached) vs"
                f" {r['separate_flops'] / args.floor_peak:.3f} s"
                f" ({r['separate_flops'] / args.floor_peak / r['separate_s']:.0%} reached)"
                if args.floor_peak
                else ""
            )
        )


if __name__ == "__main__":
    main()
