"""``asyncrl replay RUN [--from CKPT] [--until STEP]``: trains a run again from its step
records and says whether its weights come out bit for bit as the run's checkpoints
recorded them.

The process is made to run as the run's trainer did before torch is imported, since a
float sum's order, and so its last bits, can hang on each of these: the allocator
(mimalloc re-executes this command with it preloaded, as the trainer process did), the
torch threads (a reduction split over another number of threads adds in another order)
and the world size (a run of N trainer ranks is replayed by N ranks, started here by
torchrun, which run this module). What each record says the trainer had is what the
replay takes (:class:`~asyncrl.wire.messages.TrainedBatch`).

Exit status: 0 when every checkpoint in the range and every step's statistics matched, 1
when one differs, a record is missing or the replay cannot start.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncrl.entry.cli import add_replay_args
from asyncrl.runtime.allocator import loaded_mimalloc, mimalloc_preload, use_mimalloc
from asyncrl.runtime.cores import THREADS_ENV
from asyncrl.train.replay_log import ReplayError, ReplayPlan, plan_replay
from asyncrl.train.torchrun import rank_main, torchrun_argv

VERDICT_ENV = "ASYNCRL_REPLAY_VERDICT"
"""A file where rank 0 of a replay under torchrun leaves its exit status: the ranks
themselves end with 0, so that a checkpoint that differs is not reported by torchrun as a
failed rank."""


def replay(
    run_dir: Path, start_from: str | None, until: int | None, export: str | None = None
) -> int:
    """Replays the run at ``run_dir`` (see the module); returns the exit status. Where the
    run's trainer had mimalloc, this executes the command again under it first (as
    :func:`~asyncrl.runtime.allocator.use_mimalloc`), so call it from the command line's
    process only."""
    try:
        plan = plan_replay(run_dir, start_from, until)
    except ReplayError as exc:
        print(f"asyncrl replay: {exc}", file=sys.stderr)
        return 1
    first = plan.first
    if first.world_size > 1 and "RANK" not in os.environ:
        return _launch_ranks(plan, start_from, export)
    if first.allocator == "mimalloc" and not loaded_mimalloc():
        why = use_mimalloc()  # returns only where it cannot
        print(
            f"asyncrl replay: warning: the run's trainer had mimalloc, this {why}", file=sys.stderr
        )
    elif first.allocator != "mimalloc" and loaded_mimalloc():
        print(
            "asyncrl replay: warning: the run's trainer had the C library's malloc, this mimalloc",
            file=sys.stderr,
        )
    os.environ[THREADS_ENV] = os.environ["OMP_NUM_THREADS"] = str(first.threads)
    from asyncrl.train.replay import replay_rank  # noqa: PLC0415 - imports torch, after the allocator and threads are set

    code = replay_rank(plan, sys.stdout, export)
    if (verdict := os.environ.get(VERDICT_ENV)) and int(os.environ.get("RANK", "0")) == 0:
        Path(verdict).write_text(str(code))
        return 0
    return code


def _launch_ranks(plan: ReplayPlan, start_from: str | None, export: str | None) -> int:
    """Runs the replay in ``world_size`` ranks on this machine (torchrun, one node), each
    with the run's threads and allocator; returns rank 0's verdict."""
    args = [str(plan.run_dir), "--until", str(plan.until)]
    if start_from is not None:
        args += ["--from", start_from]
    if export is not None:
        args += ["--export", export]
    argv = torchrun_argv(["-m", "asyncrl.entry.replay", *args], nproc=plan.first.world_size)
    with tempfile.TemporaryDirectory(prefix="asyncrl-replay-") as tmp:
        verdict = Path(tmp) / "verdict"
        env = {**os.environ, VERDICT_ENV: str(verdict)}
        env[THREADS_ENV] = env["OMP_NUM_THREADS"] = str(plan.first.threads)
        if plan.first.allocator == "mimalloc":
            env.update(mimalloc_preload())
        done = subprocess.run(argv, env=env, check=False)
        if done.returncode != 0 or not verdict.is_file():
            print(
                f"asyncrl replay: the trainer ranks failed (exit {done.returncode})",
                file=sys.stderr,
            )
            return 1
        return int(verdict.read_text())


def main(argv: list[str] | None = None) -> int:
    """A rank of a replay under torchrun (:func:`_launch_ranks`)."""
    parser = argparse.ArgumentParser(prog="asyncrl-replay")
    add_replay_args(parser)
    args = parser.parse_args(argv)
    return replay(args.run, args.start_from, args.until, args.export)


if __name__ == "__main__":
    rank_main(main)
