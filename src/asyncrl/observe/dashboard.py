"""The live dashboard of ``asyncrl up`` and ``asyncrl metrics``: one screen, redrawn as
metrics and heartbeats arrive.

:class:`DashboardState` folds the run's NATS records (``Metrics`` of every role,
``ActorInfo`` heartbeats) into what the screen shows; :meth:`DashboardState.render` draws
it with rich. The state knows nothing of NATS, so a test (or a replay of a finished
run's ``metrics.jsonl``) drives it with recorded records; :func:`start_dashboard`
subscribes one to a live run.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from asyncrl.observe.fleet import ALIVE_WINDOW
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects

if TYPE_CHECKING:
    from asyncrl.config.recipe import Recipe
    from asyncrl.runtime.bus import Bus

BAR_WIDTH = 30
"""Characters of the longest staleness bar."""


@dataclass
class _ActorRates:
    role: str
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    version: int = -1


@dataclass
class DashboardState:
    """What the dashboard knows; feed it with :meth:`on_metrics` and :meth:`on_heartbeat`."""

    run: str = ""
    max_steps: int = 0
    started: float = field(default_factory=time.time)
    trainer: dict[str, float] = field(default_factory=dict)
    eval: dict[str, float] = field(default_factory=dict)
    batch_size: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    actors: dict[str, _ActorRates] = field(default_factory=dict)
    last_seen: dict[str, tuple[str, float]] = field(default_factory=dict)
    dropped: dict[str, int] = field(default_factory=dict)
    """Per actor: received messages its bus could not handle (from its heartbeats)."""
    reward_history: list[float] = field(default_factory=list)
    episodes: dict[str, int] = field(default_factory=dict)
    leased: dict[str, int] = field(default_factory=dict)
    _scored: dict[str, tuple[float, float]] = field(default_factory=dict)

    def on_metrics(self, m: Metrics) -> None:
        v = m.values
        if m.role == "trainer":
            self.trainer = dict(v)
            self.reward_history.append(float(v.get("reward_mean", 0.0)))
            for key, count in v.items():
                if key.startswith("staleness/"):
                    self.staleness[int(key.split("/", 1)[1])] += int(count)
            rates = _ActorRates("trainer", v.get("samples_per_s"), v.get("tokens_per_s"))
            rates.version = int(v.get("version", -1))
            self.actors[m.actor_id] = rates
        elif m.role == "eval":
            self.eval = dict(v)
            rates = _ActorRates("eval", None, v.get("eval/tokens_per_s"), int(v.get("version", -1)))
            self.actors[m.actor_id] = rates
        elif m.role == "rollout":
            # progress records carry the rates; weight-update records only some counters
            prev = self.actors.get(m.actor_id) or _ActorRates("rollout")
            self.actors[m.actor_id] = _ActorRates(
                "rollout",
                v.get("samples_per_s", prev.samples_per_s),
                v.get("gen_tokens_per_s", prev.tokens_per_s),
                int(v.get("version", prev.version)),
            )
            self.episodes[m.actor_id] = int(v.get("episodes", 0))
            self.leased[m.actor_id] = int(v.get("leased", 0))
        elif m.role == "reward":
            scored = float(v.get("scored", 0.0))
            before = self._scored.get(m.actor_id)
            rate = None
            if before is not None and m.time > before[0]:
                rate = (scored - before[1]) / (m.time - before[0])
            self._scored[m.actor_id] = (m.time, scored)
            self.actors[m.actor_id] = _ActorRates("reward", rate, None)

    def on_heartbeat(self, info: ActorInfo, now: float | None = None) -> None:
        self.last_seen[info.actor_id] = (info.role, time.time() if now is None else now)
        if info.dropped:
            self.dropped[info.actor_id] = sum(info.dropped.values())

    def alive(self, now: float | None = None) -> Counter[str]:
        now = time.time() if now is None else now
        return Counter(role for role, t in self.last_seen.values() if now - t <= ALIVE_WINDOW)

    # -- drawing -------------------------------------------------------------------------------

    def render(self, now: float | None = None) -> RenderableType:
        now = time.time() if now is None else now
        parts: list[RenderableType] = [self._header(now)]
        parts.append(self._main_table())
        if self.staleness:
            parts.append(self._staleness())
        parts.append(self._actors_table(now))
        return Group(*parts)

    def _header(self, now: float) -> Text:
        t = self.trainer
        elapsed = now - self.started
        step = int(t.get("step", 0))
        head = Text(f"asyncrl {self.run}  ", style="bold")
        head.append(f"step {step}/{self.max_steps or '?'}  ")
        if t:
            head.append(f"v{int(t.get('version', 0))}  ")
        head.append(f"{elapsed / 60:.1f} min")
        if not t:
            # before the first step: the groups (episodes) finished by the rollout actors,
            # against the first batch's size
            done = sum(self.episodes.values())
            need = self.batch_size or "?"
            head.append(f"\ngenerating: {done}/{need} groups", style="yellow")
            if self.leased:
                head.append(f"  ({sum(self.leased.values())} leased)")
        return head

    def _main_table(self) -> Table:
        t, e = self.trainer, self.eval
        table = Table(show_header=False, box=None, pad_edge=False)
        table.add_column(style="dim")
        table.add_column()
        table.add_column(style="dim")
        table.add_column()
        rows = [
            ("reward", _f(t, "reward_mean"), "eval", _eval_summary(e)),
            ("loss", _f(t, "loss", ".4f"), "entropy", _f(t, "train/entropy")),
            (
                "staleness",
                f"{_f(t, 'staleness_mean', '.2f')} (max {_f(t, 'staleness_max', '.0f')})",
                "accepted / rejected",
                f"{_f(t, 'accepted', '.0f')} / {_f(t, 'rejected', '.0f')}",
            ),
            (
                "response length",
                f"{_f(t, 'response_length/mean', '.1f')} (max {_f(t, 'response_length/max', '.0f')}, clipped {_pct(t, 'response_length/clip_ratio')})",
                "groups all 0 / all 1",
                f"{_pct(t, 'reward_groups/all_zero')} / {_pct(t, 'reward_groups/all_one')}",
            ),
            (
                "step time",
                _time_split(t),
                "reward trend",
                _sparkline(self.reward_history[-40:]),
            ),
        ]
        for row in rows:
            table.add_row(*row)
        return table

    def _staleness(self) -> Table:
        table = Table(
            title="staleness of trained samples", title_justify="left", box=None, show_header=False
        )
        table.add_column(justify="right")
        table.add_column()
        table.add_column(justify="right")
        top = max(self.staleness.values())
        total = sum(self.staleness.values())
        for s in range(max(self.staleness) + 1):
            n = self.staleness.get(s, 0)
            bar = "█" * max(1 if n else 0, round(BAR_WIDTH * n / top))
            table.add_row(str(s), bar, f"{n} ({100 * n / total:.0f}%)")
        return table

    def _actors_table(self, now: float) -> Table:
        alive = self.alive(now)
        table = Table(title_justify="left", box=None)
        table.add_column("actor")
        table.add_column("role")
        table.add_column("version", justify="right")
        table.add_column("samples/s", justify="right")
        table.add_column("tokens/s", justify="right")
        for actor_id, a in sorted(self.actors.items(), key=lambda kv: (kv[1].role, kv[0])):
            table.add_row(
                actor_id,
                a.role,
                str(a.version) if a.version >= 0 else "-",
                _num(a.samples_per_s),
                _num(a.tokens_per_s),
            )
        live = ", ".join(f"{role} {n}" for role, n in sorted(alive.items())) or "-"
        table.title = f"actors alive: {live}"
        if dropped := sum(self.dropped.values()):
            table.title += f"  (bad messages dropped: {dropped})"
        return table

    def plain_line(self) -> str:
        """The one-line summary for a terminal that cannot redraw (a log file, a pipe)."""
        t = self.trainer
        return (
            f"step {int(t.get('step', 0))}/{self.max_steps}  v{int(t.get('version', 0))}  "
            f"reward {_f(t, 'reward_mean')}  staleness {_f(t, 'staleness_mean', '.2f')}/"
            f"{_f(t, 'staleness_max', '.0f')}  accepted {_f(t, 'accepted', '.0f')} "
            f"rejected {_f(t, 'rejected', '.0f')}  {_f(t, 'samples_per_s', '.2f')} samples/s  "
            f"loss {_f(t, 'loss', '.4f')}"
        )


def _f(values: dict[str, Any], key: str, fmt: str = ".3f") -> str:
    value = values.get(key)
    return format(value, fmt) if isinstance(value, int | float) else "-"


def _pct(values: dict[str, Any], key: str) -> str:
    value = values.get(key)
    return f"{100 * value:.0f}%" if isinstance(value, int | float) else "-"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _eval_summary(e: dict[str, float]) -> str:
    if not e:
        return "-"
    parts = [
        f"{k.removeprefix('eval/')} {v:.3f}"
        for k, v in e.items()
        if k.startswith("eval/") and ("accuracy" in k or "@" in k)
    ]
    return f"{'  '.join(parts)}  @v{int(e.get('version', 0))}"


def _time_split(t: dict[str, float]) -> str:
    if not t:
        return "-"
    return (
        f"wait {_f(t, 'time_wait_batch_s', '.1f')}s  train {_f(t, 'time_train_s', '.1f')}s  "
        f"sync {_f(t, 'time_weights_s', '.1f')}s  gen pause {_f(t, 'time_gen_pause_s', '.2f')}s"
    )


_SPARKS = "▁▂▃▄▅▆▇█"


def _sparkline(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(_SPARKS[round((v - lo) / span * (len(_SPARKS) - 1))] for v in values)


async def start_dashboard(bus: Bus, subjects: Subjects, recipe: Recipe) -> Live:
    """Subscribes a :class:`DashboardState` to the run and starts redrawing it; returns
    the rich ``Live`` to stop at the end."""
    state = DashboardState(
        run=recipe.run.name,
        max_steps=recipe.trainer.max_steps,
        batch_size=recipe.buffer.batch_size,
    )
    live = Live(state.render(), refresh_per_second=2, get_renderable=state.render)

    async def on_metrics(m: Metrics) -> None:
        state.on_metrics(m)

    async def on_heartbeat(info: ActorInfo) -> None:
        state.on_heartbeat(info)

    await bus.subscribe(subjects.metrics("*"), Metrics, on_metrics)
    await bus.subscribe(subjects.heartbeat("*"), ActorInfo, on_heartbeat)
    live.start()
    return live
