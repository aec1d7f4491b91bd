"""TieringManager over a CPU primary and in-memory tiers: cascades, promotions, liveness, reset."""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

import pytest
from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import JobResult, OffloadingManager, SecondaryTier, TierJob
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
    make_offload_key,
)
from kvfsm.errors import ConfigError, DuplicateJobError, UnknownJobError
from kvfsm.machines.names import JobKind, JobState, SlotState
from kvfsm.tiers.memory import InMemoryTier

R1, R2 = ReqContext("r1"), ReqContext("r2")
HIT, MISS, PENDING, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.HIT_PENDING, LookupResult.RETRY


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


def make(
    num_slots: int = 4, tiers: int = 1, autocomplete: bool = False
) -> tuple[TieringManager, CPUOffloadingManager, list[InMemoryTier]]:
    primary = CPUOffloadingManager(num_slots, checked=True)
    ts = [InMemoryTier(f"mem{i}", autocomplete=autocomplete) for i in range(tiers)]
    return TieringManager(primary, ts, checked=True), primary, ts


def store(tm: TieringManager, *ids: int, ctx: ReqContext = R1) -> PrepareStoreOutput:
    out = tm.prepare_store(keys(*ids), ctx)
    assert out is not None
    tm.complete_store(out.keys_to_store, ctx)
    return out


class DictSlots:
    """A SlotIO over a dict: the primary's slot bytes."""

    def __init__(self) -> None:
        self.data: dict[int, bytes] = {}

    def read_slot(self, slot_id: int) -> bytes:
        return self.data[slot_id]

    def write_slot(self, slot_id: int, data: bytes) -> None:
        self.data[slot_id] = data


class FixedTier(SecondaryTier):
    """Answers every lookup with one result; never finishes anything."""

    name = "fixed"

    def __init__(self, answer: LookupResult) -> None:
        self.answer = answer
        self.submitted: list[TierJob] = []

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return self.answer

    @override
    def submit_store(self, job: TierJob) -> None:
        self.submitted.append(job)

    @override
    def submit_load(self, job: TierJob) -> None:
        self.submitted.append(job)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return []

    @override
    def drain_jobs(self) -> None:
        pass


class ScriptedTier(FixedTier):
    """Reports whatever results the test queues."""

    def __init__(self) -> None:
        super().__init__(LookupResult.MISS)
        self.results: list[JobResult] = []

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        out, self.results = self.results, []
        return out


class RefusingTier(FixedTier):
    @override
    def submit_store(self, job: TierJob) -> None:
        raise ConfigError("tier refuses the store")

    @override
    def submit_load(self, job: TierJob) -> None:
        raise ConfigError("tier refuses the load")


# -- base-class defaults --


def test_base_has_pending_work_defaults_false() -> None:
    class Minimal(OffloadingManager):
        @override
        def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
            return MISS

        @override
        def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> SlotSpec:
            return SlotSpec(())

        @override
        def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
            pass

        @override
        def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
            return None

        @override
        def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
            pass

        @override
        def take_events(self) -> list[OffloadingEvent]:
            return []

        @override
        def reset_cache(self) -> None:
            pass

    assert Minimal().has_pending_work() is False
    assert FixedTier(HIT).has_pending_work() is False
    tier = InMemoryTier()
    tier.submit_store(TierJob(0, (k(0),), (0,), False, "r"))
    assert tier.pending_job_ids() == [0]
    assert tier.has_pending_work() is False  # its jobs are counted by the tiering manager


# -- cascade --


def test_cascade_pins_primary_slot_until_polled() -> None:
    tm, primary, (tier,) = make(num_slots=1)
    assert tm.has_pending_work() is False
    store(tm, 0)
    assert primary.slot_state(k(0)) is SlotState.READING and primary.ref_cnt(k(0)) == 1
    assert tm.has_pending_work() is True
    (jid,) = tier.pending_job_ids()
    job = tm.transfer_job(jid)
    assert (job.kind, job.state, job.world_size, job.slots) == (
        JobKind.CASCADE,
        JobState.IN_FLIGHT,
        1,
        SlotSpec((0,)),
    )
    assert tier.pending_job(jid).is_promotion is False
    # Pinned: the only slot cannot be evicted for a new store.
    assert tm.prepare_store(keys(1), R1) is None
    tier.complete(jid)
    assert tm.has_pending_work() is True  # finished in the tier, not yet polled
    tm.on_schedule_end()
    assert tm.has_pending_work() is False
    assert job.state is JobState.COMPLETE
    assert primary.slot_state(k(0)) is SlotState.READY
    assert k(0) in tier
    assert tm.stats().cascades_completed == 1
    out = tm.prepare_store(keys(1), R1)
    assert out is not None and out.evicted_keys == (k(0),)


