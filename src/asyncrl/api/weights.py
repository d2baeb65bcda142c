"""The weight-transport contract: the trainer side publishes a version, the engine side
receives it.

Trainer side, :class:`WeightPublisher`: ``publish(version, weights)`` gets the weights to
the engines and returns the ``WeightsUpdated`` that announces them (the trainer puts it on
the weights subject; the buffer keeps the newest for actors that join later).
:class:`Weights` is the version to publish, lazily in the two forms transports need: an
HF export folder (files) or the named tensors (a broadcast, IPC handles). Each is made
at most once per version.

Engine side, :class:`WeightReceiver`: every announcement goes to ``announce`` in arrival
order, at once (a broadcast must be taken as it is sent); ``receive()`` then yields the
newest weights announced, staged for the engine while it generates, so that the pause
only swaps them in.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from asyncrl.runtime.bus import Bus
from asyncrl.wire.messages import WeightsUpdated
from asyncrl.wire.subjects import Subjects

if TYPE_CHECKING:
    import torch

NamedTensors = list[tuple[str, "torch.Tensor"]]
"""Full weights as ``(HF parameter name, tensor)`` pairs."""


class Weights(Protocol):
    """One version of the policy, in the forms transports ask for, each made at most once
    (:class:`asyncrl.weights.version.PolicyWeights` is the trainer's)."""

    version: int
    epoch: int
    step: int
    folder: Path
    """Where :meth:`directory` puts the HF export."""

    def directory(self) -> Path:
        """The HF export of this version at :attr:`folder` (blocking: call in a thread).
        Collective across trainer ranks."""
        ...

    @property
    def exported(self) -> bool:
        """Whether :meth:`directory` wrote the export (a checkpoint may link it)."""
        ...

    def tensors(self, dtype: str) -> NamedTensors:
        """The full named tensors in ``dtype`` on rank 0 (blocking: call in a thread;
        collective). Some may be the trainer's live parameters: a transport copies what it
        keeps before it returns."""
        ...


class WeightPublisher(ABC):
    """The trainer side of a transport (rank 0, in the trainer actor's event loop)."""

    kind: str

    def __init__(self, bus: Bus, subjects: Subjects) -> None:
        self.bus, self.subjects = bus, subjects

    async def announce(self, weights: Weights, location: str, **extra: Any) -> WeightsUpdated:
        """Puts the ``WeightsUpdated`` of ``weights`` (this transport's kind, at
        ``location``) on the weights subject; returns it."""
        msg = WeightsUpdated(
            version=weights.version,
            kind=self.kind,  # type: ignore[arg-type]
            location=location,
            step=weights.step,
            epoch=weights.epoch,
            **extra,
        )
        await self.bus.publish(self.subjects.weights, msg)
        return msg

    async def start(self) -> None:
        """Opens what the transport needs (a rendezvous store, request handlers)."""
        return None

    @abstractmethod
    async def publish(self, weights: Weights) -> WeightsUpdated:
        """Gets ``weights`` to the engines; returns the announcement to send."""

    async def begin(self, weights: Weights) -> WeightsUpdated:
        """Like :meth:`publish`, but may return once ``weights`` are copied out and
        announced, with their delivery still under way (the trainer trains on meanwhile);
        :meth:`settle` waits for it. A transport that cannot do so publishes whole."""
        return await self.publish(weights)

    async def settle(self) -> None:
        """Waits for the delivery :meth:`begin` left under way, if any: then
        :meth:`record` and :meth:`delivery` describe that version."""
        return None

    def record(self) -> dict[str, float]:
        """The transport's numbers for the step's record (``weights/...``)."""
        return {}

    def delivery(self) -> dict[str, Any]:
        """Who the last version went to, for the run's ``weights.jsonl``."""
        return {}

    async def close(self) -> None:
        """Releases what :meth:`start` opened."""
        return None


@dataclass
class Received:
    """Weights an engine can load: their version and trainer epoch, ``source`` as the
    engine's ``stage_weights`` returned it, and the seconds fetching and staging took."""

    version: int
    epoch: int
    source: Any
    fetch_s: float
    via: str
    """The transport that brought them (``collective`` may fall back to the object store)."""


class WeightReceiver(ABC):
    """The engine side (a rollout or eval actor)."""

    @abstractmethod
    def announce(self, msg: WeightsUpdated, *, force: bool = False) -> None:
        """Takes an announcement as it arrives, in order, without waiting; ``force`` keeps
        it even where the receiver would skip its version."""

    @abstractmethod
    def receive(
        self, idle: float | None = None
    ) -> contextlib.AbstractAsyncContextManager[Received]:
        """Waits for weights newer than any returned before; yields them staged. Whatever
        staging holds (a temporary folder) lives until the context ends. ``idle``: raise
        :class:`NothingAnnounced` when that many seconds pass with no announcement to take
        (a transfer under way is never cut short); None waits for as long as it takes."""

    async def close(self) -> None:
        """Ends what the receiver started."""
        return None


class NothingAnnounced(Exception):
    """:meth:`WeightReceiver.receive` waited its ``idle`` seconds and no weights came."""


__all__ = [
    "NamedTensors",
    "NothingAnnounced",
    "Received",
    "WeightPublisher",
    "WeightReceiver",
    "Weights",
]
