"""Soak: at least 100k operations on a CPU primary and a real file-system tier with a 1% I/O fault rate,
then the whole engine on the same kind of tier.

Opt-in (``-m soak``; deselected by default)::

    pytest -m soak tests/test_soak.py -s

The manager phase prints (and, with ``KVFSM_SOAK_REPORT=path``, writes as JSON) the counts: operations,
faults injected by kind, disk corruptions, restarts, loads served and verified, lost blocks (must be 0)
and corrupt blocks served (must be 0). ``KVFSM_SOAK_OPS`` and ``KVFSM_SOAK_SEED`` change the size and the
seed.

The engine phase runs a :class:`~kvfsm.engine.core.ReferenceEngine` (real tensors, free-running copy
threads, a CPU primary smaller than the working set) in front of a file-system tier with the same 1% fault
rate, wired with ``tiers=``: multi-turn conversations that share prefixes, in batches, with an engine
restart over the same directory every few batches. Every block a load brings back is verified byte for
byte by the engine (mismatches must be 0), every request must finish, and some loads must come from the
tier after a restart. ``KVFSM_SOAK_ENGINE_REQUESTS`` sets its size (with ``KVFSM_SOAK_REPORT``, its counts
go to ``<path>.engine.json``).
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

from kvfsm.control.deadlines import Deadlines
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


# ---------------------------------------------------------------------------------------------- engine

ENGINE_SLOTS = 24  #: CPU slots: fewer than the conversations' chunks, so the tier serves promotions
ENGINE_CONVERSATIONS = 12
ENGINE_BATCH = 4  #: requests added together, then the engine runs until idle
ENGINE_RESTART_EVERY = 25  #: batches per engine; then a fresh engine over the same directory


@dataclass
class EngineSoakCounts:
    requests: int = 0
    steps: int = 0
    restarts: int = 0
    loads_completed: int = 0
    #: Loads in the first batch of a restarted engine: its CPU primary is empty, so they came from disk.
    loads_from_disk_after_restart: int = 0
    loads_failed: int = 0
    blocks_verified: int = 0
    mismatches: int = 0
    unfinished_requests: int = 0
    faults_injected: int = 0
    faults_by_kind: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def run_engine_soak(root: Path, requests: int, seed: int = 0, fault_rate: float = 0.01) -> EngineSoakCounts:
    pytest.importorskip("torch")
    from kvfsm.engine.core import EngineConfig, ReferenceEngine
    from kvfsm.tiers.fs import FileSystemTier

    start = time.monotonic()
    rules = [
        FaultRule(op, kind, probability=fault_rate / len(kinds))
        for op, kinds in FAULTS_PER_OP.items()
        for kind in kinds
    ]
    plan = FaultPlan(rules, seed=seed)
    rng = random.Random(seed)
    config = EngineConfig(
        num_layers=2,
        num_heads=4,
        head_dim=4,
        tokens_per_block=4,
        blocks_per_chunk=2,
        num_gpu_blocks=48,
        num_cpu_slots=ENGINE_SLOTS,
        world_size=2,
        device="cpu",
        copy_threads=1,
    )
    # Bounded waits, so a slow or faulty tier costs a recompute, never a wedge.
    deadlines = Deadlines(store_s=GUARD_S, load_s=GUARD_S, cascade_s=GUARD_S, promote_s=GUARD_S, lookup_wait_s=2.0)
    history = {c: [rng.randrange(1, 30000) for _ in range(8)] for c in range(ENGINE_CONVERSATIONS)}
    counts = EngineSoakCounts()

    def new_engine() -> ReferenceEngine:
        tier = FileSystemTier(root, faults=plan, capacity_files=256, checked=True)
        assert tier.wait_scan(GUARD_S)
        return ReferenceEngine(config, tiers=[tier], deadlines=deadlines)

    def tally(engine: ReferenceEngine) -> None:
        integrity = engine.integrity
        counts.loads_completed += integrity.loads_completed
        counts.loads_failed += integrity.loads_failed
        counts.blocks_verified += integrity.blocks_verified
        counts.mismatches += integrity.mismatches

    engine = new_engine()
    batches = 0
    while counts.requests < requests:
        batch = []
        for c in rng.sample(sorted(history), ENGINE_BATCH):
            req = engine.make_request(f"r{counts.requests}", history[c], max_tokens=3)
            engine.add_request(req)
            batch.append((c, req))
            counts.requests += 1
        counts.steps += engine.run_until_idle()
        if counts.restarts and batches % ENGINE_RESTART_EVERY == 0:
            counts.loads_from_disk_after_restart += engine.integrity.loads_completed
        for c, req in batch:
            if not req.is_finished:
                counts.unfinished_requests += 1
            # The next turn extends the conversation; long ones start over (prompts stay below the CPU tier).
            grown = req.all_token_ids + [rng.randrange(1, 30000) for _ in range(rng.randrange(2, 9))]
            history[c] = grown if len(grown) <= 64 else [rng.randrange(1, 30000) for _ in range(8)]
        batches += 1
        if batches % ENGINE_RESTART_EVERY == 0 and counts.requests < requests:
            engine.shutdown(timeout=GUARD_S)
            tally(engine)
            engine = new_engine()
            counts.restarts += 1
    engine.shutdown(timeout=GUARD_S)
    tally(engine)
    counts.faults_injected = plan.total_injected
    counts.faults_by_kind = {kind.value: n for kind, n in sorted(plan.injected.items())}
    counts.seconds = round(time.monotonic() - start, 1)
    return counts


def test_soak_the_engine_over_a_faulty_file_system_tier(tmp_path: Path) -> None:
    requests = int(os.environ.get("KVFSM_SOAK_ENGINE_REQUESTS", "20000"))
    seed = int(os.environ.get("KVFSM_SOAK_SEED", "0"))
    counts = run_engine_soak(tmp_path, requests, seed)
    summary = json.dumps(asdict(counts), indent=2)
    print(f"\nengine soak counts:\n{summary}")
    if path := os.environ.get("KVFSM_SOAK_REPORT"):
        Path(path + ".engine.json").write_text(summary + "\n")
    assert counts.requests >= requests and counts.unfinished_requests == 0
    assert counts.mismatches == 0
    assert counts.loads_completed > 0 and counts.blocks_verified > 0
    if counts.restarts:
        assert counts.loads_from_disk_after_restart > 0, "no load came back from the tier after a restart"
    if requests >= 1000:
        assert counts.faults_injected > 0
