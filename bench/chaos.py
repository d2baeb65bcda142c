"""Chaos: runs of the ci recipe, each with one ``kill -9`` at a seeded random moment, and
the proof afterwards that nothing was lost, trained twice or trained too stale.

    .venv/bin/python bench/chaos.py --runs 100 --seed 0        # the goal: 0 violations
    .venv/bin/python bench/chaos.py --runs 3 --seed 7 --clean 0   # the smoke CI runs

Every run is ``asyncrl up recipes/ci.toml`` for ``--steps`` steps on a 3-server NATS
cluster (the run's streams and object stores replicated on all three), with evaluation
on, so that each of its parts is there to be killed. What is killed, and when, comes from
``random.Random(f"{seed}:{run}")``, printed before the run starts: one of the rollout,
reward, buffer, trainer or eval actor, or one of the three nats-servers, a ``fraction``
of a step after the trainer finished step ``k`` (k in 2 … steps − 2; the fraction of the
time step k took, from step k − 1's end: the first step's time is mostly the run's
start-up), so that the kill falls about while step k + 1 is under way, whatever the
machine's speed, and steps follow it. Every run uses the same ``run.seed``: runs differ only by the kill and by
timing.

After each run, these must hold (each failure a violation of its kind):

- ``exit``: ``asyncrl up`` exits 0 within ``--timeout`` seconds;
- ``restart``: a killed actor was replaced (its ``-r1`` log exists; a buffer's replacement
  says it restored its state). A run whose steps all end before its kill lands is run
  again from the start (up to ``MISS_TRIES`` times; counted in the table): the kill, not
  the run, missed;
- ``steps``, ``trained_twice``, ``unaccounted``, ``staleness``: the checks of
  ``asyncrl audit`` (:mod:`asyncrl.observe.audit`): every step recorded once, no sample
  trained twice, every leased prompt trained, dropped with a reason or held, every
  trained token within η of its step, from the step records;
- ``replay``: ``asyncrl replay`` of the run reproduces every checkpoint bit for bit.

Across runs, the trained response lengths of the chaos runs are compared with those of
``--clean`` runs without a kill (two-sample Kolmogorov–Smirnov): recovery must not bias
training towards short answers. A p-value below 0.01 with the chaos runs' answers shorter
counts as a ``length_bias`` violation. Samples of one group are not independent, so the
p-value is optimistic: read it with the mean lengths beside it.

The table: runs, kills by role, violations by kind, recovery seconds (from the kill to the
next step the trainer finished; median and max, beside the clean runs' median step time)
and recomputed tokens (estimated: each prompt leased again is charged its trained samples'
response tokens once for every extra lease). Exit 1 on any violation.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import random
import signal
import statistics
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from asyncrl.observe.audit import KINDS, audit_run, read_jsonl
from asyncrl.runtime import lineage
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.log import configure_logging
from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects

REPO = Path(__file__).resolve().parent.parent
ACTORS = ("rollout", "reward", "buffer", "trainer", "eval")
ROLES = (*ACTORS, "nats")
VIOLATIONS = ("exit", "restart", *KINDS, "replay", "length_bias")
STEP_CAP_S = 10.0
"""The longest step a kill's fraction is taken of (a watcher that missed step k − 1 takes
the time since it began to watch)."""


@dataclass
class Kill:
    role: str
    after_step: int
    fraction: float

    def __str__(self) -> str:
        return f"kill -9 {self.role} {self.fraction:.2f} of a step after step {self.after_step}"


MISS_TRIES = 3
"""Tries of a run whose steps all end before its planned kill lands (a fast run on a busy
machine: the watcher hears of step k late); a run that misses every time is a violation."""


def plan_kill(seed: int, run: int, steps: int, roles: tuple[str, ...]) -> Kill:
    rng = random.Random(f"{seed}:{run}")
    return Kill(rng.choice(roles), rng.randint(2, steps - 2), round(rng.uniform(0.0, 1.0), 2))


@dataclass
class Outcome:
    kill: Kill | None
    violations: list[tuple[str, str]] = field(default_factory=list)
    recovery_s: float | None = None
    step_s: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    recomputed_tokens: int = 0
    seconds: float = 0.0
    killed: bool = False
    missed: int = 0
    """Earlier tries of this run whose steps all ended before the planned kill (each run
    again from the start: a kill that never happened proves nothing)."""


def up_argv(run_dir: Path, steps: int, run_seed: int) -> list[str]:
    sets = [
        f"run.dir={run_dir.parent}",
        f"run.name={run_dir.name}",
        f"run.seed={run_seed}",
        f"trainer.max_steps={steps}",
        f"trainer.checkpoint_every={steps // 2}",
        "eval.every=2",
        "run.nats_servers=3",
        "run.nats_replicas=3",
        "rollout.lease_ttl=5",
        "run.restart_backoff=0.5",
        "run.tensorboard=false",
        "run.plots=false",
    ]
    flags = [x for s in sets for x in ("--set", s)]
    recipe = str(REPO / "recipes" / "ci.toml")
    return [sys.executable, "-m", "asyncrl.entry.cli", "up", recipe, *flags, "--quiet"]


def server_pids(run_dir: Path) -> dict[str, int]:
    """The cluster's nats-servers by name, from the ports file each writes."""
    out = {}
    for ports in sorted((run_dir / "nats").glob("*/nats-server_*.ports")):
        out[ports.parent.name] = int(ports.stem.rsplit("_", 1)[1])
    return out


