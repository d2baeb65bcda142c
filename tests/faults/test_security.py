"""Security of a run's NATS server: no client gets in without the run's credentials, an
embedded server opened to other machines (``run.listen``) keeps them, TLS when given a
certificate, and the credentials stay out of logs, metrics, the recipe copies and
process lists, while a copy of ``nats.json`` is all an actor elsewhere needs.

Every server here is a real nats-server; the last test is a real run (``asyncrl up``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from e2e_kit import CI_RECIPE, running_up

from asyncrl.config.checks import recipe_problems
from asyncrl.config.recipe import RecipeError, load_recipe
from asyncrl.runtime.bus import Bus
from asyncrl.runtime.nats_server import (
    NATS_JSON,
    EmbeddedNats,
    NatsInfo,
    advertised_host,
    external_info,
    take_credentials,
)
from asyncrl.wire.messages import ActorInfo, Metrics
from asyncrl.wire.subjects import Subjects


async def refused(info: NatsInfo) -> str:
    """Connects with ``info``; returns the error text, failing the test if it got in."""
    try:
        nc = await nats.connect(
            **info.connect_kwargs(),
            allow_reconnect=False,
            max_reconnect_attempts=1,
            connect_timeout=5,
        )
    except Exception as exc:  # nats-py raises several types for a refused login
        return f"{type(exc).__name__}: {exc}"
    await nc.close()
    raise AssertionError(f"{info!r} connected to {info.url}")


async def raw_session(url: str, lines: list[bytes]) -> tuple[dict[str, object], bytes]:
    """Speaks the NATS protocol by hand: reads the server's INFO, sends ``lines``, and
    returns the INFO and everything the server said until it closed the connection."""
    host, port = url.split("://")[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    try:
        info_line = await asyncio.wait_for(reader.readline(), 10)
        assert info_line.startswith(b"INFO "), info_line
        writer.write(b"".join(line + b"\r\n" for line in lines))
        await writer.drain()
        said = await asyncio.wait_for(reader.read(), 10)  # until the server hangs up
    finally:
        writer.close()
    return json.loads(info_line[5:]), said


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def self_signed_cert(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost and its key, made with the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
            *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def command_line(pid: int | None) -> bytes:
    return Path(f"/proc/{pid}/cmdline").read_bytes()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -- a client without the credentials -------------------------------------------------------


async def test_a_client_without_the_token_can_neither_subscribe_nor_publish(
    embedded_nats: EmbeddedNats, bus: Bus
) -> None:
    info = embedded_nats.info
    subjects = Subjects(embedded_nats.run_dir.name)
    assert info.token and len(info.token) >= 32
    assert info.token not in repr(info)

    for stranger in (NatsInfo(url=info.url), NatsInfo(url=info.url, token="not-the-token")):
        assert "Authorization Violation" in await refused(stranger)

    seen: list[str] = []
    arrived = asyncio.Event()

    async def on_metrics(m: Metrics) -> None:
        seen.append(m.role)
        arrived.set()

    await bus.subscribe(subjects.metrics("*"), Metrics, on_metrics)
    await bus.nc.flush()
    for connect in (b'CONNECT {"verbose":false}', b'CONNECT {"auth_token":"not-the-token"}'):
        server_info, said = await raw_session(
            info.url,
            [
                connect,
                b"SUB " + subjects.metrics("*").encode() + b" 1",
                b"PUB " + subjects.metrics("stranger").encode() + b" 2",
                b"{}",
                b"PING",
            ],
        )
        assert server_info["auth_required"] is True
        assert b"-ERR 'Authorization Violation'" in said, said
        assert b"PONG" not in said and b"MSG" not in said, said  # nothing was taken in

    # anything the strangers had published would reach the subscriber before this
    await bus.publish(
        subjects.metrics("trainer"), Metrics(role="trainer", actor_id="trainer-0", step=1)
    )
    await asyncio.wait_for(arrived.wait(), 10)
    assert seen == ["trainer"]


# -- run.listen: a chosen address, user and password, TLS -----------------------------------


@pytest.fixture
async def listening(tmp_path: Path) -> AsyncIterator[tuple[EmbeddedNats, int]]:
    port = free_port()
    server = EmbeddedNats(
        tmp_path / "run", listen=f"127.0.0.1:{port}", user="actor", password="s3cret-pw-xyz"
    )
    async with server:
        yield server, port


async def test_listen_with_user_and_password(listening: tuple[EmbeddedNats, int]) -> None:
    server, port = listening
    info = server.info
    assert info.url == f"nats://127.0.0.1:{port}"
    assert (info.user, info.password, info.token) == ("actor", "s3cret-pw-xyz", None)
    assert "s3cret-pw-xyz" not in repr(info)

    nats_json = server.run_dir / NATS_JSON
    conf = server.store_dir / "nats-server.conf"
    assert mode(nats_json) == 0o600 and mode(conf) == 0o600
    assert NatsInfo.read(nats_json) == info
    cmdline = command_line(server.pid)
    assert b"s3cret" not in cmdline and str(conf).encode() in cmdline

    b = await Bus.connect(info)
    await b.close()
    for stranger in (
        NatsInfo(url=info.url),
        NatsInfo(url=info.url, user="actor", password="wrong"),
        NatsInfo(url=info.url, token="s3cret-pw-xyz"),
    ):
        assert "Authorization Violation" in await refused(stranger)
    assert b"s3cret" not in server.log_file.read_bytes()  # the refusals are logged, bare


async def test_a_user_without_a_password_gets_a_random_one_kept_over_restarts(
    tmp_path: Path,
) -> None:
    server = EmbeddedNats(tmp_path / "run", listen=f"127.0.0.1:{free_port()}", user="actor")
    async with server:
        info = server.info
        assert info.user == "actor" and info.password and len(info.password) >= 32
        b = await Bus.connect(NatsInfo.read(server.run_dir / NATS_JSON))
        await b.close()
    async with server:  # a restart: what clients hold still logs them in
        assert server.info == info
        b = await Bus.connect(info)
        await b.close()


async def test_listen_on_every_interface_names_this_machine(tmp_path: Path) -> None:
    """A wildcard address is no address to connect to: nats.json names the machine."""
    async with EmbeddedNats(tmp_path / "run", listen="0.0.0.0:0") as server:
        url = server.info.url
        assert url.startswith(f"nats://{advertised_host()}:"), url
        assert server.info.token
        b = await Bus.connect(server.info)  # the handshake already used this very URL
        await b.close()
        assert "Authorization Violation" in await refused(NatsInfo(url=url))


async def test_tls_with_a_self_signed_certificate(tmp_path: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    server = EmbeddedNats(
        tmp_path / "run", listen="127.0.0.1:0", tls_cert=cert, tls_key=key, tls_ca=cert
    )
    async with server:
        info = server.info
        assert info.url.startswith("tls://127.0.0.1:")
        assert info.tls_ca == cert.read_text()  # in the file, so a copy of it is enough

        copy = tmp_path / "elsewhere" / NATS_JSON
        copy.parent.mkdir()
        shutil.copy(server.run_dir / NATS_JSON, copy)
        b = await Bus.connect(NatsInfo.read(copy))
        await b.close()

        # a client that does not trust the certificate (the system CAs) is refused
        untrusting = NatsInfo(url=info.url, token=info.token)
        assert "CERTIFICATE_VERIFY_FAILED" in await refused(untrusting)
        # plain text gets nowhere: the server asks for TLS before anything else
        server_info, said = await raw_session(
            info.url.replace("tls://", "nats://"),
            [b'CONNECT {"auth_token":' + json.dumps(info.token).encode() + b"}", b"PING"],
        )
        assert server_info["tls_required"] is True
        assert b"PONG" not in said, said


async def test_a_certificate_the_clients_would_not_trust_fails_start_at_once(
    tmp_path: Path,
) -> None:
    cert, key = self_signed_cert(tmp_path)
    other = tmp_path / "other"
    other.mkdir()
    other_cert, _ = self_signed_cert(other)
    server = EmbeddedNats(
        tmp_path / "run", listen="127.0.0.1:0", tls_cert=cert, tls_key=key, tls_ca=other_cert
    )
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"TLS to tls://127.0.0.1:\d+ failed .*run.tls_ca"):
        await server.start()
    assert time.monotonic() - t0 < server.start_timeout / 2  # no retrying what cannot work
    assert server.returncode is not None  # and the server is stopped
    assert not (tmp_path / "run" / NATS_JSON).exists()


# -- credentials in the recipe and the environment ------------------------------------------


def test_credentials_in_the_recipe_are_refused() -> None:
    with pytest.raises(RecipeError, match="ASYNCRL_NATS_TOKEN") as refused_url:
        load_recipe(None, ["run.nats_url=nats://me:pw-42@nats.example:4222"])
    assert "pw-42" not in str(refused_url.value)  # the error quotes the URL without them
    assert "nats://***@nats.example:4222" in str(refused_url.value)
    with pytest.raises(RecipeError, match=r"run.listen must look like 0.0.0.0:4222"):
        load_recipe(None, ["run.listen=nats.example"])
    with pytest.raises(RecipeError, match=r"run.tls_cert and run.tls_key go together"):
        load_recipe(None, ['run.listen="0.0.0.0:4222"', "run.tls_cert=cert.pem"])
    recipe = load_recipe(None, ['run.listen="[::]:4222"'])
    _, warnings = recipe_problems(recipe)
    assert any("clear text" in w for w in warnings), warnings
    assert not recipe_problems(load_recipe(None, ['run.listen="127.0.0.1:0"']))[1]


def test_credentials_from_the_environment_are_taken_out_of_it() -> None:
    env = {"ASYNCRL_NATS_USER": "actor", "ASYNCRL_NATS_PASSWORD": "pw", "HOME": "/h"}
    assert take_credentials(env) == (None, "actor", "pw")
    assert env == {"HOME": "/h"}  # no child process inherits them
    assert take_credentials({"ASYNCRL_NATS_TOKEN": "t"}) == ("t", None, None)
    with pytest.raises(ValueError, match="not both"):
        take_credentials({"ASYNCRL_NATS_TOKEN": "t", "ASYNCRL_NATS_USER": "u"})
    with pytest.raises(ValueError, match="ASYNCRL_NATS_USER is not"):
        take_credentials({"ASYNCRL_NATS_PASSWORD": "pw"})


async def test_an_external_server_gets_its_credentials_from_the_environment(
    embedded_nats: EmbeddedNats, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run.nats_url`` without credentials, the token in ``ASYNCRL_NATS_TOKEN``."""
    token = embedded_nats.info.token
    assert token
    monkeypatch.setenv("ASYNCRL_NATS_TOKEN", token)
    recipe = load_recipe(None, [f"run.nats_url={embedded_nats.info.url}"])
    info = external_info(recipe.run)
    assert "ASYNCRL_NATS_TOKEN" not in os.environ
    assert info == NatsInfo(url=embedded_nats.info.url, token=token)
    b = await Bus.connect(info)
    await b.close()
    with pytest.raises(RecipeError, match=r"run.tls_ca: 'nowhere.pem' is not a file"):
        external_info(
            load_recipe(None, ["run.nats_url=tls://x:4222", "run.tls_ca=nowhere.pem"]).run
        )