def test_cascade_to_every_tier_pins_once_per_tier() -> None:
    tm, primary, tiers = make(tiers=2)
    store(tm, 0, 1)
    assert primary.ref_cnt(k(0)) == 2 and primary.ref_cnt(k(1)) == 2
    assert [len(t.pending_job_ids()) for t in tiers] == [1, 1]
    tiers[0].complete_all()
    tm.on_schedule_end()
    assert primary.ref_cnt(k(0)) == 1 and tm.has_pending_work() is True
    tiers[1].complete_all()
    tm.on_schedule_end()
    assert primary.ref_cnt(k(0)) == 0 and tm.has_pending_work() is False
    assert all(k(1) in t for t in tiers)


def test_failed_cascade_keeps_cpu_copy() -> None:
    tm, primary, (tier,) = make()
    store(tm, 0)
    (jid,) = tier.pending_job_ids()
    job = tm.transfer_job(jid)
    tier.complete(jid, success=False)
    tm.on_schedule_end()
    assert job.state is JobState.FAILED
    assert tm.has_pending_work() is False
    assert tm.lookup(k(0), R1) is HIT
    assert primary.ref_cnt(k(0)) == 0
    assert k(0) not in tier
    assert tm.stats().cascades_failed == 1


def test_no_cascade_for_failed_or_repeated_store() -> None:
    tm, primary, (tier,) = make()
    out = tm.prepare_store(keys(0, 1), R1)
    assert out is not None
    tm.complete_store(keys(0), R1, success=False)
    tm.complete_store(keys(1), R1)
    tm.complete_store(keys(1), R1)  # idempotent: nothing new to cascade
    assert [tier.pending_job(j).keys for j in tier.pending_job_ids()] == [(k(1),)]
    assert primary.ref_cnt(k(1)) == 1
    assert primary.slot_state(k(0)) is SlotState.ABSENT


def test_prepare_store_polls_first_so_finished_cascades_free_slots() -> None:
    tm, _primary, (tier,) = make(num_slots=1, autocomplete=True)
    store(tm, 0)  # polled this step already (prepare_store); the cascade is in flight
    tm.on_schedule_end()  # new step
    out = tm.prepare_store(keys(1), R1)
    assert out is not None and out.evicted_keys == (k(0),)
    assert k(0) in tier


def test_cascade_copies_slot_bytes() -> None:
    io = DictSlots()
    primary = CPUOffloadingManager(2)
    tier = InMemoryTier("mem", slot_io=io)
    tm = TieringManager(primary, [tier])
    out = tm.prepare_store(keys(0), R1)
    assert out is not None
    io.data[out.store_spec.slot_ids[0]] = b"chunk-0"
    tm.complete_store(out.keys_to_store, R1)
    tier.complete_all()
    tm.on_schedule_end()
    assert tier.data(k(0)) == b"chunk-0"


# -- promotion --


def test_promotion_reserves_slot_then_hits_after_completion() -> None:
    tm, primary, (tier,) = make()
    tier.put(k(5))
    assert tm.lookup(k(5), R1) is PENDING
    assert primary.slot_state(k(5)) is SlotState.WRITING
    assert tm.num_queued_promotions() == 1
    assert tm.lookup(k(5), R1) is PENDING  # seen in flight: no second reservation
    assert tm.lookup(k(5), R2) is PENDING  # another request: still no double promotion
    assert tier.pending_job_ids() == []
    tm.on_schedule_end()
    assert tm.num_queued_promotions() == 0
    (jid,) = tier.pending_job_ids()
    tjob = tier.pending_job(jid)
    assert (tjob.keys, tjob.slot_ids, tjob.is_promotion, tjob.req_id) == ((k(5),), (0,), True, "r1")
    job = tm.transfer_job(jid)
    assert (job.kind, job.state) == (JobKind.PROMOTE, JobState.IN_FLIGHT)
    assert tm.has_pending_work() is True
    assert tm.lookup(k(5), R2) is PENDING
    tier.complete(jid)
    tm.on_schedule_end()
    assert job.state is JobState.COMPLETE
    assert tm.has_pending_work() is False
    assert tm.lookup(k(5), R2) is HIT
    assert tm.prepare_load(keys(5), R2) == SlotSpec((0,))
    tm.complete_load(keys(5), R2)
    assert primary.slot_state(k(5)) is SlotState.READY
    assert OffloadingEvent((k(5),), "CPU", removed=False) in tm.take_events()
    s = tm.stats()
    assert (s.secondary_hits, s.promotions_submitted, s.promotions_completed) == (1, 1, 1)


