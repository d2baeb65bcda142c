"""The prepared GPU check: asyncrl's own code on one CUDA device, in one table.

    make gpu-check                         # on the GPU machine (sized for 8 min on one H100)
    make gpu-check DEVICE=cpu              # the same code with small shapes (CI, under 60 s)
    python bench/gpu_check.py --device cpu --out check.json

Nothing is downloaded: every model is random-initialised from a transformers config
written in code (bench/trainer.py's shapes; a model folder, where one is needed, gets
the character tokenizer of :mod:`asyncrl.models.tiny`). Rows, each measured on its own so
that one failing row prints its error and the others still run:

1. trainer MFU: ``TrainEngine`` built from the ci recipe's sections, on the Qwen2.5-1.5B
   shape in bf16, packed micro-batches, about 16k tokens a step; model FLOPs as
   bench/trainer.py counts them, against the bf16 matmul peak measured in the same run
   (the better of before and after the steps). Goal ≥ 40%.
2. hf engine decode tokens/s at concurrency 64, SmolLM2-135M shape: generated tokens
   over the wall time of 64 concurrent requests that ignore end-of-sequence.
3. the weight-update pause of the 1.5B shape, object store against ``cuda_ipc``, from
   ``measure()`` of bench/weight_sync.py. Goal ≤ 0.5 s with ``cuda_ipc``. If that
   function cannot be imported or fails, the row says "not available" (a failure only
   with ``--strict``). On the CPU, ``collective`` (gloo) stands in for ``cuda_ipc``.
4. colocation: per step, what the hf engine frees with ``release_memory`` (weights and
   KV cache) and takes back with ``resume_memory`` while the trainer steps, and what the
   trainer frees by moving its parameters and optimizer state to the host
   (``TrainEngine.offload``) while the engine generates and takes back (``onload``),
   with the seconds of each hand-over. 0 on the CPU, where nothing is shared.
5. ``asyncrl up`` of recipes/ci.toml on the SmolLM2 shape, trainer and hf engine
   colocated on ``cuda:0``: exit 0, every step recorded in ``metrics.jsonl``, and the
   staleness of every trained sample (``trained_samples.jsonl``) at most η.

``--profile DIR`` also writes a torch profiler table of one more trainer step and one more
decode burst (``DIR/trainer.txt``, ``DIR/decode.txt``: the ops by device time, then by host
time), for the next round of speed work on a machine that is only lent for minutes.

With ``--device cpu`` the shapes are small (the tiny shape, 1k tokens a step, 16 new
tokens) and the goals are not judged. The exit status is 1 if any row failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import gc
import io
import json
import math
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from trainer import SHAPES, model_config, model_flops  # bench/trainer.py, beside this file
from transformers import AutoModelForCausalLM

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.config.recipe import Recipe, load_recipe
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.models.resolve import ModelConfig, cache_root, materialize
from asyncrl.models.tiny import build_tokenizer
from asyncrl.observe.records import METRICS_FILE, SAMPLES_FILE
from asyncrl.train.batch import Sample
from asyncrl.train.engine import TrainEngine, build_train_engine

REPO = Path(__file__).resolve().parents[1]
CI_RECIPE = REPO / "recipes" / "ci.toml"
GIB = 2**30


@dataclass(frozen=True)
class Sizes:
    """What each row runs on one kind of device."""

    dtype: str
    trainer_shape: str
    step_tokens: int
    microbatch_tokens: int
    warmup_steps: int
    timed_steps: int
    peak_size: int
    engine_shape: str
    concurrency: int
    new_tokens: int
    prompt_tokens: int
    weights_shape: str
    transports: tuple[str, str]
    colocated_steps: int
    colocated_step_tokens: int
    up_steps: int
    up_timeout_s: float
    up_lr: float


SIZES = {
    "cuda": Sizes(
        dtype="bfloat16", trainer_shape="qwen2.5-1.5b", step_tokens=16384,
        microbatch_tokens=8192, warmup_steps=2, timed_steps=4, peak_size=8192,
        engine_shape="smollm2-135m", concurrency=64, new_tokens=256, prompt_tokens=128,
        weights_shape="qwen2.5-1.5b", transports=("object_store", "cuda_ipc"),
        colocated_steps=3, colocated_step_tokens=4096, up_steps=8, up_timeout_s=300.0,
        up_lr=1e-5,  # the ci recipe's 1e-2 suits its 2-layer toy, not 135M weights
    ),
    "cpu": Sizes(
        dtype="float32",  # this CPU may emulate bf16; fp32 is what a CPU trainer runs
        trainer_shape="tiny", step_tokens=1024, microbatch_tokens=4096, warmup_steps=1,
        timed_steps=2, peak_size=1024, engine_shape="tiny", concurrency=64, new_tokens=16,
        prompt_tokens=16, weights_shape="tiny",
        transports=("object_store", "collective"),  # cuda_ipc needs CUDA
        colocated_steps=2, colocated_step_tokens=256, up_steps=3, up_timeout_s=120.0,
        up_lr=1e-2,
    ),
}  # fmt: skip


@dataclass
class Row:
    """One line of the table. ``met``: whether the goal is reached (None: no goal, or
    not judged on this device). ``error``: why the row failed; ``unavailable`` marks
    a weights row whose measure could not run, a failure only with ``--strict``."""

    check: str
    result: str = ""
    goal: str = "—"
    met: bool | None = None
    error: str | None = None
    unavailable: bool = False
    figures: dict[str, float] = field(default_factory=dict)


# --- shared pieces ---------------------------------------------------------------------------


PROFILE_DIR: Path | None = None
"""Where ``--profile`` writes its tables; None: no profiling."""


@contextlib.contextmanager
def profiling(name: str, engine: HFEngine | None = None) -> Iterator[None]:
    """Profiles the body (sync or async code alike) into ``PROFILE_DIR/<name>.txt`` when
    ``--profile`` is given; otherwise does nothing. torch's profiler sees the ops of this
    thread and every CUDA kernel; with an ``engine``, whose model thread runs the ops, a
    Python profile of that thread's calls is added (what the host spends per step)."""
    if PROFILE_DIR is None:
        yield
        return
    host = cProfile.Profile()
    if engine is not None:
        model_thread = engine._in_model_thread

        async def profiled(fn: Callable[..., Any], *args: Any) -> Any:
            def run(*a: Any) -> Any:
                host.enable()
                try:
                    return fn(*a)
                finally:
                    host.disable()

            return await model_thread(run, *args)

        engine._in_model_thread = profiled  # type: ignore[method-assign]
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    try:
        with profile(activities=activities) as prof:
            yield
    finally:
        if engine is not None:
            del engine._in_model_thread  # the class's own again
    averages = prof.key_averages()
    tables = [averages.table(sort_by="self_cuda_time_total", row_limit=30)] if cuda else []
    tables.append(averages.table(sort_by="self_cpu_time_total", row_limit=30))
    if engine is not None:
        text = io.StringIO()
        pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(30)
        tables.append("the model thread, by own time:\n" + text.getvalue())
    PROFILE_DIR.mkdir(parents=True, exist_ok=True)  # (a table of no ops is empty: left out)
    (PROFILE_DIR / f"{name}.txt").write_text("\n\n".join(t for t in tables if t.strip()) + "\n")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 10 else f"{nbytes / 2**20:.1f} MiB"


