"""End to end: ``asyncrl up recipes/ci.toml`` as a user runs it, with real processes, a real
nats-server, a real (tiny) model, FSDP training and weight updates.

Each test starts a whole run (a few tens of seconds on two cores)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from e2e_kit import REPO, cli, run, running_up, up_args

from asyncrl.launch.core_placement import split_cores
from asyncrl.runtime.allocator import wheel_platform
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.train.checkpoint import latest_checkpoint_meta
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects

pytestmark = pytest.mark.slow

RUN_TIMEOUT = 420.0


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def connect(run_dir: Path) -> Bus:
    return await Bus.connect(nats_info_for_run(run_dir), name="test")


async def wait_for_step(bus: Bus, run_dir: Path, step: int) -> None:
    """Returns once the trainer has finished ``step`` (event-driven, via its metrics)."""
    reached = asyncio.Event()

    async def on_metrics(m: Metrics) -> None:
        if m.step >= step:
            reached.set()

    await bus.subscribe(Subjects(run_dir.name).metrics("trainer"), Metrics, on_metrics)
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists() and len(read_jsonl(metrics)) >= step:
        return
    await asyncio.wait_for(reached.wait(), RUN_TIMEOUT)


def check_staleness_and_uniqueness(run_dir: Path, eta: int) -> list[dict[str, Any]]:
    trained = read_jsonl(run_dir / "trained_samples.jsonl")
    assert trained, "no sample was trained"
    too_stale = [t for t in trained if t["trained_version"] - t["head_version"] > eta]
    assert not too_stale, f"samples beyond η={eta}: {too_stale[:3]}"
    uids = Counter(t["uid"] for t in trained)
    assert max(uids.values()) == 1, f"trained twice: {[u for u, c in uids.items() if c > 1][:5]}"
    steps_of_prompt: dict[str, set[int]] = {}
    for t in trained:
        steps_of_prompt.setdefault(t["prompt_uid"], set()).add(t["step"])
    assert all(len(s) == 1 for s in steps_of_prompt.values()), "a group was split over steps"
    return trained


async def test_ci_recipe_learns_within_the_staleness_bound(tmp_path: Path) -> None:
    steps = 16
    code, out = await run(up_args(tmp_path, "ci"))
    assert code == 0, out
    run_dir = tmp_path / "ci"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.2, f"reward did not rise: {rewards}"
    for key in (
        "accepted",
        "rejected",
        "staleness_mean",
        "staleness_max",
        "samples_per_s",
        "tokens_per_s",
        "loss",
        "grad_norm",
        "time_train_s",
    ):
        assert key in metrics[-1], key
    trained = check_staleness_and_uniqueness(run_dir, eta=1)
    recipe = json.loads((run_dir / "recipe.json").read_text())
    batch = recipe["buffer"]["batch_size"] * recipe["rollout"]["group_size"]
    assert len(trained) == steps * batch
    assert (run_dir / "checkpoints" / "latest.json").is_file()
    trainer_log = (run_dir / "logs" / "trainer-0.log").read_text()
    if wheel_platform():
        # a CPU trainer runs under mimalloc (asyncrl.runtime.allocator), mapped, not just asked
        assert "memory allocator allocator=mimalloc" in trainer_log, trainer_log[:3000]
    assert oct((run_dir / "nats.json").stat().st_mode & 0o777) == "0o600"
    # on a CPU machine every actor is a fork of one process that imported once
    up_log = (run_dir / "logs" / "up.log").read_text()
    for actor in ("buffer-0", "reward-0", "rollout-0", "trainer-0"):
        assert f"forked actor={actor} " in up_log, up_log[-3000:]
    # the recipe pins nothing, so up placed generation and training by asyncrl.launch.core_placement's rule
    # where it may use two cores or more, and each process applied it
    if len(os.sched_getaffinity(0)) >= 2:
        placed = json.loads((run_dir / "placement.json").read_text())
        gen, train = split_cores(sorted(os.sched_getaffinity(0)))
        assert (placed["generation"], placed["training"]) == (gen, train), placed
        # a trainer pool on generation's cores is told to let its idle workers sleep
        assert placed["passive"] == (["trainer"] if set(gen) & set(train) else []), placed
        assert f"cpus={placed['training']}" in trainer_log, "the trainer was not placed"
        assert f"cpus={placed['generation']}" in (run_dir / "logs" / "rollout-0.log").read_text()


async def test_ppo_minibatches_clip_and_still_learn(tmp_path: Path) -> None:
    """Four optimizer steps per batch: the later ones see a policy that moved away from the
    proximal one, so the clip acts; the version still advances once per batch. A small KL
    penalty to the initial policy rides along (the trainer holds the reference model)."""
    steps = 24  # more than the ci recipe's 16: a run whose first steps go sideways has time
    code, out = await run(
        up_args(
            tmp_path,
            "mb4",
            f"trainer.max_steps={steps}",
            "trainer.ppo_minibatches=4",
            "trainer.loss.kl_coef=0.001",
            # Half the recipe's 1e-2: with four optimizer steps a batch at 1e-2, one CI run
            # lost the answer it had learned (reward 1.0 at versions 15-19, 0.0 from 20 on,
            # while its gradient norms were 0.003-0.02). At 5e-3 12 runs of 12 rose by
            # 0.77-0.95, the clip acting in 14-20 of their 17-22 steps with a signal.
            "trainer.optim.lr=5e-3",
        )
    )
    assert code == 0, out
    metrics = read_jsonl(tmp_path / "mb4" / "metrics.jsonl")
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert all(m["train/optimizer_steps"] == 4 for m in metrics)
    # The clip can act only where some advantage is non-zero: once every group scores all
    # ones (this run may converge within a dozen steps) there is nothing left to clip.
    with_signal = [m["clip_frac"] for m in metrics if m["adv_abs_mean"] > 0]
    assert len(with_signal) >= 4, f"hardly a step with a learning signal: {with_signal}"
    clipped = sum(c > 0 for c in with_signal)
    assert clipped >= len(with_signal) / 2, f"the clip hardly acted: {with_signal}"
    assert all(0 <= m["clip_frac"] <= 1 for m in metrics)
    # k3 is never negative; it is 0 only until the first optimizer step moves the policy
    assert all(m["kl"] >= 0 for m in metrics) and max(m["kl"] for m in metrics) > 0
    rewards = [m["reward_mean"] for m in metrics]
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last >= first + 0.2, f"reward did not rise: {rewards}"
    check_staleness_and_uniqueness(tmp_path / "mb4", eta=1)


async def test_an_attached_rollout_actor_gets_leases_and_is_trained_on(tmp_path: Path) -> None:
    """A rollout actor attached to a live run gets leases and its samples are trained on.

    The run has no step budget worth the name: the test stops it (SIGTERM, as Ctrl-C in a
    terminal) once the attached actor's samples reached the trainer, so the outcome does not
    hang on how fast this machine steps compared with how fast the extra actor starts."""
    extra: asyncio.subprocess.Process | None = None
    async with running_up(
        tmp_path,
        "attach",
        "trainer.max_steps=100000",
        "rollout.max_concurrent=4",
        "rollout.sampling.max_new_tokens=32",
    ) as up:
        run_dir = up.run_dir
        bus = await connect(run_dir)
        try:
            await wait_for_step(bus, run_dir, 2)
            code, status = await run(cli("status", "--run", str(run_dir)), limit=60)
            assert code == 0, status
            for actor in ("buffer-0", "reward-0", "rollout-0", "trainer-0"):
                assert actor in status
            code, out = await run(
                cli(
                    "metrics", "--run", str(run_dir), "--json", "--role", "trainer", "--count", "1"
                ),
                limit=120,
            )
            assert code == 0, out
            record = json.loads(out.strip().splitlines()[-1])
            assert record["role"] == "trainer" and "reward_mean" in record
            extra = await asyncio.create_subprocess_exec(
                *cli("attach", "rollout", "--run", str(run_dir), "--actor-id", "extra"),
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                cwd=REPO,
            )
            await wait_until_trained_from(bus, run_dir, "extra", extra)
        finally:
            await bus.close()
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.proc.wait(), 120) == 0
        out_b, _ = await asyncio.wait_for(extra.communicate(), 120)
        assert extra.returncode == 0, out_b.decode()  # it stops with the run, cleanly
    # the attached actor names the run folder: a failed test kills it with the run
    events = read_jsonl(run_dir / "buffer_events.jsonl")
    assert any(e["event"] == "lease" and e["actor"] == "extra" for e in events)
    trained = check_staleness_and_uniqueness(run_dir, eta=1)
    assert any(t["actor_id"] == "extra" for t in trained)


async def wait_until_trained_from(
    bus: Bus, run_dir: Path, actor: str, proc: asyncio.subprocess.Process
) -> None:
    """Returns once a trained sample came from ``actor``; checked after every trainer step."""
    stepped = asyncio.Event()

    async def on_metrics(m: Metrics) -> None:
        stepped.set()

    await bus.subscribe(Subjects(run_dir.name).metrics("trainer"), Metrics, on_metrics)
    samples = run_dir / "trained_samples.jsonl"
    async with asyncio.timeout(RUN_TIMEOUT):
        while not any(t["actor_id"] == actor for t in read_jsonl(samples)):
            assert proc.returncode is None, f"{actor} exited with code {proc.returncode}"
            stepped.clear()
            await stepped.wait()


def outstanding_leases(run_dir: Path, actor: str) -> set[str]:
    """Prompts leased to ``actor`` that have not finished yet, from the buffer's log."""
    path = run_dir / "buffer_events.jsonl"
    if not path.exists():
        return set()
    events = [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")]
    leased = {e["prompt"] for e in events if e["event"] == "lease" and e["actor"] == actor}
    done = {e["prompt"] for e in events if e["event"] in ("admit", "reject", "filter", "return")}
    return leased - done


async def test_kill_9_of_a_rollout_actor_loses_no_prompt(tmp_path: Path) -> None:
    async with running_up(
        tmp_path,
        "kill",
        # no step budget worth the name: the test stops the run (SIGTERM) once the killed
        # actor's leases came back, however fast this machine steps
        "trainer.max_steps=100000",
        "rollout.actors=2",
        "rollout.lease_ttl=3",
        "rollout.sampling.max_new_tokens=48",  # episodes long enough to kill one mid-way
        "buffer.max_head_offpolicyness=2",
    ) as up:
        run_dir = up.run_dir
        bus = await connect(run_dir)
        victim: asyncio.Future[ActorInfo] = asyncio.get_running_loop().create_future()

        async def on_beat(info: ActorInfo) -> None:
            if info.actor_id == "rollout-1" and not victim.done():
                victim.set_result(info)

        try:
            await bus.subscribe(Subjects("kill").heartbeat("rollout"), ActorInfo, on_beat)
            await wait_for_step(bus, run_dir, 2)
            info = await asyncio.wait_for(victim, 30)
        finally:
            await bus.close()
        async with asyncio.timeout(120):
            # kill it while it holds episodes: the buffer's log says what it holds
            while not outstanding_leases(run_dir, "rollout-1"):  # noqa: ASYNC110 - another process's log
                await asyncio.sleep(0.02)
        os.kill(info.pid, signal.SIGKILL)
        async with asyncio.timeout(RUN_TIMEOUT):
            # its leases expire (lease_ttl) and return to the pool; a replacement starts
            while (
                outstanding_leases(run_dir, "rollout-1")
                or not (run_dir / "logs" / "rollout-1-r1.log").is_file()
            ):
                assert up.proc.returncode is None, "the run ended before the leases came back"
                await asyncio.sleep(0.1)
        up.proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(up.proc.wait(), 120) == 0

    events = read_jsonl(run_dir / "buffer_events.jsonl")
    finished = {e["prompt"] for e in events if e["event"] in ("admit", "reject", "filter")}
    leased_to_victim = {
        e["prompt"] for e in events if e["event"] == "lease" and e["actor"] == "rollout-1"
    }
    returned = {e["prompt"] for e in events if e["event"] == "return" and e["actor"] == "rollout-1"}
    assert leased_to_victim, "the killed actor never held a lease"
    lost = leased_to_victim - finished - returned
    assert not lost, f"prompts of the killed actor neither finished nor returned: {lost}"
    assert returned, "the killed actor's unfinished prompts were not returned"
    final = events[-1]
    assert final["event"] == "stop"
    for uid in returned - finished:
        later = [
            e
            for e in events
            if e["event"] == "lease" and e["prompt"] == uid and e["actor"] != "rollout-1"
        ]
        assert later or uid in final["pool"] or uid in final["leased"], f"{uid} vanished"
    check_staleness_and_uniqueness(run_dir, eta=2)
    assert (run_dir / "logs" / "rollout-1-r1.log").is_file(), "no replacement actor"


async def test_resume_continues_version_and_accounting(tmp_path: Path) -> None:
    # the file transport: a step that publishes and checkpoints exports its weights once
    code, out = await run(
        up_args(
            tmp_path,
            "resume",
            "trainer.max_steps=6",
            "trainer.checkpoint_every=3",
            "weights.transport=dir",
            # executed actors here, forked ones in the resumed run: the replay below then
            # shows a forked trainer computes bit for bit what an executed one does
            "run.actor_start=exec",
        )
    )
    assert code == 0, out
    run_dir = tmp_path / "resume"
    assert "spawned actor=trainer-0 " in (run_dir / "logs" / "up.log").read_text()
    latest = latest_checkpoint_meta(run_dir)
    assert latest is not None and (latest["step"], latest["version"]) == (6, 6)
    # step 6 published and checkpointed its weights, exported once: the same file twice
    published = run_dir / "weights" / "e0-v000006" / "model.safetensors"
    kept = Path(latest["path"]) / "hf" / "model.safetensors"
    assert kept.stat().st_ino == published.stat().st_ino
    code, out = await run(
        [
            *up_args(tmp_path, "resume", "trainer.max_steps=10", "trainer.checkpoint_every=3"),
            "--resume",
        ]
    )
    assert code == 0, out
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert [m["version"] for m in metrics] == list(range(1, 11))
    recipe = json.loads((run_dir / "recipe.json").read_text())
    b = recipe["buffer"]["batch_size"]
    # accepted restarts at v·B = 6·B, then grows by at least B per step
    assert metrics[6]["accepted"] >= 7 * b
    assert "resumed" in (run_dir / "logs" / "buffer-0.log").read_text()
    trained = check_staleness_and_uniqueness(run_dir, eta=1)
    assert {t["step"] for t in trained} == set(range(1, 11))
    # the two trainers' steps replay as one: steps 1-6 under max_steps 6 (which the
    # constant learning rate does not see), then the resumed 7-10, across the restore
    code, out = await run(cli("replay", str(run_dir)))
    assert code == 0 and "4 of 4 checkpoints identical (steps 3, 6, 9, 10)" in out, out
    assert "step 1: trained under other settings" in out, out


async def test_a_trainer_across_two_torchrun_nodes_and_weights_through_the_object_store(
    tmp_path: Path,
) -> None:
    """``trainer.nodes = 2``: two torchrun processes (one rank each) joined by a c10d
    rendezvous on loopback; one global rank 0 is the trainer actor, the other rank follows
    it, and the weights reach the rollout through the object store. The numbers are checked
    against one node in test_train_distributed (fixed batches); here the run."""
    code, out = await run(
        up_args(
            tmp_path,
            "nodes",
            "trainer.max_steps=4",
            "trainer.nodes=2",
            "weights.transport=object_store",
        )
    )
    assert code == 0, out
    run_dir = tmp_path / "nodes"
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["version"] for m in metrics] == [1, 2, 3, 4]
    logs = [run_dir / "logs" / f"{name}.log" for name in ("trainer-0", "trainer-0-node1")]
    leads = ["started actor=trainer-0" in log.read_text() for log in logs]
    assert sorted(leads) == [False, True], "exactly one node holds the trainer actor"
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    # step 4 trains at version 3 with η = 1: its samples came from weights v2 or later,
    # which the rollout actor can only have fetched from the object store
    assert re.search(r"weights updated .*version=2\b", rollout_log), rollout_log[-2000:]
    check_staleness_and_uniqueness(run_dir, eta=1)


