"""The trainer's version of the policy to publish (:class:`PolicyWeights`), made lazily in
the form the run's transport asks for: an HF export (through the trainer ranks' collective
export, or linked from a checkpoint's) or the named tensors (gathered, or read from that
checkpoint's export)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from asyncrl.api.weights import NamedTensors
from asyncrl.weights.files import link_export, read_safetensors


@dataclass(frozen=True)
class Wanted:
    """The versions an engine loads: version 0, every multiple of ``every`` and ``last``
    (the run's final version). ``every = 1`` (the default) is every version; ``every = 0``
    is version 0 and ``last`` alone. The eval actor's are its due versions; it tells the
    trainer in its join (:class:`~asyncrl.wire.messages.WeightsJoin`), so that a broadcast
    sends it no other."""

    every: int = 1
    last: int = -1

    def __call__(self, version: int) -> bool:
        return (
            version == 0 or version == self.last or (self.every > 0 and version % self.every == 0)
        )


class PolicyWeights:
    """The trainer's :class:`~asyncrl.api.weights.Weights`: one version of the policy, in
    the forms transports ask for; each made once.

    ``export(folder)`` writes the HF export (collective across trainer ranks);
    ``gather(dtype)`` returns the full named tensors on rank 0 (collective too). A
    version restored from a checkpoint has its export already (``source``): the folder
    links it, the tensors are read from it."""

    def __init__(
        self,
        version: int,
        epoch: int,
        step: int,
        folder: Path,
        *,
        export: Callable[[Path], None],
        gather: Callable[[str], NamedTensors],
        source: Path | None = None,
    ) -> None:
        self.version, self.epoch, self.step = version, epoch, step
        self.folder = folder
        self._export, self._gather, self.source = export, gather, source
        self._exported = False

    def directory(self) -> Path:
        """The HF export of this version at :attr:`folder` (blocking: call in a thread)."""
        if not self._exported:
            # only a --resume finds the name taken (epochs count the restarts of one
            # ``up``), by an export of the run before it that nothing reads any more
            shutil.rmtree(self.folder, ignore_errors=True)
            if self.source is not None and self.source.is_dir():
                link_export(self.source, self.folder)
            else:
                self._export(self.folder)
            self._exported = True
        return self.folder

    @property
    def exported(self) -> bool:
        """Whether :meth:`directory` wrote the export (a checkpoint may link it)."""
        return self._exported

    def tensors(self, dtype: str) -> NamedTensors:
        """The named tensors in ``dtype`` (blocking: call in a thread). Some may be the
        trainer's live parameters: a transport copies what it keeps before it returns."""
        if self.source is not None and self.source.is_dir():
            return read_safetensors(self.source, dtype)
        return self._gather(dtype)


__all__ = ["PolicyWeights", "Wanted"]
