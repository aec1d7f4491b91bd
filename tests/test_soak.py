"""Soak: at least 100k operations on a CPU primary and a real file-system tier with a 1% I/O fault rate.

Opt-in (``-m soak``; deselected by default)::

    pytest -m soak tests/test_soak.py -s

It prints (and, with ``KVFSM_SOAK_REPORT=path``, writes as JSON) the counts: operations, faults injected
by kind, disk corruptions, restarts, loads served and verified, lost blocks (must be 0) and corrupt blocks
served (must be 0). ``KVFSM_SOAK_OPS`` and ``KVFSM_SOAK_SEED`` change the size and the seed.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pytest
from tier_support import GUARD_S, HIT, FsRig, fs_rig, k, payload

from kvfsm.control.types import OffloadKey
from kvfsm.machines.names import SlotState
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

pytestmark = pytest.mark.soak

NUM_KEYS = 96
NUM_SLOTS = 16
TIER_FILES = 64

#: Per operation, the chance of a fault: 1% in all, split over the kinds that operation can suffer.
FAULTS_PER_OP: dict[str, tuple[FaultKind, ...]] = {
    "fs.write": (FaultKind.EIO, FaultKind.ENOSPC, FaultKind.SHORT_WRITE, FaultKind.CORRUPT),
    "fs.replace": (FaultKind.EIO,),
    "fs.read": (FaultKind.EIO, FaultKind.SHORT_READ, FaultKind.CORRUPT),
    "fs.unlink": (FaultKind.EIO,),
    "slot.read": (FaultKind.EIO,),
    "slot.write": (FaultKind.EIO,),
}


@dataclass
class SoakCounts:
    operations: int = 0
    stores: int = 0
    failed_stores: int = 0
    lookups: int = 0
    loads_served: int = 0
    verified_reads: int = 0
    restarts: int = 0
    disk_corruptions: int = 0
    faults_injected: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    promotions_failed: int = 0
    cascades_failed: int = 0
    corrupt_detected: int = 0
    lost_blocks: int = 0
    corrupt_blocks_served: int = 0
    seconds: float = 0.0


class Soak:
    def __init__(self, root: Path, seed: int, fault_rate: float) -> None:
        rules = [
            FaultRule(op, kind, probability=fault_rate / len(kinds))
            for op, kinds in FAULTS_PER_OP.items()
            for kind in kinds
        ]
        self.root = root
        self.plan = FaultPlan(rules, seed=seed)
        self.rng = random.Random(seed)
        self.counts = SoakCounts()
        self.cpu_held: set[OffloadKey] = set()
        self.fs_held: set[OffloadKey] = set()
        self.rig = self._rig()

    def _rig(self) -> FsRig:
        return fs_rig(self.root, num_slots=NUM_SLOTS, faults=self.plan, capacity_files=TIER_FILES)

    def _events(self) -> None:
        for ev in self.rig.tm.take_events():
            held = self.cpu_held if ev.medium == "CPU" else self.fs_held
            (held.difference_update if ev.removed else held.update)(ev.keys)

    def _check(self, key: OffloadKey, data: bytes) -> None:
        if data != payload(key):
            self.counts.corrupt_blocks_served += 1

    def _totals(self) -> None:
        s = self.rig.tm.stats()
        t = self.rig.tier.stats()
        self.counts.promotions_failed += s.promotions_failed
        self.counts.cascades_failed += s.cascades_failed
        self.counts.corrupt_detected += t.corrupt_detected

    def op(self) -> None:
        c = self.counts
        c.operations += 1
        tm = self.rig.tm
        key = k(self.rng.randrange(NUM_KEYS))
        r = self.rng.random()
        if r < 0.35:
            ok = self.rng.random() < 0.98
            fresh = self.rig.primary.slot_state(key) is SlotState.ABSENT
            if self.rig.store(key, success=ok):
                c.stores += 1
                if fresh and not ok:
                    c.failed_stores += 1
                    if self.rig.primary.slot_state(key) is not SlotState.ABSENT:
                        c.lost_blocks += 1  # a failed store left something behind
        elif r < 0.70:
            c.lookups += 1
            if tm.lookup(key, _R) is HIT:
                spec = tm.prepare_load([key], _R)
                self._check(key, self.rig.io.data[spec.slot_ids[0]])
                tm.complete_load([key], _R)
                c.loads_served += 1
        elif r < 0.85:
            tm.on_schedule_end()
        elif r < 0.999:
            self.rig.settle()
        else:
            path = self.rig.tier.file_of(key)
            if path is not None and Path(path).exists():
                raw = bytearray(Path(path).read_bytes())
                raw[self.rng.randrange(len(raw))] ^= 1 << self.rng.randrange(8)
                Path(path).write_bytes(bytes(raw))
                c.disk_corruptions += 1
        self._events()

    def verify(self) -> None:
        """Every key reported stored and not removed is loadable with identical bytes, or a failed load
        reports it removed."""
        self.rig.settle()
        self._events()
        for key in sorted(self.cpu_held | self.fs_held):
            data = self.rig.read_through(key, steps=12)
            self._events()
            if data is None:
                if key in self.cpu_held | self.fs_held:
                    self.counts.lost_blocks += 1
            else:
                self.counts.verified_reads += 1
                self._check(key, data)

    def restart(self) -> None:
        self.rig.settle()
        self._events()
        self._totals()
        self.rig.tm.shutdown(timeout=GUARD_S)
        self._events()
        self.rig = self._rig()
        self.cpu_held.clear()
        self.counts.restarts += 1

    def finish(self) -> SoakCounts:
        self.plan.clear()
        self.verify()
        self._totals()
        self.rig.tm.shutdown(timeout=GUARD_S)
        c = self.counts
        c.faults_injected = self.plan.total_injected
        c.faults_by_kind = {kind.value: n for kind, n in sorted(self.plan.injected.items())}
        return c


_R = __import__("tier_support").R1


def run_soak(root: Path, operations: int, seed: int = 0, fault_rate: float = 0.01) -> SoakCounts:
    start = time.monotonic()
    soak = Soak(root, seed, fault_rate)
    for n in range(1, operations + 1):
        soak.op()
        if n % 10_000 == 0:
            soak.verify()
        if n % 25_000 == 0 and n < operations:
            soak.restart()
    counts = soak.finish()
    counts.seconds = round(time.monotonic() - start, 1)
    return counts


def test_soak_100k_operations_with_one_percent_faults(tmp_path: Path) -> None:
    operations = int(os.environ.get("KVFSM_SOAK_OPS", "100000"))
    seed = int(os.environ.get("KVFSM_SOAK_SEED", "0"))
    counts = run_soak(tmp_path, operations, seed)
    summary = json.dumps(asdict(counts), indent=2)
    print(f"\nsoak counts:\n{summary}")
    if path := os.environ.get("KVFSM_SOAK_REPORT"):
        Path(path).write_text(summary + "\n")
    assert counts.operations >= operations
    assert counts.faults_injected > 0
    assert counts.loads_served > 0 and counts.verified_reads > 0
    assert counts.lost_blocks == 0
    assert counts.corrupt_blocks_served == 0