def started_pid(log: Path) -> int:
    """The pid an actor's log says it started with."""
    found = re.search(r"started actor=\S+ pid=(\d+)", log.read_text())
    assert found, log.read_text()[-2000:]
    return int(found.group(1))


async def test_ctrl_c_stops_a_trainer_of_two_ranks_whose_other_rank_went_first(
    tmp_path: Path,
) -> None:
    """SIGINT to ``up`` with a trainer of two torchrun nodes: ``up`` signals every rank at
    once, and the other rank can be gone before rank 0 sends it ``stop`` (it was, in five
    Ctrl-Cs of five by hand). Made certain here: rank 0 is frozen (SIGSTOP) while it waits
    for a batch (the rollout actor frozen first) until the other node has exited. Rank 0
    must still stop as asked (ok), with no error in its log, and ``up`` exit with 130."""
    async with running_up(tmp_path, "stop2", "trainer.max_steps=1000", "trainer.nodes=2") as up:
        logs = up.run_dir / "logs"
        bus = await connect(up.run_dir)
        try:
            await wait_for_step(bus, up.run_dir, 3)
        finally:
            await bus.close()
        # rank 0 is on the node whose address sorts first: here both are 127.0.0.1
        nodes = {name: logs / f"{name}.log" for name in ("trainer-0", "trainer-0-node1")}
        lead = next(n for n, log in nodes.items() if "started actor=trainer-0" in log.read_text())
        other = next(n for n in nodes if n != lead)
        rollout, rank0 = started_pid(logs / "rollout-0.log"), started_pid(nodes[lead])
        os.kill(rollout, signal.SIGSTOP)  # no more batches: the trainer ends up waiting
        await asyncio.sleep(2.0)  # a step of this model takes ~0.05 s
        os.kill(rank0, signal.SIGSTOP)
        up.proc.send_signal(signal.SIGINT)
        up_log = logs / "up.log"
        try:
            async with asyncio.timeout(60):  # polls the log that up (another process) writes
                while f"exited actor={other} code" not in up_log.read_text():  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
        finally:
            for pid in (rank0, rollout):
                os.kill(pid, signal.SIGCONT)
        code = await asyncio.wait_for(up.proc.wait(), RUN_TIMEOUT)
    log = nodes[lead].read_text()
    seen = f"{up_log.read_text()[-2000:]}\n== {lead}\n{log[-3000:]}"
    assert code == 130, seen
    assert re.search(r"stopped .*actor=trainer-0 ok=True", log), seen
    assert "[error" not in log, seen


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("trainer.max_stepz=3", "trainer.max_stepz"),
        ("buffer.batch_size=lots", "buffer.batch_size"),
        ("model.path=./no/such/model", "model.path"),
        ("rollout.group_size=1", "rollout.group_size"),
    ],
)
async def test_a_bad_recipe_fails_before_anything_starts(
    tmp_path: Path, override: str, named: str
) -> None:
    code, out = await run(up_args(tmp_path, "bad", override), limit=60)
    assert code == 2
    assert named in out
    assert not (tmp_path / "bad").exists(), "a run folder was created for a bad recipe"


async def test_the_version_0_gate_ends_the_run_without_restarting_the_trainer(
    tmp_path: Path,
) -> None:
    """A limit no engine meets (1e-30: fp32 engine and trainer differ by ~1e-14) stands
    for a broken setup. The first batch sampled at version 0 trips the gate: ``up`` exits 1
    naming the gate and the likely causes, the trainer exits fatally and, though
    ``run.max_restarts`` allows 3 replacements, none is started."""
    code, out = await run(up_args(tmp_path, "gate", "trainer.mismatch_limit=1e-30"), limit=240)
    assert code == 1, out
    assert "fatal: not restarted" in out and "exceeds trainer.mismatch_limit = 1e-30" in out
    assert "temperature" in out and "dtype" in out
    logs = sorted(p.name for p in (tmp_path / "gate" / "logs").glob("trainer*.log"))
    assert logs == ["trainer-0.log"], logs
    assert not (tmp_path / "gate" / "metrics.jsonl").exists() or not read_jsonl(
        tmp_path / "gate" / "metrics.jsonl"
    ), "no step is recorded past a tripped gate"
