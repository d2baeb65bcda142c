"""Spans for a timeline of the run: who generated, scored, leased, trained or loaded
weights, when, and for how long.

Each actor owns a :class:`Tracer`. While the actor's policy version lies in the recipe's
window (``run.trace_steps = "a:b"``), every span it closes becomes one line of
``<run>/traces/<actor id>.jsonl``; outside the window, or with tracing off, ``span()``
costs one comparison. ``asyncrl up`` merges the files into ``<run>/trace.json``
(:func:`merge_traces`), Chrome-trace JSON that Perfetto and ``chrome://tracing`` open.

Spans that overlap inside one actor (the episodes of a rollout actor) get separate lanes
(Chrome-trace thread ids): a span takes the lowest lane that is free when it starts, so
concurrency reads as stacked bars and idle time as gaps.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

TRACE_DIR = "traces"
TRACE_FILE = "trace.json"

ROLE_ORDER = ("trainer", "buffer", "rollout", "reward", "eval")
"""Top-to-bottom order of the roles in the merged timeline."""


def now_us() -> float:
    """Wall-clock microseconds: comparable across the processes of one machine."""
    return time.time() * 1e6


class Tracer:
    """Records spans of one actor inside a version window; a no-op without one."""

    def __init__(
        self,
        run_dir: Path | None,
        actor_id: str,
        role: str,
        window: tuple[int, int] | None,
        version: Callable[[], int] = lambda: 0,
    ) -> None:
        self.enabled = run_dir is not None and window is not None
        self.path = run_dir / TRACE_DIR / f"{actor_id}.jsonl" if run_dir is not None else None
        self.actor_id = actor_id
        self.role = role
        self.window = window or (0, -1)
        self.version = version
        self._busy: set[int] = set()
        self._file: IO[str] | None = None

    def active(self) -> bool:
        if not self.enabled:
            return False
        lo, hi = self.window
        return lo <= self.version() <= hi

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """Times the block as one span (if the version is in the window when it starts)."""
        if not self.active():
            yield
            return
        lane = self._take_lane()
        version = self.version()  # the version the span started under (a weight load ends
        start = now_us()  # under the next one)
        try:
            yield
        finally:
            self._busy.discard(lane)
            self._write(name, start, now_us() - start, lane, {"version": version, **args})

    def complete(self, name: str, start_us: float, **args: Any) -> None:
        """A span that started at ``start_us`` (from :func:`now_us`) and ends now: for
        handlers where a ``with`` block would re-indent the code."""
        if self.active():
            lane = self._take_lane(release=True)
            self._write(
                name, start_us, now_us() - start_us, lane, {"version": self.version(), **args}
            )

    def _take_lane(self, release: bool = False) -> int:
        lane = 0
        while lane in self._busy:
            lane += 1
        if not release:
            self._busy.add(lane)
        return lane

    def _write(self, name: str, start: float, dur: float, lane: int, args: dict[str, Any]) -> None:
        if self._file is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a", buffering=1)
        event = {
            "name": name,
            "ts": round(start, 1),
            "dur": round(dur, 1),
            "lane": lane,
            "actor": self.actor_id,
            "role": self.role,
            "args": args,
        }
        self._file.write(json.dumps(event) + "\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _role_rank(role: str) -> int:
    return ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER)


def merge_traces(run_dir: Path) -> Path | None:
    """Writes ``<run>/trace.json`` from every actor's span file; None if there were none.

    One Chrome-trace process per actor (named ``<actor id> (<role>)``, ordered by role),
    one thread per lane; complete events (``ph = "X"``) in microseconds. Lines cut short
    by a killed actor are skipped."""
    spans: list[dict[str, Any]] = []
    for path in sorted((run_dir / TRACE_DIR).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                spans.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    if not spans:
        return None
    actors = sorted(
        {(s["role"], s["actor"]) for s in spans}, key=lambda a: (_role_rank(a[0]), a[1])
    )
    pid_of = {actor: pid for pid, (_, actor) in enumerate(actors, 1)}
    events: list[dict[str, Any]] = []
    for role, actor in actors:
        pid = pid_of[actor]
        events.append(
            {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"{actor} ({role})"}}
        )
        events.append(
            {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}
        )
    lanes = sorted({(pid_of[s["actor"]], s["lane"]) for s in spans})
    for pid, lane in lanes:
        events.append(
            {
                "ph": "M",
                "name": "thread_name",
                "pid": pid,
                "tid": lane,
                "args": {"name": f"lane {lane}"},
            }
        )
    for s in sorted(spans, key=lambda s: s["ts"]):
        events.append(
            {
                "name": s["name"],
                "cat": s["role"],
                "ph": "X",
                "ts": s["ts"],
                "dur": s["dur"],
                "pid": pid_of[s["actor"]],
                "tid": s["lane"],
                "args": s.get("args", {}),
            }
        )
    out = run_dir / TRACE_FILE
    out.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}))
    return out