def allocated(device: torch.device) -> int:
    """Bytes the CUDA caching allocator has handed out on ``device`` (0 on the CPU)."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, reps: int = 5) -> float:
    """FLOP/s of the fastest of ``reps`` rounds of ``size``² matmuls in ``dtype`` on
    ``device`` (after one untimed round); a CUDA round is ten back-to-back products between
    two synchronisations, so that launch latency does not count."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=g).to(device=device, dtype=dtype)
    out = torch.empty(size, size, device=device, dtype=dtype)
    per_round = 10 if device.type == "cuda" else 1
    best = math.inf
    for i in range(reps + 1):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(per_round):
            torch.mm(a, b, out=out)
        sync(device)
        if i:
            best = min(best, (time.perf_counter() - t0) / per_round)
    return 2.0 * size**3 / best


def packed_batch(tokens: int, vocab: int, g: torch.Generator) -> list[Sample]:
    """GRPO-like sequences totalling about ``tokens``: about 32 of them, lengths lognormal
    (σ 0.5) around ``tokens / 32``, the first quarter of each the prompt, advantages ±1."""
    median = tokens / 32
    batch: list[Sample] = []
    total = 0
    while total < tokens:
        n = int((torch.randn((), generator=g) * 0.5 + math.log(median)).exp().clamp(8, 4 * median))
        mask = torch.zeros(n, dtype=torch.bool)
        mask[n // 4 :] = True
        behav = torch.where(mask, -1.0, 0.0)
        adv = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
        batch.append(Sample(torch.randint(vocab, (n,), generator=g), mask, behav, adv))
        total += n
    return batch


def recipe_for(sizes: Sizes, device: str, *sets: str) -> Recipe:
    """The ci recipe on ``device`` in the run's dtype, with ``sets`` on top."""
    return load_recipe(
        CI_RECIPE,
        [
            f"trainer.device={device}",
            f"rollout.engine.device={device}",
            f"model.dtype={sizes.dtype}",
            *sets,
        ],
    )


def random_model_dir(shape: str, dtype: str, seed: int = 0) -> Path:
    """An HF model folder of bench/trainer.py's ``shape`` with random weights (saved in
    ``dtype``) and the character tokenizer of :mod:`asyncrl.models.tiny`, built once into
    the cache. Token ids past the tokenizer's decode to nothing, which the rollouts of a
    random model do not mind."""
    target = cache_root() / "models" / f"gpu-check-{shape}-{dtype}-s{seed}"

    def build(out: Path) -> None:
        tok = build_tokenizer()
        config = model_config(shape, 4096)
        config.eos_token_id, config.pad_token_id, config.bos_token_id = (
            tok.eos_token_id,
            tok.pad_token_id,
            None,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            lm = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
        lm.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)

    return materialize(target, build)


# --- the rows --------------------------------------------------------------------------------


def trainer_mfu(sizes: Sizes, device: str) -> Row:
    dev = torch.device(device)
    row = Row(
        f"trainer MFU, {sizes.trainer_shape} shape, {sizes.dtype}, packed,"
        f" ~{sizes.step_tokens} tokens/step",
        goal="≥ 40% of the measured matmul peak" + ("" if dev.type == "cuda" else " (on CUDA)"),
    )
    recipe = recipe_for(
        sizes,
        device,
        f"trainer.max_tokens_per_microbatch={sizes.microbatch_tokens}",
        "trainer.packing=true",
        "trainer.optim.lr=1e-6",
        "trainer.loss.behav_imp_weight_cap=null",
    )
    g = torch.Generator().manual_seed(recipe.run.seed)
    vocab = SHAPES[sizes.trainer_shape]["vocab_size"]
    batches = [
        packed_batch(sizes.step_tokens, vocab, g)
        for _ in range(sizes.warmup_steps + sizes.timed_steps)
    ]
    peak_dtype = getattr(torch, sizes.dtype)
    peak = matmul_peak(dev, peak_dtype, sizes.peak_size)
    # random init from a config: no multi-GB folder of the 1.5B shape is written for this
    architecture = model_config(sizes.trainer_shape, max(len(s) for b in batches for s in b))
    engine = TrainEngine(
        recipe.trainer, recipe.model, seed=recipe.run.seed, architecture=architecture
    )
    times = []
    for batch in batches:
        t0 = time.perf_counter()
        engine.train_step(batch)  # synchronises on CUDA (it reads the loss)
        times.append(time.perf_counter() - t0)
    timed = batches[sizes.warmup_steps :]
    with profiling("trainer"):
        engine.train_step(timed[-1])
    flops = statistics.mean(model_flops(engine, b) for b in timed)
    tokens = statistics.mean(sum(len(s) for s in b) for b in timed)
    step_s = statistics.median(times[sizes.warmup_steps :])
    del engine
    free_device_memory()
    peak = max(peak, matmul_peak(dev, peak_dtype, sizes.peak_size))
    mfu = flops / step_s / peak
    row.result = (
        f"{mfu:.1%} ({flops / step_s / 1e12:.1f} of {peak / 1e12:.1f} TFLOP/s {sizes.dtype};"
        f" {tokens:.0f} tokens in {step_s:.3f} s)"
    )
    row.met = mfu >= 0.40 if dev.type == "cuda" else None
    row.figures = {"mfu": mfu, "peak_flops": peak, "step_s": step_s, "tokens": tokens}
    return row


async def decode_throughput(sizes: Sizes, device: str) -> Row:
    row = Row(
        f"hf engine decode, {sizes.engine_shape} shape, concurrency {sizes.concurrency}",
        goal="— (recorded)",
    )
    path = random_model_dir(sizes.engine_shape, sizes.dtype)
    engine = HFEngine(
        ModelConfig(path=str(path), dtype=sizes.dtype),
        HFEngineConfig(device=device, max_batch_size=sizes.concurrency),
    )
    vocab = SHAPES[sizes.engine_shape]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(vocab, (sizes.prompt_tokens,), generator=g).tolist()
        for _ in range(sizes.concurrency)
    ]
    async with engine:
        await burst(engine, prompts[:4], 4)  # first-call allocations
        engine.stats.decode_batch_sizes.clear()
        t0 = time.perf_counter()
        tokens = await burst(engine, prompts, sizes.new_tokens)
        dt = time.perf_counter() - t0
        sizes_seen = Counter(engine.stats.decode_batch_sizes)
        with profiling("decode", engine):
            await burst(engine, prompts, min(sizes.new_tokens, 32))
    mean_batch = sum(k * v for k, v in sizes_seen.items()) / max(1, sizes_seen.total())
    row.result = (
        f"{tokens / dt:.0f} tokens/s ({tokens} tokens in {dt:.2f} s, mean decode batch"
        f" {mean_batch:.1f})"
    )
    row.figures = {"tokens_per_s": tokens / dt, "seconds": dt, "mean_batch": mean_batch}
    del engine
    free_device_memory()
    return row


