"""Bug 10 (part): promotion from every tier position. A real TieringManager over a CPU primary (its slot
bytes in a dict) and two or three secondary tiers, in-memory and file-system (real files); a key held by
tier i alone is promoted from tier i, byte for byte, and so are many keys spread over every tier at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest
from tier_support import GUARD_S, HIT, MISS, PENDING, SLOT_BYTES, k, payload

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import OffloadKey, ReqContext
from kvfsm.machines.names import SlotState
from kvfsm.tiers.blockfile import BlockIO
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.memory import InMemoryTier
from kvfsm.tiers.slotio import DictSlotIO

#: Tier layouts: "m" an in-memory tier, "f" a file-system tier; every position of each is tested.
LAYOUTS = ["mm", "mf", "fm", "ff", "mmm", "mmf", "mfm", "fmm", "fmf"]
REQ = ReqContext("req")


class Stack:
    """A TieringManager over a CPU primary and the tiers of one layout, sharing the primary's slot bytes."""

    def __init__(
        self, root: Path, layout: str, placed: Mapping[int, Sequence[OffloadKey]], num_slots: int, corrupt: bool = False
    ) -> None:
        self.io = DictSlotIO(SLOT_BYTES)
        self.tiers: list[InMemoryTier | FileSystemTier] = []
        for i, kind in enumerate(layout):
            held = placed.get(i, ())
            if kind == "m":
                mem = InMemoryTier(f"mem{i}", autocomplete=True, slot_io=self.io)
                for key in held:
                    mem.put(key, payload(key, generation=i))
                self.tiers.append(mem)
            else:
                bio = BlockIO(root / f"fs{i}")
                for n, key in enumerate(held):
                    info = bio.write(key, payload(key, generation=i), n + 1)  # left by an earlier process
                    if corrupt:  # its payload damaged after the write: the checksum will not match
                        raw = bytearray(Path(info.path).read_bytes())
                        raw[-1] ^= 0xFF
                        Path(info.path).write_bytes(bytes(raw))
                fs = FileSystemTier(root / f"fs{i}", slot_io=self.io, name=f"fs{i}", checked=True)
                assert fs.wait_scan(GUARD_S)
                self.tiers.append(fs)
        self.primary = CPUOffloadingManager(num_slots, checked=True)
        self.tm = TieringManager(self.primary, self.tiers, checked=True)
        self.tm.on_schedule_end()  # applies the file-system tiers' scans

    def step(self) -> None:
        """One engine step: submit what lookups reserved, let every tier's I/O finish, apply the results."""
        self.tm.on_schedule_end()
        for tier in self.tiers:
            if isinstance(tier, FileSystemTier):
                assert tier.wait_idle(GUARD_S)
        self.tm.on_schedule_end()

    def read(self, key: OffloadKey) -> bytes:
        spec = self.tm.prepare_load([key], REQ)
        data = self.io.data[spec.slot_ids[0]]
        self.tm.complete_load([key], REQ)
        return data

    def close(self) -> None:
        self.tm.shutdown(timeout=GUARD_S)


@contextmanager
def stack(
    root: Path, layout: str, placed: Mapping[int, Sequence[OffloadKey]], num_slots: int = 8, *, corrupt: bool = False
) -> Iterator[Stack]:
    s = Stack(root, layout, placed, num_slots, corrupt)
    try:
        yield s
    finally:
        s.close()


@pytest.mark.parametrize(
    ("layout", "position"), [(layout, i) for layout in LAYOUTS for i in range(len(layout))], ids=lambda v: str(v)
)
def test_a_key_held_by_one_tier_is_promoted_from_that_tier_byte_identical(
    tmp_path: Path, layout: str, position: int
) -> None:
    key = k(position + 1)
    with stack(tmp_path, layout, {position: [key]}) as s:
        assert [key in tier for tier in s.tiers] == [i == position for i in range(len(layout))]
        assert s.tm.lookup(key, REQ) is PENDING
        assert s.primary.slot_state(key) is SlotState.WRITING  # reserved: a second lookup cannot promote twice
        assert s.tm.lookup(key, REQ) is PENDING
        s.step()
        assert s.tm.lookup(key, REQ) is HIT
        assert s.read(key) == payload(key, generation=position)  # its bytes, from that tier
        stats = s.tm.stats()
        assert (stats.promotions_submitted, stats.promotions_completed, stats.promotions_failed) == (1, 1, 0)
        assert s.tm.lookup(k(999), REQ) is MISS
        assert not s.tm.has_pending_work()


