"""The reference engine end to end: real KV tensors, real torch copies on CPU, W worker ranks.

Copies run through GatedBackends (tests/helpers.py), so when a copy finishes is decided by the test:
``release_on_wait=True`` plus ``step_released`` makes every run fully deterministic, and a closed gate
with :class:`StepInThread` shows a step that blocks in a flush.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest

pytest.importorskip("torch")

from helpers import (
    GatedEngine,
    StepInThread,
    check_cpu_copies,
    cpu_manager,
    engine_config,
    gated_engine,
    keys_of,
    run_released,
    tokens,
)

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.types import LookupResult, ReqContext
from kvfsm.engine.core import EngineConfig, ReferenceEngine, StepRecord
from kvfsm.engine.requests import EngineRequest, RequestStatus
from kvfsm.errors import ConfigError, DuplicateRequestError
from kvfsm.machines.names import EngineState, JobKind, RequestState, SlotState

CTX = ReqContext("probe")


def step_until(ge: GatedEngine, done: Callable[[], bool], max_steps: int = 50) -> StepRecord:
    """Step (without completing copies) until ``done()``; returns the last step's record."""
    for _ in range(max_steps):
        rec = ge.engine.step()
        assert rec is not None, "the engine went idle first"
        if done():
            return rec
    raise AssertionError(f"condition not reached in {max_steps} steps")


def offload_and_settle(ge: GatedEngine, req: EngineRequest) -> None:
    """Run ``req`` to completion and let its stores commit (deterministically)."""
    ge.engine.add_request(req)
    run_released(ge)
    assert req.is_finished and ge.engine.state is EngineState.IDLE


# ------------------------------------------------------------------------------------------- fences


def test_reused_block_of_a_finished_request_flushes_its_store_before_the_forward() -> None:
    # Three GPU blocks: B must take one of A's freed blocks while A's store of it is still held.
    with gated_engine(engine_config(world_size=2, num_gpu_blocks=3)) as ge:
        e = ge.engine
        a = e.make_request("A", tokens("A", 8), 1)
        e.add_request(a)
        e.step()
        assert a.is_finished
        (store_a,) = e.scheduler.jobs()
        a_blocks = set(e.scheduler.jobs()[store_a].gpu.block_ids)
        assert set(e.scheduler.fenced_blocks()) == a_blocks

        b = e.make_request("B", tokens("B", 8), 1)
        e.add_request(b)
        step = StepInThread(e, ge.backends[0]).start()  # the fence flush waits for A's store
        assert set(b.block_ids) & a_blocks  # B re-uses a block that A's store still has to read
        assert e.scheduler.job(store_a) is not None
        ge.open_all()
        rec = step.finish()
        assert rec is not None and rec.flushed == 1
        assert e.scheduler.stats.fence_flushes == 1
        assert e.scheduler.job(store_a) is None
        ge.close_all()
        run_released(ge)
        # The store read A's KV, not what B's forward wrote over it afterwards.
        assert check_cpu_copies(ge, a.block_hashes) == 2 * 2

        # C loads both of A's chunks back: byte-exact.
        e.reset_prefix_cache()
        c = e.make_request("C", a.prompt_token_ids + tokens("C", 4), 1)
        offload_and_settle(ge, c)
        assert e.integrity.loads_completed == 1
        assert e.integrity.blocks_verified == 2 * e.config.num_layers
        assert e.integrity.mismatches == 0


