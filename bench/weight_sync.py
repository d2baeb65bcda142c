"""How long generation stops for one weight update: fetch-then-load inside the pause (the
old way) against fetch and stage while generating, pause only for the load (the
rollout actor's way now), and, full weights against a LoRA adapter (``--lora-rank``, on
the attention and MLP projections), the bytes one update moves and the pause it costs.

    python bench/weight_sync.py                    # SmolLM2 fp32, object store, 4 updates
    python bench/weight_sync.py --transport dir    # a shared directory instead
    python bench/weight_sync.py --model tiny-random-llama

One embedded nats-server and one hf engine with ``--concurrency`` requests generating all
the time. Each update takes an HF export of the current weights (what the trainer
publishes) either from the NATS object store (``object_store``) or from a directory
(``dir``). ``pause s`` is the time generation is stopped; ``fetch s`` is the time spent
before the pause (download and reading the tensors into memory), while decoding goes on.
The adapter (random factors, peft's files) is merged by the hf engine into its kept base
weights during the pause: the pause holds the merge, the update moves only the adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncrl.actors.weights import get_weights, put_weights
from asyncrl.engines import GenerateRequest, SamplingParams
from asyncrl.engines.config import HFEngineConfig
from asyncrl.engines.hf import HFEngine
from asyncrl.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, PEFT_PREFIX
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats

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


async def amain(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        async with (
            EmbeddedNats(tmp / "nats") as server,
            HFEngine(args.model, HFEngineConfig(max_batch_size=args.concurrency)) as engine,
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--transport", choices=["object_store", "dir"], default="object_store")
    p.add_argument("--updates", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--lora-rank", type=int, default=16, help="rank of the adapter updates")
    p.add_argument("--gap", type=float, default=1.0, help="seconds of generation between updates")
    asyncio.run(amain(p.parse_args()))


if __name__ == "__main__":
    main()
