"""The scheduler half (OffloadingScheduler) on its own: no torch, no engine.

Each test drives the scheduler the way vLLM's engine does (lookup, allocation, per-step metadata, summed
worker outputs) with a real CPUOffloadingManager, FakeRequests and LoopbackWorkers that launch every job
and report outcomes only when the test says so. These re-create vLLM's offloading-connector scheduler
tests (design reference, section 15) in kvfsm's terms.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pytest
from helpers import FakeRequest, LoopbackWorkers, keys_of, tokens
from typing_extensions import override

from kvfsm.control.config import DrainMode, OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.manager import JobResult, OffloadingManager, SecondaryTier, TierJob
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import (
    GPUBlockSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
)
from kvfsm.control.worker import HeldCopyBackend
from kvfsm.errors import (
    AckCountError,
    ConfigError,
    DuplicateRequestError,
    KeyNotReadyError,
    UnknownJobError,
    UnknownRequestError,
)
from kvfsm.machines.names import JobEffect, JobEvent, JobKind, JobState, RequestState, SlotState

TPB = 4  # tokens per block
CTX = ReqContext("probe")


class Harness:
    """A scheduler, its CPU manager and W loopback workers, plus the engine-side moves tests need."""

    def __init__(
        self,
        world_size: int = 1,
        *,
        blocks_per_chunk: int = 1,
        num_slots: int = 16,
        drain: DrainMode = DrainMode.NONBLOCKING,
    ) -> None:
        self.config = OffloadConfig(TPB, blocks_per_chunk, world_size, drain)
        self.manager = CPUOffloadingManager(num_slots)
        self.sched = OffloadingScheduler(self.config, self.manager)
        self.workers = LoopbackWorkers(world_size)

    def request(self, req_id: str, seed: str, num_tokens: int) -> FakeRequest:
        return FakeRequest(req_id, tokens(seed, num_tokens), TPB)

    def keys(self, req: FakeRequest) -> list[OffloadKey]:
        return keys_of(req.block_hashes, self.config.blocks_per_chunk)

    def lookup(self, key: OffloadKey) -> LookupResult:
        return self.manager.lookup(key, CTX)

    def admit(self, req: FakeRequest, block_ids: Sequence[int], num_computed: int = 0) -> ScheduledRequest:
        """Admit a request that loads nothing: it computes everything past ``num_computed``."""
        external, is_async = self.sched.get_num_new_matched_tokens(req, num_computed)
        assert (external, is_async) == (0, False)
        self.sched.update_state_after_alloc(req, block_ids, 0)
        return ScheduledRequest(req.req_id, tuple(block_ids), req.num_tokens - num_computed, admitted=True)

    def step(
        self,
        scheduled: Iterable[ScheduledRequest] = (),
        *,
        preempted: Iterable[str] = (),
        allocated: Iterable[int] = (),
    ) -> ConnectorMetadata:
        meta = self.sched.build_connector_meta(
            SchedulerOutput(tuple(scheduled), frozenset(preempted), frozenset(allocated))
        )
        self.workers.deliver(meta)
        return meta

    def prefill(self, req: FakeRequest, block_ids: Sequence[int]) -> ConnectorMetadata:
        """One step that admits and computes the whole prompt; returns its metadata (the stores)."""
        meta = self.step([self.admit(req, block_ids)], allocated=block_ids)
        req.num_computed_tokens = req.num_tokens
        return meta

    def finish(self, req: FakeRequest) -> ConnectorMetadata:
        """The request samples its last token and finishes; the next step plans and signals."""
        req.token_ids.append(7)
        assert self.sched.request_finished(req) is False  # GPU blocks are freed at once
        return self.step()

    def ack(self, job_id: int, ranks: Iterable[int] | None = None, *, ok: bool = True) -> None:
        self.sched.update_connector_output(self.workers.report(job_id, ranks, ok=ok))

    def ack_all(self) -> None:
        self.sched.update_connector_output(self.workers.report_all())


def only(jobs: Mapping[int, Job]) -> int:
    assert len(jobs) == 1, jobs
    (job_id,) = jobs
    return job_id


def snapshot(h: Harness, keys: Iterable[OffloadKey], req_ids: Iterable[str]) -> dict[str, object]:
    """Everything an operation that raises must leave as it was."""
    s = h.sched
    return {
        "jobs": {
            j: (job.state, job.pending, job.launched_mask, job.reported_mask, job.failed_reports)
            for j, job in s.jobs().items()
        },
        "quarantine": s.quarantined_jobs(),
        "requests": {r: (s.request_state(r) if s.is_tracked(r) else None, s.request_jobs(r)) for r in req_ids},
        "slots": {k: (h.manager.slot_state(k), h.manager.ref_cnt(k), h.manager.slot_id(k)) for k in keys},
        "stats": dataclasses.asdict(s.stats),
        "manager": h.manager.stats(),
        "fences": s.fenced_blocks(),
        "loading": s.chunks_being_loaded(),
        "ids": (s.stale_threshold, s.job_counter),
        "pending": s.has_pending_push_work(),
    }


# ------------------------------------------------------------------------------------------- the drain


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_last_stores_drain_without_flush_and_commit_on_the_wth_ack(world_size: int) -> None:
    h = Harness(world_size)
    a = h.request("A", "a", 8)
    store_meta = h.prefill(a, [0, 1])
    job_id = only(store_meta.store_jobs)
    job = store_meta.store_jobs[job_id]
    assert job.kind is JobKind.STORE and job.gpu.block_ids == (0, 1) and job.pending == world_size

    meta = h.finish(a)
    assert meta.jobs_to_flush == frozenset()  # no flush: the stores drain by stepping
    assert not meta.store_jobs and not meta.load_jobs
    assert h.sched.has_pending_push_work()
    assert h.sched.request_state("A") is RequestState.FINISHED_SIGNALLED
    assert h.sched.fenced_blocks() == {0: frozenset({job_id}), 1: frozenset({job_id})}

    keys = h.keys(a)
    for rank in range(world_size):
        assert [h.lookup(k) for k in keys] == [LookupResult.HIT_PENDING] * 2
        assert h.sched.stats.committed_stores == 0
        assert h.step().jobs_to_flush == frozenset()  # an empty drain step flushes nothing
        h.ack(job_id, [rank])
        if rank < world_size - 1:
            assert job.state is JobState.IN_FLIGHT and job.pending == world_size - rank - 1
            assert h.sched.has_pending_push_work() and h.sched.is_tracked("A")
    assert job.state is JobState.COMPLETE and job.pending == 0
    assert [h.lookup(k) for k in keys] == [LookupResult.HIT] * 2
    assert h.sched.stats.committed_stores == 1
    assert not h.sched.has_pending_push_work()
    assert not h.sched.is_tracked("A")
    with pytest.raises(UnknownRequestError):
        h.sched.request_state("A")  # the record is dropped at delete
    assert h.sched.fenced_blocks() == {}


def test_blocking_baseline_flushes_every_job_once_no_live_request_remains() -> None:
    h = Harness(2, drain=DrainMode.BLOCKING)
    a, b = h.request("A", "a", 8), h.request("B", "b", 8)
    job_a = only(h.prefill(a, [0, 1]).store_jobs)
    job_b = only(h.prefill(b, [2, 3]).store_jobs)
    meta = h.finish(a)
    assert meta.jobs_to_flush == frozenset()  # B is still live
    meta = h.finish(b)
    assert meta.jobs_to_flush == {job_a, job_b}


# ------------------------------------------------------------------------------------------- fences


@pytest.mark.parametrize("load", [True, False], ids=["load-destination", "fresh-block"])
def test_fence_flush_at_update_state_after_alloc(load: bool) -> None:
    h = Harness()
    z = h.request("Z", "z", 8)
    h.prefill(z, [5, 6])
    h.finish(z)
    h.ack_all()  # Z's two chunks are ready in the CPU tier
    assert h.sched.fenced_blocks() == {}

    a = h.request("A", "a", 8)
    job_a = only(h.prefill(a, [0, 1]).store_jobs)
    h.finish(a)
    assert set(h.sched.fenced_blocks()) == {0, 1}

    # The engine's tiny GPU pool hands A's freed block 1 to B.
    if load:
        b = FakeRequest("B", z.token_ids[:8], TPB)  # Z's prompt: its first chunk is a CPU hit
        external, is_async = h.sched.get_num_new_matched_tokens(b, 0)
        assert (external, is_async) == (4, True)
        h.sched.update_state_after_alloc(b, [1, 2], 4)  # block 1 is the load's destination
    else:
        b = h.request("B", "b", 8)
        h.admit(b, [1, 2])
    meta = h.step()
    assert meta.jobs_to_flush == {job_a}
    assert h.sched.stats.fence_flushes == 1
    if load:
        load_id = only(meta.load_jobs)
        assert meta.load_jobs[load_id].gpu.block_ids == (1,)
    h.ack(job_a)
    assert h.sched.fenced_blocks() == {}
    assert not h.sched.is_tracked("A")


def test_fence_flush_at_store_job_build_for_a_finished_request() -> None:
    """A finished request's final store (retried after an allocation failure) reads a block that the same
    batch re-allocates: it is flushed in the very metadata that creates it."""
    h = Harness(num_slots=2)
    x = h.request("X", "x", 8)
    job_x = only(h.prefill(x, [4, 5]).store_jobs)  # fills both slots (writing)
    a = h.request("A", "a", 4)
    meta = h.step([h.admit(a, [0])], allocated=[0])
    a.num_computed_tokens = 4
    assert not meta.store_jobs and h.sched.stats.allocation_failures == 1  # nothing evictable
    h.ack(job_x)  # X's slots become ready, hence evictable
    a.token_ids.append(7)
    h.sched.request_finished(a)  # block 0 is free again; A's chunk is not stored yet

    b = h.request("B", "b", 4)
    h.admit(b, [0])  # the engine re-allocates block 0 in the same batch
    meta = h.step()
    job_a = only(meta.store_jobs)
    assert meta.store_jobs[job_a].gpu.block_ids == (0,)
    assert meta.jobs_to_flush == {job_a}
    assert h.sched.stats.fence_flushes == 1
    assert h.sched.stats.allocation_failures == 1  # the retry at finish succeeded
    assert h.sched.request_state("A") is RequestState.FINISHED_SIGNALLED


def test_preemption_flushes_the_requests_stores_and_defers_readmission() -> None:
    h = Harness()
    a = h.request("A", "a", 12)
    job_a = only(h.prefill(a, [0, 1, 2]).store_jobs)
    meta = h.step(preempted=["A"])
    assert meta.jobs_to_flush == {job_a}
    assert h.sched.stats.preemption_flushes == 1
    assert h.sched.request_state("A") is RequestState.PREEMPTED

    a.num_computed_tokens = 0
    assert h.sched.get_num_new_matched_tokens(a, 0) == (None, False)  # its own stores are unacked
    assert h.sched.request_state("A") is RequestState.DEFERRED
    h.ack(job_a)
    # Re-admission loads what it stored (all but the last chunk, whose last token is recomputed).
    assert h.sched.get_num_new_matched_tokens(a, 0) == (8, True)
    h.sched.update_state_after_alloc(a, [3, 4, 5], 8)
    load = h.step().load_jobs
    assert [j.gpu.block_ids for j in load.values()] == [(3, 4)]


# ------------------------------------------------------------------------------------------- lookups


def test_concurrent_lookups_of_the_same_prefix_give_exactly_one_load() -> None:
    h = Harness()
    a = h.request("A", "a", 8)
    h.prefill(a, [0, 1])
    h.finish(a)
    h.ack_all()
    key0 = h.keys(a)[0]

    # The GPU prefix cache was reset: B and C (A's prompt) both start from zero computed tokens.
    b = FakeRequest("B", a.token_ids[:8], TPB)
    c = FakeRequest("C", a.token_ids[:8], TPB)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)
    h.sched.update_state_after_alloc(b, [2, 3], 4)
    assert h.sched.chunks_being_loaded() == {key0}

    assert h.sched.get_num_new_matched_tokens(c, 0) == (None, False)  # B loads it: defer
    assert h.sched.request_state("C") is RequestState.DEFERRED
    assert h.sched.request_jobs("C") == frozenset()
    meta = h.step()
    load_b = only(meta.load_jobs)
    assert meta.load_jobs[load_b].req_id == "B" and not meta.store_jobs
    assert h.sched.get_num_new_matched_tokens(c, 0) == (None, False)  # still loading: defer again

    h.ack(load_b)
    assert h.sched.chunks_being_loaded() == frozenset()
    assert h.sched.request_state("B") is RequestState.RUNNING
    # C now hits the GPU prefix cache (block 2 holds the chunk): nothing left to load.
    assert h.sched.get_num_new_matched_tokens(c, 4) == (0, False)
    h.sched.update_state_after_alloc(c, [2, 4], 0)
    assert not h.step().load_jobs
    assert h.sched.stats.load_jobs == 1
    assert h.sched.stats.committed_loads == 1
    assert h.sched.fenced_blocks() == {}


def test_aborted_loading_request_stays_tracked_until_its_load_completes() -> None:
    h = Harness(2)
    a = h.request("A", "a", 8)
    h.prefill(a, [0, 1])
    h.finish(a)
    h.ack_all()
    key0 = h.keys(a)[0]

    b = FakeRequest("B", a.token_ids[:8], TPB)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)
    h.sched.update_state_after_alloc(b, [2, 3], 4)
    load_b = only(h.step().load_jobs)
    assert h.manager.slot_state(key0) is SlotState.READING

    b.is_aborted = True
    h.sched.request_finished(b)
    meta = h.step()
    assert not meta.store_jobs and meta.jobs_to_flush == frozenset()  # an aborted load stores nothing
    assert h.sched.is_tracked("B")
    assert h.sched.request_state("B") is RequestState.FINISHED_SIGNALLED
    assert h.sched.has_pending_push_work()

    h.ack(load_b, [0])
    assert h.sched.is_tracked("B")  # one of two ranks is still writing B's blocks
    h.ack(load_b, [1])
    assert not h.sched.is_tracked("B")
    assert h.manager.slot_state(key0) is SlotState.READY
    assert not h.sched.has_pending_push_work()


# ------------------------------------------------------------------------------------------- eviction


def test_eviction_never_takes_writing_or_reading_slots_and_failed_allocation_is_retried() -> None:
    h = Harness(num_slots=3)
    a = h.request("A", "a", 12)
    job_a = only(h.prefill(a, [0, 1, 2]).store_jobs)
    ka = h.keys(a)
    assert [h.manager.slot_state(k) for k in ka] == [SlotState.WRITING] * 3

    # B's chunk cannot be stored: the only slots are writing.
    b = h.request("B", "b", 4)
    sched_b = h.admit(b, [3])
    assert not h.step([sched_b], allocated=[3]).store_jobs
    b.num_computed_tokens = 4
    assert h.sched.stats.allocation_failures == 1
    assert not h.step([ScheduledRequest("B", (), 0)]).store_jobs  # retried next step, fails again
    assert h.sched.stats.allocation_failures == 2
    assert [h.manager.slot_state(k) for k in ka] == [SlotState.WRITING] * 3

    h.ack(job_a)
    # C loads A's first two chunks: those slots are now being read.
    c = FakeRequest("C", a.token_ids[:12], TPB)
    assert h.sched.get_num_new_matched_tokens(c, 0) == (8, True)
    h.sched.update_state_after_alloc(c, [4, 5, 6], 8)
    meta = h.step([ScheduledRequest("B", (), 0)])
    load_c = only(meta.load_jobs)
    store_b = only(meta.store_jobs)  # the retry evicted the one ready slot, A's third chunk
    assert h.manager.slot_state(ka[2]) is SlotState.ABSENT
    assert [h.manager.slot_state(k) for k in ka[:2]] == [SlotState.READING] * 2
    assert h.manager.slot_state(h.keys(b)[0]) is SlotState.WRITING
    assert h.sched.stats.allocation_failures == 2

    # D needs two slots; none is ready (two reading, one writing): nothing is evicted.
    d = h.request("D", "d", 8)
    assert not h.step([h.admit(d, [7, 8])], allocated=[7, 8]).store_jobs
    assert h.sched.stats.allocation_failures == 3
    assert [h.manager.slot_state(k) for k in ka[:2]] == [SlotState.READING] * 2
    assert h.manager.slot_state(h.keys(b)[0]) is SlotState.WRITING
    assert all(h.manager.slot_state(k) is SlotState.ABSENT for k in h.keys(d))
    h.ack(load_c)
    h.ack(store_b)
    assert not h.sched.has_pending_push_work()


# ------------------------------------------------------------------------------------------- reset


def test_reset_cache_makes_in_flight_jobs_stale() -> None:
    h = Harness(2)
    z = h.request("Z", "z", 8)
    h.prefill(z, [5, 6])
    h.finish(z)
    h.ack_all()
    a = h.request("A", "a", 8)
    store_a = only(h.prefill(a, [0, 1]).store_jobs)
    b = FakeRequest("B", z.token_ids[:8], TPB)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)
    h.sched.update_state_after_alloc(b, [2, 3], 4)
    load_b = only(h.step().load_jobs)
    stale = {store_a, load_b}
    assert h.sched.has_pending_push_work()

    h.sched.reset_cache()
    assert not h.sched.has_pending_push_work()  # at once, although both transfers are in flight
    assert h.sched.jobs() == {}
    assert h.sched.stale_threshold == h.sched.job_counter == max(stale) + 1
    assert all(h.workers.jobs[j].state is JobState.STALE for j in stale)
    assert h.sched.request_state("B") is RequestState.RUNNING  # its load was discarded
    assert h.manager.stats().used == 0

    meta = h.step([ScheduledRequest("A", (), 0)])
    assert stale <= meta.jobs_to_flush  # flushed before any new store can reuse their slots
    new_store = only(meta.store_jobs)  # A's chunks are offloaded again
    assert new_store >= h.sched.stale_threshold

    h.sched.update_connector_output(WorkerOutput(completed={store_a: {0, 1}}, failed={load_b: {0}}))
    assert h.sched.stats.stale_reports_ignored == 2
    assert h.sched.stats.committed_stores == 1 and h.sched.stats.failed_loads == 0  # Z's store only
    assert [h.lookup(k) for k in h.keys(a)] == [LookupResult.HIT_PENDING] * 2  # the new job's writes
    assert h.sched.has_pending_push_work()
    h.ack(new_store)
    assert [h.lookup(k) for k in h.keys(a)] == [LookupResult.HIT] * 2
    assert not h.sched.has_pending_push_work()


# ------------------------------------------------------------------------------------------- pending work


class _MinimalManager(OffloadingManager):
    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.MISS

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


class _MinimalTier(SecondaryTier):
    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.MISS

    @override
    def submit_store(self, job: TierJob) -> None:
        pass

    @override
    def submit_load(self, job: TierJob) -> None:
        pass

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        return []

    @override
    def drain_jobs(self) -> None:
        pass


def test_has_pending_work_defaults_to_false() -> None:
    manager = _MinimalManager()
    assert manager.has_pending_work() is False
    assert _MinimalTier().has_pending_work() is False
    sched = OffloadingScheduler(OffloadConfig(TPB), manager)
    assert sched.has_pending_push_work() is False


def test_tiering_manager_has_pending_work_while_a_cascade_is_in_flight() -> None:
    try:
        from kvfsm.control.tiering import TieringManager
        from kvfsm.tiers.memory import InMemoryTier
    except ImportError as exc:  # pragma: no cover - only while tiering is not written yet
        pytest.skip(f"kvfsm.control.tiering is not available yet: {exc}")
    tier = InMemoryTier("mem")
    manager = TieringManager(CPUOffloadingManager(8), [tier])
    sched = OffloadingScheduler(OffloadConfig(TPB), manager)
    workers = LoopbackWorkers(1)
    a = FakeRequest("A", tokens("a", 4), TPB)
    assert sched.get_num_new_matched_tokens(a, 0) == (0, False)
    sched.update_state_after_alloc(a, [0], 0)
    meta = sched.build_connector_meta(SchedulerOutput((ScheduledRequest("A", (0,), 4, admitted=True),)))
    workers.deliver(meta)
    a.num_computed_tokens = 4
    a.token_ids.append(7)
    sched.request_finished(a)
    workers.deliver(sched.build_connector_meta(SchedulerOutput()))
    assert manager.has_pending_work() is False  # the GPU store is the scheduler's job, not the manager's

    sched.update_connector_output(workers.report_all())  # the store commits: a cascade starts
    assert sched.jobs() == {}
    assert manager.has_pending_work() is True
    assert sched.has_pending_push_work() is True  # only the cascade keeps the engine stepping
    assert tier.pending_job_ids() != []

    sched.build_connector_meta(SchedulerOutput())  # an empty step polls the tier: still running
    assert sched.has_pending_push_work() is True
    tier.complete_all()
    sched.build_connector_meta(SchedulerOutput())  # the next step's poll sees it finish
    assert manager.has_pending_work() is False
    assert sched.has_pending_push_work() is False
    assert keys_of(a.block_hashes, 1)[0] in tier


# ------------------------------------------------------------------------------------------- typed errors


def _two_jobs(world_size: int = 2) -> tuple[Harness, FakeRequest, FakeRequest, int, int]:
    h = Harness(world_size)
    a, b = h.request("A", "a", 8), h.request("B", "b", 8)
    job_a = only(h.prefill(a, [0, 1]).store_jobs)
    job_b = only(h.prefill(b, [2, 3]).store_jobs)
    return h, a, b, job_a, job_b


def test_unknown_job_ids_at_or_above_the_stale_threshold_raise_and_change_nothing() -> None:
    h, a, b, job_a, job_b = _two_jobs()
    h.ack(job_a)  # job_a is retired: its id is now unknown too
    keys = h.keys(a) + h.keys(b)
    before = snapshot(h, keys, ["A", "B"])
    for bad in (job_a, h.sched.job_counter, h.sched.job_counter + 10):
        for output in (
            WorkerOutput(completed={job_b: {0}, bad: {0}}),
            WorkerOutput(failed={bad: {0}}, completed={job_b: {0}}),
        ):
            with pytest.raises(UnknownJobError, match=f"job {bad}"):
                h.sched.update_connector_output(output)
            assert snapshot(h, keys, ["A", "B"]) == before  # job_b's valid ack was not applied

    # Below the threshold (after a reset) the same kind of report is ignored instead.
    h.sched.reset_cache()
    threshold = h.sched.stale_threshold
    h.sched.update_connector_output(WorkerOutput(completed={threshold - 1: {0}}))
    assert h.sched.stats.stale_reports_ignored == 1
    with pytest.raises(UnknownJobError):
        h.sched.update_connector_output(WorkerOutput(completed={threshold: {0}}))


@pytest.mark.parametrize("after_reset", [False, True])
def test_a_negative_job_id_is_unknown_not_stale_and_changes_nothing(after_reset: bool) -> None:
    # Regression (issue 13, bug 5): below a threshold of 0, a never-issued negative id was counted as stale.
    h, a, b, _, job_b = _two_jobs()
    if after_reset:
        h.sched.reset_cache()
    keys = h.keys(a) + h.keys(b)
    before = snapshot(h, keys, ["A", "B"])
    for output in (WorkerOutput(completed={job_b: {0}, -1: {0}}), WorkerOutput(failed={-5: {0}})):
        with pytest.raises(UnknownJobError, match="never issues"):
            h.sched.update_connector_output(output)
        assert snapshot(h, keys, ["A", "B"]) == before
    assert h.sched.stats.stale_reports_ignored == 0


def test_request_state_of_an_id_never_seen_raises() -> None:
    # Regression (issue 13, bug 5): an id never seen answered DELETED.
    h = Harness()
    with pytest.raises(UnknownRequestError, match="'nobody' is not tracked"):
        h.sched.request_state("nobody")
    assert not h.sched.is_tracked("nobody")


@pytest.mark.parametrize(
    ("completed", "failed", "match"),
    [
        pytest.param({0}, set(), "rank 0 already reported", id="second-ack-from-one-rank"),
        pytest.param(set(), {0}, "rank 0 already reported", id="failure-after-ack-from-one-rank"),
        pytest.param({2}, set(), "worker rank 2 outside 0..1", id="rank-outside-world"),
        pytest.param({1}, {1}, r"ranks \[1\] reported both", id="one-rank-ack-and-failure"),
        pytest.param(set(), set(), "a report that names no worker rank", id="no-rank"),
    ],
)
def test_a_report_not_attributable_to_an_unreported_launched_rank_raises_and_changes_nothing(
    completed: set[int], failed: set[int], match: str
) -> None:
    h, a, b, job_a, job_b = _two_jobs(world_size=2)
    h.ack(job_b, [0])  # job_b: rank 0 reported, rank 1 still copying
    keys = h.keys(a) + h.keys(b)
    before = snapshot(h, keys, ["A", "B"])
    output = WorkerOutput(completed={job_a: {0, 1}})  # valid on its own: it must not be applied either
    if completed or not failed:
        output.completed[job_b] = completed
    if failed:
        output.failed[job_b] = failed
    with pytest.raises(AckCountError, match=f"job {job_b}: {match}"):
        h.sched.update_connector_output(output)
    assert snapshot(h, keys, ["A", "B"]) == before


def _one_rank_launched() -> tuple[Harness, FakeRequest, Job]:
    """W=2 and a store that only rank 0 launched (rank 1 has not run its after_forward yet)."""
    h = Harness(world_size=2)
    a = h.request("A", "a", 8)
    meta = h.sched.build_connector_meta(SchedulerOutput((h.admit(a, [0, 1]),), allocated_block_ids=frozenset({0, 1})))
    a.num_computed_tokens = a.num_tokens
    job = meta.store_jobs[only(meta.store_jobs)]
    assert job.launch(0)
    return h, a, job


def test_w2_acks_from_both_ranks_with_only_rank_0_launched_do_not_commit() -> None:
    # Regression (issue 10, item 5): acks were counted, not attributed to ranks, so with W=2 and only rank
    # 0 launched an ack of count 2 committed the store: rank 1's shard was never copied, yet its keys
    # became READY.
    h, a, job = _one_rank_launched()
    keys = h.keys(a)
    before = snapshot(h, keys, ["A"])
    for output in (WorkerOutput(completed={job.job_id: {0, 1}}), WorkerOutput(completed={job.job_id: {1}})):
        with pytest.raises(AckCountError, match=f"job {job.job_id}: rank 1 reported a job it never launched"):
            h.sched.update_connector_output(output)
        assert snapshot(h, keys, ["A"]) == before
    assert [h.lookup(k) for k in keys] == [LookupResult.HIT_PENDING] * 2  # never readable
    # Rank 0's own report is accepted, and the job still waits for rank 1 to launch and report.
    h.sched.update_connector_output(WorkerOutput(completed={job.job_id: {0}}))
    assert job.state is JobState.IN_FLIGHT and job.pending == 1 and job.reported_mask == 0b01
    with pytest.raises(AckCountError, match="rank 0 already reported"):
        h.sched.update_connector_output(WorkerOutput(completed={job.job_id: {0}}))
    assert [h.lookup(k) for k in keys] == [LookupResult.HIT_PENDING] * 2
    assert job.launch(1)
    h.sched.update_connector_output(WorkerOutput(completed={job.job_id: {1}}))
    assert job.current() is JobState.COMPLETE
    assert [h.lookup(k) for k in keys] == [LookupResult.HIT] * 2


def test_a_failure_from_a_rank_that_never_launched_raises_and_changes_nothing() -> None:
    h, a, job = _one_rank_launched()
    before = snapshot(h, h.keys(a), ["A"])
    with pytest.raises(AckCountError, match="rank 1 reported a job it never launched"):
        h.sched.update_connector_output(WorkerOutput(completed={job.job_id: {0}}, failed={job.job_id: {1}}))
    assert snapshot(h, h.keys(a), ["A"]) == before


def test_the_job_machine_refuses_a_report_from_a_rank_that_never_launched_or_already_reported() -> None:
    job = Job(1, JobKind.STORE, "r", (), GPUBlockSpec((0,)), SlotSpec((0,)), 2)
    job.launch(0)
    for bad, rank in ((job.ack, 1), (job.fail, 1), (job.ack, 2), (job.ack, -1)):
        with pytest.raises(AckCountError):
            bad(rank)
        assert (job.state, job.reported_mask, job.failed_reports) == (JobState.IN_FLIGHT, 0, 0)
    assert job.ack(0) is None
    with pytest.raises(AckCountError, match="rank 0 already reported"):
        job.fail(0)
    assert (job.state, job.reported_mask, job.failed_reports, job.pending) == (JobState.IN_FLIGHT, 0b01, 0, 1)
    # The guards themselves refuse it too (Rule 4 holds even for a caller that skips the checks).
    assert not job.machine.can_fire(job, JobEvent.ACK, 0)
    assert not job.machine.can_fire(job, JobEvent.ACK, 1)
    job.launch(1)
    assert job.machine.can_fire(job, JobEvent.ACK, 1)
    assert job.ack(1) is JobEffect.COMMIT and job.current() is JobState.COMPLETE


def test_duplicate_request_raises_and_changes_nothing() -> None:
    h, a, _b, _job_a, _job_b = _two_jobs()
    before = snapshot(h, h.keys(a), ["A", "B"])
    with pytest.raises(DuplicateRequestError, match="'A'"):
        h.sched.on_new_request(a)
    assert snapshot(h, h.keys(a), ["A", "B"]) == before
    fresh = h.request("C", "c", 4)
    h.sched.on_new_request(fresh)
    with pytest.raises(DuplicateRequestError):
        h.sched.on_new_request(fresh)
    assert h.sched.request_state("C") is RequestState.TRACKED


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda: OffloadConfig(tokens_per_block=0), id="tokens_per_block=0"),
        pytest.param(lambda: OffloadConfig(tokens_per_block=16, blocks_per_chunk=0), id="blocks_per_chunk=0"),
        pytest.param(lambda: OffloadConfig(tokens_per_block=16, world_size=-1), id="world_size=-1"),
        pytest.param(lambda: OffloadConfig(tokens_per_block=True), id="bool-block-size"),
        pytest.param(lambda: CPUOffloadingManager(0), id="no-cpu-slots"),
    ],
)
def test_config_errors(build: Any) -> None:
    with pytest.raises(ConfigError):
        build()


def test_load_of_a_key_still_writing_raises_key_not_ready_and_changes_nothing() -> None:
    h = Harness()
    a = h.request("A", "a", 8)
    job_a = only(h.prefill(a, [0, 1]).store_jobs)
    key0 = h.keys(a)[0]
    b = FakeRequest("B", a.token_ids[:8], TPB)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (None, False)  # HIT_PENDING: deferred
    before = snapshot(h, h.keys(a), ["A", "B"])
    with pytest.raises(KeyNotReadyError):
        h.sched.update_state_after_alloc(b, [2, 3], 4)  # an engine that loads anyway
    assert snapshot(h, h.keys(a), ["A", "B"]) == before
    assert h.manager.slot_state(key0) is SlotState.WRITING
    meta = h.step()
    assert not meta.load_jobs and meta.jobs_to_flush == frozenset()  # nothing half-planned leaks
    h.ack(job_a)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (4, True)


# ------------------------------------------------------------------------------------------- failures


@pytest.mark.parametrize("failing_rank", [0, 1])
def test_failed_store_frees_slots_only_after_every_rank_reported(failing_rank: int) -> None:
    h = Harness(2)
    a = h.request("A", "a", 8)
    job_a = only(h.prefill(a, [0, 1]).store_jobs)
    keys = h.keys(a)
    free_before = h.manager.num_free
    h.finish(a)

    first, last = (0, 1) if failing_rank == 0 else (1, 0)
    h.ack(job_a, [first], ok=first != failing_rank)
    job = h.workers.jobs[job_a]
    assert job.current() is JobState.IN_FLIGHT
    assert [h.manager.slot_state(k) for k in keys] == [SlotState.WRITING] * 2  # the other rank copies
    assert h.manager.num_free == free_before
    assert h.sched.has_pending_push_work() and h.sched.is_tracked("A")

    h.ack(job_a, [last], ok=last != failing_rank)
    assert job.current() is JobState.FAILED
    assert [h.lookup(k) for k in keys] == [LookupResult.MISS] * 2  # never HIT
    assert h.manager.num_free == free_before + 2
    assert h.sched.stats.failed_stores == 1 and h.sched.stats.committed_stores == 0
    assert not h.sched.is_tracked("A") and not h.sched.has_pending_push_work()


def test_failed_load_reports_the_blocks_and_is_never_marked_loaded() -> None:
    h = Harness(2)
    a = h.request("A", "a", 12)
    h.prefill(a, [0, 1, 2])
    h.finish(a)
    h.ack_all()
    b = FakeRequest("B", a.token_ids[:12], TPB)
    assert h.sched.get_num_new_matched_tokens(b, 0) == (8, True)
    h.sched.update_state_after_alloc(b, [3, 4, 5], 8)
    load_b = only(h.step().load_jobs)

    h.ack(load_b, [0], ok=False)
    assert h.sched.take_load_errors() == {}  # rank 1 is still writing B's blocks
    assert h.sched.request_state("B") is RequestState.LOADING
    h.ack(load_b, [1])
    assert h.sched.take_load_errors() == {"B": (3, 4)}
    assert h.sched.take_load_errors() == {}  # reported once
    assert h.sched.stats.failed_loads == 1 and h.sched.stats.committed_loads == 0
    assert h.workers.jobs[load_b].state is JobState.FAILED
    assert [h.manager.slot_state(k) for k in h.keys(a)[:2]] == [SlotState.READY] * 2  # unpinned
    assert h.sched.chunks_being_loaded() == frozenset()


def test_merging_two_reports_from_one_rank_raises_and_changes_nothing() -> None:
    merged = WorkerOutput(completed={1: {0}}, failed={2: {1}})
    for other in (WorkerOutput(completed={1: {0}}), WorkerOutput(failed={1: {0}}), WorkerOutput(completed={2: {1}})):
        with pytest.raises(AckCountError, match="reported twice in one step"):
            merged.merge(other)
        assert merged == WorkerOutput(completed={1: {0}}, failed={2: {1}})
    with pytest.raises(AckCountError, match="rank 1 reported twice in one output"):
        merged.add(2, 1, ok=True)
    merged.merge(WorkerOutput(completed={1: {1}, 3: {0}}, finished_recving={"r"}))
    assert merged == WorkerOutput(completed={1: {0, 1}, 3: {0}}, failed={2: {1}}, finished_recving={"r"})
    assert merged.job_ids() == [2, 1, 3]  # failures first: the order the scheduler applies them in


# ---------------------------------------------------------------------------------------------------------
# Across a process boundary (spec/README.md, "The scheduler/worker boundary"): plain step messages down,
# rank reports up, each side with its own job machine; the workers are the real OffloadingWorker.


def _remote_rig(
    world_size: int, **deadlines: float
) -> tuple[OffloadingScheduler, list[Any], list[HeldCopyBackend], list[float]]:
    from kvfsm.control.deadlines import Deadlines
    from kvfsm.control.messages import RemoteWorker
    from kvfsm.control.worker import OffloadingWorker

    clock = [0.0]
    sched = OffloadingScheduler(
        OffloadConfig(TPB, 1, world_size),
        CPUOffloadingManager(16),
        deadlines=Deadlines(**deadlines) if deadlines else Deadlines.none(),
        clock=lambda: clock[0],
    )
    backends = [HeldCopyBackend() for _ in range(world_size)]
    workers = [RemoteWorker(OffloadingWorker(r, world_size, b)) for r, b in enumerate(backends)]
    return sched, workers, backends, clock


def _remote_step(sched: OffloadingScheduler, workers: list[Any], output: SchedulerOutput) -> Any:
    import json

    from kvfsm.control.messages import StepMessage

    message = sched.build_step_message(output)
    wire = json.dumps(message.to_wire())  # what a process boundary does to it
    reports = []
    for worker in workers:
        worker.bind(StepMessage.from_wire(json.loads(wire)))
        worker.before_forward()
        worker.after_forward()
        reports.append(worker.poll())
    sched.apply_reports([r.report for r in reports])
    return message, reports


def test_remote_store_commits_only_when_every_rank_reported() -> None:
    sched, workers, backends, _ = _remote_rig(2)
    req = FakeRequest("a", tokens("a", 4 * TPB), TPB)
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    sched.update_state_after_alloc(req, [0, 1, 2, 3], 0)
    req.num_computed_tokens = 0
    message, _ = _remote_step(sched, workers, SchedulerOutput((ScheduledRequest("a", (0, 1, 2, 3), 4 * TPB, True),)))
    (store,) = message.store_jobs
    assert [b.held_ids for b in backends] == [(store.job_id,), (store.job_id,)]
    job = sched.job(store.job_id)
    assert job is not None and job.state is JobState.IN_FLIGHT and job.pending == 2
    backends[0].complete(store.job_id)
    _remote_step(sched, workers, SchedulerOutput())
    assert sched.has_pending_push_work() and job.pending == 1
    backends[1].complete(store.job_id)
    _, reports = _remote_step(sched, workers, SchedulerOutput())
    assert [r.report.completed for r in reports] == [(), (store.job_id,)]
    assert not sched.has_pending_push_work() and sched.stats.committed_stores == 1
    assert all(w.num_unreported == 0 for w in workers)


def test_remote_timed_out_job_stays_quarantined_until_every_rank_reported() -> None:
    sched, workers, backends, clock = _remote_rig(2, store_s=1.0)
    req = FakeRequest("a", tokens("a", 2 * TPB), TPB)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [0, 1], 0)
    message, _ = _remote_step(sched, workers, SchedulerOutput((ScheduledRequest("a", (0, 1), 2 * TPB, True),)))
    (store,) = message.store_jobs
    clock[0] = 5.0
    _remote_step(sched, workers, SchedulerOutput())  # the deadline passes: the job times out
    assert sched.stats.timed_out_stores == 1 and sched.is_quarantined(store.job_id)
    backends[0].complete(store.job_id, ok=False)
    _remote_step(sched, workers, SchedulerOutput())
    assert sched.is_quarantined(store.job_id) and sched.has_pending_push_work()  # rank 1 may still copy
    backends[1].complete(store.job_id)
    _remote_step(sched, workers, SchedulerOutput())
    assert not sched.is_quarantined(store.job_id) and not sched.has_pending_push_work()


def test_remote_report_twice_from_one_rank_is_refused() -> None:
    from kvfsm.control.messages import RankReport

    sched, workers, _, _ = _remote_rig(2)
    req = FakeRequest("a", tokens("a", TPB), TPB)
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [0], 0)
    message, _ = _remote_step(sched, workers, SchedulerOutput((ScheduledRequest("a", (0,), TPB, True),)))
    (store,) = message.store_jobs
    with pytest.raises(AckCountError):
        sched.apply_reports([RankReport(0, (store.job_id,)), RankReport(0, (store.job_id,))])
    job = sched.job(store.job_id)
    assert job is not None and job.pending == 2  # nothing changed
    with pytest.raises(UnknownJobError):
        sched.apply_reports([RankReport(0, (99,))])


def test_step_message_wire_format_is_checked() -> None:
    from kvfsm.control.messages import JobSpec, StepMessage

    msg = StepMessage((JobSpec(3, JobKind.LOAD, "r", (4, 5), 1, (7,), 2),), (), frozenset({1}))
    assert StepMessage.from_wire(msg.to_wire()) == msg
    with pytest.raises(ConfigError, match="gpu"):
        StepMessage.from_wire({"loads": [{**msg.load_jobs[0].to_wire(), "gpu": ["4"]}], "stores": [], "flush": []})
    with pytest.raises(ConfigError, match="flush"):
        StepMessage.from_wire({"loads": [], "stores": []})
    with pytest.raises(ConfigError, match="kind"):
        StepMessage.from_wire(
            {"loads": [{**msg.load_jobs[0].to_wire(), "kind": "teleport"}], "stores": [], "flush": []}
        )


def test_extend_running_blocks_is_only_for_a_running_request() -> None:
    """vLLM's second update_state_after_alloc after an asynchronous load (the connector's route)."""
    from kvfsm.errors import InvalidTransition, KvfsmError

    sched, _, _, _ = _remote_rig(1)
    req = FakeRequest("a", tokens("a", 2 * TPB), TPB)
    sched.get_num_new_matched_tokens(req, 0)
    with pytest.raises(InvalidTransition):
        sched.extend_running_blocks(req, [0, 1])  # still tracked: nothing changes
    assert sched.request_state("a") is RequestState.TRACKED
    sched.update_state_after_alloc(req, [0, 1], 0)
    with pytest.raises(KvfsmError, match="do not extend"):
        sched.extend_running_blocks(req, [5, 1, 2])
    sched.extend_running_blocks(req, [0, 1, 2])
    assert sched.request_block_ids("a") == (0, 1, 2)
    assert sched.request_state("a") is RequestState.RUNNING