def test_promotions_batched_per_tier_and_request() -> None:
    tm, _primary, (tier,) = make(num_slots=8)
    for i in range(3):
        tier.put(k(i))
    assert [tm.lookup(k(0), R1), tm.lookup(k(1), R1), tm.lookup(k(2), R2)] == [PENDING] * 3
    tm.on_schedule_end()
    jobs = [tier.pending_job(j) for j in tier.pending_job_ids()]
    assert sorted((j.req_id, j.keys) for j in jobs) == [("r1", (k(0), k(1))), ("r2", (k(2),))]
    assert tm.num_transfer_jobs == 2


def test_promotion_moves_bytes_into_reserved_slot() -> None:
    io = DictSlots()
    primary = CPUOffloadingManager(2)
    tier = InMemoryTier("mem", slot_io=io, autocomplete=True)
    tm = TieringManager(primary, [tier])
    tier.put(k(3), b"old-chunk")
    assert tm.lookup(k(3), R1) is PENDING
    tm.on_schedule_end()  # submits
    tm.on_schedule_end()  # autocompletes and polls
    sid = primary.slot_id(k(3))
    assert sid is not None and io.data[sid] == b"old-chunk"
    assert tm.lookup(k(3), R1) is HIT


def test_failed_promotion_frees_slot_and_next_lookup_misses() -> None:
    tm, primary, (tier,) = make()
    tier.put(k(5))
    assert tm.lookup(k(5), R1) is PENDING
    tm.on_schedule_end()
    (jid,) = tier.pending_job_ids()
    job = tm.transfer_job(jid)
    tier.fail_next(1)
    tier.complete(jid)
    tm.on_schedule_end()
    assert job.state is JobState.FAILED
    assert primary.slot_state(k(5)) is SlotState.ABSENT
    assert primary.num_free == 4
    assert k(5) not in tier  # invalidated: no promotion loop
    assert tm.lookup(k(5), R1) is MISS
    assert tm.stats().promotions_failed == 1


def test_promotion_of_key_lost_by_tier_fails() -> None:
    tm, primary, (tier,) = make()
    tier.put(k(5))
    assert tm.lookup(k(5), R1) is PENDING
    tier.invalidate(k(5))
    tm.on_schedule_end()
    tier.complete_all()
    tm.on_schedule_end()
    assert primary.slot_state(k(5)) is SlotState.ABSENT
    assert tm.lookup(k(5), R1) is MISS


def test_lookup_misses_when_primary_cannot_reserve() -> None:
    tm, primary, (tier,) = make(num_slots=1)
    tm.prepare_store(keys(0), R1)  # the only slot is writing
    tier.put(k(5))
    assert tm.lookup(k(5), R1) is MISS
    assert tm.num_queued_promotions() == 0
    assert primary.slot_state(k(5)) is SlotState.ABSENT


def test_lookup_order_primary_then_tiers_retry() -> None:
    primary = CPUOffloadingManager(4)
    hit_tier = InMemoryTier("mem")
    hit_tier.put(k(1))
    tm = TieringManager(primary, [FixedTier(RETRY), hit_tier])
    assert tm.lookup(k(0), R1) is RETRY  # nobody has it, one tier does not know yet
    assert tm.lookup(k(1), R1) is PENDING  # a later tier's hit still promotes
    tm2 = TieringManager(CPUOffloadingManager(4), [FixedTier(MISS)])
    assert tm2.lookup(k(0), R1) is MISS
    assert TieringManager(CPUOffloadingManager(4), []).lookup(k(0), R1) is MISS


# -- polling, errors --


def test_unknown_job_result_raises_and_applies_nothing() -> None:
    primary = CPUOffloadingManager(4)
    tier = ScriptedTier()
    tm = TieringManager(primary, [tier])
    store(tm, 0)
    (tjob,) = tier.submitted
    tier.results = [JobResult(tjob.job_id, True), JobResult(999, True)]
    with pytest.raises(UnknownJobError, match=r"job 999, which is not in flight"):
        tm.on_schedule_end()
    assert tm.num_transfer_jobs == 1
    assert primary.ref_cnt(k(0)) == 1
    tier.results = [JobResult(tjob.job_id, True), JobResult(tjob.job_id, True)]
    with pytest.raises(UnknownJobError, match="reported twice"):
        tm.on_schedule_end()
    assert primary.ref_cnt(k(0)) == 1
    tier.results = [JobResult(tjob.job_id, True)]
    tm.on_schedule_end()
    assert tm.has_pending_work() is False and primary.ref_cnt(k(0)) == 0
    tier.results = [JobResult(tjob.job_id, True)]  # reported again after it finished
    with pytest.raises(UnknownJobError):
        tm.on_schedule_end()