async def burst(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> int:
    """Generates ``new_tokens`` for every prompt at once (end-of-sequence ignored);
    returns the tokens generated."""
    sampling = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, stop_token_ids=())
    async with asyncio.TaskGroup() as tg:
        tasks = [
            tg.create_task(engine.agenerate(GenerateRequest(input_ids=p, sampling=sampling)))
            for p in prompts
        ]
    return sum(len(t.result().output_ids) for t in tasks)


def weight_pause(sizes: Sizes, device: str) -> Row:
    first, second = sizes.transports
    row = Row(
        f"weight-update pause, {sizes.weights_shape} shape: {first} vs {second}",
        goal="≤ 0.5 s with cuda_ipc" + ("" if second == "cuda_ipc" else " (on CUDA)"),
    )
    try:
        from weight_sync import measure  # bench/weight_sync.py
    except Exception as exc:
        row.result = f"not available: {type(exc).__name__}: {exc}"
        row.error, row.unavailable = row.result, True
        return row
    cells = []
    for transport in sizes.transports:
        try:
            got = measure(transport, sizes.weights_shape, sizes.dtype, device)
            pause_s = float(got["pause_s"])
        except Exception as exc:
            traceback.print_exc()
            cells.append(f"{transport} not available: {type(exc).__name__}: {exc}")
            row.error, row.unavailable = cells[-1], True
            continue
        note = f", {got['note']}" if got.get("note") else ""
        cells.append(f"{transport} {pause_s:.3f} s ({size(float(got['bytes']))}{note})")
        row.figures[f"{transport}_pause_s"] = pause_s
        row.figures[f"{transport}_bytes"] = float(got["bytes"])
        if transport == "cuda_ipc":
            row.met = pause_s <= 0.5
    row.result = "; ".join(cells)
    return row


