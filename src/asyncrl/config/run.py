"""The recipe's ``run`` section: the run's name and folder, the NATS servers its actors
meet on, restarts, and what it records (metrics sinks, traces).

It lives apart from :mod:`asyncrl.config.recipe` because the runtime reads it without the
rest of the recipe: the embedded NATS server takes its listen address and TLS files from
it, and every process that connects to a bus would otherwise load every section's schema
(the workflows', the engines', the trainer's) first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.schema import Section


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


class WandbConfig(Section):
    project: str = "asyncrl"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); None uses the account's default."""
    mode: Literal["online", "offline", "disabled"] = "online"
    """``offline`` writes the run under ``<run>/wandb`` for a later ``wandb sync``."""
    name: str | None = None
    """Display name; defaults to the run name (the eval actor adds ``-eval``)."""
    tags: list[str] = Field(default_factory=list)
    """Tags of the W&B run."""


class RunConfig(Section):
    name: str = "run"
    """Run name: the run folder is ``<dir>/<name>`` and subjects are ``asyncrl.<name>.*``."""
    dir: str = "runs"
    """Parent folder of run folders."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    nats_url: str = ""
    """An external NATS server (``nats://host:4222``, ``tls://host:4222``), or the servers
    of one cluster, comma separated (clients fail over between them); empty starts
    ``nats_servers`` embedded ones. Credentials never go in the recipe (it is copied into the run folder):
    ``up`` reads them from ``ASYNCRL_NATS_TOKEN`` or ``ASYNCRL_NATS_USER`` and
    ``ASYNCRL_NATS_PASSWORD`` and keeps them only in ``<run>/nats.json`` (mode 0600)."""
    listen: str = ""
    """``HOST:PORT`` the embedded server listens on, so that actors on other machines can
    attach (``asyncrl up --listen``); port 0 picks a free one. Empty: 127.0.0.1 and a free
    port, this machine only. Clients always need the run's credentials."""
    tls_cert: str = ""
    """PEM certificate of the embedded server (``--tls-cert``); with ``tls_key`` it speaks
    TLS only."""
    tls_key: str = ""
    """PEM private key of ``tls_cert`` (``--tls-key``)."""
    tls_ca: str = ""
    """PEM certificate(s) clients trust for the server's certificate (``--tls-ca``): the
    signing CA, or a self-signed certificate itself. Copied into ``nats.json``, so a copy
    of that file is all an actor elsewhere needs. Empty: the system's trusted CAs."""
    nats_servers: int = Field(1, ge=1, le=9)
    """How many nats-servers ``up`` starts on this machine (without ``nats_url``): more
    than one are joined by routes into one JetStream cluster, each with its own store
    under ``<run>/nats/``, and ``nats.json`` lists them all."""
    nats_replicas: int = Field(1, ge=1, le=5)
    """How many servers keep a copy of the run's trajectory stream and object stores
    (weights, batches, the buffer's state). 3 on a cluster of 3 or more: the loss of any
    one server loses nothing. At most ``nats_servers`` (JetStream allows 5)."""
    max_payload_mb: int = Field(8, ge=1, le=64)
    """Largest message the embedded server accepts, in MiB."""
    startup_timeout: float = Field(600.0, gt=0)
    """Seconds every actor has to report ``started`` before ``up`` gives up."""
    max_restarts: int = Field(3, ge=0)
    """How many times ``up`` starts a replacement for one actor that died in mid-run (any
    role: rollout, reward and eval are stateless, the buffer restores its durable state,
    the trainer its latest checkpoint) before the next death ends the run."""
    restart_backoff: float = Field(1.0, ge=0)
    """Seconds before the first replacement of an actor; doubled for each further one (at
    most 30 s), so a crash loop does not spin."""
    placement: Literal["auto", "none"] = "auto"
    """``auto``: when every role runs on this machine's CPU and no ``<role>.cpus`` is set,
    ``up`` pins generation (rollout, reward, eval, buffer) to a quarter of the cores and
    the trainer to all of them (it takes generation's back while generation waits), with
    torch threads to match, and prints the placement first (:mod:`asyncrl.launch.core_placement`).
    ``none``: processes go where the OS puts them."""
    actor_start: Literal["auto", "exec"] = "auto"
    """``auto``: where every actor runs on this machine's CPU (no GPU visible, no Ray),
    ``up`` starts one process that imports torch, transformers and the actors' modules
    while NATS starts, and forks each actor, and each replacement, from it: an actor is
    up in a fraction of a second rather than the 2-6 s of CPU its imports take
    (:mod:`asyncrl.runtime.forks`). ``exec``: each actor is a fresh interpreter."""
    plots: bool = True
    """Draw the run's curves as PNG files under ``<run>/plots`` when it finishes (a few
    seconds; ``asyncrl plot --run RUN`` draws them at any time)."""
    tensorboard: bool = Field(default_factory=lambda: _importable("tensorboard"))
    """Write TensorBoard event files under ``<run>/tensorboard`` (on by default when the
    ``tensorboard`` package is installed)."""
    wandb: WandbConfig | None = None
    """Log to Weights & Biases as well (needs the ``wandb`` package); absent: off."""
    trace_steps: str = ""
    """``a:b``: every actor records its spans (generate, score, lease, train, load weights)
    while its policy version is in [a, b], and ``up`` merges them into ``<run>/trace.json``
    (Chrome-trace JSON, for Perfetto). Empty: off. ``asyncrl up --trace`` sets it."""

    @model_validator(mode="after")
    def _trace_window(self) -> RunConfig:
        if self.trace_steps:
            trace_window(self.trace_steps)
        return self

    @model_validator(mode="after")
    def _server_options(self) -> RunConfig:
        urls = [u.strip() for u in self.nats_url.split(",")]
        if any("@" in u.partition("://")[2].partition("/")[0] for u in urls):
            raise ValueError(
                "run.nats_url carries credentials, which would be copied into the run "
                "folder's recipe: give the bare URL and set ASYNCRL_NATS_TOKEN, or "
                "ASYNCRL_NATS_USER and ASYNCRL_NATS_PASSWORD, in the environment of up"
            )
        if self.listen:
            listen_address(self.listen)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("run.tls_cert and run.tls_key go together: give both or neither")
        if self.nats_url and (self.listen or self.tls_cert):
            raise ValueError(
                "run.listen and run.tls_cert/tls_key configure the embedded server; with "
                "run.nats_url the run uses an external one"
            )
        if self.nats_url and self.nats_servers > 1:
            raise ValueError(
                "run.nats_servers is how many servers up starts itself; with run.nats_url "
                "the run joins the cluster those URLs name: leave run.nats_servers at 1"
            )
        if self.nats_url and not all(urls):
            raise ValueError(f"run.nats_url: an empty URL in {self.nats_url!r}")
        return self

    @property
    def path(self) -> Path:
        return Path(self.dir) / self.name

    def missing_packages(self) -> list[str]:
        """The metrics sinks turned on whose package is not installed here, one line each
        naming its key."""
        problems = []
        if self.tensorboard and not _importable("tensorboard"):
            problems.append("run.tensorboard: true, but the tensorboard package is missing")
        wandb = self.wandb
        if wandb is not None and wandb.mode != "disabled" and not _importable("wandb"):
            problems.append("run.wandb: set, but the wandb package is missing: pip install wandb")
        return problems


def listen_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (``"[v6]:port"`` for IPv6) as ``(host, port)``. Raises naming
    ``run.listen``."""
    host, sep, port = text.strip().rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        host = ""  # a bare IPv6 address: ambiguous without brackets
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(
            f"run.listen must look like 0.0.0.0:4222, my-host:4222 or [::]:4222 "
            f"(port 0: a free one), got {text!r}"
        )
    return host, int(port)


def trace_window(text: str) -> tuple[int, int]:
    """``"a:b"`` as ``(a, b)``; ``"a"`` alone is ``(a, a)``. Raises naming ``run.trace_steps``."""
    first, _, last = text.partition(":")
    try:
        lo, hi = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"run.trace_steps must look like 2:6, got {text!r}") from None
    if lo < 0 or hi < lo:
        raise ValueError(f"run.trace_steps: need 0 <= a <= b, got {text!r}")
    return lo, hi