def test_result_from_the_wrong_tier_raises() -> None:
    primary = CPUOffloadingManager(4)
    a, b = ScriptedTier(), ScriptedTier()
    tm = TieringManager(primary, [a, b])
    store(tm, 0)
    a_job = a.submitted[0]
    b.results = [JobResult(a_job.job_id, True)]
    with pytest.raises(UnknownJobError, match="submitted to tier"):
        tm.on_schedule_end()
    assert tm.num_transfer_jobs == 2


def test_lookup_polls_at_most_once_per_step() -> None:
    tm, primary, (tier,) = make()
    store(tm, 0)  # prepare_store polled this step
    tier.complete_all()
    tm.lookup(k(9), R1)
    assert primary.ref_cnt(k(0)) == 1  # gate closed until on_schedule_end
    tm.on_schedule_end()
    assert primary.ref_cnt(k(0)) == 0


def test_refused_submissions_roll_back() -> None:
    primary = CPUOffloadingManager(4)
    tm = TieringManager(primary, [RefusingTier(HIT)])
    out = tm.prepare_store(keys(0), R1)
    assert out is not None
    with pytest.raises(ConfigError, match="refuses the store"):
        tm.complete_store(out.keys_to_store, R1)
    assert primary.ref_cnt(k(0)) == 0 and tm.has_pending_work() is False
    assert tm.lookup(k(1), R1) is PENDING
    with pytest.raises(ConfigError, match="refuses the load"):
        tm.on_schedule_end()
    assert primary.slot_state(k(1)) is SlotState.ABSENT
    assert tm.num_transfer_jobs == 0 and tm.num_queued_promotions() == 0


def test_memory_tier_rejects_malformed_jobs() -> None:
    tier = InMemoryTier("mem")
    with pytest.raises(ConfigError, match="expected is_promotion=False"):
        tier.submit_store(TierJob(0, (k(0),), (0,), True, "r"))
    with pytest.raises(ConfigError, match="one slot per key"):
        tier.submit_load(TierJob(0, (k(0),), (), True, "r"))
    tier.submit_load(TierJob(0, (k(0),), (0,), True, "r"))
    with pytest.raises(DuplicateJobError, match="already runs job 0"):
        tier.submit_load(TierJob(0, (k(0),), (0,), True, "r"))
    with pytest.raises(UnknownJobError):
        tier.complete(5)
    with pytest.raises(ConfigError):
        tier.fail_next(-1)
    with pytest.raises(ConfigError):
        InMemoryTier(capacity=0)
    assert tier.pending_job_ids() == [0]
    tier.complete(0)
    assert list(tier.get_finished_jobs()) == [JobResult(0, False)]  # the tier never had k0


def test_memory_tier_capacity_evicts_its_lru_keys() -> None:
    tier = InMemoryTier("mem", capacity=2)
    tier.put(k(0))
    tier.put(k(1))
    tier.touch(keys(0), R1)
    tier.put(k(2))
    assert tier.keys() == [k(0), k(2)]
    assert tier.take_events()[-1] == OffloadingEvent((k(1),), "mem", removed=True)
    assert tier.lookup(k(1), R1) is MISS and tier.lookup(k(2), R1) is HIT


# -- reset, events, shutdown --


def test_reset_drains_in_flight_work_and_drops_queued_promotions() -> None:
    tm, primary, (tier,) = make(num_slots=4)
    store(tm, 0)  # cascade in flight
    tier.put(k(5))
    tier.put(k(6))
    assert tm.lookup(k(5), R1) is PENDING
    tm.on_schedule_end()  # promotion of k5 in flight
    assert tm.lookup(k(6), R1) is PENDING  # k6 only queued
    assert tm.num_transfer_jobs == 2 and tm.has_pending_work() is True
    tm.reset_cache()
    assert tier.pending_job_ids() == []
    assert tm.num_transfer_jobs == 0 and tm.num_queued_promotions() == 0
    assert tm.has_pending_work() is False
    assert primary.num_free == 4 and len(primary) == 0
    assert set(tier.keys()) == {k(0), k(5), k(6)}  # tiers keep their data
    assert tm.stats().promotions_dropped == 1
    # The reset hold: until the caller says every copy the reset discarded has reported, a key missing from
    # the primary is a MISS (a discarded store copy may still write any freed slot).
    assert tm.lookup(k(0), R1) is MISS
    assert tm.stats().promotions_held == 1 and primary.num_free == 4
    tm.on_reset_flushed()
    assert not tm.promotions_held
    assert tm.lookup(k(0), R1) is PENDING  # promoted back from the tier


