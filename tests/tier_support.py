"""Helpers for the file-system tier, fault, deadline, shutdown and crash tests (no torch at import).

Synchronisation is always a bounded wait on a real event (the tier's I/O pool going idle, a scan thread
ending, a fault plan reporting a hang): the bound is a deadlock guard, never a sleep.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Clock, Deadlines
from kvfsm.control.tiering import BackpressureConfig, TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvfsm.machines.names import SlotState
from kvfsm.tiers.faults import FaultPlan
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.slotio import DictSlotIO

if TYPE_CHECKING:
    from kvfsm.engine.core import EngineConfig, ReferenceEngine

GUARD_S = 60.0  #: deadlock guard for every bounded wait
R1 = ReqContext("r1")
HIT, MISS, PENDING, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY
SLOT_BYTES = 96


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(16, "big"))


def payload(key: OffloadKey, n: int = SLOT_BYTES, generation: int = 0) -> bytes:
    """Deterministic bytes for a key (``generation`` gives a different value for the same key)."""
    out = b""
    i = 0
    while len(out) < n:
        out += hashlib.blake2b(key + generation.to_bytes(4, "big") + i.to_bytes(4, "big"), digest_size=64).digest()
        i += 1
    return out[:n]


@dataclass
class FsRig:
    """A TieringManager over a CPU primary (slot bytes in a dict) and one file-system tier."""

    tm: TieringManager
    primary: CPUOffloadingManager
    tier: FileSystemTier
    io: DictSlotIO
    root: Path

    def settle(self) -> None:
        """Let the tier's I/O finish, then one step applies its results."""
        assert self.tier.wait_idle(GUARD_S), "the tier's I/O never went idle"
        assert self.tier.wait_lookups(GUARD_S), "the tier's lookup probes never finished"
        self.tm.on_schedule_end()

    def store(self, key: OffloadKey, data: bytes | None = None, *, success: bool = True) -> bool:
        """GPU store of ``key`` into the primary (bytes written into its slot), committed; cascades start."""
        out = self.tm.prepare_store([key], R1)
        if out is None or not out.keys_to_store:
            return False
        self.io.data[out.store_spec.slot_ids[0]] = payload(key) if data is None else data
        self.tm.complete_store(out.keys_to_store, R1, success=success)
        return True

    def evict_primary(self, key: OffloadKey) -> None:
        """Make the primary forget ``key`` by storing fresh keys until it is evicted (test-only keys)."""
        i = 10_000_000
        while self.primary.slot_state(key) is not SlotState.ABSENT:
            i += 1
            assert self.primary.slot_state(key) is SlotState.READY, "cannot evict a pinned key"
            self.store(k(i))
            self.settle()

    def read_through(self, key: OffloadKey, *, steps: int = 6) -> bytes | None:
        """Look ``key`` up until it is a primary HIT (promoting it if needed); its bytes, or None (MISS)."""
        for _ in range(steps):
            answer = self.tm.lookup(key, R1)
            if answer is HIT:
                spec = self.tm.prepare_load([key], R1)
                data = self.io.data[spec.slot_ids[0]]
                self.tm.complete_load([key], R1)
                # The scheduler step that read it ends, as an engine's does: a HIT is protected from this
                # step's promotions only (spec/README.md, "A lookup always makes progress").
                self.tm.on_schedule_end()
                return data
            if answer is MISS:
                return None
            self.tm.on_schedule_end()  # submit the promotion / post the probe
            self.settle()
        raise AssertionError(f"key {key.hex()[:12]} still not readable after {steps} steps")

    def shutdown(self) -> None:
        self.tm.shutdown(timeout=5.0)


def fs_rig(
    root: Path,
    *,
    num_slots: int = 8,
    faults: FaultPlan | None = None,
    deadlines: Deadlines | None = None,
    clock: Clock | None = None,
    backpressure: BackpressureConfig | None = None,
    capacity_bytes: int | None = None,
    capacity_files: int | None = None,
    scan: bool = True,
    wait_scan: bool = True,
    durable: bool = False,
) -> FsRig:
    io = DictSlotIO(SLOT_BYTES)
    tier = FileSystemTier(
        root,
        slot_io=io,
        faults=faults,
        capacity_bytes=capacity_bytes,
        capacity_files=capacity_files,
        scan=scan,
        durable=durable,
        checked=True,
    )
    if scan and wait_scan:
        assert tier.wait_scan(GUARD_S)
    primary = CPUOffloadingManager(num_slots, checked=True)
    tm = TieringManager(primary, [tier], checked=True, deadlines=deadlines, clock=clock, backpressure=backpressure)
    tm.on_schedule_end()  # applies the scan result
    return FsRig(tm, primary, tier, io, root)


def block_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.kvb") if not p.name.startswith("."))


def temp_files(root: Path) -> list[Path]:
    return sorted(root.rglob(".*.tmp"))


# ---------------------------------------------------------------------------------------------- engine


def fs_engine(
    root: Path,
    config: EngineConfig,
    *,
    faults: FaultPlan | None = None,
    transfer_faults: FaultPlan | None = None,
    deadlines: Deadlines | None = None,
    clock: Clock | None = None,
    tier_capacity_files: int | None = None,
    durable: bool = False,
) -> tuple[ReferenceEngine, TieringManager, FileSystemTier]:
    """A reference engine whose manager is a CPU primary plus a file-system tier moving the real slot
    bytes of every rank's pool; with ``transfer_faults`` every worker's copies go through a
    :class:`~kvfsm.tiers.faults.FaultyCopyBackend`."""
    from kvfsm.engine.core import ReferenceEngine
    from kvfsm.tiers.faults import FaultyCopyBackend
    from kvfsm.tiers.slotio import CompositeSlotIO, SizedSlotIO

    tier = FileSystemTier(root, faults=faults, capacity_files=tier_capacity_files, durable=durable, checked=True)
    assert tier.wait_scan(GUARD_S)
    primary = CPUOffloadingManager(config.num_cpu_slots, config.policy, checked=True)
    tm = TieringManager(primary, [tier], checked=True, deadlines=deadlines, clock=clock)
    engine = ReferenceEngine(config, manager=tm, deadlines=deadlines, clock=clock)
    pools: list[SizedSlotIO] = []
    for w in engine.workers:
        pool = getattr(w.backend, "pool", None)
        assert isinstance(pool, SizedSlotIO), "the engine's copy backends expose their CPU slot pool"
        pools.append(pool)
        if transfer_faults is not None:
            w.backend = FaultyCopyBackend(w.backend, transfer_faults)
    tier.slot_io = CompositeSlotIO(pools)
    return engine, tm, tier


def run_engine(engine: ReferenceEngine, tier: FileSystemTier, max_steps: int = 2000) -> int:
    """Step until idle; after every step all copies and tier I/O finish (the next step polls them)."""
    steps = 0
    while engine.step() is not None:
        engine.wait_for_transfers()
        assert tier.wait_idle(GUARD_S)
        steps += 1
        assert steps < max_steps, f"engine still {engine.state.value} after {max_steps} steps"
    return steps
