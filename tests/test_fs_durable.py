"""The file-system tier's durable mode: a cascade is acknowledged once written, its fsync and directory
sync run in the background, and the tier (so the tiering manager, the scheduler and the engine) has
pending work until they have finished.

The background syncs are gated deterministically: a HANG fault on ``fs.fsync`` / ``fs.dirsync`` holds
them on the I/O thread until the test releases it; every wait is on a real event (a hang reported, the
I/O pool idle, a job's file I/O finished), bounded only as a deadlock guard.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tier_support import GUARD_S, MISS, R1, SLOT_BYTES, block_files, fs_rig, k, payload

from kvfsm.control.config import OffloadConfig
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.types import OffloadingEvent
from kvfsm.machines.names import SlotState
from kvfsm.tiers.blockfile import BlockIO
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule


@pytest.mark.parametrize("op", ["fs.fsync", "fs.dirsync"])
def test_a_durable_cascade_is_acknowledged_before_its_sync_and_pending_until_durable(tmp_path: Path, op: str) -> None:
    """The tier term of TieringManager.has_pending_work is live: with the cascade acknowledged (no
    transfer job left) and its sync held, the tier, the manager and the scheduler are all pending; once
    the sync is released, none is. Dropping the tier term from TieringManager.has_pending_work fails
    this test."""
    plan = FaultPlan([FaultRule(op, FaultKind.HANG)])
    rig = fs_rig(tmp_path, faults=plan, durable=True)
    sched = OffloadingScheduler(OffloadConfig(16), rig.tm)
    try:
        key = k(1)
        assert not rig.tm.has_pending_work() and not sched.has_pending_push_work()
        assert rig.store(key)
        assert rig.tier.wait_jobs(GUARD_S)  # the block file is written and renamed into place
        assert rig.tier.durability_pending == 1  # owed from the rename on, before any poll
        rig.tm.on_schedule_end()  # the poll acknowledges the cascade and queues the sync
        assert plan.wait_for_hangs(1, GUARD_S), f"the background {op} never started"
        # Acknowledged: the manager holds no transfer, the block is the tier's and is readable (page cache).
        assert rig.tm.num_transfer_jobs == 0
        assert rig.tier.entry_state(key) is SlotState.READY and key in rig.tier
        assert rig.tier.stats().stores_committed == 1
        (path,) = block_files(tmp_path)
        info = BlockIO(tmp_path).probe(key)
        assert info is not None and info.path == str(path)
        assert BlockIO(tmp_path).read(info, key, SLOT_BYTES) == payload(key)
        # ... but not durable yet: everyone is pending, whatever the number of steps.
        for _ in range(3):
            rig.tm.on_schedule_end()
            assert rig.tier.has_pending_work(), "the tier forgot its unsynced block"
            assert rig.tm.has_pending_work(), "TieringManager.has_pending_work ignores the tier's own work"
            assert sched.has_pending_push_work(), "the scheduler would let the engine go idle before durability"
        plan.release_hangs()
        assert rig.tier.wait_idle(GUARD_S)
        assert rig.tier.durability_pending == 0
        assert not rig.tier.has_pending_work()
        assert not rig.tm.has_pending_work()
        assert not sched.has_pending_push_work()
        rig.tm.on_schedule_end()
        assert rig.tier.stats().blocks_made_durable == 1 and rig.tier.stats().durability_failed == 0
        assert key in rig.tier
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_without_durable_nothing_is_synced_and_the_tier_is_never_pending(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.fsync", FaultKind.HANG), FaultRule("fs.dirsync", FaultKind.HANG)])
    rig = fs_rig(tmp_path, faults=plan)
    try:
        for i in range(3):
            assert rig.store(k(i))
            assert not rig.tier.has_pending_work()
        rig.settle()
        assert plan.total_injected == 0  # no sync was ever attempted
        assert not rig.tier.has_pending_work() and not rig.tm.has_pending_work()
        assert rig.tier.stats().blocks_made_durable == 0 and rig.tier.durability_pending == 0
        assert len(block_files(tmp_path)) == 3
    finally:
        rig.shutdown()


def test_durable_blocks_are_synced_and_served_and_found_again_after_a_restart(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path, durable=True, num_slots=4)
    try:
        for i in range(6):
            assert rig.store(k(i))
            rig.settle()  # write, poll (acknowledge, queue the sync), sync
        rig.settle()
        assert rig.tier.stats().blocks_made_durable == 6
        assert not rig.tm.has_pending_work()
        assert rig.read_through(k(0)) == payload(k(0))  # evicted from the primary, promoted from disk
    finally:
        rig.shutdown()
    again = fs_rig(tmp_path, durable=True, num_slots=4)
    try:
        for i in range(6):
            assert again.read_through(k(i)) == payload(k(i))
    finally:
        again.shutdown()


@pytest.mark.parametrize("op", ["fs.fsync", "fs.dirsync"])
def test_a_block_whose_sync_fails_is_evicted_never_served(tmp_path: Path, op: str) -> None:
    """After a failed fsync the bytes on disk are in doubt: the block becomes a miss and its file goes."""
    plan = FaultPlan([FaultRule(op, FaultKind.EIO, keys=frozenset({k(2)}))])
    rig = fs_rig(tmp_path, faults=plan, durable=True, num_slots=4)
    try:
        for i in range(3):
            assert rig.store(k(i))
            rig.settle()
        rig.settle()  # applies the failed sync
        stats = rig.tier.stats()
        assert (stats.blocks_made_durable, stats.durability_failed) == (2, 1)
        assert k(2) not in rig.tier and rig.tier.entry_state(k(2)) is SlotState.ABSENT
        assert OffloadingEvent((k(2),), "fs", removed=True) in rig.tm.take_events()
        rig.settle()  # the removal ran
        assert len(block_files(tmp_path)) == 2
        rig.evict_primary(k(2))
        assert rig.read_through(k(2)) is None
        assert rig.tm.lookup(k(2), R1) is MISS
        rig.settle()  # the syncs of the blocks that evicted k(2) from the primary
        assert not rig.tm.has_pending_work()
    finally:
        rig.shutdown()


def test_a_block_evicted_before_its_sync_ran_needs_no_sync(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.fsync", FaultKind.HANG, times=1)])
    rig = fs_rig(tmp_path, faults=plan, durable=True, capacity_files=1)
    try:
        assert rig.store(k(1))
        assert rig.tier.wait_jobs(GUARD_S)
        rig.tm.on_schedule_end()
        assert plan.wait_for_hangs(1, GUARD_S)
        assert rig.store(k(2))  # k(1) is evicted (capacity 1) while its sync is held
        assert rig.tier.wait_jobs(GUARD_S)
        rig.tm.on_schedule_end()
        plan.release_hangs()
        rig.settle()
        rig.settle()
        assert not rig.tm.has_pending_work()
        assert rig.tier.stats().durability_failed == 0
        assert [p.name for p in block_files(tmp_path)] == [os.path.basename(str(rig.tier.file_of(k(2))))]
    finally:
        rig.shutdown()


def test_a_shutdown_cuts_a_hung_sync_short_and_ends_the_pending_work(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.fsync", FaultKind.HANG)])
    rig = fs_rig(tmp_path, faults=plan, durable=True)
    assert rig.store(k(1))
    assert rig.tier.wait_jobs(GUARD_S)
    rig.tm.on_schedule_end()
    assert plan.wait_for_hangs(1, GUARD_S)
    assert rig.tm.has_pending_work()
    rig.shutdown()
    assert rig.tier.threads_alive() == 0
    assert not rig.tier.has_pending_work() and not rig.tm.has_pending_work()
    assert rig.tier.durability_pending == 0
    # The file stays (acknowledged, whole): a restart serves it, checked by its checksum.
    again = fs_rig(tmp_path, durable=True)
    try:
        assert again.read_through(k(1)) == payload(k(1))
    finally:
        again.shutdown()


def test_the_engine_keeps_stepping_until_its_cascades_are_durable(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from helpers import engine_config, keys_of, tokens
    from tier_support import fs_engine

    from kvfsm.machines.names import EngineState

    plan = FaultPlan([FaultRule("fs.fsync", FaultKind.HANG)])
    cfg = engine_config(num_cpu_slots=16)
    engine, tm, tier = fs_engine(tmp_path, cfg, faults=plan, durable=True)
    try:
        req = engine.make_request("a", tokens("a", 21), 1)
        engine.add_request(req)
        n_keys = len(keys_of(req.block_hashes, cfg.blocks_per_chunk))
        steps = 0
        while tier.stats().stores_committed < n_keys:
            assert engine.step() is not None, "the engine went idle before its cascades were acknowledged"
            engine.wait_for_transfers()
            assert tier.wait_jobs(GUARD_S)
            steps += 1
            assert steps < 200
        assert plan.wait_for_hangs(1, GUARD_S)
        for _ in range(5):  # every cascade acknowledged, no transfer left: only durability is pending
            rec = engine.step()
            assert rec is not None and rec.pending_push_work, "the engine went idle before the data was durable"
            assert engine.state is not EngineState.IDLE
        assert tm.num_transfer_jobs == 0 and engine.scheduler.num_jobs == 0
        plan.clear()
        plan.release_hangs()
        assert tier.wait_idle(GUARD_S)
        while engine.step() is not None:
            assert tier.wait_idle(GUARD_S)
            steps += 1
            assert steps < 400
        assert engine.state is EngineState.IDLE
        assert tier.stats().blocks_made_durable == n_keys
    finally:
        plan.clear()
        plan.release_hangs()
        engine.shutdown(timeout=GUARD_S)