async def wait_for_file(path: Path, proc: asyncio.subprocess.Process, limit: float) -> None:
    async with asyncio.timeout(limit):
        while not path.exists():  # noqa: ASYNC240 - a stat while another process starts
            if proc.returncode is not None:
                raise RuntimeError(f"the run ended before {path.name} appeared")
            await asyncio.sleep(0.1)


async def watch_and_kill(run_dir: Path, kill: Kill | None, outcome: Outcome) -> None:
    """Follows the trainer's steps until cancelled (when the run ends); at the planned
    moment kills the planned part, and times the recovery."""
    bus = await Bus.connect(nats_info_for_run(run_dir), name="chaos")
    pids: dict[str, int] = {}
    step_times: dict[int, float] = {}
    reached, beat, stepped = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def on_beat(info: ActorInfo) -> None:
        pids.setdefault(info.actor_id, info.pid)
        beat.set()

    async def on_metrics(m: Metrics) -> None:
        step_times.setdefault(m.step, time.monotonic())
        stepped.set()
        if kill is not None and m.step >= kill.after_step:
            reached.set()

    subjects = Subjects(run_dir.name)
    await bus.subscribe(subjects.heartbeat("*"), ActorInfo, on_beat)
    await bus.subscribe(subjects.metrics("trainer"), Metrics, on_metrics)
    watching = time.monotonic()
    try:
        if kill is not None:
            await reached.wait()
            k = min(s for s in step_times if s >= kill.after_step)
            took = step_times[k] - step_times.get(k - 1, watching)
            await asyncio.sleep(kill.fraction * min(took, STEP_CAP_S))
            if kill.role == "nats":
                servers = server_pids(run_dir)
                pid = servers[random.Random(str(kill)).choice(sorted(servers))]
            else:
                while f"{kill.role}-0" not in pids:
                    beat.clear()
                    await beat.wait()
                pid = pids[f"{kill.role}-0"]
            os.kill(pid, signal.SIGKILL)
            t_kill, at = time.monotonic(), max(step_times)
            outcome.killed = True
            while not any(s > at for s in step_times):
                stepped.clear()
                await stepped.wait()
            outcome.recovery_s = min(t for s, t in step_times.items() if s > at) - t_kill
        await asyncio.Event().wait()
    finally:
        times = [step_times[s] for s in sorted(step_times)]
        outcome.step_s = [b - a for a, b in itertools.pairwise(times)]
        with contextlib.suppress(Exception):
            await bus.close()


def open_log(path: Path) -> BinaryIO:
    return open(path, "wb")


async def one_run(run_dir: Path, kill: Kill | None, args: argparse.Namespace) -> Outcome:
    outcome = Outcome(kill)
    t0 = time.monotonic()
    log = open_log(run_dir.parent / f"{run_dir.name}.out")
    proc = await asyncio.create_subprocess_exec(
        *up_argv(run_dir, args.steps, args.run_seed),
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
        start_new_session=True,
    )
    watcher: asyncio.Task[None] | None = None
    try:
        await wait_for_file(run_dir / "nats.json", proc, 120)
        watcher = asyncio.create_task(watch_and_kill(run_dir, kill, outcome))
        code = await asyncio.wait_for(proc.wait(), args.timeout)
        if code != 0:
            outcome.violations.append(("exit", f"asyncrl up exited {code}"))
    except (TimeoutError, RuntimeError) as exc:
        outcome.violations.append(("exit", f"{type(exc).__name__}: {exc}"))
    finally:
        if proc.returncode is None:
            lineage.kill_run(proc.pid, run_dir)  # what is left of a run that overran
            await proc.wait()
        log.close()
        if watcher is not None:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watcher
    outcome.seconds = time.monotonic() - t0
    if outcome.violations:  # a run that did not end is not audited further
        return outcome
    check_restart(run_dir, kill, outcome)
    check_audit(run_dir, outcome)
    if args.replay:
        await check_replay(run_dir, outcome)
    return outcome


