"""Bug 9: the file-system tier never leaves a superseded version of a block on disk, and never removes
the only valid copy before its replacement is committed. Real files in a temporary directory; a second
writer on the same directory is a second :class:`BlockIO` (another process's tier)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_support import GUARD_S, HIT, MISS, PENDING, RETRY, FsRig, block_files, fs_rig, k, payload

from kvfsm.control.types import OffloadKey, ReqContext
from kvfsm.machines.names import SlotState
from kvfsm.tiers.blockfile import BlockIO, key_name
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

PROBE = ReqContext("probe")


def files_of(root: Path, key: bytes) -> list[Path]:
    return [p for p in block_files(root) if p.name.startswith(key_name(key))]


def version_of(path: str) -> int:
    return int(Path(path).name.split(".")[1], 16)


def probing_rig(root: Path, key: OffloadKey, *, durable: bool = False) -> tuple[FsRig, FaultPlan]:
    """A rig whose scan failed (so unknown keys are probed) and whose first probe of ``key`` is posted
    and held (until ``release_hangs``)."""
    plan = FaultPlan(
        [
            FaultRule("fs.scan", FaultKind.EIO),
            FaultRule("fs.probe", FaultKind.HANG, times=1, keys=frozenset({key})),
        ]
    )
    rig = fs_rig(root, faults=plan, wait_scan=False, durable=durable)
    assert rig.tier.wait_scan(GUARD_S)
    rig.tm.on_schedule_end()  # applies the failed scan
    assert rig.tm.lookup(key, PROBE) is RETRY
    rig.tm.on_schedule_end()  # posts the probe, which hangs
    assert plan.wait_for_hangs(1, GUARD_S)
    return rig, plan


@pytest.mark.parametrize("durable", [False, True])
def test_switching_to_a_newer_version_removes_the_old_file_at_once(tmp_path: Path, durable: bool) -> None:
    key = k(1)
    rig, plan = probing_rig(tmp_path, key, durable=durable)
    try:
        assert rig.store(key)
        assert rig.tier.wait_idle(GUARD_S)
        rig.tm.on_schedule_end()  # our cascade commits
        ours = rig.tier.file_of(key)
        assert ours is not None and rig.tier.entry_state(key) is SlotState.READY
        # Another writer on the same directory puts a newer version next to ours; the probe finds it.
        newer = BlockIO(tmp_path).write(key, payload(key, generation=2), version_of(ours) + 1)
        plan.release_hangs()
        assert rig.tier.wait_lookups(GUARD_S)
        rig.tm.on_schedule_end()  # the probe's answer, the newer file, is adopted
        assert rig.tier.file_of(key) == newer.path
        assert rig.tier.wait_idle(GUARD_S)
        assert files_of(tmp_path, key) == [Path(newer.path)]  # the old version is gone, not left for a restart
        assert rig.tier.used_bytes == newer.size
        assert rig.tier.stats().old_versions_removed == 1
        rig.evict_primary(key)
        assert rig.read_through(key) == payload(key, generation=2)
    finally:
        rig.shutdown()


def test_an_older_file_is_removed_only_when_the_newer_version_commits(tmp_path: Path) -> None:
    """The probe finds an earlier process's file while our newer write is still in flight; that write then
    fails. The old file is the only valid copy: it must survive, and the tier serves it again."""
    key = k(2)
    old = BlockIO(tmp_path).write(key, payload(key), 5)
    plan = FaultPlan(
        [
            FaultRule("fs.scan", FaultKind.EIO),  # unknown keys are probed
            FaultRule("fs.write", FaultKind.HANG, times=1, keys=frozenset({key})),
            FaultRule("fs.replace", FaultKind.EIO, times=1, keys=frozenset({key})),
        ]
    )
    rig = fs_rig(tmp_path, faults=plan, wait_scan=False)
    try:
        assert rig.tier.wait_scan(GUARD_S)
        rig.tm.on_schedule_end()  # applies the failed scan
        assert rig.tm.lookup(key, PROBE) is RETRY  # queued for a probe
        assert rig.store(key)  # our cascade writes a newer version, held in its write
        assert plan.wait_for_hangs(1, GUARD_S)
        assert rig.tier.entry_state(key) is SlotState.WRITING
        rig.tm.on_schedule_end()  # posts the probe
        assert rig.tier.wait_lookups(GUARD_S)
        rig.tm.on_schedule_end()  # applies it: the old file, superseded by the write in flight
        assert rig.tier.entry_state(key) is SlotState.WRITING
        plan.release_hangs()  # the write goes on, and its rename fails
        assert rig.tier.wait_idle(GUARD_S)
        rig.tm.on_schedule_end()
        assert rig.tier.stats().stores_failed == 1
        assert files_of(tmp_path, key) == [Path(old.path)]  # the only valid copy was kept
        assert rig.tier.file_of(key) == old.path  # and it is served again
        rig.evict_primary(key)
        assert rig.tm.lookup(key, PROBE) in (HIT, PENDING)
        assert rig.read_through(key) == payload(key)
    finally:
        rig.shutdown()


def test_an_older_file_goes_when_the_newer_write_commits(tmp_path: Path) -> None:
    key = k(3)
    old = BlockIO(tmp_path).write(key, payload(key, generation=1), 5)
    plan = FaultPlan(
        [
            FaultRule("fs.scan", FaultKind.EIO),
            FaultRule("fs.write", FaultKind.HANG, times=1, keys=frozenset({key})),
        ]
    )
    rig = fs_rig(tmp_path, faults=plan, wait_scan=False)
    try:
        assert rig.tier.wait_scan(GUARD_S)
        rig.tm.on_schedule_end()
        assert rig.tm.lookup(key, PROBE) is RETRY
        assert rig.store(key)
        assert plan.wait_for_hangs(1, GUARD_S)
        rig.tm.on_schedule_end()
        assert rig.tier.wait_lookups(GUARD_S)
        rig.tm.on_schedule_end()  # the old file is known to be superseded, not yet removed
        assert Path(old.path).exists()
        plan.release_hangs()
        assert rig.tier.wait_idle(GUARD_S)
        rig.tm.on_schedule_end()  # our version commits: the old one goes now
        assert rig.tier.wait_idle(GUARD_S)
        ours = rig.tier.file_of(key)
        assert ours is not None and version_of(ours) > 5
        assert files_of(tmp_path, key) == [Path(ours)]
        assert rig.tier.stats().old_versions_removed == 1
        assert rig.tm.lookup(key, PROBE) is HIT  # the primary still holds it
    finally:
        rig.shutdown()


def test_a_restart_after_the_switch_finds_only_the_newest_version(tmp_path: Path) -> None:
    key = k(4)
    rig, plan = probing_rig(tmp_path, key)
    try:
        assert rig.store(key)
        assert rig.tier.wait_idle(GUARD_S)
        rig.tm.on_schedule_end()
        ours = rig.tier.file_of(key)
        assert ours is not None
        BlockIO(tmp_path).write(key, payload(key, generation=3), version_of(ours) + 1)
        plan.release_hangs()
        assert rig.tier.wait_lookups(GUARD_S)
        rig.tm.on_schedule_end()
        assert rig.tier.wait_idle(GUARD_S)
    finally:
        rig.shutdown()
    again = fs_rig(tmp_path)
    try:
        assert again.tier.stats().old_versions_removed == 0  # nothing was left for the scan to clean up
        assert again.read_through(key) == payload(key, generation=3)
        assert again.tm.lookup(k(99), PROBE) is MISS
    finally:
        again.shutdown()


def test_the_start_up_scan_never_removes_the_only_valid_copy_while_a_newer_write_is_in_flight(
    tmp_path: Path,
) -> None:
    """The scan finds an earlier process's file of a key this instance is writing right now; the write then
    fails. The scanned file must survive and be served (before, the scan's result removed it at once)."""
    key = k(5)
    old = BlockIO(tmp_path).write(key, payload(key), 5)
    plan = FaultPlan(
        [
            FaultRule("fs.scan", FaultKind.HANG, times=1),
            FaultRule("fs.write", FaultKind.HANG, times=1, keys=frozenset({key})),
            FaultRule("fs.replace", FaultKind.EIO, times=1, keys=frozenset({key})),
        ]
    )
    rig = fs_rig(tmp_path, faults=plan, wait_scan=False)
    try:
        assert rig.store(key)
        assert plan.wait_for_hangs(2, GUARD_S)  # the scan and our write
        plan.release_hangs()
        assert rig.tier.wait_scan(GUARD_S)
        assert rig.tier.wait_idle(GUARD_S)
        rig.tm.on_schedule_end()  # applies the scan (the key is being written), then the failed write
        assert rig.tier.wait_idle(GUARD_S)
        assert rig.tier.stats().stores_failed == 1
        assert files_of(tmp_path, key) == [Path(old.path)]
        assert rig.tier.file_of(key) == old.path
        rig.evict_primary(key)
        assert rig.read_through(key) == payload(key)
    finally:
        rig.shutdown()