async def colocation(sizes: Sizes, device: str) -> Row:
    dev = torch.device(device)
    row = Row("colocation per step: GiB released / retaken", goal="— (recorded)")
    path = random_model_dir(sizes.engine_shape, sizes.dtype)
    recipe = recipe_for(sizes, device, f"model.path={path}", "rollout.colocate=true")
    before_trainer = allocated(dev)
    trainer = build_train_engine(recipe)
    g = torch.Generator().manual_seed(0)
    vocab = SHAPES[sizes.engine_shape]["vocab_size"]
    batch = packed_batch(sizes.colocated_step_tokens, vocab, g)
    trainer.train_step(batch)  # its gradients and optimizer state exist from here on
    trainer_gib = (allocated(dev) - before_trainer) / GIB
    decoding = asyncio.Event()

    def on_step(_: object) -> None:
        decoding.set()

    engine = HFEngine(
        recipe.model, HFEngineConfig(device=device, max_batch_size=sizes.concurrency),
        memory_saver=True, on_step=on_step,
    )  # fmt: skip
    prompts = [torch.randint(vocab, (sizes.prompt_tokens,), generator=g).tolist() for _ in range(8)]
    released, retaken, release_s, resume_s = [], [], [], []
    offloaded, onloaded, offload_s, onload_s = [], [], [], []
    async with engine:
        for _ in range(sizes.colocated_steps):
            decoding.clear()
            async with asyncio.TaskGroup() as tg:
                tg.create_task(burst(engine, prompts, sizes.new_tokens))
                await decoding.wait()  # sequences run: the release takes their KV cache too
                t0 = time.perf_counter()
                # allocated, not the engine's own figure (reserved): in one process the
                # allocator's cache holds the trainer's freed blocks too
                before = allocated(dev)
                await engine.release_memory()
                sync(dev)
                release_s.append(time.perf_counter() - t0)
                released.append((before - allocated(dev)) / GIB)
                taken, seconds = trainer.onload()  # the trainer's turn on the device
                onloaded.append(taken / GIB)
                onload_s.append(seconds)
                await asyncio.to_thread(trainer.train_step, batch)
                freed, seconds = trainer.offload()  # generation's turn
                offloaded.append(freed / GIB)
                offload_s.append(seconds)
                held = allocated(dev)
                t0 = time.perf_counter()
                await engine.resume_memory()
                sync(dev)
                resume_s.append(time.perf_counter() - t0)
                retaken.append((allocated(dev) - held) / GIB)
                await engine.resume()
    row.result = (
        f"engine −{statistics.mean(released):.2f} GiB in {statistics.mean(release_s):.3f} s,"
        f" +{statistics.mean(retaken):.2f} GiB in {statistics.mean(resume_s):.3f} s;"
        f" trainer −{statistics.mean(offloaded):.2f} GiB in {statistics.mean(offload_s):.3f} s,"
        f" +{statistics.mean(onloaded):.2f} GiB in {statistics.mean(onload_s):.3f} s"
        f" (of {trainer_gib:.2f} GiB after its first step)"
    )
    if dev.type != "cuda":
        row.result = "engine 0 GiB, trainer 0 GiB (on the CPU nothing is shared or released)"
    row.figures = {
        "engine_released_gib": statistics.mean(released),
        "engine_retaken_gib": statistics.mean(retaken),
        "engine_release_s": statistics.mean(release_s),
        "engine_resume_s": statistics.mean(resume_s),
        "trainer_after_step_gib": trainer_gib,
        "trainer_released_gib": statistics.mean(offloaded),
        "trainer_retaken_gib": statistics.mean(onloaded),
        "trainer_offload_s": statistics.mean(offload_s),
        "trainer_onload_s": statistics.mean(onload_s),
        "memory_saver": float(engine.memory_saver),
    }
    del engine, trainer
    free_device_memory()
    return row