def test_preemption_flushes_the_stores_of_the_preempted_request() -> None:
    # Six GPU blocks, two growing requests: the newer one is preempted while its stores are in flight
    # (nothing completes a copy except a flush's wait).
    with gated_engine(engine_config(world_size=2, num_gpu_blocks=6), release_on_wait=True) as ge:
        e = ge.engine
        a = e.make_request("A", tokens("A", 8), 8)
        b = e.make_request("B", tokens("B", 8), 8)
        e.add_request(a)
        e.add_request(b)
        b_jobs: frozenset[int] = frozenset()
        b_blocks: list[int] = []
        b_kinds: set[JobKind] = set()
        for _ in range(20):
            b_jobs, b_blocks = e.scheduler.request_jobs("B"), list(b.block_ids)
            b_kinds = {e.scheduler.jobs()[j].kind for j in b_jobs}
            rec = e.step()
            assert rec is not None
            if b.status is RequestStatus.PREEMPTED:
                break
        else:
            raise AssertionError("B was never preempted")
        assert len(b_jobs) >= 2 and b_kinds == {JobKind.STORE}
        assert rec.flushed == len(b_jobs)
        assert e.scheduler.stats.preemption_flushes == 1
        assert all(e.scheduler.job(j) is None for j in b_jobs)  # flushed, hence acked this very step
        assert set(a.block_ids) & set(b_blocks)  # A grew into a block B's store had to read
        assert e.scheduler.request_state("B") is RequestState.PREEMPTED

        run_released(ge)
        assert a.is_finished and b.is_finished
        assert e.integrity.loads_completed >= 1  # B came back by loading what it had stored
        assert e.integrity.mismatches == 0 and e.integrity.blocks_verified > 0
        assert check_cpu_copies(ge, b.block_hashes) > 0


# ------------------------------------------------------------------------------------------- loads


def test_concurrent_lookups_of_the_same_prefix_load_once() -> None:
    with gated_engine(engine_config()) as ge:
        e = ge.engine
        prompt = tokens("A", 12)
        offload_and_settle(ge, e.make_request("A", prompt, 1))
        e.reset_prefix_cache()

        b = e.make_request("B", prompt, 2)
        c = e.make_request("C", prompt, 2)
        e.add_request(b)
        e.add_request(c)
        e.step()
        assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert e.scheduler.request_state("C") is RequestState.DEFERRED and c.block_ids == []
        (load_b,) = e.scheduler.request_jobs("B")
        assert e.scheduler.jobs()[load_b].kind is JobKind.LOAD
        assert ge.held_ids() == {load_b}  # in flight
        e.step()
        assert e.scheduler.request_state("C") is RequestState.DEFERRED and ge.held_ids() == {load_b}

        ge.release_all()
        run_released(ge)
        assert b.is_finished and c.is_finished
        assert e.scheduler.stats.load_jobs == 1
        assert e.integrity.loads_completed == 1 and e.integrity.mismatches == 0
        assert e.scheduler.request_jobs("C") == frozenset()
        assert c.first_scheduled_step is not None and b.first_scheduled_step is not None
        assert c.first_scheduled_step > b.first_scheduled_step
        assert e.scheduler.fenced_blocks() == {}


def test_aborted_loading_request_keeps_its_blocks_until_the_load_completes() -> None:
    with gated_engine(engine_config(world_size=2)) as ge:
        e = ge.engine
        prompt = tokens("A", 12)
        offload_and_settle(ge, e.make_request("A", prompt, 1))
        e.reset_prefix_cache()
        b = e.make_request("B", prompt, 4)
        e.add_request(b)
        e.step()
        assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        blocks = list(b.block_ids)
        (load_b,) = e.scheduler.request_jobs("B")

        e.abort("B")
        for _ in range(2):
            rec = e.step()
            assert rec is not None
            assert e.scheduler.is_tracked("B")
            assert e.scheduler.request_state("B") is RequestState.FINISHED_SIGNALLED
            assert all(e.block_pool.ref_count(blk) == 1 for blk in blocks)  # the load writes them
            assert e.has_pending_push_work()

        ge.release_all()
        rec = e.step()
        assert rec is not None and e.scheduler.job(load_b) is None
        assert not e.scheduler.is_tracked("B")
        assert all(e.block_pool.ref_count(blk) == 0 for blk in blocks)
        assert b in e.finished and b.output_token_ids == []
        assert e.integrity.loads_completed == 0  # an aborted load is not used
        assert rec.state is EngineState.FINISHING
        rec = e.step()
        assert rec is not None and rec.state is EngineState.IDLE
        assert e.step() is None


