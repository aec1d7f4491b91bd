"""The file-system tier: block files, the dual-queue pool, async lookups, cascades and promotions with
real bytes, persistence across restarts, capacity, and corruption never served."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
from tier_support import (
    GUARD_S,
    HIT,
    MISS,
    PENDING,
    R1,
    RETRY,
    SLOT_BYTES,
    block_files,
    fs_rig,
    k,
    payload,
    temp_files,
)

from kvfsm.control.manager import JobResult, TierJob
from kvfsm.control.types import OffloadingEvent
from kvfsm.errors import ConfigError, DuplicateJobError, KvfsmError
from kvfsm.machines.names import JobState, SlotState
from kvfsm.tiers.blockfile import HEADER, BlockIO, CorruptBlockError, decode, encode, key_name
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.tiers.fs import FileSystemTier, ScanState
from kvfsm.tiers.lookup import AsyncLookup, LookupPhase
from kvfsm.tiers.pool import DualQueuePool
from kvfsm.tiers.slotio import CompositeSlotIO, DictSlotIO

# ---------------------------------------------------------------------------------------------- format


def test_block_encoding_round_trips_and_detects_every_kind_of_damage() -> None:
    key, data = k(1), payload(k(1))
    buf = encode(key, data, 7)
    assert len(buf) == HEADER.size + len(key) + len(data)
    assert decode(buf, key) == (7, data)
    flipped = bytearray(buf)
    flipped[-5] ^= 1
    with pytest.raises(CorruptBlockError, match="checksum mismatch"):
        decode(bytes(flipped), key)
    with pytest.raises(CorruptBlockError, match="another key"):
        decode(buf, k(2))
    with pytest.raises(CorruptBlockError, match="short or trailing"):
        decode(buf[:-1], key)
    with pytest.raises(CorruptBlockError, match="magic"):
        decode(b"XXXX" + buf[4:], key)
    with pytest.raises(CorruptBlockError, match="header"):
        decode(buf[:10], key)
    header_damage = bytearray(buf)
    header_damage[20] ^= 1  # inside the version field: the digest covers it
    with pytest.raises(CorruptBlockError):
        decode(bytes(header_damage), key)


def test_block_io_write_is_atomic_and_read_removes_bad_files(tmp_path: Path) -> None:
    bio = BlockIO(tmp_path)
    info = bio.write(k(1), payload(k(1)), 5)
    assert Path(info.path).name == f"{key_name(k(1))}.{5:016x}.kvb"
    assert temp_files(tmp_path) == []
    assert bio.read(info, k(1), SLOT_BYTES) == payload(k(1))
    with pytest.raises(CorruptBlockError, match="expected 10"):
        bio.read(info, k(1), 10)
    assert not Path(info.path).exists()  # a failed read removes the file
    info = bio.write(k(1), payload(k(1)), 6)
    assert bio.probe(k(1)) == info
    assert bio.probe(k(2)) is None


# ---------------------------------------------------------------------------------------------- pool


def test_reads_are_not_starved_by_queued_writes() -> None:
    pool = DualQueuePool(read_threads=1, write_threads=1, name="t")
    gate = threading.Event()
    try:
        writes = [pool.submit_write(gate.wait, GUARD_S) for _ in range(10)]
        # The write-priority thread is stuck in the first write, nine more are queued; the read still runs.
        read = pool.submit_read(lambda: "read")
        assert read.result(GUARD_S) == "read"
        assert not any(w.done() for w in writes)
        assert pool.queued_writes >= 8
    finally:
        gate.set()
    assert pool.wait_idle(GUARD_S)
    assert pool.pending == 0
    assert pool.shutdown(GUARD_S)


def test_write_threads_prefer_writes_and_help_with_reads() -> None:
    pool = DualQueuePool(read_threads=0, write_threads=1, name="t")
    gate = threading.Event()
    order: list[str] = []
    blocker = pool.submit_write(gate.wait, GUARD_S)
    r = pool.submit_read(order.append, "read")
    w = pool.submit_write(order.append, "write")
    gate.set()
    blocker.result(GUARD_S)
    w.result(GUARD_S)
    r.result(GUARD_S)
    assert order == ["write", "read"]
    assert pool.shutdown(GUARD_S)


def test_pool_shutdown_cancels_queued_tasks_and_bounds_the_wait() -> None:
    pool = DualQueuePool(read_threads=1, write_threads=1, name="t")
    gate = threading.Event()
    running = threading.Semaphore(0)

    def hold() -> bool:
        running.release()
        return gate.wait(GUARD_S)

    stuck = [pool.submit_write(hold), pool.submit_read(hold)]
    assert running.acquire(timeout=GUARD_S) and running.acquire(timeout=GUARD_S)  # both threads are busy
    queued = [pool.submit_write(lambda: None) for _ in range(3)]
    assert not pool.shutdown(0.05)  # two threads are stuck in a task: it gives up on them
    assert all(f.cancelled() for f in queued)
    with pytest.raises(KvfsmError, match="shut down"):
        pool.submit_read(lambda: None)
    gate.set()
    for f in stuck:
        assert f.result(GUARD_S)
    assert pool.shutdown(GUARD_S) and pool.threads_alive() == 0


def test_pool_rejects_bad_thread_counts() -> None:
    with pytest.raises(ConfigError, match="write_threads=0"):
        DualQueuePool(2, 0)
    with pytest.raises(ConfigError):
        DualQueuePool(-1, 1)


# ---------------------------------------------------------------------------------------------- lookup


def test_async_lookup_answers_later_and_ignores_stale_probes() -> None:
    gate = threading.Event()
    probed: list[int] = []

    def probe(key: int) -> bool:
        gate.wait(GUARD_S)
        probed.append(key)
        if key == 3:
            raise OSError("disk gone")
        return key % 2 == 0

    lk: AsyncLookup[int, bool] = AsyncLookup(probe, False, ttl_steps=2)
    try:
        assert lk.lookup(2, "a") is None  # unknown: queued
        assert lk.lookup(2, "b") is None  # asked again: still one probe
        assert lk.lookup(3) is None and lk.lookup(4) is None
        assert lk.has_pending()
        assert lk.flush() == []  # posts the batch
        state = lk.state(2)
        assert state is not None and state.phase is LookupPhase.IN_FLIGHT and state.requesters == {"a", "b"}
        lk.set_result([4], False)  # 4's truth changed while its probe runs: the probe's answer is stale
        gate.set()
        assert lk.wait_idle(GUARD_S)
        applied = dict(lk.flush())
        assert applied == {2: True, 3: False}  # 3's probe raised: on_error; 4's result was dropped
        r2, r4 = lk.lookup(2), lk.lookup(4)
        assert r2 is not None and r2.result is True
        assert r4 is not None and r4.result is False
        assert not lk.has_pending()
        lk.cleanup("a")
        assert lk.state(2) is not None  # still referenced by "b"
        lk.cleanup("b")
        assert lk.state(2) is None
        for _ in range(4):
            lk.flush()
        assert lk.state(3) is None and lk.state(4) is None  # expired after ttl_steps
    finally:
        gate.set()
        assert lk.shutdown(GUARD_S)


# ---------------------------------------------------------------------------------------------- tier


def test_cascade_writes_a_file_and_pins_the_cpu_slot_until_done(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path, faults=(plan := FaultPlan([FaultRule("fs.write", FaultKind.HANG, times=1)])))
    try:
        assert rig.store(k(1))
        assert plan.wait_for_hangs(1, GUARD_S)
        assert rig.primary.slot_state(k(1)) is SlotState.READING  # pinned by the cascade
        assert rig.tm.has_pending_work()
        assert rig.tier.entry_state(k(1)) is SlotState.WRITING
        assert rig.tier.lookup(k(1), R1) is MISS  # being written is not readable in the tier
        plan.release_hangs()
        rig.settle()
        assert rig.primary.slot_state(k(1)) is SlotState.READY
        assert not rig.tm.has_pending_work()
        assert rig.tier.entry_state(k(1)) is SlotState.READY
        assert len(block_files(tmp_path)) == 1 and temp_files(tmp_path) == []
        events = rig.tm.take_events()
        assert OffloadingEvent((k(1),), "fs", removed=False) in events
        assert rig.tm.stats().cascades_completed == 1
    finally:
        rig.shutdown()


def test_promotion_moves_the_exact_bytes_and_a_normal_load_follows(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path, num_slots=2)
    try:
        rig.store(k(1))
        rig.settle()
        rig.evict_primary(k(1))
        assert rig.primary.slot_state(k(1)) is SlotState.ABSENT
        assert rig.tm.lookup(k(1), R1) is PENDING  # a slot is reserved at once
        assert rig.primary.slot_state(k(1)) is SlotState.WRITING
        assert rig.tm.lookup(k(1), R1) is PENDING  # no second promotion
        rig.tm.on_schedule_end()  # submitted
        assert rig.tm.num_transfer_jobs == 1 and rig.tm.has_pending_work()
        rig.settle()
        assert rig.tm.lookup(k(1), R1) is HIT
        assert rig.read_through(k(1)) == payload(k(1))
        assert rig.tier.stats().loads_completed == 1
    finally:
        rig.shutdown()


def test_index_survives_a_restart_and_serves_hits(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path)
    for i in range(5):
        rig.store(k(i))
    rig.settle()
    rig.shutdown()
    assert len(block_files(tmp_path)) == 5
    again = fs_rig(tmp_path)
    try:
        assert again.tier.scan_state is ScanState.DONE
        assert again.tier.stats().scan_entries == 5
        for i in range(5):
            assert again.read_through(k(i)) == payload(k(i))
        assert again.read_through(k(99)) is None
    finally:
        again.shutdown()


def test_restart_removes_stray_temp_files_damaged_files_and_old_versions(tmp_path: Path) -> None:
    bio = BlockIO(tmp_path)
    live = bio.write(k(1), payload(k(1)), 10)
    old = bio.write(k(2), payload(k(2), generation=1), 10)
    new = bio.write(k(2), payload(k(2), generation=2), 11)
    damaged = bio.write(k(3), payload(k(3)), 10)
    with open(damaged.path, "r+b") as f:
        f.truncate(damaged.size - 3)
    sub = Path(live.path).parent
    dead_tmp = sub / f".{Path(live.path).name}.999999999.deadbeef.1.tmp"  # no such pid
    own_tmp = sub / f".{Path(live.path).name}.{os.getpid()}.cafebabe.1.tmp"  # a dead incarnation of us
    alive_tmp = sub / f".{Path(live.path).name}.1.cafebabe.1.tmp"  # pid 1 is alive: another writer's
    for p in (dead_tmp, own_tmp, alive_tmp):
        p.write_bytes(b"partial")
    rig = fs_rig(tmp_path)
    try:
        s = rig.tier.stats()
        assert (s.temp_files_removed, s.bad_files_removed, s.old_versions_removed) == (2, 1, 1)
        assert not dead_tmp.exists() and not own_tmp.exists() and alive_tmp.exists()
        assert not Path(old.path).exists() and Path(new.path).exists()
        assert rig.read_through(k(2)) == payload(k(2), generation=2)
        assert rig.read_through(k(1)) == payload(k(1))
        assert rig.read_through(k(3)) is None
    finally:
        rig.shutdown()


def test_a_corrupt_file_is_a_failed_promotion_never_served(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path, num_slots=2)
    try:
        rig.store(k(1))
        rig.settle()
        rig.evict_primary(k(1))
        path = rig.tier.file_of(k(1))
        assert path is not None
        raw = bytearray(Path(path).read_bytes())
        raw[-1] ^= 0x55
        Path(path).write_bytes(bytes(raw))
        rig.tm.take_events()
        assert rig.tm.lookup(k(1), R1) is PENDING
        rig.tm.on_schedule_end()
        (jid,) = rig.tier.pending_job_ids()
        job = rig.tm.transfer_job(jid)
        rig.settle()
        assert job.state is JobState.FAILED
        assert rig.primary.slot_state(k(1)) is SlotState.ABSENT  # the slot was freed, never readable
        assert not Path(path).exists()  # the file was removed
        assert rig.tm.lookup(k(1), R1) is MISS  # and nobody promotes it again
        assert OffloadingEvent((k(1),), "fs", removed=True) in rig.tm.take_events()
        s = rig.tier.stats()
        assert (s.corrupt_detected, s.loads_failed) == (1, 1)
        assert rig.tm.stats().promotions_failed == 1
    finally:
        rig.shutdown()


def test_capacity_in_files_evicts_least_recent_and_removes_files(tmp_path: Path) -> None:
    rig = fs_rig(tmp_path, capacity_files=3)
    try:
        for i in range(3):
            rig.store(k(i))
            rig.settle()  # one at a time: recency is commit order
        rig.tier.touch([k(0)], R1)
        rig.store(k(3))
        rig.settle()
        assert sorted(rig.tier.keys()) == sorted([k(0), k(2), k(3)])
        assert OffloadingEvent((k(1),), "fs", removed=True) in rig.tm.take_events()
        assert rig.tier.wait_idle(GUARD_S)
        assert len(block_files(tmp_path)) == 3
        assert rig.tier.stats().evictions == 1
    finally:
        rig.shutdown()


def test_capacity_in_bytes_and_blocks_that_never_fit(tmp_path: Path) -> None:
    one = HEADER.size + len(k(0)) + SLOT_BYTES
    rig = fs_rig(tmp_path, capacity_bytes=2 * one)
    try:
        for i in range(4):
            rig.store(k(i))
            rig.settle()
        assert sorted(rig.tier.keys()) == [k(2), k(3)]
        assert rig.tier.used_bytes == 2 * one
    finally:
        rig.shutdown()
    tiny = fs_rig(tmp_path / "tiny", capacity_bytes=one - 1)
    try:
        tiny.store(k(0))
        tiny.settle()
        assert tiny.tm.stats().cascades_failed == 1  # the block can never fit
        assert tiny.tm.lookup(k(0), R1) is HIT  # the CPU copy stays valid
        assert tiny.tier.stats().stores_rejected == 1
    finally:
        tiny.shutdown()


def test_lookup_answers_retry_until_the_async_probe_resolves(tmp_path: Path) -> None:
    first = fs_rig(tmp_path)
    first.store(k(1))
    first.settle()
    first.shutdown()
    plan = FaultPlan([FaultRule("fs.scan", FaultKind.HANG)])
    rig = fs_rig(tmp_path, faults=plan, wait_scan=False)
    try:
        assert plan.wait_for_hangs(1, GUARD_S)
        assert rig.tier.scan_state is ScanState.RUNNING
        assert rig.tm.lookup(k(1), R1) is RETRY  # unknown while the index is being rebuilt
        assert rig.tm.lookup(k(2), R1) is RETRY
        assert rig.tier.probes_pending()
        assert not rig.tm.has_pending_work()  # a waiting request keeps the engine running, not the probe
        rig.tm.on_schedule_end()  # posts the probes
        assert rig.tier.wait_lookups(GUARD_S)  # the probe thread answered
        rig.tm.on_schedule_end()  # a step applies the answers
        assert not rig.tier.probes_pending()
        assert rig.tm.lookup(k(2), R1) is MISS
        assert rig.tm.lookup(k(1), R1) is PENDING  # a probe hit: promoted like any hit
        assert rig.tier.stats().probe_hits == 1
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_a_scan_that_fails_leaves_the_tier_probing(tmp_path: Path) -> None:
    first = fs_rig(tmp_path)
    first.store(k(1))
    first.settle()
    first.shutdown()
    rig = fs_rig(tmp_path, faults=FaultPlan([FaultRule("fs.scan", FaultKind.EIO)]))
    try:
        assert rig.tier.scan_state is ScanState.FAILED
        assert rig.tm.lookup(k(1), R1) is RETRY
        assert rig.read_through(k(1)) == payload(k(1))
    finally:
        rig.shutdown()


def test_composite_slot_io_spans_every_rank(tmp_path: Path) -> None:
    parts = [DictSlotIO(40), DictSlotIO(56)]
    io = CompositeSlotIO(parts)
    assert io.nbytes_per_slot == 96
    io.write_slot(3, payload(k(1)))
    assert parts[0].data[3] == payload(k(1))[:40] and parts[1].data[3] == payload(k(1))[40:]
    assert io.read_slot(3) == payload(k(1))
    with pytest.raises(ConfigError, match="expected 96"):
        io.write_slot(3, b"short")
    with pytest.raises(ConfigError):
        CompositeSlotIO([])
    with pytest.raises(ConfigError):
        CompositeSlotIO([DictSlotIO()])


def test_composite_over_real_cpu_slot_pools(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from kvfsm.data.pool import CPUSlotPool

    pools = [CPUSlotPool(4, 2, (2, 2, 4, 4), 2, torch.float16, pin_memory=False) for _ in range(2)]
    io = CompositeSlotIO(pools)
    for s in range(4):
        io.write_slot(s, payload(k(s), io.nbytes_per_slot))
    tier = FileSystemTier(tmp_path, slot_io=io)
    try:
        tier.submit_store(TierJob(0, (k(1), k(2)), (1, 2), False, "r"))
        assert tier.wait_idle(GUARD_S)
        assert list(tier.get_finished_jobs()) == [JobResult(0, True)]
        for s in range(4):
            io.write_slot(s, bytes(io.nbytes_per_slot))
        tier.submit_load(TierJob(1, (k(2),), (3,), True, "r"))
        assert tier.wait_idle(GUARD_S)
        assert list(tier.get_finished_jobs()) == [JobResult(1, True)]
        assert io.read_slot(3) == payload(k(2), io.nbytes_per_slot)
    finally:
        tier.shutdown(GUARD_S)


def test_tier_rejects_malformed_jobs_and_use_after_shutdown(tmp_path: Path) -> None:
    tier = FileSystemTier(tmp_path, slot_io=DictSlotIO(SLOT_BYTES))
    with pytest.raises(ConfigError, match="expected is_promotion=False"):
        tier.submit_store(TierJob(0, (k(0),), (0,), True, "r"))
    with pytest.raises(ConfigError, match="one slot per key"):
        tier.submit_load(TierJob(0, (k(0),), (), True, "r"))
    tier.submit_load(TierJob(0, (k(0),), (0,), True, "r"))  # a key it does not hold: fails at once
    assert list(tier.get_finished_jobs()) == [JobResult(0, False)]
    io = tier.slot_io
    assert isinstance(io, DictSlotIO)
    io.data[0] = payload(k(0))
    gate = FaultPlan([FaultRule("fs.write", FaultKind.HANG)])
    tier.faults = gate  # the tier's and its block I/O's
    tier.submit_store(TierJob(1, (k(0),), (0,), False, "r"))
    with pytest.raises(DuplicateJobError, match="already runs job 1"):
        tier.submit_store(TierJob(1, (k(0),), (0,), False, "r"))
    assert gate.wait_for_hangs(1, GUARD_S)
    tier.shutdown(GUARD_S)  # cancels the hang: the job reports failed
    assert list(tier.get_finished_jobs()) == [JobResult(1, False)]
    assert tier.threads_alive() == 0
    with pytest.raises(KvfsmError, match="shut down"):
        tier.submit_store(TierJob(2, (k(1),), (1,), False, "r"))
    with pytest.raises(ConfigError):
        FileSystemTier(tmp_path, capacity_files=0)
    bare = FileSystemTier(tmp_path / "bare", scan=False)
    with pytest.raises(ConfigError, match="no slot_io"):
        bare.submit_store(TierJob(0, (k(0),), (0,), False, "r"))
    bare.shutdown(GUARD_S)
