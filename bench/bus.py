"""Typed bus vs raw nats-py: throughput between two processes, and request/reply latency.

    .venv/bin/python bench/bus.py            # full run, about a minute
    .venv/bin/python bench/bus.py --quick    # fewer messages, a smoke run

One embedded nats-server; for each payload size a publisher process and a subscriber
process, first with raw nats-py (bytes in, bytes out), then through ``Bus`` (a
``Message`` carrying an ``Array`` of that many bytes: encode on one side, decode with
full validation on the other). Both publishers send a ready-made object again and again
(bytes for raw, a Message for typed), so the difference is the bus and the codec. The publisher keeps at most two windows of messages in
flight, released by progress reports from the subscriber, so neither the server nor
the subscriber ever drops a message for being slow; the rate is messages delivered
per second, end to end. Request/reply: one requester, one responder, one request at a
time, latency percentiles over all requests after a warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import EmbeddedNats, NatsInfo
from asyncrl.wire.messages import Ack, Array, Message, Trajectory

SUBJECT = "bench.data"
PROGRESS = "bench.progress"
SERVICE = "bench.service"
WINDOW_BYTES = 8 * 1024 * 1024  # two windows in flight: far below every pending limit


class BenchBlob(Message):
    """The benchmark's message: a sequence number and an Array of the payload size."""

    KIND: ClassVar[str] = "bench_blob"
    seq: int
    body: Array


# The codec resolves kinds through the registry; the bench's own kind joins it here only.


