"""Actors forked from one process that imported once, against each a fresh interpreter:
whole ``asyncrl up`` runs of a recipe, the two ways in turns.

    .venv/bin/python bench/startup.py                       # recipes/ci.toml, 3 rounds
    .venv/bin/python bench/startup.py --rounds 2 --recipe recipes/quickstart.toml \\
        --set trainer.max_steps=8 --set eval.every=0       # the quickstart, 8 steps

Per run: its wall time; the CPU time of ``up`` and everything it waited for (its actors,
the fork server, nats-server: ``RUSAGE_CHILDREN`` around the run); the seconds from ``up``'s
first line to "all actors started" in its ``up.log``; and where the run writes
``metrics.jsonl``, its steps/h over steps 2..N. ``run.actor_start`` is ``exec`` for one way
and ``auto`` for the other (on a machine without a GPU: forked), nothing else changes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the scripts beside this one
from flops import cpu_line

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
WAYS = ("exec", "auto")


def stamp(line: str) -> float:
    return datetime.fromisoformat(line.split(" ", 1)[0]).timestamp()


def run_once(recipe: Path, sets: list[str], way: str, parent: Path, name: str) -> dict[str, float]:
    flags = [f"run.dir={parent}", f"run.name={name}", f"run.actor_start={way}", *sets]
    argv = [sys.executable, "-m", "asyncrl.entry.cli", "up", str(recipe), "--quiet"]
    argv += [x for s in flags for x in ("--set", s)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{way} run failed ({proc.returncode}): {proc.stderr[-2000:]}")
    run_dir = parent / name
    lines = (run_dir / "logs" / "up.log").read_text().splitlines()
    first = stamp(lines[0])
    started = next(stamp(x) for x in lines if "all actors started" in x)
    out = {
        "wall_s": wall,
        "cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "to_started_s": started - first,
    }
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(x) for x in metrics.read_text().splitlines()] if metrics.is_file() else []
    steps = [m for m in records if "step" in m and "time" in m]
    if len(steps) > 2:
        out["steps_per_h"] = 3600 * (len(steps) - 1) / (steps[-1]["time"] - steps[0]["time"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", type=Path, default=REPO / "recipes" / "ci.toml")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    quiet = ["run.plots=false", "run.tensorboard=false"]
    print(
        f"{cpu_line()}, {os.cpu_count()} CPUs; "
        f"{args.recipe.name} {' '.join(args.sets)}; {args.rounds} rounds, the two ways in turns"
    )
    rows: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp:
        for r in range(args.rounds):
            for way in WAYS:
                row = run_once(args.recipe, [*quiet, *args.sets], way, Path(tmp), f"{way}{r}")
                rows[way].append(row)
                print(
                    f"round {r + 1} {way:>4}: wall {row['wall_s']:6.1f} s  cpu {row['cpu_s']:6.1f} s"
                    f"  to all started {row['to_started_s']:5.1f} s"
                    + (f"  {row['steps_per_h']:6.0f} steps/h" if "steps_per_h" in row else ""),
                    flush=True,
                )

    def med(way: str, key: str) -> float:
        values = [r[key] for r in rows[way] if key in r]
        return statistics.median(values) if values else float("nan")

    print("\nmedians      executed   forked   forked/executed")
    for key in ("wall_s", "cpu_s", "to_started_s", "steps_per_h"):
        e, f = med("exec", key), med("auto", key)
        print(f"{key:<12} {e:9.1f} {f:8.1f}   {f / e:6.2f}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / f"startup-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"recipe": str(args.recipe), "sets": args.sets, "runs": rows}))
    print(f"wrote {out.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
