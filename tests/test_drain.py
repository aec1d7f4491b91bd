"""The engine drain (vLLM #45595 against the #42611 baseline), on the reference engine with real copies.

Every worker copies through a GatedBackend, so "the stores are still in flight" is a fact the test
controls, not a race it hopes to win. Steps are compared by number, never by time.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from helpers import GatedEngine, StepInThread, check_cpu_copies, engine_config, gated_engine, keys_of, tokens

from kvfsm.control.config import DrainMode
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.engine.requests import EngineRequest
from kvfsm.machines.names import EngineState, JobKind, JobState

CTX = ReqContext("probe")


def first_scheduled(req: EngineRequest) -> int | None:
    return req.first_scheduled_step


def lookups(ge: GatedEngine, keys: list[OffloadKey]) -> list[LookupResult]:
    return [ge.engine.manager.lookup(k, CTX) for k in keys]


def finish_one_request(ge: GatedEngine, req_id: str = "A") -> EngineRequest:
    """Step 1: A (two blocks, one output token) is prefilled, plans its store and finishes."""
    e = ge.engine
    a = e.make_request(req_id, tokens(req_id, 8), 1)
    e.add_request(a)
    rec = e.step()
    assert rec is not None and rec.scheduled == (req_id,)
    assert a.is_finished and rec.state is EngineState.FINISHING
    assert rec.jobs_in_flight == 1 and ge.held_ids() == set(e.scheduler.jobs())
    return a


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_last_stores_in_flight_drain_by_stepping_until_all_workers_ack(world_size: int) -> None:
    with gated_engine(engine_config(world_size=world_size)) as ge:
        e = ge.engine
        a = finish_one_request(ge)
        keys = keys_of(a.block_hashes, 1)
        (job,) = e.scheduler.jobs().values()
        assert job.kind is JobKind.STORE and job.pending == world_size

        rec = e.step()  # A is signalled: no flush, no blocking wait
        assert rec is not None and rec.flushed == 0 and rec.state is EngineState.DRAINING
        assert e.blocking_waits == 0 and all(b.num_waits == 0 for b in ge.backends)
        assert e.has_pending_push_work() and rec.pending_push_work
        assert lookups(ge, keys) == [LookupResult.HIT_PENDING] * 2

        for _ in range(3):  # the engine keeps stepping, empty, while the copies are held
            rec = e.step()
            assert rec is not None and rec.state is EngineState.DRAINING and rec.flushed == 0
        assert all(b.num_waits == 0 for b in ge.backends)

        for rank, backend in enumerate(ge.backends):
            backend.open()
            e.workers[rank].wait_all()  # this rank's copy is done; the next poll reports it
            rec = e.step()
            assert rec is not None
            if rank < world_size - 1:
                assert job.state is JobState.IN_FLIGHT and job.pending == world_size - rank - 1
                assert rec.state is EngineState.DRAINING and e.has_pending_push_work()
                assert lookups(ge, keys) == [LookupResult.HIT_PENDING] * 2
        assert job.state is JobState.COMPLETE
        assert rec.state is EngineState.IDLE and e.state is EngineState.IDLE
        assert lookups(ge, keys) == [LookupResult.HIT] * 2
        assert not e.has_pending_push_work()
        assert not e.scheduler.is_tracked("A")
        assert e.step() is None
        assert e.blocking_waits == 0
        assert check_cpu_copies(ge, a.block_hashes) == 2 * world_size
        assert [r.state for r in e.timeline] == [
            EngineState.FINISHING,
            *[EngineState.DRAINING] * (3 + world_size),
            EngineState.IDLE,
        ]


def test_request_arriving_while_draining_is_scheduled_at_the_next_step() -> None:
    with gated_engine(engine_config(world_size=2)) as ge:
        e = ge.engine
        a = finish_one_request(ge)
        keys = keys_of(a.block_hashes, 1)
        (store_id,) = e.scheduler.jobs()
        b = e.make_request("B", tokens("B", 8), 2)
        e.add_request_during_next_step(b)
        rec = e.step()  # A signalled; B reaches the engine during this step
        assert rec is not None and rec.state is EngineState.DRAINING and rec.flushed == 0
        assert first_scheduled(b) is None

        rec = e.step()  # admitted and scheduled at once, although A's stores are still in flight
        assert rec is not None and rec.scheduled == ("B",) and rec.state is EngineState.RUNNING
        assert b.first_scheduled_step == rec.step == 3
        assert store_id in ge.held_ids()
        assert e.scheduler.job(store_id) is not None
        assert lookups(ge, keys) == [LookupResult.HIT_PENDING] * 2
        assert e.blocking_waits == 0

        ge.open_all()
        e.wait_for_transfers()
        rec = e.step()
        assert rec is not None and e.scheduler.job(store_id) is None
        assert lookups(ge, keys) == [LookupResult.HIT] * 2
        commit_step = rec.step
        assert b.first_scheduled_step < commit_step  # B did not wait for A's offload
        while ge.step_released() is not None:
            pass
        assert b.is_finished and e.blocking_waits == 0


@pytest.mark.parametrize("world_size", [1, 2])
def test_blocking_baseline_holds_a_new_request_until_the_flush_is_done(world_size: int) -> None:
    with gated_engine(engine_config(world_size=world_size, drain=DrainMode.BLOCKING)) as ge:
        e = ge.engine
        a = finish_one_request(ge)
        keys = keys_of(a.block_hashes, 1)
        (store_id,) = e.scheduler.jobs()
        b = e.make_request("B", tokens("B", 8), 2)
        e.add_request_during_next_step(b)

        step = StepInThread(e, ge.backends[0]).start()  # step 2 flushes A's stores and blocks
        assert step.is_blocked
        assert first_scheduled(b) is None and "B" not in e.requests
        assert e.scheduler.job(store_id) is not None
        ge.open_all()
        rec = step.finish()
        assert rec is not None and rec.step == 2 and rec.flushed == 1
        assert e.blocking_waits == 1
        assert e.scheduler.job(store_id) is None  # committed inside the blocking step
        assert lookups(ge, keys) == [LookupResult.HIT] * 2
        commit_step = rec.step

        rec = e.step()
        assert rec is not None and rec.scheduled == ("B",)
        assert b.first_scheduled_step == rec.step == commit_step + 1  # only after the flush
        while ge.step_released() is not None:
            pass
        assert b.is_finished


def test_reset_while_draining_stops_the_pending_signal_and_flushes_stale_jobs() -> None:
    with gated_engine(engine_config(world_size=2)) as ge:
        e = ge.engine
        a = finish_one_request(ge)
        (store_id,) = e.scheduler.jobs()
        rec = e.step()
        assert rec is not None and rec.state is EngineState.DRAINING

        e.reset_offload_cache()
        assert not e.has_pending_push_work()  # at once, with both ranks' copies still held
        assert ge.held_ids() == {store_id}
        assert e.scheduler.stale_threshold == store_id + 1

        # The next step flushes the stale store: it must finish before its slot can be reused.
        step = StepInThread(e, ge.backends[0]).start()
        ge.open_all()
        rec = step.finish()
        assert rec is not None and rec.flushed == 1
        assert rec.state is EngineState.IDLE
        assert e.scheduler.stats.stale_reports_ignored == 1  # both ranks' acks, summed: one report
        assert e.scheduler.stats.committed_stores == 0
        assert [e.manager.lookup(k, CTX) for k in keys_of(a.block_hashes, 1)] == [LookupResult.MISS] * 2
        assert e.step() is None
