"""For tests of the broadcast: a version of named tensors as the trainer publishes it, and
the trainer's side of a gloo broadcast on this machine."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from asyncrl.runtime.bus import Bus
from asyncrl.weights.build import object_store_copy
from asyncrl.weights.collective import CollectivePublisher
from asyncrl.weights.config import WeightsConfig
from asyncrl.weights.version import PolicyWeights
from asyncrl.wire.subjects import Subjects


def tensor_weights(
    version: int,
    tensors: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    folder: Path,
) -> PolicyWeights:
    """``tensors`` as version ``version`` (epoch 0, step = version): the broadcast gathers
    them in the dtype it asks for; an export is never expected."""
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)

    def never(_: Path) -> None:
        raise AssertionError("the broadcast needs no export")

    return PolicyWeights(
        version,
        0,
        version,
        folder / f"v{version}",
        export=never,
        gather=lambda dtype: [(n, t.to(getattr(torch, dtype)).clone()) for n, t in pairs],
    )


def gloo_publisher(
    bus: Bus, subjects: Subjects, *, dtype: str = "float32", **config: object
) -> CollectivePublisher:
    """Rank 0's side of the broadcast on 127.0.0.1 over gloo, the object store as its
    fallback; ``config``: keys of the ``[weights]`` section (``timeout_s`` 10 unless
    given). Not started: ``await publisher.start()`` serves the joins."""
    return CollectivePublisher(
        bus,
        subjects,
        WeightsConfig.model_validate({"transport": "collective", "timeout_s": 10, **config}),
        host="127.0.0.1",
        dtype=dtype,
        backend="gloo",
        device="cpu",
        fallback=object_store_copy(bus, subjects),
    )