def test_reset_with_a_load_in_flight_flushes_the_stale_load_before_the_request_runs() -> None:
    with gated_engine(engine_config(world_size=2), release_on_wait=True) as ge:
        e = ge.engine
        prompt = tokens("A", 12)
        offload_and_settle(ge, e.make_request("A", prompt, 1))
        e.reset_prefix_cache()
        b = e.make_request("B", prompt, 2)
        e.add_request(b)
        e.step()
        (load_b,) = e.scheduler.request_jobs("B")
        assert ge.held_ids() == {load_b}

        e.reset_offload_cache()
        assert not e.has_pending_push_work()
        assert e.scheduler.request_state("B") is RequestState.RUNNING  # its load is stale
        rec = e.step()
        assert rec is not None and rec.flushed == 1  # the stale load finished before the forward
        assert e.scheduler.stats.stale_reports_ignored == 1
        # A discarded load is never trusted: the engine recomputes its blocks from the local prefix.
        assert e.integrity.loads_completed == 0 and e.integrity.loads_failed == 1
        assert e.integrity.mismatches == 0 and b.num_computed_tokens == 0  # recomputes from its local prefix
        run_released(ge)
        assert b.is_finished and cpu_manager(e).stats().used == 3  # B's three chunks, stored anew


def test_failed_load_is_recomputed_and_never_counted_as_loaded() -> None:
    with gated_engine(engine_config(world_size=2), release_on_wait=True) as ge:
        e = ge.engine
        prompt = tokens("A", 12)
        offload_and_settle(ge, e.make_request("A", prompt, 1))
        keys = keys_of(e.make_request("probe", prompt, 1).block_hashes, 1)
        e.reset_prefix_cache()
        b = e.make_request("B", prompt, 3)
        e.add_request(b)
        e.step()
        (load_b,) = e.scheduler.request_jobs("B")
        ge.backends[0].fail_job_ids.add(load_b)  # rank 0 reports a failure, rank 1 succeeds
        ge.release_all()
        rec = e.step()
        assert rec is not None and e.scheduler.job(load_b) is None
        assert e.scheduler.stats.failed_loads == 1 and e.scheduler.stats.committed_loads == 0
        assert e.integrity.loads_failed == 1 and e.integrity.loads_completed == 0
        assert b.status is RequestStatus.RUNNING and b.num_computed_tokens == 0  # recomputes all
        assert [cpu_manager(e).slot_state(k) for k in keys[:2]] == [SlotState.READY] * 2  # unpinned
        run_released(ge)
        assert b.is_finished and len(b.output_token_ids) == 3
        assert e.integrity.blocks_verified == 0 and e.integrity.mismatches == 0


def test_failed_store_never_becomes_readable() -> None:
    with gated_engine(engine_config(world_size=2), release_on_wait=True) as ge:
        e = ge.engine
        a = e.make_request("A", tokens("A", 8), 1)
        e.add_request(a)
        e.step()
        (store_a,) = e.scheduler.jobs()
        ge.backends[1].fail_job_ids.add(store_a)
        run_released(ge)
        assert e.scheduler.stats.failed_stores == 1 and e.scheduler.stats.committed_stores == 0
        assert [e.manager.lookup(k, CTX) for k in keys_of(a.block_hashes, 1)] == [LookupResult.MISS] * 2
        assert cpu_manager(e).num_free == e.config.num_cpu_slots
        assert e.state is EngineState.IDLE


# ------------------------------------------------------------------------------------------- errors


def test_duplicate_request_id_raises_and_changes_nothing() -> None:
    with gated_engine(engine_config(), release_on_wait=True) as ge:
        e = ge.engine
        a = e.make_request("A", tokens("A", 8), 2)
        e.add_request(a)
        with pytest.raises(DuplicateRequestError, match="'A'"):
            e.add_request(e.make_request("A", tokens("other", 4), 1))  # queued, not yet admitted
        rec = e.step()
        assert rec is not None and rec.scheduled == ("A",)
        assert list(e.requests) == ["A"] and e.requests["A"] is a
        with pytest.raises(DuplicateRequestError):
            e.add_request(e.make_request("A", tokens("other", 4), 1))  # admitted
        assert list(e.requests) == ["A"] and list(e.running) == [a]
        run_released(ge)
        assert a.is_finished and len(e.finished) == 1