def check_restart(run_dir: Path, kill: Kill | None, outcome: Outcome) -> None:
    if kill is None:
        return
    if not outcome.killed:  # a miss, not a fault: the run is tried again (MISS_TRIES)
        return
    if kill.role == "nats":
        return
    log = run_dir / "logs" / f"{kill.role}-0-r1.log"
    if not log.is_file():
        outcome.violations.append(("restart", f"no replacement {kill.role}"))
    elif kill.role == "buffer" and "restored" not in log.read_text():
        outcome.violations.append(("restart", "the replacement buffer started empty"))


def check_audit(run_dir: Path, outcome: Outcome) -> None:
    result = audit_run(run_dir)
    outcome.violations += [(v.kind, v.detail) for v in result.violations]
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    outcome.lengths = [int(t["response_tokens"]) for t in trained]
    tokens_of: dict[str, int] = defaultdict(int)
    for t in trained:
        tokens_of[t["prompt_uid"]] += int(t["response_tokens"])
    events = read_jsonl(run_dir / "buffer_events.jsonl")
    leases = Counter(e["prompt"] for e in events if e["event"] == "lease")
    outcome.recomputed_tokens = sum(tokens_of[p] * (n - 1) for p, n in leases.items())


async def check_replay(run_dir: Path, outcome: Outcome) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "asyncrl.entry.cli",
        "replay",
        str(run_dir),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        cwd=REPO,
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        last = out.decode().strip().splitlines()[-3:]
        outcome.violations.append(("replay", " / ".join(last)))


def ks_two_sample(a: list[int], b: list[int]) -> tuple[float, float]:
    """Kolmogorov–Smirnov statistic D = sup |F_a − F_b| of two samples and its asymptotic
    p-value, Q(√n_e · D) with n_e = n_a n_b / (n_a + n_b) and the Kolmogorov tail
    Q(λ) = 2 Σ_{j≥1} (−1)^{j−1} e^{−2 j² λ²}."""
    xs, ys = sorted(a), sorted(b)
    i = j = 0
    d = 0.0
    for v in sorted(set(xs) | set(ys)):
        while i < len(xs) and xs[i] <= v:
            i += 1
        while j < len(ys) and ys[j] <= v:
            j += 1
        d = max(d, abs(i / len(xs) - j / len(ys)))
    lam = math.sqrt(len(xs) * len(ys) / (len(xs) + len(ys))) * d
    if lam < 1e-3:
        return d, 1.0
    p = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 101))
    return d, min(1.0, max(0.0, p))


def table(chaos: list[Outcome], clean: list[Outcome]) -> list[str]:
    kills = Counter(o.kill.role for o in chaos if o.kill)
    counts = Counter(kind for o in chaos + clean for kind, _ in o.violations)
    rec = [o.recovery_s for o in chaos if o.recovery_s is not None]
    step_s = [s for o in clean for s in o.step_s] or [s for o in chaos for s in o.step_s]
    lines = [
        f"{'runs':<28} {len(chaos)} with a kill, {len(clean)} without",
        f"{'kills by role':<28} " + ", ".join(f"{r} {kills[r]}" for r in ROLES),
        f"{'violations':<28} "
        + ", ".join(f"{k} {counts[k]}" for k in VIOLATIONS)
        + f"  (total {sum(counts.values())})",
    ]
    if rec:
        lines.append(
            f"{'recovery s (kill→next step)':<28} median {statistics.median(rec):.1f}, "
            f"max {max(rec):.1f} (median step {statistics.median(step_s):.1f} s)"
            if step_s
            else f"median {statistics.median(rec):.1f}, max {max(rec):.1f}"
        )
    tokens = [o.recomputed_tokens for o in chaos]
    if tokens:
        lines.append(
            f"{'recomputed tokens (est.)':<28} {sum(tokens)} in all, "
            f"median {statistics.median(tokens):.0f} a run, max {max(tokens)}"
        )
    seconds = [o.seconds for o in chaos + clean]
    lines.append(f"{'seconds a run':<28} median {statistics.median(seconds):.0f}")
    missed = sum(o.missed for o in chaos)
    if missed:
        lines.append(f"{'kills missed, run again':<28} {missed}")
    return lines


