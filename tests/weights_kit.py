"""A version of named tensors as the trainer publishes it, for tests of the broadcast."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from asyncrl.weights.base import Weights


def tensor_weights(
    version: int,
    tensors: Sequence[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
    folder: Path,
) -> Weights:
    """``tensors`` as version ``version`` (epoch 0, step = version): the broadcast gathers
    them in the dtype it asks for; an export is never expected."""
    pairs = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)

    def never(_: Path) -> None:
        raise AssertionError("the broadcast needs no export")

    return Weights(
        version,
        0,
        version,
        folder / f"v{version}",
        export=never,
        gather=lambda dtype: [(n, t.to(getattr(torch, dtype)).clone()) for n, t in pairs],
    )