def up_run(sizes: Sizes, device: str, run_dir: Path) -> Row:
    where = "cuda:0" if device.startswith("cuda") else device
    row = Row(f"asyncrl up, ci recipe, {sizes.engine_shape} shape, colocated on {where}")
    path = random_model_dir(sizes.engine_shape, sizes.dtype)
    sets = [
        f"model.path={path}",
        f"model.dtype={sizes.dtype}",
        f"trainer.device={where}",
        f"rollout.engine.device={where}",
        "rollout.colocate=true",
        f"trainer.max_steps={sizes.up_steps}",
        "trainer.checkpoint_every=0",
        f"trainer.optim.lr={sizes.up_lr}",
        "eval.every=0",
        "run.tensorboard=false",
        "run.plots=false",
        f"run.dir={run_dir.parent}",
        f"run.name={run_dir.name}",
    ]
    recipe = load_recipe(CI_RECIPE, sets)  # a bad override fails here, before anything starts
    eta = recipe.buffer.max_head_offpolicyness + recipe.trainer.update_every - 1
    row.goal = f"exit 0, {sizes.up_steps} steps, staleness ≤ {eta}"
    argv = [
        sys.executable,
        "-m",
        "asyncrl.entry.cli",
        "up",
        str(CI_RECIPE),
        "--quiet",
        "--overwrite",
    ]
    argv += [x for s in sets for x in ("--set", s)]
    t0 = time.perf_counter()
    code, out = run_to_end(argv, sizes.up_timeout_s)
    wall = time.perf_counter() - t0
    metrics = read_jsonl(run_dir / METRICS_FILE)
    trained = read_jsonl(run_dir / SAMPLES_FILE)
    staleness = max((t["trained_version"] - t["head_version"] for t in trained), default=-1)
    row.result = (
        f"exit {code}, {len(metrics)} steps, {len(trained)} samples, staleness max"
        f" {staleness}, {wall:.0f} s"
    )
    row.figures = {"exit": code, "steps": len(metrics), "staleness_max": staleness, "wall_s": wall}
    row.met = code == 0 and len(metrics) == sizes.up_steps and 0 <= staleness <= eta
    if not row.met:
        tail = " | ".join(out.strip().splitlines()[-3:])
        row.error = f"{row.result}; logs in {run_dir / 'logs'}; {tail}"
    return row


