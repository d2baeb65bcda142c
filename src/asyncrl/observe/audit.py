"""``asyncrl audit RUN``: checks from a finished run's folder alone that it lost nothing,
trained nothing twice and kept its staleness bound, whatever was killed along the way.

Each check reads what the run wrote as it went, never what an actor says of itself:

- **steps**: ``metrics.jsonl`` holds every step from 1 to the last exactly once, in order,
  and ``replay/`` a record of each step it still keeps (a restarted trainer's steps
  replace the dead one's, so both hold the final lineage);
- **trained_twice**: no sample id appears twice in ``trained_samples.jsonl``;
- **unaccounted**: every prompt the buffer ever leased (``buffer_events.jsonl``) was
  trained, dropped with a counted reason (stale, filtered, failed too often) or is still
  held by the buffer in its final ``stop`` event, which must be there;
- **staleness**: every generated token of every sample in the step records came from a
  version the step could train on. Step ``s`` trains the weights of version ``s − 1``, so
  a sample whose oldest token is of version ``h`` is ``s − 1 − h`` versions old, which
  must lie in ``[0, η + k − 1]`` (η = ``buffer.max_head_offpolicyness``, k =
  ``trainer.update_every``: η bounds *published* versions, which lag the trainer by up
  to k − 1 steps). A negative age is a token from a version the trainer had not reached:
  weights of a lineage a restarted trainer rolled back. Steps whose records were deleted
  (:func:`~asyncrl.train.replay_log.drop_records_through`) are judged from
  ``trained_samples.jsonl``'s ``staleness``.

The reproduction of the run's checkpoints is ``asyncrl replay RUN``'s to check.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.train.replay_log import read_record, recorded_steps

KINDS = ("steps", "trained_twice", "unaccounted", "staleness")
"""The checks of :func:`audit_run`, in the order it runs them."""

DROP_EVENTS = ("reject", "filter", "drop")
"""Buffer events that drop a prompt with a counted reason."""


@dataclass(frozen=True)
class Violation:
    kind: str
    """One of :data:`KINDS`."""
    detail: str


@dataclass
class Audit:
    """What :func:`audit_run` found: the violations, and the counts it checked them on."""

    violations: list[Violation]
    steps: int
    samples: int
    prompts_leased: int
    leases: int
    bound: int

    def of(self, kind: str) -> list[Violation]:
        return [v for v in self.violations if v.kind == kind]

    @property
    def extra_leases(self) -> int:
        """Leases beyond each prompt's first: attempts given up (a lease that expired, an
        actor that died with it) and made again."""
        return self.leases - self.prompts_leased


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a run's JSONL record ``path`` ([] when there is none): a line a
    killed writer cut short is skipped, as is anything not an object."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed process, or a blank one
        if isinstance(row, dict):
            rows.append(row)
    return rows


def staleness_bound(run_dir: Path) -> int:
    """η + k − 1 of the run's recipe (see the module)."""
    recipe = json.loads((run_dir / "recipe.json").read_text())
    eta = int(recipe["buffer"]["max_head_offpolicyness"])
    return eta + int(recipe["trainer"].get("update_every", 1)) - 1


def _steps(run_dir: Path, out: list[Violation]) -> int:
    steps = [int(m["step"]) for m in read_jsonl(run_dir / "metrics.jsonl")]
    last = max(steps, default=0)
    if steps != list(range(1, last + 1)):
        counts = Counter(steps)
        twice = sorted(s for s, n in counts.items() if n > 1)
        missing = sorted(set(range(1, last + 1)) - set(counts))
        out.append(
            Violation("steps", f"metrics.jsonl: steps recorded twice {twice}, missing {missing}")
        )
    records = recorded_steps(run_dir)
    if records and records != list(range(records[0], last + 1)):
        out.append(
            Violation("steps", f"replay/ holds records of {records}, not {records[0]}..{last}")
        )
    return last


def _trained_twice(samples: list[dict[str, Any]], out: list[Violation]) -> None:
    twice = sorted(uid for uid, n in Counter(s["uid"] for s in samples).items() if n > 1)
    if twice:
        out.append(Violation("trained_twice", f"{len(twice)} samples, e.g. {twice[:5]}"))


def _unaccounted(
    run_dir: Path, samples: list[dict[str, Any]], out: list[Violation]
) -> tuple[int, int]:
    events = read_jsonl(run_dir / "buffer_events.jsonl")
    leases = [e["prompt"] for e in events if e["event"] == "lease"]
    if not events or events[-1]["event"] != "stop":
        out.append(Violation("unaccounted", "the buffer did not stop cleanly at the end"))
        return len(set(leases)), len(leases)
    final = events[-1]
    trained = {s["prompt_uid"] for s in samples}
    dropped = {e["prompt"] for e in events if e["event"] in DROP_EVENTS}
    held = {*final["leased"], *final["pool"], *final["ready"], *final["partial"]}
    lost = sorted(set(leases) - trained - dropped - held)
    if lost:
        out.append(
            Violation(
                "unaccounted",
                f"{len(lost)} prompts neither trained, dropped nor held, e.g. {lost[:5]}",
            )
        )
    return len(set(leases)), len(leases)


def _staleness(
    run_dir: Path, samples: list[dict[str, Any]], bound: int, out: list[Violation]
) -> None:
    records = set(recorded_steps(run_dir))
    bad: list[str] = []
    for step in sorted(records):
        record = read_record(run_dir, step)
        if record is None:  # pruned between the listing and the read
            continue
        for group in record.groups:
            for t in group.samples:
                versions = t.versions.numpy()[t.loss_mask.numpy() > 0]
                versions = versions[versions >= 0]
                if versions.size == 0:
                    continue  # no generated token: nothing trained
                age = step - 1 - int(np.min(versions))
                if not 0 <= age <= bound:
                    bad.append(f"{t.uid} at step {step}: {age} versions old")
    for s in samples:  # steps whose records are gone
        if s["step"] not in records and s.get("staleness") is not None:
            if not 0 <= s["staleness"] <= bound:
                bad.append(f"{s['uid']} at step {s['step']}: {s['staleness']} versions old")
    if bad:
        out.append(
            Violation("staleness", f"{len(bad)} samples outside [0, {bound}], e.g. {bad[:3]}")
        )


def audit_run(run_dir: Path) -> Audit:
    """Runs every check of the module on the run folder ``run_dir``."""
    out: list[Violation] = []
    samples = read_jsonl(run_dir / "trained_samples.jsonl")
    bound = staleness_bound(run_dir)
    steps = _steps(run_dir, out)
    _trained_twice(samples, out)
    prompts, leases = _unaccounted(run_dir, samples, out)
    _staleness(run_dir, samples, bound, out)
    return Audit(out, steps, len(samples), prompts, leases, bound)


def audit(run_dir: Path) -> int:
    """``asyncrl audit RUN``: prints each check's verdict; 0 when all hold, else 1."""
    if not (run_dir / "recipe.json").is_file():
        print(f"{run_dir} is not a run folder (no recipe.json)")
        return 1
    result = audit_run(run_dir)
    print(
        f"{run_dir}: {result.steps} steps, {result.samples} trained samples, "
        f"{result.prompts_leased} prompts leased ({result.extra_leases} leases again), "
        f"staleness bound {result.bound}"
    )
    for kind in KINDS:
        found = result.of(kind)
        print(f"  {kind:<14} {'ok' if not found else 'VIOLATED'}")
        for v in found:
            print(f"    {v.detail}")
    return 1 if result.violations else 0
