"""The buffer's durable state over a long run: snapshot bytes and the CPU of one write.

    .venv/bin/python bench/buffer_state.py                  # 10k, 50k, 200k groups
    .venv/bin/python bench/buffer_state.py --groups 1000 20000 --actors 8 64

The buffer writes its state (:func:`~asyncrl.actors.buffer.durable.capture`, then
encoded into the snapshot) after every change, up to 20 times a second, and a restarted
buffer goes on from it. Whatever the state keeps per prompt grows with the run. This
drives the buffer's own lease book and admission, in one process without NATS, through
``--groups`` groups (a lease of one prompt, its whole group of one-sample episodes scored
and admitted; samples of 3 tokens, groups of 2, a dataset of ``--records`` prompts, so
data epochs wrap as in a long run), and prints at each mark the snapshot's size and the
time to capture and encode it (the median of ``--reps``), with the number of complete
prompts and of attempt counts it holds.

Then the state with episodes out: the prompt records of `recipes/gsm8k.toml` (GSM8K's
train split, from ``../shared/data``), a staleness
budget at ``B = 32`` groups and ``η = 2`` (96 prompts out at most), and ``--actors`` actors
asking for 4 episodes each in turn until the budget is spent, each actor's last answer
kept (as a repeated request gets it again): the snapshot's size and write time, and how
many bytes of it are prompt records.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flops import cpu_line  # bench/, beside this script

from asyncrl.actors.buffer.admission import Admission
from asyncrl.actors.buffer.batching import Batcher
from asyncrl.actors.buffer.durable import capture
from asyncrl.actors.buffer.journal import Journal
from asyncrl.actors.buffer.leases import LeaseBook, PromptSource
from asyncrl.config.recipe import load_recipe
from asyncrl.data import load_prompt_records
from asyncrl.runtime.staleness import StalenessManager
from asyncrl.wire.codec import encode
from asyncrl.wire.messages import Array, LeaseRequest, Prompt, Trajectory


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
    p.add_argument("--actors", type=int, nargs="+", default=[8, 64, 256])
    args = p.parse_args()
    print(f"{cpu_line()}; dataset of {args.records} prompts")
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
        data, ms = timed_write(leases, admission, batcher, args.reps)
        print(
            f"{mark:>9,} {len(data):>15,} {ms:>9.2f}"
            f" {len(admission.completed):>9,} {len(leases.attempts):>9,}"
        )
    episodes_out(args.actors, args.reps)


def episodes_out(counts: list[int], reps: int) -> None:
    repo = Path(__file__).resolve().parents[1]
    data = repo.parent / "shared" / "data" / "gsm8k" / "train.jsonl"
    recipe = load_recipe(
        repo / "recipes" / "gsm8k.toml",
        ["data.type=jsonl", f"data.path={data}", "model.path=smollm2-135m-instruct"],
        here=False,
    )
    records = load_prompt_records(recipe)
    size = statistics.mean(len(encode_record(r)) for r in records[:500])
    print(f"\nepisodes out: the GSM8K recipe's {len(records)} prompt records ({size:.0f} B each)")
    print(f"{'actors':>7} {'leased':>7} {'answers':>8} {'snapshot bytes':>15} {'write ms':>9}")
    for actors in counts:
        sm = StalenessManager(batch_size=32, max_concurrent=4096, max_head_offpolicyness=2)
        journal = Journal(Path(tempfile.mkdtemp()) / "buffer_events.jsonl")
        leases = LeaseBook(PromptSource(records, 1), sm, journal, ttl=30, incarnation="b")
        admission = Admission(sm, leases, journal, group_size=8, dynamic_filter=False)
        batcher = Batcher(admission, sm, journal, batch_size=32)
        k = 0
        while sm.capacity() > 0:
            who = f"r{k % actors}"
            leases.grant(LeaseRequest(actor_id=who, max_episodes=4, request_id=f"q{k}"), 0.0)
            k += 1
        data, ms = timed_write(leases, admission, batcher, reps)
        print(
            f"{actors:>7} {len(leases.leased):>7} {len(leases.answers):>8} {len(data):>15,}"
            f" {ms:>9.2f}"
        )


def timed_write(
    leases: LeaseBook, admission: Admission, batcher: Batcher, reps: int
) -> tuple[bytes, float]:
    """The snapshot a write makes now, and the median ms of its capture and encoding."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        data = encode(capture(leases, admission, batcher, epoch=0, weights=None))
        times.append(time.perf_counter() - t)
    return data, 1e3 * statistics.median(times)


def encode_record(record: dict[str, Any]) -> bytes:
    return encode(Prompt(uid="e0-0", data=record))


if __name__ == "__main__":
    main()