def test_duplicate_late_arrival_is_rejected_on_entry_and_the_engine_keeps_stepping() -> None:
    # Issue 13, bug 3: add_request_during_next_step() did not check the id, so the duplicate reached the
    # next step's admission and every later step() raised DuplicateRequestError.
    with gated_engine(engine_config(), release_on_wait=True) as ge:
        e = ge.engine
        a, b, c = (e.make_request(r, tokens(r, 6), 1) for r in "ABC")
        e.add_request(a)
        assert e.step() is not None  # A admitted
        e.add_request(b)  # B queued in the inbox
        e.add_request_during_next_step(c)  # C in the late-arrival list
        for dup in ("A", "B", "C"):
            with pytest.raises(DuplicateRequestError, match=f"'{dup}'.*expected a new id"):
                e.add_request_during_next_step(e.make_request(dup, tokens("dup", 4), 1))
        with pytest.raises(DuplicateRequestError, match="'C'"):
            e.add_request(e.make_request("C", tokens("dup", 4), 1))  # the late list is checked too
        assert list(e.requests) == ["A"]  # state unchanged by the refused calls
        run_released(ge)  # never raises
        assert list(e.requests) == ["A", "B", "C"]
        assert [r.req_id for r in e.finished] == ["A", "B", "C"] and e.state is EngineState.IDLE
        assert e.requests["C"] is c and c.is_finished


def test_manager_with_more_slots_than_the_cpu_pools_is_refused_at_construction() -> None:
    # Issue 13, bug 4: the engine took it; the first store to slot >= num_cpu_slots raised ConfigError
    # mid-step and left the engine stuck in running.
    manager = CPUOffloadingManager(8)
    with pytest.raises(ConfigError, match=r"8 slots.*num_cpu_slots=4"):
        ReferenceEngine(engine_config(num_cpu_slots=4), manager=manager)
    assert manager.num_free == 8  # untouched
    engine = ReferenceEngine(engine_config(num_cpu_slots=8), manager=manager)  # a pool that fits
    engine.add_request(engine.make_request("A", tokens("A", 30), 1))
    engine.run_until_idle()
    assert engine.state is EngineState.IDLE and manager.num_free < 8
    engine.shutdown()


