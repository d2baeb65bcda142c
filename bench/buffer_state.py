"""The buffer's durable state over a long run: snapshot bytes and the CPU of one write.

    .venv/bin/python bench/buffer_state.py                  # 10k, 50k, 200k groups
    .venv/bin/python bench/buffer_state.py --groups 1000 20000

The buffer writes its state (:func:`~asyncrl.actors.buffer.durable.capture`, then
encoded into the snapshot) after every change, up to 20 times a second, and a restarted
buffer goes on from it. Whatever the state keeps per prompt grows with the run. This
drives the buffer's own lease book and admission, in one process without NATS, through
``--groups`` groups (a lease of one prompt, its whole group of one-sample episodes scored
and admitted; samples of 3 tokens, groups of 2, a dataset of ``--records`` prompts, so
data epochs wrap as in a long run), and prints at each mark the snapshot's size and the
time to capture and encode it (the median of ``--reps``), with the number of complete
prompts and of attempt counts it holds.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from scale import cpu_model  # bench/, beside this script

from asyncrl.actors.buffer.admission import Admission
from asyncrl.actors.buffer.batching import Batcher
from asyncrl.actors.buffer.durable import capture
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook, PromptSource
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import Array, LeaseRequest, Trajectory


def sample(prompt: str, i: int, lease_id: str) -> Trajectory:
    return Trajectory(
        uid=f"{prompt}/{i}",
        prompt_uid=prompt,
        group_index=i,
        group_size=2,
        attempt=lease_id,
        input_ids=Array.of([5, 6, 7], "int32"),
        loss_mask=Array.of([False, True, True], "bool"),
        logprobs=Array.of([0.0, -1.0, -1.0], "float32"),
        versions=Array.of([-1, 0, 0], "int32"),
        reward=float(i),
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, nargs="+", default=[10_000, 50_000, 200_000])
    p.add_argument("--records", type=int, default=7473, help="dataset size (GSM8K's train)")
    p.add_argument("--reps", type=int, default=9)
    args = p.parse_args()
    print(f"{cpu_model()}; dataset of {args.records} prompts")
    print(f"{'groups':>9} {'snapshot bytes':>15} {'write ms':>9} {'complete':>9} {'attempts':>9}")
    sm = StalenessManager(batch_size=32, max_concurrent=1 << 30, max_head_offpolicyness=1 << 30)
    journal = Journal(Path(tempfile.mkdtemp()) / "buffer_events.jsonl")
    records = [{"question": f"q{i}", "answer": str(i)} for i in range(args.records)]
    leases = LeaseBook(PromptSource(records, 1), sm, journal, ttl=30, incarnation="b")
    admission = Admission(sm, leases, journal, group_size=2, dynamic_filter=False)
    batcher = Batcher(admission, sm, journal, batch_size=32)
    request = LeaseRequest(actor_id="r0", max_episodes=1)
    done = 0
    for mark in sorted(args.groups):
        while done < mark:
            lease = leases.grant(request, now=0.0)
            (prompt,) = lease.prompts
            admission.on_scored_group([sample(prompt.uid, i, lease.lease_id) for i in range(2)])
            admission.ready.clear()  # served and trained: the state keeps no group
            done += 1
        times = []
        for _ in range(args.reps):
            t = time.perf_counter()
            data = encode(capture(leases, admission, batcher, epoch=0, weights=None))
            times.append(time.perf_counter() - t)
        print(
            f"{mark:>9,} {len(data):>15,} {1e3 * statistics.median(times):>9.2f}"
            f" {len(admission.completed):>9,} {len(leases.attempts):>9,}"
        )


if __name__ == "__main__":
    main()