def run_to_end(argv: list[str], timeout: float) -> tuple[int, str]:
    """Runs ``argv`` in a session of its own and returns its exit code and output; past
    ``timeout`` its process group gets SIGTERM (``up`` stops its actors), then SIGKILL.
    The output goes to a file, not a pipe, which a leftover grandchild could hold open."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -1
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(30)
                    break
            log.write(f"\ntimed out after {timeout:.0f} s")
        log.seek(0)
        return code, log.read()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# --- the table -------------------------------------------------------------------------------


def measured(check: str, fn: Callable[[], Row | Awaitable[Row]]) -> Row:
    """``fn``'s row, or a failed row carrying its error (traceback on stderr). What the
    row prints goes to stderr, so that stdout holds the table alone."""
    t0 = time.perf_counter()
    print(f"== {check}", file=sys.stderr, flush=True)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            got = fn()
            row = asyncio.run(got) if asyncio.iscoroutine(got) else got
        assert isinstance(row, Row)
    except Exception as exc:
        traceback.print_exc()
        row = Row(check, result=f"FAILED: {type(exc).__name__}: {exc}")
        row.error = row.result
    free_device_memory()
    print(f"   {time.perf_counter() - t0:.1f} s: {row.result}", file=sys.stderr, flush=True)
    return row


def table(rows: list[Row]) -> str:
    def ok(row: Row) -> str:
        if row.error and not row.unavailable:
            return "FAIL"
        return {True: "yes", False: "no", None: "—"}[row.met]

    lines = ["| # | check | result | goal | met |", "|---|---|---|---|---|"]
    for i, row in enumerate(rows, 1):
        cells = [str(i), row.check, row.result, row.goal, ok(row)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, help="also write the rows to this JSON file")
    parser.add_argument(
        "--run-dir", type=Path, default=REPO / "runs" / "gpu-check",
        help="run folder of the asyncrl up row (replaced)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="also write torch profiler tables of a trainer step and a decode burst here",
    )  # fmt: skip
    parser.add_argument(
        "--strict", action="store_true",
        help="a weights row that is not available counts as a failure",
    )  # fmt: skip
    args = parser.parse_args()
    global PROFILE_DIR
    PROFILE_DIR = args.profile
    t_start = time.perf_counter()
    device = args.device
    if device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device (--device cpu runs small)")
        device = "cuda:0"
        where = f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    else:
        where = f"cpu x{torch.get_num_threads()} threads, torch {torch.__version__}"
    sizes = SIZES[args.device]
    print(f"gpu check on {where}", file=sys.stderr, flush=True)
    rows = [
        measured("trainer MFU", lambda: trainer_mfu(sizes, device)),
        measured("hf engine decode", lambda: decode_throughput(sizes, device)),
        measured("weight-update pause", lambda: weight_pause(sizes, device)),
        measured("colocation", lambda: colocation(sizes, device)),
        measured("asyncrl up", lambda: up_run(sizes, device, args.run_dir.resolve())),
    ]
    wall = time.perf_counter() - t_start
    print(f"\nasyncrl gpu check on {where}; {wall:.0f} s\n")
    print(table(rows), flush=True)
    failed = [r for r in rows if r.error and (args.strict or not r.unavailable)]
    if args.out:
        report = {"device": where, "wall_s": wall, "rows": [asdict(r) for r in rows]}
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
