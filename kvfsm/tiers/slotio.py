"""Slot access for secondary tiers: the bytes of a CPU primary slot, across every rank's pool.

A tier moves whole slots. With tensor parallelism (W > 1) each rank holds its own shard of every slot in
its own pool, so a tier needs all W shards: :class:`CompositeSlotIO` concatenates them on read (rank 0
first) and splits them on write. The data plane's ``CPUSlotPool`` is a :class:`SizedSlotIO`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from kvfsm.errors import ConfigError

__all__ = ["CompositeSlotIO", "DictSlotIO", "SizedSlotIO", "SlotIO", "slot_nbytes"]


class SlotIO(Protocol):
    """Access to the CPU primary's slot bytes (the data plane's shared region)."""

    def read_slot(self, slot_id: int) -> bytes: ...

    def write_slot(self, slot_id: int, data: bytes) -> None: ...


@runtime_checkable
class SizedSlotIO(Protocol):
    """A :class:`SlotIO` that also knows the size of one slot."""

    @property
    def nbytes_per_slot(self) -> int: ...

    def read_slot(self, slot_id: int) -> bytes: ...

    def write_slot(self, slot_id: int, data: bytes) -> None: ...


def slot_nbytes(io: object) -> int | None:
    """``io.nbytes_per_slot`` if it has one (an int > 0), else None."""
    try:
        n = getattr(io, "nbytes_per_slot", None)
    except Exception:
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class CompositeSlotIO:
    """The slots of W rank pools as one: slot ``s`` is rank 0's shard of ``s``, then rank 1's, and so on."""

    __slots__ = ("_offsets", "parts")

    def __init__(self, parts: Sequence[SizedSlotIO]) -> None:
        if not parts:
            raise ConfigError("CompositeSlotIO needs at least one rank's pool; got none")
        sizes = []
        for i, part in enumerate(parts):
            n = slot_nbytes(part)
            if n is None:
                raise ConfigError(f"rank {i}'s pool has no positive nbytes_per_slot; expected a sized slot pool")
            sizes.append(n)
        self.parts = tuple(parts)
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        self._offsets = tuple(offsets)

    @property
    def nbytes_per_slot(self) -> int:
        return self._offsets[-1]

    def read_slot(self, slot_id: int) -> bytes:
        return b"".join(part.read_slot(slot_id) for part in self.parts)

    def write_slot(self, slot_id: int, data: bytes) -> None:
        if len(data) != self._offsets[-1]:
            raise ConfigError(
                f"slot data has {len(data)} bytes; expected {self._offsets[-1]} (the shards of {len(self.parts)} ranks)"
            )
        view = memoryview(data)
        for i, part in enumerate(self.parts):
            part.write_slot(slot_id, bytes(view[self._offsets[i] : self._offsets[i + 1]]))


class DictSlotIO:
    """Slots as a dict of bytes (tests, and tiers exercised without a data plane)."""

    __slots__ = ("data", "nbytes")

    def __init__(self, nbytes: int | None = None) -> None:
        self.data: dict[int, bytes] = {}
        self.nbytes = nbytes

    @property
    def nbytes_per_slot(self) -> int:
        if self.nbytes is None:
            raise ConfigError("this DictSlotIO has no fixed slot size")
        return self.nbytes

    def read_slot(self, slot_id: int) -> bytes:
        try:
            return self.data[slot_id]
        except KeyError:
            raise ConfigError(f"slot {slot_id} was never written; expected a written slot") from None

    def write_slot(self, slot_id: int, data: bytes) -> None:
        if self.nbytes is not None and len(data) != self.nbytes:
            raise ConfigError(f"slot data has {len(data)} bytes; expected {self.nbytes}")
        self.data[slot_id] = bytes(data)