@pytest.mark.parametrize("layout", ["mmm", "mfm", "fmf", "ffm"])
def test_the_first_tier_holding_a_key_serves_it(tmp_path: Path, layout: str) -> None:
    key = k(7)
    last = len(layout) - 1
    with stack(tmp_path, layout, {1: [key], last: [key]}) as s:
        assert s.tm.lookup(key, REQ) is PENDING
        s.step()
        assert s.tm.lookup(key, REQ) is HIT
        assert s.read(key) == payload(key, generation=1)  # tier 1's copy, not the last tier's


@pytest.mark.parametrize("layout", ["fm", "fmm", "ffm"])
def test_a_failed_promotion_falls_back_to_the_next_tier_holding_the_key(tmp_path: Path, layout: str) -> None:
    """Tier 0's file is damaged: its promotion fails, the file is removed, and the next lookup promotes the
    key from the last tier, with that tier's bytes; nothing corrupt ever reaches the primary."""
    key = k(8)
    last = len(layout) - 1
    with stack(tmp_path, layout, {0: [key], last: [key]}, corrupt=True) as s:
        assert s.tm.lookup(key, REQ) is PENDING
        s.step()
        assert s.primary.slot_state(key) is SlotState.ABSENT  # the failed promotion freed its slot
        assert s.tm.stats().promotions_failed == 1
        assert key not in s.tiers[0]
        assert s.tm.lookup(key, REQ) is PENDING  # now from the last tier
        s.step()
        assert s.tm.lookup(key, REQ) is HIT
        assert s.read(key) == payload(key, generation=last)


@pytest.mark.parametrize("layout", ["mmf", "fmf", "fmm"])
def test_many_keys_over_every_tier_are_promoted_in_one_step(tmp_path: Path, layout: str) -> None:
    n = 96
    all_keys = [k(100 + j) for j in range(n)]
    placed = {i: all_keys[i :: len(layout)] for i in range(len(layout))}
    where = {key: i for i, ks in placed.items() for key in ks}
    with stack(tmp_path, layout, placed, num_slots=n + 8) as s:
        assert all(s.tm.lookup(key, REQ) is PENDING for key in all_keys)
        s.step()
        assert all(s.tm.lookup(key, REQ) is HIT for key in all_keys)
        wrong = [key.hex()[:12] for key in all_keys if s.read(key) != payload(key, generation=where[key])]
        assert wrong == []
        stats = s.tm.stats()
        assert (stats.promotions_submitted, stats.promotions_completed, stats.promotions_failed) == (n, n, 0)
        assert stats.secondary_hits == n


def test_many_requests_promote_from_every_tier_through_a_small_primary(tmp_path: Path) -> None:
    """More keys than primary slots, in waves of requests: each wave is promoted, read and released, and
    the next one evicts it; every key comes from the one tier that holds it, with its own bytes."""
    layout, n, slots = "fmf", 120, 16
    all_keys = [k(1000 + j) for j in range(n)]
    placed = {i: all_keys[i :: len(layout)] for i in range(len(layout))}
    where = {key: i for i, ks in placed.items() for key in ks}
    with stack(tmp_path, layout, placed, num_slots=slots) as s:
        for w in range(0, n, 12):
            wave = all_keys[w : w + 12]
            ctx = ReqContext(f"wave{w}")
            assert [s.tm.lookup(key, ctx) for key in wave] == [PENDING] * len(wave)
            s.step()
            for key in wave:
                assert s.tm.lookup(key, ctx) is HIT
                spec = s.tm.prepare_load([key], ctx)
                assert s.io.data[spec.slot_ids[0]] == payload(key, generation=where[key]), key.hex()
                s.tm.complete_load([key], ctx)
            s.tm.on_request_finished(ctx)
            # The scheduler step that read this wave ends: its HITs are no longer protected from the next
            # wave's promotions (spec/README.md, "A lookup always makes progress").
            s.tm.on_schedule_end()
        stats = s.tm.stats()
        assert (stats.promotions_completed, stats.promotions_failed) == (n, 0)
