"""The prompts whose group is complete, kept in a size that does not grow with the run.

The buffer remembers every prompt whose group it completed (admitted, rejected as stale or
filtered) so that a late sample of it (a lease that ran it again) is told a duplicate, not
taken for the start of a new group. Kept as prompt ids, that set grew by one id a group and
went into every snapshot of the buffer's state. Prompt ids are ``e<data epoch>-<record
index>`` (:class:`~asyncrl.actors.buffer.leases.PromptSource`): here a data epoch is one bit
per dataset record, and an epoch whose every prompt is complete is its number alone. Any
other id (a prompt from elsewhere, an index past the dataset) is kept as it is.
"""

from __future__ import annotations

from collections.abc import Iterable

from asyncrl.wire.messages import CompletedEpoch


class CompletedPrompts:
    """A set of prompt ids (``add``, ``discard``, ``in``, ``len``) of a dataset of ``size``
    records."""

    def __init__(self, size: int, uids: Iterable[str] = ()) -> None:
        self.size = size
        self._bits: dict[int, bytearray] = {}
        self._counts: dict[int, int] = {}
        self._full: set[int] = set()
        """Data epochs whose every prompt is complete (no bits kept)."""
        self._other: set[str] = set()
        for uid in uids:
            self.add(uid)

    def _place(self, uid: str) -> tuple[int, int] | None:
        """``(data epoch, record index)`` of a prompt id of this dataset, else None."""
        if uid[:1] != "e":
            return None
        epoch_text, _, index_text = uid[1:].partition("-")
        if not (epoch_text.isdigit() and index_text.isdigit()):
            return None
        epoch, index = int(epoch_text), int(index_text)
        # one id per place: "e01-2" is not "e1-2"
        if index >= self.size or uid != f"e{epoch}-{index}":
            return None
        return epoch, index

    def __contains__(self, uid: object) -> bool:
        if not isinstance(uid, str):
            return False
        where = self._place(uid)
        if where is None:
            return uid in self._other
        epoch, index = where
        if epoch in self._full:
            return True
        bits = self._bits.get(epoch)
        return bits is not None and bool(bits[index >> 3] & (1 << (index & 7)))

    def add(self, uid: str) -> None:
        where = self._place(uid)
        if where is None:
            self._other.add(uid)
            return
        epoch, index = where
        if epoch in self._full:
            return
        bits = self._bits.get(epoch)
        if bits is None:
            bits = self._bits[epoch] = bytearray((self.size + 7) // 8)
        mask = 1 << (index & 7)
        if bits[index >> 3] & mask:
            return
        bits[index >> 3] |= mask
        count = self._counts[epoch] = self._counts.get(epoch, 0) + 1
        if count == self.size:
            self._full.add(epoch)
            del self._bits[epoch], self._counts[epoch]

    def discard(self, uid: str) -> None:
        where = self._place(uid)
        if where is None:
            self._other.discard(uid)
            return
        epoch, index = where
        if epoch in self._full:  # every bit set again, then this one cleared
            self._full.discard(epoch)
            self._bits[epoch] = _all_set(self.size)
            self._counts[epoch] = self.size
        bits = self._bits.get(epoch)
        mask = 1 << (index & 7)
        if bits is None or not bits[index >> 3] & mask:
            return
        bits[index >> 3] &= ~mask & 0xFF
        self._counts[epoch] -= 1
        if not self._counts[epoch]:
            del self._bits[epoch], self._counts[epoch]

    def __len__(self) -> int:
        return len(self._full) * self.size + sum(self._counts.values()) + len(self._other)

    # -- in the buffer's snapshot ----------------------------------------------------------------

    def epochs(self) -> tuple[list[int], list[CompletedEpoch]]:
        """The whole epochs, and the others' bits (what a snapshot keeps)."""
        return sorted(self._full), [
            CompletedEpoch(epoch=e, bits=bytes(self._bits[e])) for e in sorted(self._bits)
        ]

    def others(self) -> list[str]:
        """The ids that are not of this dataset's form, as the set holds them."""
        return list(self._other)

    @classmethod
    def restored(
        cls,
        size: int,
        full: Iterable[int],
        partial: Iterable[CompletedEpoch],
        others: Iterable[str],
    ) -> CompletedPrompts:
        """The set a snapshot kept (:meth:`epochs`, :meth:`others`). A snapshot of an older
        asyncrl keeps every id in ``others``: each goes to its place."""
        done = cls(size, others)
        for epoch in full:
            done._bits.pop(epoch, None)
            done._counts.pop(epoch, None)
            done._full.add(epoch)
        for part in partial:
            if part.epoch in done._full:
                continue
            for index in _set_bits(part.bits, size):
                done.add(f"e{part.epoch}-{index}")
        return done


def _all_set(size: int) -> bytearray:
    bits = bytearray(b"\xff" * ((size + 7) // 8))
    if size & 7:
        bits[-1] = (1 << (size & 7)) - 1
    return bits


def _set_bits(bits: bytes, size: int) -> list[int]:
    """The indices below ``size`` whose bit is set."""
    return [i for i in range(min(size, 8 * len(bits))) if bits[i >> 3] >> (i & 7) & 1]
