"""Bounded shutdown: it returns within its timeout plus a small margin even with a hung tier or a hung copy;
afterwards every job is terminal, nothing is pinned, and the threads kvfsm can interrupt have stopped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from helpers import engine_config, keys_of, tokens
from tier_support import GUARD_S, R1, block_files, fs_engine, fs_rig, k, run_engine
from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import JobResult, SecondaryTier, TierJob
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.machines.names import EngineState, SlotState
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

pytest.importorskip("torch")

TIMEOUT_S = 0.5
MARGIN_S = 2.0  # generous for a loaded CI machine; the measured overrun is a few tens of milliseconds


def _kvfsm_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("kvfsm-") and t.is_alive()]


def test_shutdown_with_a_hung_tier_returns_within_its_deadline(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.write", FaultKind.HANG)])
    cfg = engine_config(num_cpu_slots=16)
    engine, tm, tier = fs_engine(tmp_path, cfg, faults=plan)
    engine.add_request(engine.make_request("a", tokens("a", 18), 2))
    for _ in range(50):  # step until the store committed and its cascade went to the tier
        engine.step()
        engine.wait_for_transfers()
        if tm.num_transfer_jobs:
            break
    assert plan.wait_for_hangs(1, GUARD_S)  # the cascade is stuck in the tier
    assert engine.has_pending_push_work()  # the hung cascade keeps the engine from going idle
    start = time.monotonic()
    report = engine.shutdown(timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_S + MARGIN_S, f"shutdown took {elapsed:.3f} s"
    assert report.deadline_hit and report.transfers_timed_out >= 1 and not report.clean  # the cascade
    assert report.abandoned == []  # the tier's hang is a cancellable wait: nothing was left behind
    assert engine.state is EngineState.STOPPED
    assert engine.scheduler.jobs() == {} and tm.num_transfer_jobs == 0 and tm.num_quarantined == 0
    assert tm.primary.num_reading == 0 and tm.primary.num_writing == 0  # nothing left pinned
    assert tier.threads_alive() == 0
    assert plan.hanging == 0
    assert engine.shutdown(timeout=TIMEOUT_S).already_stopped


def test_shutdown_with_a_hung_copy_returns_and_leaves_only_that_thread(tmp_path: Path) -> None:
    from kvfsm.engine.core import ReferenceEngine
    from kvfsm.tiers.faults import FaultyCopyBackend

    plan = FaultPlan([FaultRule("transfer.store", FaultKind.HANG, times=1)])
    cfg = engine_config(num_cpu_slots=16)
    engine = ReferenceEngine(cfg)
    for w in engine.workers:
        w.backend = FaultyCopyBackend(w.backend, plan)
    try:
        engine.add_request(engine.make_request("a", tokens("a", 18), 2))
        for _ in range(20):  # step until the store was launched
            engine.step()
            if engine.scheduler.stats.store_jobs and engine.scheduler.job(0) is not None:
                break
        assert plan.wait_for_hangs(1, GUARD_S)  # its copy hangs
        start = time.monotonic()
        report = engine.shutdown(timeout=TIMEOUT_S)
        elapsed = time.monotonic() - start
        assert elapsed < TIMEOUT_S + MARGIN_S, f"shutdown took {elapsed:.3f} s"
        assert engine.state is EngineState.STOPPED
        assert report.jobs_timed_out == 1
        # A copy engine cannot abort a copy: the worker whose copy hangs is left behind (a daemon thread)
        # and the memory its job held is released because nothing can use it after the stop.
        assert report.abandoned == ["worker 0"]
        assert report.quarantine_abandoned == 1
        assert engine.scheduler.jobs() == {} and not engine.scheduler.quarantined_jobs()
        primary = engine.manager
        assert isinstance(primary, CPUOffloadingManager)
        assert primary.num_reading == 0 and primary.num_writing == 0
    finally:
        plan.release_hangs()
    # Once the copy ends, the abandoned shutdown finishes and its threads stop.
    for t in _kvfsm_threads():
        if t.name.startswith("kvfsm-shutdown") or t.name.startswith("kvfsm-fault"):
            t.join(GUARD_S)
            assert not t.is_alive()


def test_a_clean_shutdown_drains_stores_and_cascades_to_disk(tmp_path: Path) -> None:
    cfg = engine_config(num_cpu_slots=16)
    engine, _tm, tier = fs_engine(tmp_path, cfg)
    prompt = tokens("a", 21)
    req = engine.make_request("a", prompt, 1)
    engine.add_request(req)
    for _ in range(3):  # the request runs and finishes; its last stores and the cascades are still due
        engine.step()
    report = engine.shutdown(timeout=GUARD_S)
    assert report.clean, report
    assert engine.state is EngineState.STOPPED
    keys = keys_of(req.block_hashes, cfg.blocks_per_chunk)
    assert len(block_files(tmp_path)) == len(keys) == 5
    assert tier.threads_alive() == 0
    # A new engine on the same directory serves them from the tier.
    engine2, tm2, _tier2 = fs_engine(tmp_path, cfg)
    try:
        engine2.add_request(engine2.make_request("b", prompt, 1))
        run_engine(engine2, _tier2)
        assert engine2.integrity.loads_completed == 1 and engine2.integrity.mismatches == 0
        assert tm2.stats().promotions_completed == len(keys)
    finally:
        engine2.shutdown(timeout=GUARD_S)


@pytest.mark.parametrize("timeout", [None, "default"])
def test_an_unbounded_or_default_shutdown_puts_every_cascade_on_disk(tmp_path: Path, timeout: str | None) -> None:
    # Regression (issue 13, bug 2): shutdown() without a timeout spun its empty steps and timed the
    # cascades out, so the KV never reached disk. Few rounds: each one now waits for the tier.
    cfg = engine_config(num_cpu_slots=16)
    engine, _tm, tier = fs_engine(tmp_path, cfg)
    req = engine.make_request("a", tokens("a", 21), 1)
    engine.add_request(req)
    for _ in range(3):  # the request runs and finishes; its last stores and the cascades are still due
        engine.step()
    report = engine.shutdown(max_rounds=3) if timeout == "default" else engine.shutdown(None, max_rounds=3)
    assert report.clean, report
    assert len(block_files(tmp_path)) == len(keys_of(req.block_hashes, cfg.blocks_per_chunk)) == 5
    assert tier.threads_alive() == 0


class StuckTier(SecondaryTier):
    """A tier whose jobs never finish and whose shutdown blocks until told otherwise."""

    name = "stuck"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.jobs: list[TierJob] = []
        self.shutting_down = False

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.MISS

    @override
    def submit_store(self, job: TierJob) -> None:
        self.jobs.append(job)

    @override
    def submit_load(self, job: TierJob) -> None:
        self.jobs.append(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self.shutting_down:
            raise AssertionError("a tier whose shutdown did not return must not be polled")
        return []

    @override
    def drain_jobs(self) -> None:
        self.release.wait(GUARD_S)

    @override
    def shutdown(self) -> None:
        self.shutting_down = True
        self.release.wait(GUARD_S)


def test_tiering_shutdown_gives_up_on_a_tier_whose_shutdown_hangs() -> None:
    primary = CPUOffloadingManager(4, checked=True)
    tier = StuckTier()
    tm = TieringManager(primary, [tier], checked=True)
    out = tm.prepare_store([k(0)], R1)
    assert out is not None
    tm.complete_store(out.keys_to_store, R1)
    assert primary.slot_state(k(0)) is SlotState.READING
    start = time.monotonic()
    try:
        tm.shutdown(timeout=0.2)
    finally:
        tier.release.set()
    assert time.monotonic() - start < 0.2 + MARGIN_S
    assert tm.num_transfer_jobs == 0 and tm.num_quarantined == 0 and not tm.has_pending_work()
    assert primary.slot_state(k(0)) is SlotState.READY
    assert tm.stats().transfers_abandoned == 1


def test_fs_tier_shutdown_cancels_queued_work_and_reports_it_failed(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.write", FaultKind.HANG)])
    rig = fs_rig(tmp_path, faults=plan)
    for i in range(8):
        rig.store(k(i))  # two writes hang, six wait in the queue
    assert plan.wait_for_hangs(2, GUARD_S)
    start = time.monotonic()
    rig.tier.shutdown(timeout=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
    assert rig.tier.threads_alive() == 0
    rig.tm.on_schedule_end()  # every job reports: the hung ones cancelled, the queued ones never run
    assert rig.tm.num_transfer_jobs == 0
    assert rig.tm.stats().cascades_failed == 8
    assert rig.primary.num_reading == 0
    assert block_files(tmp_path) == []
    rig.tm.shutdown(timeout=TIMEOUT_S)