def test_reset_gives_up_on_jobs_a_tier_did_not_drain() -> None:
    primary = CPUOffloadingManager(4)
    tier = ScriptedTier()  # drain_jobs does nothing and reports nothing
    tm = TieringManager(primary, [tier])
    store(tm, 0)
    job = tm.transfer_job(tier.submitted[0].job_id)
    tm.reset_cache()
    assert job.state is JobState.STALE
    assert tm.has_pending_work() is False
    tier.results = [JobResult(job.job_id, True)]  # arrives late: ignored
    tm.on_schedule_end()
    assert primary.slot_state(k(0)) is SlotState.ABSENT


def test_take_events_merges_primary_and_tiers() -> None:
    tm, _primary, _tiers = make(autocomplete=True)
    store(tm, 0)
    tm.on_schedule_end()
    assert tm.take_events() == [
        OffloadingEvent((k(0),), "CPU", removed=False),
        OffloadingEvent((k(0),), "mem0", removed=False),
    ]
    assert tm.take_events() == []


def test_shutdown_tiers_then_primary() -> None:
    order: list[str] = []

    class P(CPUOffloadingManager):
        @override
        def shutdown(self) -> None:
            order.append("primary")

    class T(InMemoryTier):
        @override
        def shutdown(self) -> None:
            order.append(self.name)

    tm = TieringManager(P(2), [T("a"), T("b")])
    tm.shutdown()
    assert order == ["a", "b", "primary"]


def test_touch_reaches_primary_and_tiers() -> None:
    tm, primary, (tier,) = make(num_slots=2, autocomplete=True)
    store(tm, 0, 1)
    tm.on_schedule_end()
    tm.touch(keys(0), R1)
    assert primary.policy.keys() == [k(1), k(0)]
    assert tier.keys() == [k(1), k(0)]


def test_random_operations_keep_pins_and_liveness_consistent() -> None:
    rng = random.Random(5)
    tm, primary, tiers = make(num_slots=6, tiers=2)
    loads: list[list[OffloadKey]] = []  # keys pinned by open GPU loads
    for _ in range(1500):
        op = rng.randrange(7)
        ctx = ReqContext(f"r{rng.randrange(3)}")
        if op == 0:
            out = tm.prepare_store(keys(*(rng.randrange(20) for _ in range(rng.randrange(1, 3)))), ctx)
            if out is not None and out.keys_to_store:
                tm.complete_store(out.keys_to_store, ctx, success=rng.random() < 0.9)
        elif op == 1:
            key = k(rng.randrange(20))
            if tm.lookup(key, ctx) is HIT and rng.random() < 0.5:
                tm.prepare_load([key], ctx)
                loads.append([key])
        elif op == 2 and loads:
            tm.complete_load(loads.pop(rng.randrange(len(loads))), ctx)
        elif op == 3:
            tier = rng.choice(tiers)
            for jid in tier.pending_job_ids():
                if rng.random() < 0.5:
                    tier.complete(jid, success=rng.random() < 0.8)
        elif op in (4, 5):
            tm.on_schedule_end()
        elif rng.random() < 0.02:
            tm.reset_cache()
            tm.on_reset_flushed()  # no GPU copy runs here
            loads.clear()
        # Every pending tier job is in flight in the manager, with its primary slots in the right state.
        for tier in tiers:
            for jid in tier.pending_job_ids():
                job = tm.transfer_job(jid)
                assert job.state is JobState.IN_FLIGHT
                want = SlotState.WRITING if job.kind is JobKind.PROMOTE else SlotState.READING
                assert all(primary.slot_state(x) is want for x in job.keys)
        assert tm.has_pending_work() is (tm.num_transfer_jobs > 0)
        assert primary.num_free + primary.num_writing + primary.num_reading + primary.num_evictable == 6
        assert primary.num_evictable == primary.policy.num_evictable
    for _ in range(2):  # finish the in-flight jobs, then the promotions the last lookups queued
        for tier in tiers:
            tier.complete_all()
        tm.on_schedule_end()
    assert tm.has_pending_work() is False
    assert primary.num_writing == 0
    pinned = sum(len(x) for x in loads)
    assert sum(primary.ref_cnt(k(i)) or 0 for i in range(20)) == pinned