def make_message(kind: str, size: int, seq: int) -> Message:
    if kind == "trajectory":  # about 13 bytes per token over the four arrays
        n = max(1, size // 13)
        return Trajectory(
            uid=f"p/{seq}",
            prompt_uid="p",
            group_index=0,
            group_size=8,
            input_ids=Array.of(np.arange(n, dtype=np.int32)),
            loss_mask=Array.of(np.ones(n, dtype=bool)),
            logprobs=Array.of(np.zeros(n, dtype=np.float32)),
            versions=Array.of(np.zeros(n, dtype=np.int32)),
        )
    return BenchBlob(seq=seq, body=Array.of(np.zeros(size, dtype=np.uint8)))


def run_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    if os.environ.get("ASYNCRL_BENCH_GC_FREEZE"):
        # Everything imported so far is permanent: full collections stop walking it.
        gc.freeze()
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- child processes -------------------------------------------------------------------------


def subscriber(
    info: NatsInfo, mode: str, kind: str, count: int, window: int, ready: MpEvent, out: Any
) -> None:
    async def main() -> None:
        bus = await Bus.connect(info, name="bench-sub")
        received = 0
        done = asyncio.Event()
        cpu0 = 0.0

        async def on_any(_: object) -> None:
            nonlocal received, cpu0
            received += 1
            if received == 1:
                cpu0 = time.process_time()
            if received % window == 0 or received == count:
                await bus.nc.publish(PROGRESS, str(received).encode())
                if received == count:
                    done.set()

        if mode == "raw":
            await bus.nc.subscribe(SUBJECT, cb=on_any, pending_bytes_limit=256 * 1024 * 1024)
            await bus.nc.flush()
        else:
            msg_type = Trajectory if kind == "trajectory" else BenchBlob
            await bus.subscribe(SUBJECT, msg_type, on_any)
        ready.set()
        await done.wait()
        out.put(("sub_cpu_us", (time.process_time() - cpu0) / max(1, count - 1) * 1e6))
        assert not bus.errors, bus.errors
        await bus.close()

    run_loop(main())


def publisher(
    info: NatsInfo, mode: str, kind: str, size: int, count: int, window: int, out: Any
) -> None:
    async def main() -> None:
        bus = await Bus.connect(info, name="bench-pub")
        acked = 0
        progressed = asyncio.Condition()

        async def on_progress(msg: Any) -> None:
            nonlocal acked
            async with progressed:
                acked = int(msg.data)
                progressed.notify_all()

        await bus.nc.subscribe(PROGRESS, cb=on_progress)
        await bus.nc.flush()
        template = make_message(kind, size, 0)
        raw = os.urandom(size)
        sent = 0
        t0, cpu0 = time.perf_counter(), time.process_time()
        while sent < count:
            async with progressed:
                # Evaluated right here, while `sent` holds still: the late binding is harmless.
                await progressed.wait_for(lambda: sent - acked < 2 * window)  # noqa: B023
            for _ in range(min(window, count - sent)):
                if mode == "raw":
                    await bus.nc.publish(SUBJECT, raw)
                else:
                    await bus.publish(SUBJECT, template)
                sent += 1
        async with progressed:
            await progressed.wait_for(lambda: acked >= count)
        out.put(("rate", count / (time.perf_counter() - t0)))
        out.put(("pub_cpu_us", (time.process_time() - cpu0) / count * 1e6))
        await bus.close()

    run_loop(main())


def responder(info: NatsInfo, mode: str, ready: MpEvent, stop: MpEvent) -> None:
    async def main() -> None:
        bus = await Bus.connect(info, name="bench-responder")
        if mode == "raw":
            reply = b"ok"

            async def on_raw(msg: Any) -> None:
                await msg.respond(reply)

            await bus.nc.subscribe(SERVICE, cb=on_raw)
            await bus.nc.flush()
        else:
            ok = Ack()

            async def on_typed(_: BenchBlob) -> Ack:
                return ok

            await bus.serve(SERVICE, BenchBlob, on_typed)
        ready.set()
        await asyncio.to_thread(stop.wait)
        await bus.close()

    run_loop(main())


def requester(info: NatsInfo, mode: str, n: int, warmup: int, out: Any) -> None:
    async def main() -> None:
        bus = await Bus.connect(info, name="bench-requester")
        request = make_message("blob", 64, 0)
        raw = os.urandom(64)
        lat_ns: list[int] = []
        for i in range(warmup + n):
            t = time.perf_counter_ns()
            if mode == "raw":
                await bus.nc.request(SERVICE, raw, timeout=5)
            else:
                await bus.request(SERVICE, request, Ack, timeout=5)
            if i >= warmup:
                lat_ns.append(time.perf_counter_ns() - t)
        out.put(lat_ns)
        await bus.close()

    run_loop(main())


# -- orchestration -----------------------------------------------------------------------------


def spawn(ctx: Any, target: Callable[..., None], *args: Any) -> Any:
    p = ctx.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def throughput(info: NatsInfo, mode: str, kind: str, size: int, count: int) -> dict[str, float]:
    """Messages/s end to end, and CPU microseconds per message in each process."""
    ctx = mp.get_context("spawn")
    window = max(16, min(2000, WINDOW_BYTES // size))
    ready, out = ctx.Event(), ctx.Queue()
    sub = spawn(ctx, subscriber, info, mode, kind, count, window, ready, out)
    if not ready.wait(60):
        raise RuntimeError("subscriber did not start")
    pub = spawn(ctx, publisher, info, mode, kind, size, count, window, out)
    result = dict(out.get(timeout=600) for _ in range(3))
    for p in (pub, sub):
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"{p.name} exited with {p.exitcode}")
    return result


def latency(info: NatsInfo, mode: str, n: int) -> list[int]:
    ctx = mp.get_context("spawn")
    ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
    resp = spawn(ctx, responder, info, mode, ready, stop)
    if not ready.wait(60):
        raise RuntimeError("responder did not start")
    req = spawn(ctx, requester, info, mode, n, max(200, n // 10), out)
    lat = list(out.get(timeout=600))
    req.join(60)
    stop.set()
    resp.join(60)
    return lat


def pct(values: list[int], q: float) -> float:
    """The q-quantile in milliseconds (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e6


async def amain(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="asyncrl-bench-") as tmp:
        async with EmbeddedNats(Path(tmp)) as server:
            info = server.info
            cases = [("blob", 1024, args.count_1k), ("blob", 65536, args.count_64k)]
            if not args.quick:
                cases.append(("trajectory", 1024, args.count_1k // 2))
            print(
                f"throughput between two processes, best of {args.repeat}; CPU per message "
                "(median) is what each side costs whatever the load on the machine"
            )
            print(
                f"{'payload':<17}{'raw msg/s':>11}{'typed msg/s':>13}{'ratio':>7}"
                f"{'pub us raw/typed':>19}{'sub us raw/typed':>19}{'sub ratio':>10}"
            )
            for kind, size, count in cases:
                runs: dict[str, list[dict[str, float]]] = {"raw": [], "typed": []}
                for _ in range(args.repeat):  # interleaved, so drift hits both alike
                    for mode in ("raw", "typed"):
                        runs[mode].append(
                            await asyncio.to_thread(throughput, info, mode, kind, size, count)
                        )

                def best(mode: str, key: str, pick: Callable[..., float]) -> float:
                    return pick([r[key] for r in runs[mode]])  # noqa: B023

                r, t = best("raw", "rate", max), best("typed", "rate", max)
                med = statistics.median
                pub_r, pub_t = best("raw", "pub_cpu_us", med), best("typed", "pub_cpu_us", med)
                sub_r, sub_t = best("raw", "sub_cpu_us", med), best("typed", "sub_cpu_us", med)
                name = f"{size // 1024} KB {'Array' if kind == 'blob' else 'Trajectory'}"
                print(
                    f"{name:<17}{r:>11,.0f}{t:>13,.0f}{t / r:>7.0%}"
                    f"{pub_r:>10.1f}/{pub_t:<8.1f}{sub_r:>10.1f}/{sub_t:<8.1f}{sub_r / sub_t:>9.0%}"
                )
                if args.verbose:
                    for mode in ("raw", "typed"):
                        print(f"  {mode:<6}{[round(x['rate']) for x in runs[mode]]} msg/s")
            print(f"\nrequest/reply, one at a time, {args.requests} requests (ms)")
            print(f"{'path':<22}{'p50':>10}{'p99':>10}{'mean':>10}")
            for mode in ("raw", "typed"):
                lat = await asyncio.to_thread(latency, info, mode, args.requests)
                mean = statistics.fmean(lat) / 1e6
                label = "raw nats-py" if mode == "raw" else "typed Bus"
                print(f"{label:<22}{pct(lat, 0.5):>10.3f}{pct(lat, 0.99):>10.3f}{mean:>10.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer messages, one repeat")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--count-1k", type=int, default=200_000)
    p.add_argument("--count-64k", type=int, default=20_000)
    p.add_argument("--requests", type=int, default=10_000)
    p.add_argument("--verbose", "-v", action="store_true")
    p.add_argument(
        "--gc-freeze",
        action="store_true",
        help="gc.freeze() in every bench process after its imports (raw and typed alike)",
    )
    args = p.parse_args()
    if args.quick:
        args.repeat, args.count_1k, args.count_64k, args.requests = 1, 20_000, 2_000, 1_000
    if args.gc_freeze:
        os.environ["ASYNCRL_BENCH_GC_FREEZE"] = "1"  # the spawned processes inherit it
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, "
        f"load average {os.getloadavg()[0]:.1f}, gc.freeze {'on' if args.gc_freeze else 'off'}"
    )
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
