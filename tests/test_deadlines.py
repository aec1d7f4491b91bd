"""Deadlines on every waiting state, timeouts through the job machine, quarantine of copies that may still
run, and cascade backpressure. Time is a ManualClock: nothing here sleeps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import pytest
from helpers import FakeRequest, LoopbackWorkers, engine_config, keys_of, tokens
from tier_support import GUARD_S

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import DeadlineQueue, Deadlines, ManualClock
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.tiering import BackpressureConfig, CascadeBackpressure, TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvfsm.errors import AckCountError, ConfigError, UnknownJobError
from kvfsm.machines.names import EngineState, JobKind, JobState, RequestState, SlotState
from kvfsm.tiers.memory import InMemoryTier

TPB = 4
R1 = ReqContext("r1")
HIT, MISS, PENDING = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


# ---------------------------------------------------------------------------------------------- basics


def test_deadlines_validate_and_map_kinds() -> None:
    d = Deadlines(store_s=1, load_s=2, cascade_s=3, promote_s=4, lookup_wait_s=5)
    assert [d.for_kind(kd) for kd in (JobKind.STORE, JobKind.LOAD, JobKind.CASCADE, JobKind.PROMOTE)] == [1, 2, 3, 4]
    assert Deadlines.uniform(2.5) == Deadlines(2.5, 2.5, 2.5, 2.5, 2.5, 2.5)
    assert not Deadlines.none().any_job_deadline and d.any_job_deadline
    assert all(getattr(Deadlines.none(), f.name) is None for f in dataclasses.fields(Deadlines))
    for bad in (0, -1, float("inf"), float("nan"), True):
        with pytest.raises(ConfigError, match="expected a finite number of seconds"):
            Deadlines(store_s=bad)


def test_the_defaults_bound_every_waiting_state() -> None:
    # Regression (issue 13, bug 6): with nothing configured no state had a deadline.
    d = Deadlines()
    assert {f.name: getattr(d, f.name) for f in dataclasses.fields(d)} == {
        "store_s": 30.0,
        "load_s": 30.0,
        "cascade_s": 60.0,
        "promote_s": 30.0,
        "lookup_wait_s": 5.0,
        "shutdown_s": 20.0,
    }
    assert d.any_job_deadline


def test_a_hit_pending_wait_ends_by_default() -> None:
    # Regression (issue 13, bug 6): with no deadlines configured a HIT_PENDING wait lasted as long as the
    # store took (forever for a hung store). The default lookup_wait_s ends it after 5 s.
    clock = ManualClock()
    manager = CPUOffloadingManager(16)
    sched = OffloadingScheduler(OffloadConfig(TPB), manager, clock=clock)  # nothing configured
    workers = LoopbackWorkers(1)
    first = FakeRequest("a", tokens("a", 17), TPB)
    assert sched.get_num_new_matched_tokens(first, 0) == (0, False)
    sched.update_state_after_alloc(first, list(range(5)), 0)
    workers.deliver(
        sched.build_connector_meta(
            SchedulerOutput(
                (ScheduledRequest("a", tuple(range(5)), 17, admitted=True),), allocated_block_ids=frozenset(range(5))
            )
        )
    )  # its store never completes: a hung copy
    second = FakeRequest("b", first.token_ids, TPB)
    for _ in range(4):
        assert sched.get_num_new_matched_tokens(second, 0) == (None, False)
        clock.advance(1.0)
    clock.advance(1.0)
    assert sched.get_num_new_matched_tokens(second, 0) == (0, False)  # waited 5 s: computes it instead
    assert sched.stats.lookup_wait_timeouts == 1


def test_deadline_queue_and_manual_clock() -> None:
    q = DeadlineQueue()
    for i, t in enumerate((5.0, 1.0, 3.0)):
        q.push(i, t)
    assert q.next_deadline() == 1.0
    assert q.pop_expired(2.0) == [1]
    assert q.pop_expired(10.0) == [2, 0]
    assert len(q) == 0
    for i in range(200):
        q.push(i, 100.0 + i)
    q.compact({5}, 1)
    assert len(q) == 1
    clock = ManualClock(10.0)
    assert clock() == 10.0 and clock.advance(2.5) == 12.5
    with pytest.raises(ConfigError):
        clock.advance(-1)


# ---------------------------------------------------------------------------------------------- scheduler


class Rig:
    """A scheduler with deadlines on a manual clock, its CPU manager and loopback workers."""

    def __init__(self, world_size: int = 1, deadlines: Deadlines | None = None, num_slots: int = 16) -> None:
        self.clock = ManualClock()
        self.manager = CPUOffloadingManager(num_slots, checked=True)
        self.sched = OffloadingScheduler(
            OffloadConfig(TPB, 1, world_size),
            self.manager,
            checked=True,
            deadlines=deadlines or Deadlines(store_s=1.0, load_s=1.0, lookup_wait_s=2.0),
            clock=self.clock,
        )
        self.workers = LoopbackWorkers(world_size)

    def request(self, req_id: str, seed: str, n: int = 17) -> FakeRequest:
        return FakeRequest(req_id, tokens(seed, n), TPB)

    def keys(self, req: FakeRequest) -> list[OffloadKey]:
        return keys_of(req.block_hashes, 1)

    def step(self, *scheduled: ScheduledRequest, deliver: bool = True) -> ConnectorMetadata:
        allocated = frozenset(b for s in scheduled if s.admitted for b in s.new_block_ids)
        meta = self.sched.build_connector_meta(SchedulerOutput(tuple(scheduled), allocated_block_ids=allocated))
        if deliver:
            self.workers.deliver(meta)
        return meta

    def store(self, req: FakeRequest, blocks: Sequence[int], *, deliver: bool = True) -> int:
        """Admit ``req`` (no load) and run the step that plans its store; returns the store job id."""
        assert self.sched.get_num_new_matched_tokens(req, 0) == (0, False)
        self.sched.update_state_after_alloc(req, list(blocks), 0)
        meta = self.step(ScheduledRequest(req.req_id, tuple(blocks), req.num_tokens, admitted=True), deliver=deliver)
        req.num_computed_tokens = req.num_tokens
        (job_id,) = meta.store_jobs
        return job_id


def test_a_timed_out_store_is_quarantined_until_its_copy_reports() -> None:
    rig = Rig()
    req = rig.request("a", "a")
    jid = rig.store(req, range(5))
    job = rig.sched.job(jid)
    assert job is not None and job.state is JobState.IN_FLIGHT
    keys = rig.keys(req)
    rig.clock.advance(0.5)
    rig.step()
    assert job.current() is JobState.IN_FLIGHT  # not yet
    rig.clock.advance(0.6)
    rig.step()
    assert job.current() is JobState.TIMED_OUT
    assert rig.sched.num_jobs == 0 and rig.sched.request_jobs("a") == frozenset()  # the engine moves on
    assert rig.sched.is_quarantined(jid)
    # Regression (issue 10, item 6): the copy may still touch memory, so it is pending work until it
    # reports; before, has_pending_push_work() was False here and an engine could go idle over it.
    assert rig.sched.has_pending_push_work() and rig.sched.num_quarantined == 1
    # The copy may still be writing: the slots stay writing (never readable, never reused).
    assert all(rig.manager.slot_state(x) is SlotState.WRITING for x in keys)
    assert rig.manager.lookup(keys[0], R1) is PENDING
    assert rig.sched.stats.timed_out_stores == 1
    # The late ack is absorbed, not an UnknownJobError, and it never commits anything.
    rig.sched.update_connector_output(rig.workers.report(jid))
    assert not rig.sched.is_quarantined(jid)
    assert all(rig.manager.slot_state(x) is SlotState.ABSENT for x in keys)
    assert rig.sched.take_released_quarantine() == [jid]
    assert rig.sched.stats.late_reports_ignored == 1
    assert rig.sched.stats.committed_stores == 0
    assert rig.manager.num_free == 16
    assert not rig.sched.has_pending_push_work() and rig.sched.num_quarantined == 0


def test_quarantine_waits_for_every_launched_rank() -> None:
    rig = Rig(world_size=2)
    req = rig.request("a", "a")
    jid = rig.store(req, range(5))
    rig.sched.update_connector_output(rig.workers.report(jid, [0]))  # rank 0 acked in time
    rig.clock.advance(2.0)
    rig.step()
    assert rig.sched.is_quarantined(jid)
    late = rig.workers.report(jid, [1], ok=False)
    for refused in (WorkerOutput(completed={jid: {0, 1}}), WorkerOutput(completed={jid: {0}})):
        # rank 0 already reported in time: a second report from it is refused, alone or beside rank 1's
        with pytest.raises(AckCountError, match="rank 0 has no outstanding copy"):
            rig.sched.update_connector_output(refused)
        assert rig.sched.is_quarantined(jid)  # the refused report changed nothing
    rig.sched.update_connector_output(late)
    assert not rig.sched.is_quarantined(jid)
    assert rig.manager.num_free == 16
    with pytest.raises(UnknownJobError):
        rig.sched.update_connector_output(WorkerOutput(completed={jid: {1}}))  # a report beyond every rank


def test_a_job_no_worker_launched_is_released_at_once() -> None:
    rig = Rig()
    req = rig.request("a", "a")
    jid = rig.store(req, range(5), deliver=False)
    rig.clock.advance(5.0)
    rig.step(deliver=False)
    assert not rig.sched.is_quarantined(jid)
    assert rig.manager.num_free == 16
    assert rig.sched.request_state("a") is RequestState.RUNNING


def test_a_timed_out_load_reports_invalid_blocks_and_keeps_its_slots_pinned() -> None:
    rig = Rig()
    first = rig.request("a", "a")
    sid = rig.store(first, range(5))
    rig.sched.update_connector_output(rig.workers.report(sid))
    keys = rig.keys(first)
    assert all(rig.manager.slot_state(x) is SlotState.READY for x in keys)
    second = FakeRequest("b", first.token_ids, TPB)
    external, is_async = rig.sched.get_num_new_matched_tokens(second, 0)
    assert (external, is_async) == (16, True)
    rig.sched.update_state_after_alloc(second, [10, 11, 12, 13, 14], 16)
    meta = rig.step()
    (lid,) = meta.load_jobs
    rig.clock.advance(1.5)
    rig.step()
    load = rig.workers.jobs[lid]
    assert load.state is JobState.TIMED_OUT
    assert rig.sched.request_state("b") is RequestState.RUNNING  # the request moves on and recomputes
    assert rig.sched.take_load_errors() == {"b": (10, 11, 12, 13)}
    assert rig.sched.is_quarantined(lid)
    assert all(rig.manager.slot_state(x) is SlotState.READING for x in keys)  # still being read
    assert rig.sched.stats.timed_out_loads == 1 and rig.sched.stats.committed_loads == 0
    rig.sched.update_connector_output(rig.workers.report(lid))
    assert all(rig.manager.slot_state(x) is SlotState.READY for x in keys)
    assert rig.sched.take_released_quarantine() == [lid]


def test_hit_pending_waits_end_after_lookup_wait_s() -> None:
    rig = Rig(deadlines=Deadlines(lookup_wait_s=2.0))
    first = rig.request("a", "a")
    rig.store(first, range(5))  # in flight: its chunks answer HIT_PENDING
    second = FakeRequest("b", first.token_ids, TPB)
    assert rig.sched.get_num_new_matched_tokens(second, 0) == (None, False)
    rig.clock.advance(1.0)
    assert rig.sched.get_num_new_matched_tokens(second, 0) == (None, False)
    rig.clock.advance(1.0)
    assert rig.sched.get_num_new_matched_tokens(second, 0) == (0, False)  # gave up waiting: recompute
    assert rig.sched.stats.lookup_wait_timeouts == 1
    assert rig.sched.request_state("b") is RequestState.DEFERRED


def test_no_deadlines_means_no_timeouts() -> None:
    rig = Rig(deadlines=Deadlines.none())
    req = rig.request("a", "a")
    jid = rig.store(req, range(5))
    rig.clock.advance(1e9)
    rig.step()
    assert rig.sched.job(jid) is not None
    assert rig.sched.expire_jobs() == 0


def test_abandon_jobs_cancels_unlaunched_and_times_out_launched() -> None:
    rig = Rig(deadlines=Deadlines.none())
    launched = rig.store(rig.request("a", "a"), range(5))
    unlaunched = rig.store(rig.request("b", "b"), range(5, 10), deliver=False)
    assert rig.sched.abandon_jobs() == (1, 1, 0)
    assert rig.workers.jobs[launched].state is JobState.TIMED_OUT
    assert rig.sched.stats.cancelled_jobs == 1 and not rig.sched.is_quarantined(unlaunched)
    assert rig.sched.is_quarantined(launched)
    assert rig.sched.release_quarantine() == 1
    assert rig.manager.num_free == 16 and rig.manager.num_writing == 0
    assert rig.sched.stats.quarantine_abandoned == 1


def test_reset_flushes_quarantined_copies() -> None:
    rig = Rig()
    jid = rig.store(rig.request("a", "a"), range(5))
    rig.clock.advance(2.0)
    rig.step()
    assert rig.sched.is_quarantined(jid)
    rig.sched.reset_cache()
    meta = rig.step()
    assert jid in meta.jobs_to_flush  # the workers wait for the copy before the slots are reused
    assert not rig.sched.is_quarantined(jid)
    rig.sched.update_connector_output(rig.workers.report(jid))  # stale now: ignored
    assert rig.sched.stats.stale_reports_ignored == 1


# ---------------------------------------------------------------------------------------------- tiering


def tiering(
    deadlines: Deadlines | None = None, backpressure: BackpressureConfig | None = None, num_slots: int = 4
) -> tuple[TieringManager, CPUOffloadingManager, InMemoryTier, ManualClock]:
    clock = ManualClock()
    primary = CPUOffloadingManager(num_slots, checked=True)
    tier = InMemoryTier("mem")
    tm = TieringManager(
        primary,
        [tier],
        checked=True,
        deadlines=deadlines or Deadlines(cascade_s=1.0, promote_s=1.0),
        clock=clock,
        backpressure=backpressure,
    )
    return tm, primary, tier, clock


def store(tm: TieringManager, *ids: int) -> None:
    out = tm.prepare_store([key(i) for i in ids], R1)
    assert out is not None
    tm.complete_store(out.keys_to_store, R1)


def test_a_timed_out_cascade_keeps_its_slot_pinned_until_the_tier_reports() -> None:
    tm, primary, tier, clock = tiering()
    store(tm, 0)
    (jid,) = tier.pending_job_ids()
    job = tm.transfer_job(jid)
    clock.advance(1.5)
    tm.on_schedule_end()
    assert job.state is JobState.TIMED_OUT
    # The tier may still read the slot: its copy is pending work (the engine keeps draining and polling)
    # until it reports (issue 10, item 6; before, a hung tier let the engine go idle over it).
    assert tm.has_pending_work()
    assert tm.num_quarantined == 1 and tm.quarantined_job_ids() == [jid]
    assert primary.slot_state(key(0)) is SlotState.READING  # the tier may still be reading it
    assert tm.lookup(key(0), R1) is HIT  # the CPU copy stays valid
    tier.complete(jid)  # the late result
    tm.on_schedule_end()
    assert primary.slot_state(key(0)) is SlotState.READY and not tm.has_pending_work()
    s = tm.stats()
    assert (s.cascades_timed_out, s.late_results, s.transfers_quarantined) == (1, 1, 0)


def test_a_timed_out_promotion_never_commits_and_is_retried_after() -> None:
    tm, primary, tier, clock = tiering()
    tier.put(key(5))
    assert tm.lookup(key(5), R1) is PENDING
    tm.on_schedule_end()
    (jid,) = tier.pending_job_ids()
    clock.advance(1.5)
    tm.on_schedule_end()
    with pytest.raises(UnknownJobError):
        tm.transfer_job(jid)  # no longer in flight
    assert primary.slot_state(key(5)) is SlotState.WRITING  # reserved until the tier reports
    assert tm.lookup(key(5), R1) is PENDING  # no second promotion meanwhile
    assert tier.pending_job_ids() == [jid]
    tier.complete(jid)  # succeeds, but too late: the slot is freed, not committed
    tm.on_schedule_end()
    assert primary.slot_state(key(5)) is SlotState.ABSENT
    assert key(5) in tier  # a timeout is not evidence of bad data: the tier keeps its copy
    assert tm.lookup(key(5), R1) is PENDING  # promoted again
    assert tm.stats().promotions_timed_out == 1


def test_shutdown_releases_everything_tiers_never_reported() -> None:
    tm, primary, tier, _clock = tiering(deadlines=Deadlines.none())
    store(tm, 0)
    tier.put(key(5))
    assert tm.lookup(key(5), R1) is PENDING
    tm.on_schedule_end()
    tier.drain_jobs = lambda: None  # type: ignore[method-assign]  # a tier that never reports
    tier.get_finished_jobs = lambda: []  # type: ignore[method-assign]
    tm.shutdown(timeout=1.0)
    assert tm.num_transfer_jobs == 0 and tm.num_quarantined == 0
    assert primary.num_reading == 0 and primary.num_writing == 0  # nothing left pinned
    assert not tm.has_pending_work()
    assert tm.stats().transfers_abandoned == 2


def pressured(bp: CascadeBackpressure) -> bool:
    """Read through a call, so that mypy does not narrow the flag across updates."""
    return bp.under_pressure


def test_backpressure_ema_with_warmup_and_hysteresis() -> None:
    bp = CascadeBackpressure(BackpressureConfig(alpha=0.5, high_water_s=1.0, low_water_s=0.5, warmup=3))
    bp.on_completed(5.0)
    bp.on_completed(5.0)
    assert not pressured(bp)  # warm-up: no decision yet
    bp.on_completed(5.0)
    assert pressured(bp)
    bp.on_completed(0.4)  # EMA 2.7
    bp.on_completed(0.4)  # 1.55
    bp.on_completed(0.4)  # 0.975: below high but above low: still under pressure (hysteresis)
    assert pressured(bp)
    bp.on_completed(0.1)  # 0.54
    assert pressured(bp)
    bp.on_completed(0.1)  # 0.32 < low
    assert not pressured(bp)
    bp.on_outstanding(2.0)  # a stuck cascade is pressure too
    assert pressured(bp) and bp.transitions == 3
    bp.reset()
    assert not pressured(bp) and bp.ema_s is None
    with pytest.raises(ConfigError):
        BackpressureConfig(alpha=0.0)
    with pytest.raises(ConfigError):
        BackpressureConfig(low_water_s=2.0, high_water_s=1.0)
    with pytest.raises(ConfigError):
        BackpressureConfig(warmup=-1)


def test_backpressure_drops_cascades_to_a_slow_tier_but_never_promotions() -> None:
    tm, primary, tier, clock = tiering(
        deadlines=Deadlines.none(),
        backpressure=BackpressureConfig(high_water_s=1.0, low_water_s=0.5, warmup=2),
        num_slots=16,
    )

    def cascade_one(i: int, latency: float) -> None:
        store(tm, i)
        clock.advance(latency)
        tier.complete_all()
        tm.on_schedule_end()

    cascade_one(0, 3.0)
    cascade_one(1, 3.0)
    bp = tm.backpressure(0)
    assert bp is not None and pressured(bp)
    store(tm, 2)  # no cascade in flight: admitted as a probe
    store(tm, 3)  # the probe is in flight: dropped
    assert tm.stats().cascade_probes == 1 and tm.stats().cascades_dropped == 1
    assert primary.slot_state(key(3)) is SlotState.READY  # a dropped cascade pins nothing
    assert tier.pending_job_ids() and len(tier.pending_job_ids()) == 1
    tier.put(key(50))
    assert tm.lookup(key(50), R1) is PENDING  # promotions are never dropped
    tm.on_schedule_end()
    assert len(tier.pending_job_ids()) == 2
    tier.complete_all()
    tm.on_schedule_end()
    for i in range(4, 12):  # fast probes bring the average down: cascades flow again
        cascade_one(i, 0.0)
    assert not pressured(bp)
    store(tm, 20)
    store(tm, 21)
    assert len(tier.pending_job_ids()) == 2
    assert key(50) in tier


def test_a_hung_cascade_puts_its_tier_under_pressure() -> None:
    tm, _primary, tier, clock = tiering(
        deadlines=Deadlines.none(), backpressure=BackpressureConfig(high_water_s=1.0, low_water_s=0.5, warmup=3)
    )
    store(tm, 0)
    clock.advance(2.0)  # the first cascade is stuck (warm-up or not)
    store(tm, 1)
    assert tm.stats().cascades_dropped == 1
    assert len(tier.pending_job_ids()) == 1


# ---------------------------------------------------------------------------------------------- engine


def test_engine_moves_on_from_a_hung_load_and_quarantines_its_gpu_blocks() -> None:
    pytest.importorskip("torch")
    from kvfsm.data.backend import ThreadPoolCopyBackend
    from kvfsm.engine.core import ReferenceEngine
    from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule, FaultyCopyBackend

    clock = ManualClock()
    plan = FaultPlan([FaultRule("transfer.load", FaultKind.HANG, times=1)])
    cfg = engine_config(num_gpu_blocks=24, num_cpu_slots=16)
    engine = ReferenceEngine(cfg, deadlines=Deadlines(load_s=5.0), clock=clock)
    inners: list[ThreadPoolCopyBackend] = []
    for w in engine.workers:
        assert isinstance(w.backend, ThreadPoolCopyBackend)
        inners.append(w.backend)
        w.backend = FaultyCopyBackend(w.backend, plan)

    def run(until: Callable[[], bool] = lambda: False) -> None:
        for _ in range(500):
            if until() or engine.step() is None:
                return
            for inner in inners:
                inner.wait_all()  # every copy that is not hung has finished before the next poll
            clock.advance(1.0)
        raise AssertionError("engine never went idle")

    try:
        prompt = tokens("p", 21)
        first = engine.make_request("a", prompt, 2)
        engine.add_request(first)
        run()
        engine.reset_prefix_cache()  # the next request must load from the CPU tier
        second = engine.make_request("b", prompt, 2)
        engine.add_request(second)
        run(until=lambda: second.is_finished and engine.scheduler.num_jobs == 0)
        assert plan.hanging == 1  # the load is still hung, yet the engine finished the request
        assert engine.scheduler.stats.timed_out_loads == 1
        quarantined = engine.quarantined_blocks
        assert len(quarantined) == 1
        (blocks,) = quarantined.values()
        assert blocks and all(engine.block_pool.ref_count(b) == 1 for b in blocks)  # kept out of the pool
        assert engine.integrity.mismatches == 0
        assert engine.integrity.loads_completed == 1  # the re-queued request loaded again, correctly
        # Regression (issue 10, item 6): the hung copy may still write those GPU blocks, so it is pending
        # work: the engine keeps draining (and polling) instead of going idle while it hangs.
        for _ in range(20):
            rec = engine.step()
            assert rec is not None and rec.state is EngineState.DRAINING and rec.pending_push_work
            clock.advance(1.0)
        assert engine.quarantined_blocks == quarantined
        plan.release_hangs()
        run()  # the released copy reports at a drain step's poll, and only then may the engine go idle
        assert engine.quarantined_blocks == {}
        assert engine.state is EngineState.IDLE and not engine.has_pending_push_work()
        third = engine.make_request("c", tokens("q", 9), 1)
        engine.add_request(third)
        run()
        assert engine.quarantined_blocks == {}
        assert engine.block_pool.num_free == cfg.num_gpu_blocks
        assert engine.scheduler.stats.late_reports_ignored == 1
    finally:
        plan.release_hangs()
        report = engine.shutdown(timeout=GUARD_S)
    assert report.quarantine_abandoned == 0


def test_compaction_at_scale_keeps_only_live_ids_in_deadline_order() -> None:
    # Issue 13, bug 10: compaction tested where it matters, with 100k finished jobs in the heap.
    n = 100_000
    q = DeadlineQueue()
    live: set[int] = set()
    for job_id in range(n):
        q.push(job_id, float((job_id * 7919) % n))  # deadlines out of id order
        if job_id % 1000 == 0:
            live.add(job_id)  # 1 in 1000 still running; the rest finished
    assert len(q) == n
    q.compact(live, len(live))
    assert len(q) == len(live)  # every finished job's entry is gone
    expected = sorted(live, key=lambda j: (j * 7919) % n)
    assert q.pop_expired(float(n)) == expected
    assert len(q) == 0


def test_compaction_keeps_the_heap_bounded_while_jobs_come_and_go() -> None:
    # As the scheduler uses it: one compact per step, jobs finish soon after they start. The heap never
    # holds more than 2 x live + 64 entries after a compaction, and the work stays linear overall.
    q = DeadlineQueue()
    live: dict[int, float] = {}
    for job_id in range(100_000):
        q.push(job_id, job_id + 30.0)
        live[job_id] = job_id + 30.0
        live.pop(job_id - 8, None)  # at most 8 jobs in flight
        q.compact(live, len(live))
        assert len(q) <= 2 * len(live) + 65
    # Removal is lazy: dead entries may remain (callers skip them), but no live one is ever lost.
    assert [j for j in q.pop_expired(1e12) if j in live] == sorted(live)
