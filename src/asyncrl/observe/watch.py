"""``asyncrl metrics`` and ``asyncrl status``: read a live run from its NATS subjects.

``asyncrl metrics`` on a terminal shows the live dashboard (:mod:`asyncrl.observe.dashboard`);
in a pipe, or with ``--json``/``--lines``, it prints one record per line."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

from asyncrl.config.recipe import Recipe
from asyncrl.observe.dashboard import start_dashboard
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.loop import run_async
from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects


def _run_name(run_dir: Path) -> str:
    recipe = json.loads((run_dir / "recipe.json").read_text())
    return str(recipe["run"]["name"])


def format_metrics(m: Metrics) -> str:
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in m.values.items()]
    return f"[{m.role} {m.actor_id} step {m.step}] " + " ".join(parts)


async def _dashboard(run_dir: Path) -> int:
    recipe = Recipe.model_validate(json.loads((run_dir / "recipe.json").read_text()))
    bus = await Bus.connect(nats_info_for_run(run_dir), name="asyncrl-metrics")
    live = await start_dashboard(bus, Subjects(recipe.run.name), recipe)
    try:
        await asyncio.Event().wait()  # until Ctrl-C
    finally:
        live.stop()
        await bus.close()
    return 0


async def _stream(run_dir: Path, as_json: bool, role: str, count: int) -> int:
    subjects = Subjects(_run_name(run_dir))
    bus = await Bus.connect(nats_info_for_run(run_dir), name="asyncrl-metrics")
    done = asyncio.Event()
    seen = 0

    async def show(m: Metrics) -> None:
        nonlocal seen
        line = (
            json.dumps(
                {"role": m.role, "actor_id": m.actor_id, "step": m.step, "time": m.time, **m.values}
            )
            if as_json
            else format_metrics(m)
        )
        print(line, flush=True)
        seen += 1
        if count and seen >= count:
            done.set()

    try:
        await bus.subscribe(subjects.metrics(role), Metrics, show)
        await done.wait()
    finally:
        await bus.close()
    return 0


def stream_metrics(
    run_dir: Path, *, as_json: bool, role: str = "*", count: int = 0, lines: bool = False
) -> int:
    """On a terminal, the live dashboard until Ctrl-C; otherwise (or with ``--json``,
    ``--lines``, ``--role`` or ``--count``) prints metrics records as they arrive until
    Ctrl-C (or ``count`` records)."""
    plain = as_json or lines or role != "*" or count or not sys.stdout.isatty()
    try:
        if not plain:
            return run_async(_dashboard(run_dir))
        return run_async(_stream(run_dir, as_json, role, count))
    except KeyboardInterrupt:
        return 0


async def _status(run_dir: Path, wait: float) -> dict[str, ActorInfo]:
    subjects = Subjects(_run_name(run_dir))
    bus = await Bus.connect(nats_info_for_run(run_dir), name="asyncrl-status")
    actors: dict[str, ActorInfo] = {}

    async def seen(info: ActorInfo) -> None:
        actors[info.actor_id] = info

    try:
        await bus.subscribe(subjects.heartbeat("*"), ActorInfo, seen)
        await asyncio.sleep(wait)  # heartbeats come every second; listen for a few
    finally:
        await bus.close()
    return actors


def show_status(run_dir: Path, *, wait: float = 2.5) -> int:
    """Lists the actors heard from within ``wait`` seconds; exit 1 if none."""
    try:
        actors = run_async(_status(run_dir, wait))
    except Exception as exc:
        print(f"asyncrl status: cannot reach the run in {run_dir}: {exc}", file=sys.stderr)
        return 1
    if not actors:
        print(f"no live actors in {run_dir}")
        return 1
    now = time.time()
    print(f"{'actor':<14} {'role':<8} {'pid':>7} {'host':<16} {'version':>7} {'status':<9} seen")
    for a in sorted(actors.values(), key=lambda a: (a.role, a.actor_id)):
        print(
            f"{a.actor_id:<14} {a.role:<8} {a.pid:>7} {a.host[:16]:<16} {a.version:>7} "
            f"{a.status:<9} {now - a.time:.1f}s ago"
        )
    return 0