def length_bias(chaos: list[Outcome], clean: list[Outcome]) -> tuple[str, bool]:
    a = [x for o in chaos for x in o.lengths]
    b = [x for o in clean for x in o.lengths]
    if not a or not b:
        return "length bias: not measured (needs runs with and without a kill)", False
    d, p = ks_two_sample(a, b)
    mean_a, mean_b = statistics.fmean(a), statistics.fmean(b)
    biased = p < 0.01 and mean_a < mean_b
    return (
        f"length bias: KS D {d:.3f}, p {p:.3g}; mean response tokens {mean_a:.2f} with a "
        f"kill ({len(a)} samples) vs {mean_b:.2f} without ({len(b)})"
        + ("  VIOLATED" if biased else ""),
        biased,
    )


async def main(args: argparse.Namespace) -> int:
    out: Path = args.out
    roles = tuple(args.roles)
    chaos: list[Outcome] = []
    clean: list[Outcome] = []
    for i in range(args.runs):
        kill = plan_kill(args.seed, i, args.steps, roles)
        print(f"run {i + 1}/{args.runs} (seed {args.seed}:{i}): {kill}", flush=True)
        run_dir = out / f"chaos-{args.seed}-{i}"
        outcome = await one_run(run_dir, kill, args)
        for attempt in range(2, MISS_TRIES + 1):
            if outcome.killed or outcome.violations:
                break
            print(f"  the run ended before the kill: again (try {attempt})", flush=True)
            missed = outcome.missed + 1
            outcome = await one_run(run_dir.with_name(f"{run_dir.name}-try{attempt}"), kill, args)
            outcome.missed = missed
        if not outcome.killed and not outcome.violations:
            outcome.violations.append(
                ("restart", f"the run ended before {kill} happened, {MISS_TRIES} tries")
            )
        chaos.append(outcome)
        verdict = "; ".join(f"{k}: {d}" for k, d in outcome.violations) or "ok"
        rec = f"{outcome.recovery_s:.1f} s" if outcome.recovery_s is not None else "-"
        print(f"  {outcome.seconds:.0f} s, recovered in {rec}: {verdict}", flush=True)
    for i in range(args.clean):
        print(f"clean run {i + 1}/{args.clean}", flush=True)
        outcome = await one_run(out / f"clean-{args.seed}-{i}", None, args)
        clean.append(outcome)
        verdict = "; ".join(f"{k}: {d}" for k, d in outcome.violations) or "ok"
        print(f"  {outcome.seconds:.0f} s: {verdict}", flush=True)
    bias_line, biased = length_bias(chaos, clean)
    if biased:
        chaos[0].violations.append(("length_bias", bias_line))
    print()
    for line in [*table(chaos, clean), bias_line]:
        print(line)
    summary = {
        "seed": args.seed,
        "runs": [
            {
                "kill": str(o.kill) if o.kill else None,
                "violations": o.violations,
                "recovery_s": o.recovery_s,
                "recomputed_tokens": o.recomputed_tokens,
                "seconds": o.seconds,
            }
            for o in chaos + clean
        ],
    }
    (out / f"chaos-{args.seed}.json").write_text(json.dumps(summary, indent=1))
    return 1 if any(o.violations for o in chaos + clean) else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=10, help="runs with a kill")
    p.add_argument("--seed", type=int, default=0, help="seeds what is killed and when")
    p.add_argument("--clean", type=int, default=3, help="runs without a kill, for the KS test")
    p.add_argument("--steps", type=int, default=8, help="trainer steps a run (at least 4)")
    p.add_argument("--run-seed", type=int, default=1, help="every run's run.seed")
    p.add_argument("--roles", nargs="+", choices=ROLES, default=list(ROLES))
    p.add_argument("--timeout", type=float, default=420.0, help="seconds a run may take")
    p.add_argument("--no-replay", dest="replay", action="store_false")
    p.add_argument("--out", default=str(REPO / "runs" / "chaos"), help="where the runs go")
    args = p.parse_args(argv)
    args.out = Path(args.out).resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.steps < 4:
        p.error("--steps must be at least 4: a kill after step 2 … steps − 2, a checkpoint")
    return args


if __name__ == "__main__":
    configure_logging("ERROR")  # the watcher's connection sees each run's servers go
    sys.exit(asyncio.run(main(parse_args())))
