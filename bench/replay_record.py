"""What the step records of ``asyncrl replay`` cost: bytes a step, and how other
compressions would compare, read from real run folders.

    python bench/replay_record.py runs/ci runs/quickstart

Per run: steps recorded, samples and tokens a step, the record file's bytes a step (the
wire codec's bytes through zlib at :data:`~asyncrl.train.replay_log.ZLIB_LEVEL`, as the
trainer writes them), the uncompressed codec bytes, zlib 9 and lzma on the same bytes,
and the milliseconds to pack one record (what the trainer spends a step).
"""

from __future__ import annotations

import argparse
import json
import lzma
import statistics
import time
import zlib
from pathlib import Path

from asyncrl.train.replay_log import pack, read_record, record_path, recorded_steps
from asyncrl.wire.codec import encode

RESULTS = Path(__file__).resolve().parent / "results"


def measure(run_dir: Path) -> dict[str, float]:
    steps = recorded_steps(run_dir)
    if not steps:
        raise SystemExit(f"{run_dir}: no step records")
    rows = []
    for step in steps:
        record = read_record(run_dir, step)
        assert record is not None
        raw = encode(record)
        t0 = time.perf_counter()
        pack(record)
        pack_ms = (time.perf_counter() - t0) * 1e3
        samples = [t for g in record.groups for t in g.samples]
        rows.append(
            {
                "file": record_path(run_dir, step).stat().st_size,
                "raw": len(raw),
                "zlib9": len(zlib.compress(raw, 9)),
                "lzma": len(lzma.compress(raw)),
                "samples": len(samples),
                "tokens": sum(len(t.input_ids) for t in samples),
                "pack_ms": pack_ms,
            }
        )
    out = {k: statistics.mean(r[k] for r in rows) for k in rows[0]}
    out["steps"] = len(steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders")
    args = parser.parse_args()
    print(
        f"{'run':<24}{'steps':>6}{'samples':>9}{'tokens':>8}{'file B':>9}{'codec B':>9}"
        f"{'zlib9 B':>9}{'lzma B':>9}{'pack ms':>9}"
    )
    results = {}
    for run_dir in args.runs:
        m = results[str(run_dir)] = measure(run_dir)
        print(
            f"{run_dir.name:<24}{m['steps']:>6.0f}{m['samples']:>9.0f}{m['tokens']:>8.0f}"
            f"{m['file']:>9.0f}{m['raw']:>9.0f}{m['zlib9']:>9.0f}{m['lzma']:>9.0f}"
            f"{m['pack_ms']:>9.2f}"
        )
    summary = ", ".join(
        f"{Path(r).name} {m['file'] / 1e3:.1f} KB a step" for r, m in results.items()
    )
    print(f"replay records: {summary}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"replay_record-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"runs": results, "summary": summary}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