def test_given_workers_are_checked_against_the_manager_and_the_config() -> None:
    big = ReferenceEngine(engine_config(world_size=2, num_cpu_slots=8))
    small = ReferenceEngine(engine_config(world_size=2, num_cpu_slots=4))
    try:
        with pytest.raises(ConfigError, match=r"rank 0's CPU pool has 4 slots.*manager's CPU primary has 8"):
            ReferenceEngine(engine_config(world_size=2), manager=CPUOffloadingManager(8), workers=small.workers)
        with pytest.raises(ConfigError, match=r"has 4 slots but the manager's CPU primary has 64"):
            ReferenceEngine(engine_config(world_size=2, num_cpu_slots=64), workers=small.workers)  # its own manager
        with pytest.raises(ConfigError, match="worker 0 has rank=1"):
            ReferenceEngine(engine_config(world_size=2), workers=big.workers[::-1])
        with pytest.raises(ConfigError, match="expected world_size=1"):
            ReferenceEngine(engine_config(world_size=1), workers=big.workers)
        with pytest.raises(ConfigError, match="worker 0 has rank=0, world_size=2; expected rank=0, world_size=1"):
            ReferenceEngine(engine_config(world_size=1), workers=big.workers[:1])
        with pytest.raises(ConfigError, match="blocks per slot; expected blocks_per_chunk=2"):
            ReferenceEngine(engine_config(world_size=2, blocks_per_chunk=2, num_cpu_slots=8), workers=big.workers)
    finally:
        big.shutdown()
        small.shutdown()


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param({"num_heads": 3, "world_size": 2}, id="heads-not-divisible"),
        pytest.param({"num_gpu_blocks": 1, "blocks_per_chunk": 2}, id="gpu-pool-below-one-chunk"),
        pytest.param({"tokens_per_block": 0}, id="tokens_per_block=0"),
        pytest.param({"num_cpu_slots": 0}, id="num_cpu_slots=0"),
        pytest.param({"world_size": True}, id="bool-world-size"),
        pytest.param({"poll": "spin"}, id="unknown-poll-mode"),
    ],
)
def test_engine_config_errors(overrides: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        engine_config(**overrides)


def test_worker_count_must_match_the_world_size() -> None:
    with pytest.raises(ConfigError, match="world_size=2"):
        ReferenceEngine(engine_config(world_size=2), workers=[])


# ------------------------------------------------------------------------------------------- workloads


def multi_turn(engine: ReferenceEngine, run: Callable[[], object], turns: int = 3) -> list[EngineRequest]:
    """Three conversations; each turn's prompt is the previous turn's tokens plus new ones."""
    history = {c: tokens(f"conv{c}", 14) for c in range(3)}
    done: list[EngineRequest] = []
    for turn in range(turns):
        for c in history:
            req = engine.make_request(f"c{c}-t{turn}", history[c], 4)
            engine.add_request(req)
            done.append(req)
        run()
        for req in done[-len(history) :]:
            assert req.is_finished
            c = int(req.req_id[1])
            history[c] = req.all_token_ids + tokens(f"conv{c}-t{turn}", 6)
    return done


def integrity_config(**overrides: object) -> EngineConfig:
    # A GPU pool of 14 blocks cannot keep three conversations cached, so later turns load from the CPU;
    # ten CPU slots (two blocks each) cannot keep every chunk either, so the LRU policy evicts.
    return engine_config(world_size=2, blocks_per_chunk=2, num_gpu_blocks=14, num_cpu_slots=10, **overrides)


def test_multi_turn_prefix_reuse_loads_byte_exact_kv() -> None:
    with gated_engine(integrity_config(), release_on_wait=True) as ge:
        e = ge.engine
        reqs = multi_turn(e, lambda: run_released(ge))
        assert e.integrity.mismatches == 0
        assert e.integrity.loads_completed > 0
        assert e.integrity.blocks_verified > 0
        assert e.integrity.loads_failed == 0
        assert cpu_manager(e).stats().evictions > 0
        assert sum(check_cpu_copies(ge, r.block_hashes) for r in reqs) > 0
        assert not e.has_pending_push_work()


def test_multi_turn_with_free_running_copy_threads() -> None:
    """The same workload on the engine's own thread-pool backends: copies finish whenever they do."""
    engine = ReferenceEngine(integrity_config())

    def run() -> None:
        while engine.step() is not None:
            engine.wait_for_transfers()

    try:
        multi_turn(engine, run)
        assert engine.integrity.mismatches == 0
        assert engine.integrity.loads_completed > 0
        assert engine.integrity.blocks_verified > 0
    finally:
        engine.shutdown()
    assert engine.state is EngineState.STOPPED


def test_checked_mode_gives_the_same_timeline() -> None:
    timelines: dict[bool, list[StepRecord]] = {}
    for checked in (False, True):
        with gated_engine(integrity_config(checked=checked), release_on_wait=True) as ge:
            e = ge.engine
            assert cpu_manager(e).machine.checked is checked
            multi_turn(e, functools.partial(run_released, ge), turns=2)
            assert e.integrity.mismatches == 0
            timelines[checked] = list(e.timeline)
    assert [r.state for r in timelines[True]] == [r.state for r in timelines[False]]
    assert timelines[True] == timelines[False]
    assert {r.state for r in timelines[True]} >= {EngineState.RUNNING, EngineState.FINISHING}
