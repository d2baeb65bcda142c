"""Asynchronous against synchronous RL: the same recipe and seed, η = 0 and η ≥ 1.

    python bench/async_vs_sync.py                 # two real runs, SmolLM2 on 2 cores, < 20 min
    python bench/async_vs_sync.py --steps 3       # a quick look
    python bench/async_vs_sync.py --simulate      # the GPU-cluster regime, simulated, seconds
    python bench/async_vs_sync.py --placements --steps 6   # the default core placement vs by hand

**Real mode** runs ``asyncrl up`` twice on ``--recipe`` (the quickstart: SmolLM2-135M
learns small arithmetic), once with ``buffer.max_head_offpolicyness = 0`` (synchronous:
at most one batch is generated ahead of the trainer, so generation and training take
turns) and once with ``--eta`` and ``buffer.max_concurrent`` C above the batch size B
(asynchronous). Everything else is equal: seed, data, steps, learning rate. Generation
and training get a core each, as they get their own GPUs on a cluster: the rollout and
reward actors are pinned to ``--gen-cpu`` and the trainer to ``--train-cpu``
(``rollout.cpus``, ``trainer.cpus``; one torch thread each). The eval actor shares the
trainer's core and scores only versions 0 and N (``eval.every = N``): at version 0 the
trainer waits for its first batch anyway, and version N comes after the last step, so
evaluation lands in neither run's measured window.

Per run it prints, from ``metrics.jsonl`` and ``eval.jsonl`` of the run folder:

- wall time: from the start of step 1 (its record's time minus its wait, train and
  weight times) to the record of step N, and the window of steps 2..N, over which the
  rest is measured: step 1 holds what both runs do once (the first batch from scratch,
  the version-0 evaluation beside it), so steps per hour = (N − 1) / window;
- trainer idle: the share of the window spent waiting for a batch (``time_wait_batch_s``);
- generation idle: the share of the window with no episode running in the rollout actor
  (``rollout/idle_s``: waiting on the staleness budget or for new weights);
- reward per step (``reward_mean``) and the held-out greedy accuracy at versions 0 and N
  on prompts the buffer never leases;

then the speedup, async steps/hour over sync steps/hour. If the faster run's reward or
held-out accuracy is lower, the summary says so beside the speedup.

**Placements mode** (``--placements``) runs only the asynchronous recipe, once under
asyncrl's own placement (no ``cpus`` or ``threads`` override: :mod:`asyncrl.launch.core_placement`)
and once under each hand placement: generation (rollout, reward, eval) on the first k
cores and the trainer on the rest, for k in {1, N/4, N/2, N − 1}, and the unpinned
machine with torch's default threads or with one generation thread and N trainer
threads, and the overlapping one (the trainer on every core, generation pinned to N/4
of them). It prints steps/h, training seconds per step, idle fractions and held-out
accuracy per placement, then the default's steps/h as a share of the best hand
placement's. Short runs of one placement differ by about ±10%: ``--repeats R`` runs
every placement R times, in rounds, and compares medians; ``--only`` keeps the hand
placements whose labels contain one of its words (the default always runs), e.g.
``--only "train all" "shared, gen 1"``. A sweep too long for one job (a machine lent for
minutes at a time) runs in parts: ``--time-limit S`` starts no run that would end after
S seconds, judged by the longest run so far, and stops saying what is left; the same
command with ``--resume`` then runs only the runs not yet finished with the same
overrides (each finished run leaves ``bench.json`` in its folder), and the last part
prints the whole table. ``--run-timeout S`` stops a run after S seconds, as Ctrl-C would,
and counts the steps it finished (marked ``*``): on 16 cores a placement whose thread
pools share cores can take minutes a step, and is then reported rather than waited for.

**Simulated mode** (``--simulate``) replays a model of the GPU-cluster regime, without a
model or a network: a generation server with S concurrent sequence slots, each sequence
taking ``prefill + length · token time`` seconds once it has a slot (a GPU decodes a batch
of S in about the time of one), lengths drawn from a log-normal (``--len-median``,
``--len-sigma``, capped at ``--len-max``; or fitted to the responses of real runs with
``--lengths-from``), and a trainer whose step takes a fixed ``--train-s``. Admission is
the real :class:`StalenessManager`; an episode's samples all carry the version it started
under. It models throughput only (no rewards) and ignores the weight-load pause. Its
output says it is simulated.

Results go to ``bench/results/`` (git-ignored): a JSON file and a PNG (reward per step of
both runs against wall time, and the idle fractions), and the run folders under
``bench/results/async_vs_sync/``, without their checkpoints, published weights and NATS
store (about 3 GB a SmolLM2 run), which are deleted once the run is summarised.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the scripts beside this one
from flops import cpu_line

from asyncrl.runtime.staleness import StalenessManager

HERE = Path(__file__).resolve()
REPO = HERE.parents[1]
RESULTS = HERE.parent / "results"
RUNS = RESULTS / "async_vs_sync"
GOAL_SPEEDUP = 1.7


# -- the machine ----------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    return {
        "cpu": cpu_line(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "load_average": list(os.getloadavg()),
    }


# -- real runs ------------------------------------------------------------------------------------


def common_sets(args: argparse.Namespace, name: str, eta: int) -> list[str]:
    """The overrides every real run shares; only ``name``, η and the placement differ."""
    return [
        f"run.dir={RUNS}",
        f"run.name={name}",
        f"run.seed={args.seed}",
        "run.tensorboard=false",
        f"trainer.max_steps={args.steps}",
        f"buffer.max_head_offpolicyness={eta}",
        f"buffer.batch_size={args.batch_size}",
        f"buffer.max_concurrent={args.max_concurrent}",
        f"rollout.max_concurrent={args.max_concurrent}",
        f"eval.every={args.steps}",
        f"eval.max_prompts={args.eval_prompts}",
    ]


def pinned(gen: list[int], train: list[int]) -> list[str]:
    """A hand placement: rollout, reward and eval on ``gen``, the trainer on ``train``, a
    torch thread per core; the eval actor one, as under the default (a second pool of
    threads on the rollout actor's cores slows both many times over)."""
    g, t = ",".join(map(str, gen)), ",".join(map(str, train))
    return [
        f"rollout.cpus=[{g}]",
        f"reward.cpus=[{g}]",
        f"eval.cpus=[{g}]",
        f"trainer.cpus=[{t}]",
        f"rollout.threads={len(gen)}",
        "eval.threads=1",
        f"trainer.threads={len(train)}",
    ]


def run_sets(args: argparse.Namespace, name: str, eta: int) -> list[str]:
    """The overrides of one run of the η comparison: a core each for generation
    (``--gen-cpu``) and training (``--train-cpu``); the eval actor shares the trainer's."""
    gen, train = args.gen_cpu, args.train_cpu
    return [
        *common_sets(args, name, eta),
        f"rollout.cpus=[{gen}]",
        f"reward.cpus=[{gen}]",
        f"trainer.cpus=[{train}]",
        f"eval.cpus=[{train}]",
        "rollout.threads=1",
        "trainer.threads=1",
        "eval.threads=1",
        *args.set,
    ]


def run_up(
    args: argparse.Namespace,
    name: str,
    eta: int,
    sets: list[str] | None = None,
    timeout: float | None = None,
) -> float:
    """One ``asyncrl up`` in a subprocess (``sets``: its overrides, default
    :func:`run_sets`); returns its wall seconds. Its output goes to ``<runs>/<name>.log``;
    a failed run stops the bench naming that log. A run still going after ``timeout``
    seconds is stopped as Ctrl-C stops it (its actors stop, its records stay) and marked
    with :data:`STOPPED` in its folder."""
    RUNS.mkdir(parents=True, exist_ok=True)
    recipe = str(args.recipe)
    cmd = [sys.executable, "-m", "asyncrl.entry.cli", "up", recipe, "--overwrite", "--quiet"]
    for s in sets if sets is not None else run_sets(args, name, eta):
        cmd += ["--set", s]
    log = RUNS / f"{name}.log"
    t0 = time.monotonic()
    stopped = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stopped = True
            proc.send_signal(signal.SIGINT)
            try:
                code = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        except BaseException:
            proc.send_signal(signal.SIGINT)  # the bench itself interrupted: stop the run too
            proc.wait(timeout=120)
            raise
    seconds = time.monotonic() - t0
    if stopped:
        (RUNS / name / STOPPED).write_text(json.dumps({"after_s": timeout, "exit": code}))
    elif code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise SystemExit(f"run {name} (η = {eta}) failed with exit {code}; {log}:\n{tail}")
    return seconds


STOPPED = "stopped.json"
"""Written into the folder of a run that ``--run-timeout`` stopped."""


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarise_run(run_dir: Path, process_s: float | None) -> dict[str, Any]:
    """The figures of one finished run, from its run folder; of a run ``--run-timeout``
    stopped, those of the steps it finished (``stopped``: after how many seconds), and 0
    steps/h where it finished fewer than two."""
    recipe = json.loads((run_dir / "recipe.json").read_text())
    steps = read_jsonl(run_dir / "metrics.jsonl")
    evals = read_jsonl(run_dir / "eval.jsonl")
    stopped = json.loads((run_dir / STOPPED).read_text()) if (run_dir / STOPPED).is_file() else None
    if stopped is not None and len(steps) < 2:
        train = [s["time_train_s"] for s in steps]
        return {
            "eta": recipe["buffer"]["max_head_offpolicyness"],
            "steps": len(steps),
            "stopped": stopped["after_s"],
            "process_s": process_s,
            "steps_per_hour": 0.0,
            "train_s_mean": sum(train) / len(train) if train else None,
            "trainer_idle_frac": None,
            "gen_idle_frac": None,
            "accuracy": {},
            "accuracy_final": None,
        }
    if not steps:
        raise SystemExit(f"{run_dir}: no trainer records in metrics.jsonl")
    if len(steps) < 2:
        raise SystemExit(f"{run_dir}: one trainer step; the window needs two (--steps >= 2)")
    first = steps[0]
    start = first["time"] - (
        first["time_wait_batch_s"] + first["time_train_s"] + first["time_weights_s"]
    )
    # the window: steps 2..N. Step 1 holds what both runs do once (the first batch from
    # scratch, the version-0 evaluation beside it); steady-state steps/h excludes it.
    window = steps[-1]["time"] - first["time"]
    wait = sum(s["time_wait_batch_s"] for s in steps[1:])
    idle_first, idle_last = first.get("rollout/idle_s"), steps[-1].get("rollout/idle_s")
    gen_idle = None
    if idle_first is not None and idle_last is not None:
        gen_idle = min(1.0, max(0.0, (idle_last - idle_first) / window))
    rewards = [s["reward_mean"] for s in steps]
    tail = rewards[-max(1, len(rewards) // 4) :]
    accuracy = {int(e["version"]): e["eval/accuracy"] for e in evals if "eval/accuracy" in e}
    return {
        "eta": recipe["buffer"]["max_head_offpolicyness"],
        "max_concurrent": recipe["buffer"]["max_concurrent"],
        "batch_size": recipe["buffer"]["batch_size"],
        "steps": len(steps),
        "wall_s": steps[-1]["time"] - start,
        "window_s": window,
        "process_s": process_s,
        "step1_s": first["time"] - start,
        "steps_per_hour": (len(steps) - 1) / window * 3600,
        "trainer_idle_frac": wait / window,
        "gen_idle_frac": gen_idle,
        "train_s_mean": sum(s["time_train_s"] for s in steps[1:]) / (len(steps) - 1),
        "wait_s_mean": wait / (len(steps) - 1),
        "staleness_mean": sum(s["staleness_mean"] for s in steps) / len(steps),
        "reward_per_step": rewards,
        "reward_mean": sum(rewards) / len(rewards),
        "reward_last_quarter": sum(tail) / len(tail),
        "step_end_s": [s["time"] - start for s in steps],
        "accuracy": accuracy,
        "accuracy_final": accuracy.get(len(steps)),  # None if version N was not scored
        "stopped": stopped["after_s"] if stopped is not None else None,
        "response_tokens": [
            s["response_tokens"]
            for s in read_jsonl(run_dir / "trained_samples.jsonl")
            if "response_tokens" in s
        ],
    }


BULKY = ("checkpoints", "weights", "nats")
"""A finished run's folders that the summary does not read: about 3 GB a run of
SmolLM2 (checkpoints and published weights), removed once it is summarised."""


def prune(run_dir: Path) -> None:
    """Deletes a summarised run's :data:`BULKY` folders (its records stay)."""
    for sub in BULKY:
        shutil.rmtree(run_dir / sub, ignore_errors=True)


def fmt_frac(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def print_run(label: str, r: dict[str, Any]) -> None:
    acc = ", ".join(f"v{v}: {a:.3f}" for v, a in sorted(r["accuracy"].items())) or "none"
    process = "not run here" if r["process_s"] is None else f"{r['process_s']:.0f} s"
    print(
        f"{label:>5} (η = {r['eta']}): {r['steps']} steps in {r['wall_s']:.0f} s (step 1 "
        f"{r['step1_s']:.0f} s, steps 2-{r['steps']} {r['window_s']:.0f} s: "
        f"{r['steps_per_hour']:.0f} steps/h; the whole process {process}); "
        f"train {r['train_s_mean']:.1f} s/step, wait {r['wait_s_mean']:.1f} s/step; "
        f"idle: trainer {fmt_frac(r['trainer_idle_frac'])}, "
        f"generation {fmt_frac(r['gen_idle_frac'])}; staleness {r['staleness_mean']:.2f}"
    )
    rewards = " ".join(f"{x:.2f}" for x in r["reward_per_step"])
    print(f"{'':>7}reward per step: {rewards}")
    print(
        f"{'':>7}reward mean {r['reward_mean']:.3f}, last quarter {r['reward_last_quarter']:.3f}; "
        f"held-out greedy accuracy {acc}"
    )


def verdict(sync: dict[str, Any], asyn: dict[str, Any]) -> str:
    """The speedup, with what it cost (reward, held-out accuracy) said beside it."""
    speedup = asyn["steps_per_hour"] / sync["steps_per_hour"]
    sync_step = 3600 / sync["steps_per_hour"]
    costs = []
    if asyn["reward_last_quarter"] < sync["reward_last_quarter"]:
        costs.append(
            f"reward of the last quarter {asyn['reward_last_quarter']:.3f} vs "
            f"{sync['reward_last_quarter']:.3f}"
        )
    a, s = asyn["accuracy_final"], sync["accuracy_final"]
    if a is not None and s is not None and a < s:
        costs.append(f"held-out accuracy {a:.3f} vs {s:.3f}")
    line = (
        f"summary: async (η = {asyn['eta']}) {asyn['steps_per_hour']:.0f} steps/h vs sync "
        f"{sync['steps_per_hour']:.0f} steps/h: speedup {speedup:.2f}x "
        f"(goal {GOAL_SPEEDUP}x, {'met' if speedup >= GOAL_SPEEDUP else 'NOT met'})"
    )
    line += (
        f"; at a cost: {'; '.join(costs)}"
        if costs
        else "; reward and held-out accuracy equal or better"
    )
    if speedup < GOAL_SPEEDUP:
        line += (
            f". Idle: sync trainer {fmt_frac(sync['trainer_idle_frac'])} / generation "
            f"{fmt_frac(sync['gen_idle_frac'])}, async trainer "
            f"{fmt_frac(asyn['trainer_idle_frac'])} / generation "
            f"{fmt_frac(asyn['gen_idle_frac'])}: async can only hide the shorter of "
            f"generation and training behind the longer; sync's steps took "
            f"{sync_step:.1f} s, {sync['train_s_mean']:.1f} s of them training, so hiding "
            f"all the rest gives at most {sync_step / sync['train_s_mean']:.2f}x at that "
            f"training speed (async trained at {asyn['train_s_mean']:.1f} s/step)"
        )
    return line


def real(args: argparse.Namespace) -> dict[str, Any]:
    runs = {}
    for label, eta in (("sync", 0), ("async", args.eta)):
        if not args.reuse:
            print(f"running {label} (η = {eta}, {args.steps} steps) ...", flush=True)
        process_s = None if args.reuse else run_up(args, label, eta)
        runs[label] = summarise_run(RUNS / label, process_s)
        prune(RUNS / label)
    print_run("sync", runs["sync"])
    print_run("async", runs["async"])
    speedup = runs["async"]["steps_per_hour"] / runs["sync"]["steps_per_hour"]
    return {"runs": runs, "speedup": speedup, "summary": verdict(runs["sync"], runs["async"])}


# -- placements -----------------------------------------------------------------------------------


def placement_candidates(cores: list[int]) -> dict[str, list[str]]:
    """Label -> placement overrides. ``default`` is asyncrl's own rule
    (:mod:`asyncrl.launch.core_placement`: no override at all); the others are placed by hand: disjoint
    splits giving generation k cores, and the shared machine (no pinning) with torch's
    default threads, or with one generation thread and every core for the trainer; and the
    overlapping placement: the trainer on every core, generation pinned to N/4 of them."""
    n = len(cores)
    out: dict[str, list[str]] = {"default": []}
    for k in sorted({1, max(1, n // 4), max(1, n // 2), n - 1}):
        out[f"gen {k} / train {n - k}"] = pinned(cores[:k], cores[k:])
    k = max(1, n // 4)  # overlapping: the trainer on every core, generation on k of them
    out[f"gen {k} / train all {n}"] = pinned(cores[:k], cores)
    out["shared, torch defaults"] = ["run.placement=none"]
    out[f"shared, gen 1 / train {n} threads"] = [
        "run.placement=none",
        "rollout.threads=1",
        "eval.threads=1",
        f"trainer.threads={n}",
    ]
    return out


FINISHED = "bench.json"
"""Written into a placement run's folder once the run has finished and been summarised:
its process seconds and overrides, for ``--resume``."""


def finished_run(run_dir: Path, sets: list[str]) -> float | None:
    """The process seconds of a run that finished with exactly these overrides (read
    from its :data:`FINISHED` file), or None: then it must run (again)."""
    try:
        done = json.loads((run_dir / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    return float(done["process_s"]) if done.get("sets") == sets else None


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def placements(args: argparse.Namespace) -> dict[str, Any]:
    """The async run (η = ``--eta``) under each of :func:`placement_candidates` (or those
    ``--only`` names, with the default always), ``--repeats`` times in rounds; the
    default's median steps/h against the best hand placement's."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("placements: needs two cores or more")
    candidates = {
        i: (label, sets)
        for i, (label, sets) in enumerate(placement_candidates(cores).items())
        if label == "default" or not args.only or any(o in label for o in args.only)
    }
    repeats: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in candidates.values()}
    started, longest = time.monotonic(), 0.0
    total = args.repeats * len(candidates)
    # in rounds, every placement once a round: a slow spell of the machine (another job,
    # a noisy neighbour) then slows one run of each rather than every run of one
    for r in range(args.repeats):
        for i, (label, sets) in candidates.items():
            name = f"place{i}" if r == 0 else f"place{i}-r{r + 1}"
            all_sets = [*common_sets(args, name, args.eta), *sets, *args.set]
            finished = finished_run(RUNS / name, all_sets) if args.resume else None
            if args.reuse or finished is not None:
                process_s = finished
            else:
                if args.time_limit and time.monotonic() - started + longest > args.time_limit:
                    done = sum(map(len, repeats.values()))
                    raise SystemExit(
                        f"--time-limit {args.time_limit:.0f} s: stopped before '{label}' of "
                        f"round {r + 1} ({done} of {total} runs done, the longest "
                        f"{longest:.0f} s); the same command with --resume runs the rest"
                    )
                print(f"running '{label}' (η = {args.eta}, {args.steps} steps, round {r + 1}) ...",
                      flush=True)  # fmt: skip
                process_s = run_up(args, name, args.eta, all_sets, args.run_timeout)
                longest = max(longest, process_s)
            run = summarise_run(RUNS / name, process_s)
            if (RUNS / name / "placement.json").is_file():
                run["placement"] = json.loads((RUNS / name / "placement.json").read_text())
            prune(RUNS / name)
            if process_s is not None:
                (RUNS / name / FINISHED).write_text(
                    json.dumps({"process_s": process_s, "sets": all_sets})
                )
            repeats[label].append(run)
    runs = {label: summarise_repeats(rs) for label, rs in repeats.items()}
    print(
        f"{'placement':<28} {'steps/h':>8} {'train s':>8} {'trainer idle':>13} "
        f"{'gen idle':>9} {'held-out':>9}  steps/h of each run"
    )
    for label, r in runs.items():
        acc = "n/a" if r["accuracy_final"] is None else f"{r['accuracy_final']:.3f}"
        each = " ".join(
            f"{x['steps_per_hour']:.0f}" + ("*" if x.get("stopped") else "") for x in r["repeats"]
        )
        train_s = "n/a" if r["train_s_mean"] is None else f"{r['train_s_mean']:.1f}"
        print(
            f"{label:<28} {r['steps_per_hour']:>8.0f} {train_s:>8} "
            f"{fmt_frac(r['trainer_idle_frac']):>13} {fmt_frac(r['gen_idle_frac']):>9} "
            f"{acc:>9}  {each}"
        )
    if any(x.get("stopped") for r in runs.values() for x in r["repeats"]):
        print(
            f"* stopped by --run-timeout {args.run_timeout:.0f} s: steps/h of the steps it "
            "finished (0 under two)"
        )
    default = runs["default"]
    hand = {k: v for k, v in runs.items() if k != "default"}
    if not hand:
        return {"runs": runs, "summary": "summary: only the default ran (see --only)"}
    best = max(hand, key=lambda k: hand[k]["steps_per_hour"])
    if not hand[best]["steps_per_hour"]:
        return {
            "runs": runs,
            "summary": "summary: no hand placement made two steps (--run-timeout)",
        }
    ratio = default["steps_per_hour"] / hand[best]["steps_per_hour"]
    chosen = default.get("placement", {})
    of = f"median of {args.repeats} runs each" if args.repeats > 1 else "one run each"
    summary = (
        f"summary: the default placement (generation on {chosen.get('generation')}, training "
        f"on {chosen.get('training')}) makes {default['steps_per_hour']:.0f} steps/h, "
        f"{ratio:.0%} of the best hand placement ('{best}', "
        f"{hand[best]['steps_per_hour']:.0f} steps/h; {of}): "
        f"{'within' if ratio >= 0.95 else 'NOT within'} 5%"
    )
    return {"runs": runs, "best_hand": best, "default_ratio": ratio, "summary": summary}


def summarise_repeats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One placement's figures over its repeats: the medians of the timing figures, the
    mean held-out accuracy, every run's own summary under ``repeats``."""
    out = dict(runs[0])
    for key in ("steps_per_hour", "train_s_mean", "trainer_idle_frac", "gen_idle_frac"):
        values = [r[key] for r in runs if r[key] is not None]
        out[key] = median(values) if values else None
    accs = [r["accuracy_final"] for r in runs if r["accuracy_final"] is not None]
    out["accuracy_final"] = sum(accs) / len(accs) if accs else None
    out["steps_per_hour_runs"] = [r["steps_per_hour"] for r in runs]
    out["repeats"] = runs
    return out


# -- simulation -----------------------------------------------------------------------------------


@dataclass
class SimParams:
    steps: int
    batch_size: int
    """B: episodes per trainer step."""
    group_size: int
    slots: int
    """S: sequences the generation server runs at once."""
    token_s: float
    """Seconds per generated token of one sequence (decode step time at any batch ≤ S)."""
    prefill_s: float
    train_s: float
    lengths: list[int] = field(default_factory=list)
    """Response lengths to draw from (uniformly, with replacement)."""
    seed: int = 1


def simulate(p: SimParams, eta: int, max_concurrent: int) -> dict[str, Any]:
    """Event-driven: episodes start while the real staleness manager gives capacity,
    their samples wait for a free slot, an episode is scored when its last sample ends,
    and the trainer takes B admitted episodes (oldest first; stale ones expire) and
    steps for ``train_s``."""
    rng = random.Random(p.seed)
    sm = StalenessManager(p.batch_size, max_concurrent, eta)
    events: list[tuple[float, int, str, Any]] = []
    order = itertools.count()
    now, version = 0.0, 0
    queue: deque[list[Any]] = deque()  # samples waiting for a slot: [episode]
    running = 0  # sequences in slots
    remaining: dict[int, int] = {}  # episode id -> samples not finished
    head: dict[int, int] = {}  # episode id -> version it started under
    ready: deque[int] = deque()  # admitted episodes, oldest first (their head versions)
    trainer_busy = False
    steps_done = 0
    trainer_wait, waiting_since = 0.0, 0.0
    idle_gen, idle_since = 0.0, 0.0
    slot_seconds, last_t = 0.0, 0.0
    step_end: list[float] = []
    stalest: list[float] = []
    episodes = itertools.count()

    def push(t: float, kind: str, payload: Any = None) -> None:
        heapq.heappush(events, (t, next(order), kind, payload))

    def fill() -> None:
        nonlocal running, idle_gen, idle_since
        while sm.capacity() > 0:
            sm.on_start()
            e = next(episodes)
            remaining[e], head[e] = p.group_size, version
            queue.extend([e] for _ in range(p.group_size))
        while queue and running < p.slots:
            (e,) = queue.popleft()
            if running == 0:
                idle_gen += now - idle_since
            running += 1
            push(now + p.prefill_s + rng.choice(p.lengths) * p.token_s, "sample", e)

    def try_train() -> None:
        nonlocal trainer_busy, trainer_wait
        while ready and version - ready[0] > eta:
            ready.popleft()
            sm.expire_accepted()
        if trainer_busy or len(ready) < p.batch_size:
            return
        batch = [ready.popleft() for _ in range(p.batch_size)]
        stalest.append(sum(version - h for h in batch) / len(batch))
        trainer_busy = True
        trainer_wait += now - waiting_since
        push(now + p.train_s, "trained")

    fill()
    while steps_done < p.steps:
        now, _, kind, payload = heapq.heappop(events)
        slot_seconds += running * (now - last_t)
        last_t = now
        if kind == "sample":
            running -= 1
            if running == 0:
                idle_since = now
            e = payload
            remaining[e] -= 1
            if remaining[e] == 0:
                del remaining[e]
                h = head.pop(e)
                if sm.on_scored(h):
                    ready.append(h)
        else:
            trainer_busy = False
            waiting_since = now
            steps_done += 1
            version += 1
            sm.set_version(version)
            step_end.append(now)
        fill()
        try_train()
    if running == 0:
        idle_gen += now - idle_since
    wall = step_end[-1]
    return {
        "eta": eta,
        "max_concurrent": max_concurrent,
        "steps": steps_done,
        "wall_s": wall,
        "steps_per_hour": steps_done / wall * 3600,
        "trainer_idle_frac": trainer_wait / wall,
        "gen_idle_frac": idle_gen / wall,
        "slot_occupancy": slot_seconds / (wall * p.slots),
        "staleness_mean": sum(stalest) / len(stalest),
        "rejected": sm.rejected,
        "step_end_s": step_end,
    }


def lognormal_lengths(median: float, sigma: float, cap: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(cap, round(rng.lognormvariate(math.log(median), sigma)))) for _ in range(n)]


def fitted_lengths(run_dirs: list[Path], n: int, seed: int) -> tuple[list[int], str]:
    """A log-normal fitted (by the mean and spread of log length) to the responses the
    runs trained on, capped at the longest of them."""
    observed = [
        s["response_tokens"]
        for d in run_dirs
        for s in read_jsonl(d / "trained_samples.jsonl")
        if s.get("response_tokens")
    ]
    if len(observed) < 2:
        raise SystemExit(f"--lengths-from: no response_tokens in {[str(d) for d in run_dirs]}")
    logs = [math.log(x) for x in observed]
    mu = sum(logs) / len(logs)
    sigma = math.sqrt(sum((x - mu) ** 2 for x in logs) / (len(logs) - 1))
    source = (
        f"log-normal fitted to {len(observed)} responses of {', '.join(map(str, run_dirs))}: "
        f"median {math.exp(mu):.0f}, σ {sigma:.2f}, cap {max(observed)}"
    )
    return lognormal_lengths(math.exp(mu), sigma, max(observed), n, seed), source


def simulated(args: argparse.Namespace) -> dict[str, Any]:
    if args.lengths_from:
        lengths, source = fitted_lengths(args.lengths_from, 100_000, args.seed)
    else:
        lengths = lognormal_lengths(
            args.len_median, args.len_sigma, args.len_max, 100_000, args.seed
        )
        source = (
            f"log-normal, median {args.len_median:.0f}, σ {args.len_sigma}, cap {args.len_max} "
            "(assumed)"
        )
    p = SimParams(
        steps=args.steps,
        batch_size=args.batch_size,
        group_size=args.group_size,
        slots=args.slots,
        token_s=args.token_ms / 1000,
        prefill_s=args.prefill_s,
        train_s=args.train_s,
        lengths=lengths,
        seed=args.seed,
    )
    mean_len = sum(lengths) / len(lengths)
    print(
        f"SIMULATED (no model, no cluster): S = {p.slots} slots, B = {p.batch_size} episodes "
        f"x {p.group_size} samples, {args.token_ms} ms/token, prefill {p.prefill_s} s, "
        f"train {p.train_s} s/step; lengths: {source}, mean {mean_len:.0f}"
    )
    runs = {
        "sync": simulate(p, 0, args.max_concurrent),
        "async": simulate(p, args.eta, args.max_concurrent),
    }
    for label, r in runs.items():
        print(
            f"{label:>5} (η = {r['eta']}, C = {r['max_concurrent']}): {r['steps']} steps in "
            f"{r['wall_s']:.0f} simulated s ({r['steps_per_hour']:.0f} steps/h); idle: trainer "
            f"{fmt_frac(r['trainer_idle_frac'])}, generation {fmt_frac(r['gen_idle_frac'])}; "
            f"slots busy {r['slot_occupancy']:.0%}; staleness {r['staleness_mean']:.2f}, "
            f"rejected {r['rejected']}"
        )
    speedup = runs["async"]["steps_per_hour"] / runs["sync"]["steps_per_hour"]
    summary = (
        f"summary (SIMULATED): async (η = {args.eta}) {runs['async']['steps_per_hour']:.0f} "
        f"steps/h vs sync {runs['sync']['steps_per_hour']:.0f} steps/h: speedup "
        f"{speedup:.2f}x; throughput only, rewards are not simulated"
    )
    return {
        "simulated": True,
        "params": {**vars(p), "lengths": None, "length_source": source, "mean_len": mean_len},
        "runs": runs,
        "speedup": speedup,
        "summary": summary,
    }


# -- the figure -----------------------------------------------------------------------------------


def plot(result: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    simulated_run = result.get("simulated", False)
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), width_ratios=[2, 1])
    for label, r in runs.items():
        minutes = [t / 60 for t in r["step_end_s"]]
        if simulated_run:
            left.plot(
                minutes, range(1, len(minutes) + 1), marker=".", label=f"{label} η={r['eta']}"
            )
        else:
            acc = r["accuracy_final"]
            tag = f"{label} η={r['eta']}" + (f", held-out {acc:.2f}" if acc is not None else "")
            left.plot(minutes, r["reward_per_step"], marker="o", label=tag)
    left.set_xlabel("wall time (simulated minutes)" if simulated_run else "wall time (minutes)")
    left.set_ylabel("trainer steps done" if simulated_run else "reward per step")
    left.legend()
    left.grid(alpha=0.3)
    labels = list(runs)
    x = range(len(labels))
    right.bar([i - 0.2 for i in x], [runs[k]["trainer_idle_frac"] for k in labels], 0.4)
    right.bar([i + 0.2 for i in x], [runs[k]["gen_idle_frac"] or 0.0 for k in labels], 0.4)
    right.legend(["trainer idle", "generation idle"], loc="upper center", ncol=2)
    right.set_xticks(list(x), labels)
    right.set_ylim(0, 1.15)
    right.set_ylabel("idle fraction" if simulated_run else "idle fraction, steps 2..N")
    title = f"async (η = {runs['async']['eta']}) vs sync: {result['speedup']:.2f}x the steps/h"
    fig.suptitle(("SIMULATED " if simulated_run else "") + title)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


# -- main -----------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--simulate", action="store_true", help="the simulated GPU-cluster regime")
    p.add_argument("--steps", type=int, default=None, help="trainer steps (real 10, sim 50)")
    p.add_argument("--eta", type=int, default=2, help="η of the async run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=None, help="B (real 8, sim 32)")
    p.add_argument("--max-concurrent", type=int, default=None, help="C of the async run")
    real_args = p.add_argument_group("real runs")
    real_args.add_argument("--recipe", type=Path, default=REPO / "recipes" / "quickstart.toml")
    real_args.add_argument("--gen-cpu", type=int, default=0, help="core of rollout and reward")
    real_args.add_argument("--train-cpu", type=int, default=1, help="core of trainer and eval")
    real_args.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts")
    real_args.add_argument(
        "--set", action="append", default=[], help="one more override for both runs"
    )
    real_args.add_argument(
        "--reuse", action="store_true", help="summarise the last real runs again, run nothing"
    )
    real_args.add_argument(
        "--placements",
        action="store_true",
        help="the async run under the default placement and hand placements, not η = 0",
    )
    real_args.add_argument(
        "--repeats", type=int, default=1, help="--placements: runs of each placement, in rounds"
    )
    real_args.add_argument(
        "--only",
        nargs="+",
        default=None,
        help="--placements: the hand placements whose label contains one of these (and the default)",
    )
    real_args.add_argument(
        "--resume",
        action="store_true",
        help="--placements: runs that finished with the same overrides are read, not run again",
    )
    real_args.add_argument(
        "--run-timeout",
        type=float,
        default=None,
        metavar="S",
        help="--placements: stop a run after S seconds (as Ctrl-C does) and count the steps "
        "it finished: a placement that stalls the machine is reported, not waited for",
    )
    real_args.add_argument(
        "--time-limit",
        type=float,
        default=None,
        metavar="S",
        help="--placements: start no run that the longest so far says would end after S "
        "seconds; stops naming what is left (continue with --resume)",
    )
    sim = p.add_argument_group("simulation")
    sim.add_argument("--group-size", type=int, default=8)
    sim.add_argument("--slots", type=int, default=512, help="S: concurrent sequences")
    sim.add_argument("--token-ms", type=float, default=30.0, help="decode ms per token")
    sim.add_argument("--prefill-s", type=float, default=0.2)
    sim.add_argument("--train-s", type=float, default=40.0, help="trainer step seconds")
    sim.add_argument("--len-median", type=float, default=200.0)
    sim.add_argument("--len-sigma", type=float, default=0.7)
    sim.add_argument("--len-max", type=int, default=1024)
    sim.add_argument(
        "--lengths-from", type=Path, nargs="+", default=None, help="fit lengths to run folders"
    )
    args = p.parse_args()
    if args.simulate:
        args.steps = args.steps or 50
        args.batch_size = args.batch_size or 32
        args.max_concurrent = args.max_concurrent or 2 * args.batch_size
    else:
        args.steps = args.steps or 10
        args.batch_size = args.batch_size or 8
        args.max_concurrent = args.max_concurrent or 4 * args.batch_size
    if args.eta < 1 or args.max_concurrent <= args.batch_size:
        p.error("the async run needs --eta >= 1 and --max-concurrent above --batch-size")
    before = machine()
    print(
        f"{before['cpu']}, {before['cpus']} CPUs, load average "
        f"{' '.join(f'{x:.2f}' for x in before['load_average'])} at start",
        flush=True,
    )
    if args.simulate:
        result = simulated(args)
    elif args.placements:
        result = placements(args)
    else:
        result = real(args)
    after = machine()
    print(
        f"load average {' '.join(f'{x:.2f}' for x in after['load_average'])} at the end "
        "(other processes on these cores distort every figure)"
    )
    print(result["summary"])
    RESULTS.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    kind = "-sim" if args.simulate else "-placements" if args.placements else ""
    name = f"async_vs_sync{kind}-{stamp}"
    out = RESULTS / f"{name}.json"
    header = {"machine_start": before, "machine_end": after, "args": vars(args)}
    out.write_text(json.dumps({**header, **result}, indent=2, default=str))
    if args.placements:
        print(f"wrote {out.relative_to(REPO)}")
        return
    plot(result, RESULTS / f"{name}.png")
    print(f"wrote {out.relative_to(REPO)} and {name}.png")


if __name__ == "__main__":
    main()
