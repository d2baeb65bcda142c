"""The run's NATS servers as a cluster: the connection file lists every server, clients
are given them all, a recipe whose replicas the servers cannot hold is refused naming
the keys, and a consumer outlives the server that led it. (A whole run that loses one
of its servers is tests/faults/test_nats_cluster.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import nats.errors
import pytest

from asyncrl.config.checks import recipe_problems
from asyncrl.config.recipe import RecipeError, RunConfig, load_recipe
from asyncrl.runtime.bus import Bus, BusTimeout
from asyncrl.runtime.nats_cluster import NatsCluster
from asyncrl.runtime.nats_server import NatsInfo
from asyncrl.wire.messages import Metrics

URLS = ("nats://127.0.0.1:4222", "nats://127.0.0.1:4223", "nats://127.0.0.1:4224")


def test_nats_json_carries_every_server_and_the_replicas(tmp_path: Path) -> None:
    info = NatsInfo(url=URLS[0], token="t", urls=URLS, replicas=3)
    info.write(tmp_path / "nats.json")
    assert NatsInfo.read(tmp_path / "nats.json") == info
    assert info.connect_kwargs()["servers"] == list(URLS)
    one = NatsInfo(url=URLS[0], token="t")
    one.write(tmp_path / "one.json")
    assert NatsInfo.read(tmp_path / "one.json") == one
    assert one.connect_kwargs()["servers"] == [URLS[0]]
    # a file written before clusters existed: one server, one replica
    (tmp_path / "old.json").write_text(f'{{"url": "{URLS[0]}", "token": "t"}}')
    assert NatsInfo.read(tmp_path / "old.json") == one


def test_a_cluster_given_by_urls() -> None:
    info = NatsInfo.from_url(" nats://a:4222 , nats://b:4222,nats://c:4222 ")
    assert info.servers == ["nats://a:4222", "nats://b:4222", "nats://c:4222"]
    assert info.url == "nats://a:4222"
    secret = NatsInfo.from_url("nats://u:pw-42@a:4222,nats://u:pw-42@b:4222")
    assert secret.redacted_url == "nats://***@a:4222,nats://***@b:4222"
    with pytest.raises(RecipeError, match="ASYNCRL_NATS_TOKEN"):
        load_recipe(None, ["run.nats_url=nats://a:4222,nats://me:pw@b:4222"])
    with pytest.raises(RecipeError, match=r"run\.nats_servers"):
        load_recipe(None, ["run.nats_url=nats://a:4222", "run.nats_servers=3"])


def test_replicas_above_the_servers_are_refused_naming_the_keys() -> None:
    def problems(*sets: str) -> tuple[list[str], list[str]]:
        return recipe_problems(load_recipe(None, list(sets)))

    errors, _ = problems("run.nats_replicas=3")
    assert len(errors) == 1
    assert "run.nats_replicas = 3 exceeds run.nats_servers = 1" in errors[0]
    assert problems("run.nats_servers=3", "run.nats_replicas=3") == ([], [])
    assert problems("run.nats_servers=3") == ([], [])
    # an external cluster may have more servers than its URLs name: a warning
    errors, warnings = problems("run.nats_url=nats://a:4222", "run.nats_replicas=3")
    assert not errors and len(warnings) == 1 and "run.nats_url" in warnings[0]
    with pytest.raises(RecipeError, match=r"run\.nats_replicas"):
        load_recipe(None, ["run.nats_replicas=6"])  # JetStream's limit is 5


def test_each_server_of_a_cluster_has_its_name_store_log_and_routes(tmp_path: Path) -> None:
    run = RunConfig(name="r", nats_servers=3, nats_replicas=3, listen="127.0.0.1:14222")
    cluster = NatsCluster.for_run(run, tmp_path)
    names = [s.server_name for s in cluster.servers]
    assert names == ["nats-0", "nats-1", "nats-2"]
    assert len({s.store_dir for s in cluster.servers}) == 3
    assert len({s.log_file for s in cluster.servers}) == 3
    assert [s.port for s in cluster.servers] == [14222, 14223, 14224]
    logins = {(s._credentials().token, s._credentials().user) for s in cluster.servers}
    assert len(logins) == 1  # a client logs in to any of them alike
    route_ports = [s.cluster.port for s in cluster.servers if s.cluster is not None]
    assert len(set(route_ports)) == 3
    for server in cluster.servers:
        assert server.cluster is not None and server.cluster.name == "asyncrl-r"
        others = {f"127.0.0.1:{p}" for p in route_ports if p != server.cluster.port}
        assert set(server.cluster.routes) == others
    with pytest.raises(ValueError, match="3 replicas need as many servers"):
        NatsCluster(tmp_path, cluster.servers[:2], replicas=3)


@pytest.mark.slow
async def test_a_consumer_goes_on_when_its_leader_server_dies(tmp_path: Path) -> None:
    """The pull consumer's leader is killed: pull requests find no responder (503) until
    another server leads it, and the consumer asks again rather than failing."""
    cluster = NatsCluster.for_run(RunConfig(nats_servers=3, nats_replicas=3), tmp_path)
    info = await cluster.start()
    got: set[int] = set()
    try:
        bus = await Bus.connect(info)
        await bus.ensure_stream("WORK", ["t.work"], retention="workqueue")

        async def handler(m: Metrics) -> None:
            got.add(m.step)

        consumer = await bus.js_consume("WORK", "t.work", "workers", Metrics, handler)
        consumer.pull_expires = 0.2  # ask often: some requests fall in the election
        task = asyncio.create_task(consumer.run())
        state = await bus.js.consumer_info("WORK", "workers")
        assert state.cluster is not None and state.cluster.leader
        (leader,) = [s for s in cluster.servers if s.server_name == state.cluster.leader]
        assert leader._proc is not None
        leader._proc.kill()
        for step in range(10):
            async with asyncio.timeout(30):
                while True:  # the stream may be electing its own leader too
                    try:
                        await bus.js_publish(
                            "t.work",
                            Metrics(role="t", actor_id="t0", step=step),
                            msg_id=f"{step}",
                            timeout=1,
                        )
                        break
                    except (BusTimeout, nats.errors.Error):
                        await asyncio.sleep(0.2)
        async with asyncio.timeout(30):
            while len(got) < 10:
                assert not task.done(), task.exception()
                await asyncio.sleep(0.1)
        await consumer.stop()
        await bus.close()
    finally:
        await cluster.stop()
