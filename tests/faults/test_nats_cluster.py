"""One server of a 3-server NATS cluster dies in mid-run (kill -9): the run finishes.

``up`` starts three nats-servers on loopback, joined by routes, with the run's stream and
object stores replicated on all three (``run.nats_replicas = 3``). At step 5 the server
that leads the trajectory stream is killed with SIGKILL: the actors connected to it fail
over to the others, the stream elects another leader, and the run ends with exit 0, every
step recorded once, no sample trained twice and every prompt accounted for.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from e2e_kit import running_up
from test_e2e import RUN_TIMEOUT, connect, read_jsonl, wait_for_step

from asyncrl.runtime.nats_server import nats_info_for_run
from asyncrl.wire.subjects import Subjects
from faults.test_kill_9 import check_every_prompt_accounted_for

pytestmark = pytest.mark.slow

STEPS = 7
KILL_AT_STEP = 5


def server_pid(run_dir: Path, name: str) -> int:
    """The pid of the cluster's server ``name``, from the ports file it writes."""
    (ports,) = (run_dir / "nats" / name).glob("nats-server_*.ports")
    return int(ports.stem.rsplit("_", 1)[1])


@pytest.mark.timeout(300)
async def test_kill_9_of_one_server_of_three_and_the_run_finishes(tmp_path: Path) -> None:
    name = "nats-cluster"
    async with running_up(
        tmp_path,
        name,
        "run.nats_servers=3",
        "run.nats_replicas=3",
        f"trainer.max_steps={STEPS}",
        f"trainer.checkpoint_every={STEPS}",
        "rollout.lease_ttl=5",
        # the cheapest run that still has steps after the kill: small batches, no extras
        "buffer.batch_size=2",
        "rollout.group_size=4",
        "run.tensorboard=false",
    ) as run:
        info = nats_info_for_run(run.run_dir)
        assert len(info.servers) == 3 and info.replicas == 3
        bus = await connect(run.run_dir)
        try:
            await wait_for_step(bus, run.run_dir, KILL_AT_STEP)
            subjects = Subjects(name)
            stream = await bus.js.stream_info(subjects.stream)
            assert stream.config.num_replicas == 3
            # the buffer's state, an object store: replicated too
            state = await bus.js.stream_info(f"OBJ_{subjects.buffer_bucket}")
            assert state.config.num_replicas == 3
            assert stream.cluster is not None and stream.cluster.leader
            leader = stream.cluster.leader
        finally:
            await bus.close()
        os.kill(server_pid(run.run_dir, leader), signal.SIGKILL)
        assert await asyncio.wait_for(run.proc.wait(), RUN_TIMEOUT) == 0, "the run failed"
    run_dir = run.run_dir
    assert f"server={leader}" in (run_dir / "logs" / "up.log").read_text()
    assert check_every_prompt_accounted_for(run_dir)["version"] == STEPS
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == STEPS
