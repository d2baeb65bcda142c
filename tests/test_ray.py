"""``asyncrl up --ray`` on a Ray cluster of two nodes started on this machine (Ray's own
multi-node test cluster, each node with a custom resource that names it): the ci recipe
with the rollout on one node and the trainer on the other, placed as Ray's actor table
shows; the rollout's node dies (every process of it, SIGKILL) in mid-run and the run
finishes, the rollout replaced on the other node, nothing trained twice, nothing of the
run left on the cluster.

Run by ``make test-ray`` (it installs the ray extra and sets ASYNCRL_RAY_TESTS=1); skipped
otherwise: a Ray cluster costs minutes on two cores, more than CI has.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("ASYNCRL_RAY_TESTS") != "1":
    pytest.skip("the Ray tests run under `make test-ray`", allow_module_level=True)
ray = pytest.importorskip("ray", reason="ray is not installed: `make test-ray` installs it")

from e2e_kit import run_processes, running_up, up_args  # noqa: E402
from faults.test_kill_9 import check_every_prompt_accounted_for  # noqa: E402
from test_e2e import RUN_TIMEOUT, connect, read_jsonl, wait_for_step  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS = 8


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def node_processes(node: Any) -> list[int]:
    """Every process of one node of a test cluster: its Ray daemons (raylet, agents, log
    monitor), their workers, and whatever the workers started."""
    pids = [p.process.pid for procs in node.all_processes.values() for p in procs]
    return sorted({q for p in pids for q in (p, *descendants(p))})


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    from ray.cluster_utils import Cluster

    # no idle workers started ahead: two cores
    monkeypatch.setenv("RAY_enable_worker_prestart", "0")
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "0")
    # Ray's memory monitor kills workers when the *machine* runs low, whoever uses it:
    # on a shared test machine that is other work, not this run
    monkeypatch.setenv("RAY_memory_monitor_refresh_ms", "0")
    c = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"node-a": 10},
            "include_dashboard": False,
            # a dead node is known as dead in seconds, not the default half minute
            "_system_config": {"health_check_period_ms": 1000, "health_check_failure_threshold": 5},
        },
    )
    try:
        c.add_node(num_cpus=2, resources={"node-b": 10})
        c.wait_for_nodes()
        yield c
    finally:
        with contextlib.suppress(Exception):
            ray.shutdown()
        c.shutdown()


async def reach_step(run: Any, step: int) -> None:
    """Returns once the trainer has finished ``step``; fails at once if ``up`` ends first."""
    bus = await connect(run.run_dir)
    try:
        reached = asyncio.ensure_future(wait_for_step(bus, run.run_dir, step))
        ended = asyncio.ensure_future(run.proc.wait())
        await asyncio.wait([reached, ended], return_when=asyncio.FIRST_COMPLETED)
        if not reached.done():
            reached.cancel()
            pytest.fail(f"asyncrl up ended (exit {run.proc.returncode}) before step {step}")
        ended.cancel()
        reached.result()
    finally:
        await bus.close()


async def nothing_left(run_dir: Path) -> None:
    """No process of the run (a proxy, a role's process) outlives ``up`` for long."""
    for _ in range(60):
        if not (left := run_processes(run_dir)):
            return
        await asyncio.sleep(0.5)
    lines = [Path(f"/proc/{p}/cmdline").read_bytes()[:200] for p in left]  # noqa: ASYNC240
    pytest.fail(f"left behind: {lines}")


def cluster_actors() -> list[dict[str, Any]]:
    """Every Ray actor of the (test's own) cluster, alive and dead, from the GCS actor
    table: name, state, node."""
    table = ray._private.state.actors()
    return [
        {"name": a["Name"], "state": a["State"], "node": a["Address"]["NodeID"]}
        for a in table.values()
    ]


@pytest.mark.timeout(900)
async def test_placed_on_two_nodes_and_the_rollout_node_dies(tmp_path: Path, cluster: Any) -> None:
    head, node_b = cluster.head_node, cluster.list_all_nodes()[1]
    name = "ray-node-death"
    sets = (
        f"trainer.max_steps={STEPS}",
        "trainer.checkpoint_every=4",
        "rollout.lease_ttl=5",
        "run.restart_backoff=0.5",
        "run.startup_timeout=300",
        # three servers on two nodes, two on the trainer's: a majority outlives node-b
        "run.nats_servers=3",
        "run.nats_replicas=3",
        "rollout.node=node-b",
        "trainer.node=node-a",
        "buffer.node=node-a",
        "reward.node=node-a",
    )
    argv = [*up_args(tmp_path, name, *sets), "--ray", cluster.address]
    out = (tmp_path / "up.out").open("w")
    async with running_up(tmp_path, name, argv=argv, stdout=out, stderr=out) as run:
        await reach_step(run, 2)
        ray.init(address=cluster.address, namespace="asyncrl-test", log_to_driver=False)
        placed = {a["name"]: a["node"] for a in cluster_actors() if a["state"] == "ALIVE"}
        assert placed["rollout-0"] == node_b.node_id, placed
        for actor in ("trainer-0", "buffer-0", "reward-0", "nats-0", "nats-2"):
            assert placed[actor] == head.node_id, (actor, placed)
        assert placed["nats-1"] == node_b.node_id, placed
        # the node dies: every one of its processes at once
        for pid in node_processes(node_b):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        code = await asyncio.wait_for(run.proc.wait(), RUN_TIMEOUT)
        assert code == 0, (tmp_path / "up.out").read_text()[-3000:]
        # nothing of the run outlives up: no proxy, no role process on either node
        await nothing_left(run.run_dir)
    run_dir = run.run_dir
    assert check_every_prompt_accounted_for(run_dir)["version"] == STEPS
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS
    # the rollout's replacement runs on the node that is left (one started before Ray
    # knew node-b was dead may have been sent there, and was replaced in its turn)
    actors = cluster_actors()
    replacements = sorted(
        (a for a in actors if a["name"].startswith("rollout-0-r")),
        key=lambda a: int(a["name"].rsplit("-r", 1)[1]),
    )
    assert replacements and replacements[-1]["node"] == head.node_id, actors
    assert all(a["node"] in (head.node_id, node_b.node_id) for a in replacements)
    # nothing of the run is left on the cluster: no live actor, no placement group
    assert [a for a in actors if a["state"] != "DEAD"] == [], actors
    groups = ray.util.placement_group_table()
    assert all(g["state"] == "REMOVED" for g in groups.values()), groups


@pytest.mark.timeout(600)
async def test_a_trainer_across_both_nodes_in_one_group_and_a_clean_stop(
    tmp_path: Path, cluster: Any
) -> None:
    head, node_b = cluster.head_node, cluster.list_all_nodes()[1]
    name = "ray-trainer-gang"
    sets = (
        "trainer.max_steps=50",  # stopped long before
        "trainer.nodes=2",
        'trainer.node=["node-a", "node-b"]',
        "rollout.node=node-a",
    )
    argv = [*up_args(tmp_path, name, *sets), "--ray", cluster.address]
    out = (tmp_path / "up.out").open("w")
    async with running_up(tmp_path, name, argv=argv, stdout=out, stderr=out) as run:
        await reach_step(run, 1)
        ray.init(address=cluster.address, namespace="asyncrl-test", log_to_driver=False)
        placed = {a["name"]: a["node"] for a in cluster_actors() if a["state"] == "ALIVE"}
        assert placed["trainer-0"] == head.node_id, placed
        assert placed["trainer-0-node1"] == node_b.node_id, placed
        (group,) = ray.util.placement_group_table().values()
        assert group["strategy"] == "STRICT_SPREAD" and group["state"] == "CREATED", group
        assert sorted(group["bundles_to_node_id"].values()) == sorted(
            [head.node_id, node_b.node_id]
        )
        # a stop (Ctrl-C, SIGTERM): every actor stops, and nothing of the run is left
        run.proc.send_signal(signal.SIGTERM)
        code = await asyncio.wait_for(run.proc.wait(), 120)
        assert code == 0, (tmp_path / "up.out").read_text()[-3000:]
        await nothing_left(run.run_dir)
    assert [a for a in cluster_actors() if a["state"] != "DEAD"] == []
    (group,) = ray.util.placement_group_table().values()
    assert group["state"] == "REMOVED", group
