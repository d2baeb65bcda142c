"""What the trainer knows of the other actors from their heartbeats and metrics: live
actors per role, the rollout actors' generation rate, the cores they keep busy, their
weight-update pause and idle time, and the messages the run's actors dropped."""

from __future__ import annotations

import asyncio
import time

from asyncrl.wire.messages import ActorInfo, Metrics

ALIVE_WINDOW = 5.0
"""An actor counts as live (``actors/<role>``) if its last heartbeat is this recent
(heartbeats come every second; a loaded machine can hold one back a few seconds)."""


class FleetView:
    """Fed with every actor's heartbeat (:meth:`on_heartbeat`) and the rollout actors'
    metrics (:meth:`on_rollout_metrics`); read once per step with :meth:`stats`."""

    def __init__(self, trainer_ranks: int, roles: tuple[str, ...] = ("rollout", "buffer")) -> None:
        self.trainer_ranks = trainer_ranks
        self._last_heartbeat: dict[str, tuple[str, float]] = {}
        # the roles every run has, and every role heard from since: one with no live actor
        # reads 0 (none started yet, or all silent), never missing from a step's record
        self._roles: set[str] = set(roles)
        self._rollout_latest: dict[str, dict[str, float]] = {}
        # each rollout actor's (time, tokens, CPU seconds) as of the previous step's view
        self._rollout_seen: dict[str, tuple[float, float, float]] = {}
        # each actor's latest drop counters, kept after it dies: they are totals of the run
        self._dropped: dict[str, dict[str, int]] = {}
        self._heard: dict[str, asyncio.Event] = {}

    def _heard_from(self, role: str) -> asyncio.Event:
        return self._heard.setdefault(role, asyncio.Event())

    async def on_heartbeat(self, info: ActorInfo) -> None:
        self._last_heartbeat[info.actor_id] = (info.role, time.monotonic())
        self._roles.add(info.role)
        self._heard_from(info.role).set()
        if info.dropped:
            self._dropped[info.actor_id] = info.dropped

    async def wait_for(self, role: str, limit_s: float) -> bool:
        """Waits until an actor of ``role`` has sent a heartbeat (at once if one has);
        False if none came within ``limit_s`` seconds."""
        heard = self._heard_from(role)
        if heard.is_set():
            return True
        try:
            await asyncio.wait_for(heard.wait(), limit_s)
        except TimeoutError:
            return False
        return True

    async def on_rollout_metrics(self, m: Metrics) -> None:
        # two kinds of record (progress, weight update): keep the latest of each value
        self._rollout_latest.setdefault(m.actor_id, {}).update(m.values, _time=m.time)

    def stats(self, own_id: str, own_dropped: dict[str, int]) -> dict[str, float]:
        """:meth:`fleet_stats` and :meth:`drop_stats` (the trainer's own drops, current,
        as ``own_dropped`` of actor ``own_id``)."""
        return {**self.fleet_stats(), **self.drop_stats(own_id, own_dropped)}

    def drop_stats(self, own_id: str, own_dropped: dict[str, int]) -> dict[str, float]:
        """The messages the run's actors received and could not handle, summed over the
        actors by ``dropped/<subject>/<reason>``: bad input shows in the metrics stream.
        The trainer's own count is current; the others' as of their last heartbeat."""
        self._dropped[own_id] = own_dropped
        out: dict[str, float] = {}
        for counts in self._dropped.values():
            for key, n in counts.items():
                out[f"dropped/{key}"] = out.get(f"dropped/{key}", 0.0) + n
        return out

    def fleet_stats(self) -> dict[str, float]:
        """Live actors per role (0 for a role of ``roles``, or heard from earlier, whose
        actors are all silent now), each live rollout actor's generation rate over the step,
        the cores the live rollout actors kept busy over it (``cores/rollout``: their CPU
        seconds over the seconds between two views; on a CPU run, next to the trainer's
        ``cores/trainer``, where the machine's cores went), the rollout actors' latest
        pause for a weight update (the pause of the previous version: this step's weights
        are still on their way) and their idle time."""
        now = time.monotonic()
        alive: dict[str, int] = dict.fromkeys(self._roles, 0)
        for actor_id, (role, seen) in list(self._last_heartbeat.items()):
            if now - seen <= ALIVE_WINDOW:
                alive[role] = alive.get(role, 0) + 1
            else:
                del self._last_heartbeat[actor_id]
                self._rollout_latest.pop(actor_id, None)
                self._rollout_seen.pop(actor_id, None)
        out: dict[str, float] = {f"actors/{role}": float(n) for role, n in sorted(alive.items())}
        out["actors/trainer"] = float(self.trainer_ranks)
        rates, cores = {}, {}
        for actor_id, v in self._rollout_latest.items():
            # generated tokens (and CPU seconds) over the time between this step's and the
            # previous step's view of the actor's counters: its average over the step, idle
            # time included; before a second view, its average since it started
            now_point = (v.get("_time", 0.0), v.get("tokens", 0.0), v.get("cpu_s", 0.0))
            before = self._rollout_seen.get(actor_id)
            if before is not None and now_point[0] > before[0]:
                span = now_point[0] - before[0]
                rates[actor_id] = (now_point[1] - before[1]) / span
                cores[actor_id] = (now_point[2] - before[2]) / span
            else:
                rates[actor_id] = v.get("gen_tokens_per_s_total", 0.0)
                cores[actor_id] = v.get("cores_total", 0.0)
            if before is None or now_point[0] > before[0]:
                self._rollout_seen[actor_id] = now_point
        for actor_id, rate in sorted(rates.items()):
            out[f"rollout/{actor_id}/tokens_per_s"] = rate
        out["rollout/tokens_per_s"] = sum(rates.values())
        out["cores/rollout"] = sum(cores.values())
        pauses = [
            v["weight_update_s"] for v in self._rollout_latest.values() if "weight_update_s" in v
        ]
        out["time_gen_pause_s"] = max(pauses, default=0.0)
        idle = [(v["idle_s"], v["run_s"]) for v in self._rollout_latest.values() if "run_s" in v]
        if idle:
            # the live rollout actors' time with no episode running, and its share of their
            # running time: generation starved by the staleness budget (η = 0 waits here)
            out["rollout/idle_s"] = sum(i for i, _ in idle)
            out["rollout/idle_frac"] = out["rollout/idle_s"] / max(sum(r for _, r in idle), 1e-9)
        return out


__all__ = ["ALIVE_WINDOW", "FleetView"]