# -- a real run ---------------------------------------------------------------------------


def processes_mentioning(needles: list[str]) -> dict[int, tuple[bytes, bytes]]:
    """``pid: (cmdline, environ)`` of this user's processes whose command line names one
    of ``needles``."""
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            if any(n.encode() in cmdline for n in needles):
                found[int(proc.name)] = (cmdline, (proc / "environ").read_bytes())
        except OSError:  # gone, or another user's
            continue
    return found


@pytest.mark.slow
async def test_a_listening_run_keeps_its_secret_and_a_copy_of_nats_json_attaches(
    tmp_path: Path,
) -> None:
    """``asyncrl up --listen`` with a password from the environment; a rollout actor
    attaches from another folder holding only copies of the recipe and ``nats.json``. The
    password is in ``nats.json`` and the server config (mode 0600) and nowhere else: not
    in any other file of the run, nor in any process's command line or environment."""
    password = "pw-" + os.urandom(12).hex()
    run_dir = tmp_path / "sec"
    env = {**os.environ, "ASYNCRL_NATS_USER": "trainer-box", "ASYNCRL_NATS_PASSWORD": password}
    sets = ["run.dir=" + str(tmp_path), "run.name=sec", "trainer.max_steps=100000", "eval.every=0"]
    argv = [sys.executable, "-m", "asyncrl.entry.cli", "up", str(CI_RECIPE), "--quiet"]
    argv += ["--listen", f"127.0.0.1:{free_port()}", *[x for s in sets for x in ("--set", s)]]
    remote: asyncio.subprocess.Process | None = None
    elsewhere = tmp_path / "elsewhere"
    async with running_up(
        tmp_path, "sec", argv=argv, env=env, stderr=asyncio.subprocess.PIPE
    ) as run:
        up = run.proc
        try:
            assert mode(run_dir / NATS_JSON) == 0o600
            info = NatsInfo.read(run_dir / NATS_JSON)
            assert (info.user, info.password) == ("trainer-box", password)

            (elsewhere / "keys").mkdir(parents=True)
            shutil.copy(run_dir / "recipe.json", elsewhere / "recipe.json")
            shutil.copy(run_dir / NATS_JSON, elsewhere / "keys" / NATS_JSON)
            bus = await Bus.connect(NatsInfo.read(elsewhere / "keys" / NATS_JSON), name="test")
            try:
                started: set[str] = set()
                remote_started = asyncio.Event()

                async def on_started(a: ActorInfo) -> None:
                    started.add(a.actor_id)
                    if a.actor_id == "remote-0":
                        remote_started.set()

                stepped = asyncio.Event()

                async def on_metrics(m: Metrics) -> None:
                    stepped.set()

                # the run's own actors may have announced their start before this
                # subscription (forked, they start within a second or two): their
                # heartbeats, which carry the same record, say it again
                await bus.subscribe(Subjects("sec").started, ActorInfo, on_started)
                await bus.subscribe(Subjects("sec").heartbeat(), ActorInfo, on_started)
                await bus.subscribe(Subjects("sec").metrics("trainer"), Metrics, on_metrics)
                remote = await asyncio.create_subprocess_exec(
                    *[sys.executable, "-m", "asyncrl.entry.cli", "attach", "rollout", "--run", "."],
                    *["--nats", "keys/nats.json", "--actor-id", "remote-0"],
                    stdout=asyncio.subprocess.PIPE,
                    stderr=asyncio.subprocess.STDOUT,
                    cwd=elsewhere,
                    env={k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_NATS")},
                )
                await asyncio.wait_for(remote_started.wait(), 180)
                async with asyncio.timeout(180):  # the run's own actors, for the process scan
                    while not {"buffer-0", "reward-0", "rollout-0", "trainer-0"} <= started:
                        assert up.returncode is None, "the run ended early"
                        await asyncio.sleep(0.1)

                await asyncio.wait_for(stepped.wait(), 180)  # so that metrics.jsonl exists

                procs = processes_mentioning([str(tmp_path), "remote-0"])
                assert len(procs) >= 7, procs  # up, nats-server, 4 actors, the attached one
                for pid, (cmdline, environ) in procs.items():
                    assert password.encode() not in cmdline, (pid, cmdline)
                    # up itself was started with the password in its environment (the user's
                    # choice, readable by that user only); no process it starts inherits it
                    assert pid == up.pid or password.encode() not in environ, (pid, cmdline)
                ps = await asyncio.create_subprocess_exec(
                    "ps", "-eo", "args", stdout=asyncio.subprocess.PIPE
                )
                listing, _ = await ps.communicate()
                assert b"nats-server" in listing and password.encode() not in listing
            finally:
                await bus.close()
            up.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(up.communicate(), 120)
            assert up.returncode == 0, err.decode()
            out, _ = await asyncio.wait_for(remote.communicate(), 120)
            assert remote.returncode == 0, out.decode()  # it stops with the run, cleanly
        finally:
            # it names no run folder (it runs elsewhere): not killed with the run
            if remote is not None and remote.returncode is None:
                remote.kill()
                await remote.wait()

    keepers = {run_dir / NATS_JSON, run_dir / "nats" / "nats-server.conf"}
    keepers |= {elsewhere / "keys" / NATS_JSON}
    checked = [p for p in (*run_dir.rglob("*"), *elsewhere.rglob("*")) if p.is_file()]
    assert {run_dir / "config.toml", run_dir / "logs" / "nats-server.log"} <= set(checked)
    assert (run_dir / "metrics.jsonl").exists()
    leaks = [p for p in checked if p not in keepers and password.encode() in p.read_bytes()]
    assert not leaks, leaks
    assert all(mode(p) == 0o600 for p in keepers)
