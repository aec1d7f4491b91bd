"""KvfsmConnector inside vLLM 0.33's real Scheduler: the drain, fences, preemption, abort while loading,
reset_cache and failed loads, each checked against the bytes in the KV caches (tests/vllm/connector_support.py).

The scheduler role is vLLM's own ``Scheduler`` with KvfsmConnector loaded from ``kv_connector_module_path``; the
worker role is W KvfsmConnector workers over CPU tensors, each copy held at a gate on its real copy thread until
the test releases it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

# The real vLLM (tests/vllm itself is a namespace package named vllm when tests/ is on sys.path).
pytest.importorskip("vllm.v1.core.sched.scheduler")

from connector_support import Rig, opt_config_dir

from kvfsm.control.messages import StepMessage
from kvfsm.errors import ConfigError
from kvfsm.machines.names import JobKind
from kvfsm.vllm.connector import KvfsmConnectorMetadata, parse_settings

PROMPT_A = list(range(1, 70))  # 69 tokens: 4 full blocks of 16
PROMPT_B = list(range(500, 540))  # 40 tokens: 2 full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return opt_config_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def rig(model_dir: Path) -> Iterator[Rig]:
    r = Rig(model_dir)
    yield r
    r.shutdown()


@pytest.fixture
def rig2(model_dir: Path) -> Iterator[Rig]:
    r = Rig(model_dir, world_size=2)
    yield r
    r.shutdown()


def _message(rig: Rig, step: int) -> StepMessage:
    meta = rig.steps[step].output.kv_connector_metadata
    assert isinstance(meta, KvfsmConnectorMetadata)
    return meta.message


def _jobs(rig: Rig, kind: JobKind) -> list[int]:
    ids: list[int] = []
    for i in range(len(rig.steps)):
        msg = _message(rig, i)
        ids.extend(j.job_id for j in (msg.load_jobs if kind is JobKind.LOAD else msg.store_jobs))
    return ids


def _finish_request(rig: Rig, req_id: str) -> None:
    """Step until vLLM has finished ``req_id`` (its stores may still be held)."""
    for _ in range(50):
        if req_id not in rig.scheduler.requests:
            return
        rig.step()
    raise AssertionError(f"{req_id} did not finish")


def _release_all(rig: Rig) -> None:
    for rank in range(rig.world_size):
        for job_id in rig.held(rank):
            rig.release(job_id, ranks=[rank])


def _drain(rig: Rig) -> None:
    """Step until vLLM's loop goes idle, letting every copy finish as soon as it is submitted."""
    for _ in range(200):
        _release_all(rig)
        if not rig.has_work():
            return
        rig.step()
    raise AssertionError("the engine did not go idle")


def _reload(rig: Rig, prompt: list[int]) -> str:
    """Drop vLLM's GPU prefix cache and run ``prompt`` again: its prefix can come only from kvfsm's CPU copy."""
    assert rig.scheduler.reset_prefix_cache()
    req = rig.add(prompt, max_tokens=2)
    while req.request_id in rig.scheduler.requests:
        _release_all(rig)
        rig.step()
    _release_all(rig)
    rig.run_until_idle()
    return str(req.request_id)


# ---------------------------------------------------------------------------------------------- the drain


@pytest.mark.parametrize("world", [1, 2])
def test_drain_keeps_stepping_admits_arrivals_and_goes_idle_after_every_worker(model_dir: Path, world: int) -> None:
    """The seed's scenario in vLLM's own engine loop test (``Scheduler.has_requests``): the last request
    finishes with its store in flight; the loop keeps stepping while has_pending_push_work() is True; a
    request arriving meanwhile is scheduled at the very next step; the loop goes idle only once every
    worker has reported; and the stored bytes come back right."""
    rig = Rig(model_dir, world_size=world)
    try:
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish_request(rig, "a")
        stores = _jobs(rig, JobKind.STORE)
        assert stores, "no store was planned for a 4-block prompt"
        assert all(j in rig.held(rank) for j in stores for rank in range(world))
        assert not rig.scheduler.requests  # no request left in vLLM
        assert rig.connector.has_pending_push_work()
        assert rig.has_work()  # vLLM's engine loop keeps stepping on the connector's word alone
        for _ in range(3):
            rig.step()
            assert rig.steps[-1].pending_push_work_before
        rig.add(PROMPT_B, max_tokens=1, req_id="b")  # arrives during the drain
        rec = rig.step()
        assert "b" in rec.new_req_ids, "a request arriving during the drain waits for the next step, no longer"
        _finish_request(rig, "b")
        # Every rank but the last reports: the job is still awaited (acks are per rank, not counted).
        for job_id in stores:
            for rank in range(world - 1):
                rig.release(job_id, ranks=[rank])
        _release_all_but_last = [j for j in rig.held(world - 1) if j not in stores]
        for job_id in _release_all_but_last:
            rig.release(job_id)
        rig.step()
        rig.step()
        assert rig.connector.has_pending_push_work()
        for job_id in stores:
            rig.release(job_id, ranks=[world - 1])
        rig.run_until_idle()
        assert not rig.has_work()
        assert not rig.connector.has_pending_push_work()
        sched = rig.connector.scheduler
        assert sched is not None
        assert sched.stats.committed_stores >= len(stores)
        # The bytes: vLLM's GPU prefix cache is dropped, so a's prefix can only be loaded from kvfsm.
        before = sched.stats.committed_loads
        _reload(rig, PROMPT_A)
        assert sched.stats.committed_loads == before + 1
        assert not rig.mismatches, rig.mismatches[:3]
    finally:
        rig.shutdown()


def test_second_update_state_after_alloc_after_an_async_load(rig: Rig) -> None:
    """vLLM calls update_state_after_alloc again when a request whose asynchronous load finished is
    rescheduled; kvfsm takes it as a bookkeeping update (no request event) and the request runs on."""
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish_request(rig, "a")
    _release_all(rig)
    rig.run_until_idle()
    assert rig.scheduler.reset_prefix_cache()
    rig.add([*PROMPT_A, 7, 8, 9], max_tokens=3, req_id="c")
    rec = rig.step()
    assert not rec.scheduled  # waiting for its load
    loads = _message(rig, len(rig.steps) - 1).load_jobs
    assert len(loads) == 1 and loads[0].req_id == "c"
    rig.release(loads[0].job_id)
    rig.step()  # the load's report: vLLM marks c finished receiving
    rec = rig.step()  # c is rescheduled: the second update_state_after_alloc
    assert rec.scheduled.get("c", 0) > 0
    _finish_request(rig, "c")
    _release_all(rig)
    rig.run_until_idle()
    assert not rig.mismatches, rig.mismatches[:3]
    sched = rig.connector.scheduler
    assert sched is not None and not sched.is_tracked("c")


# ---------------------------------------------------------------------------------------------- fences


def test_fence_flushes_a_store_before_its_freed_block_is_reused(model_dir: Path) -> None:
    """A finished request's store still reads its freed GPU blocks; when vLLM hands one out again the next
    step flushes the store before the forward writes it, and the CPU copy keeps the old bytes."""
    rig = Rig(model_dir, num_gpu_blocks=9)  # 8 usable blocks: b's prompt needs a's freed ones
    try:
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish_request(rig, "a")
        stores = _jobs(rig, JobKind.STORE)
        assert stores and all(j in rig.held() for j in stores)
        rig.add(list(range(900, 1000)), max_tokens=1, req_id="b")  # 100 tokens: 7 blocks
        _finish_request(rig, "b")
        flushed = [e for e in rig.log if e[0] == "flush" and e[2] in stores]
        assert flushed, "the reused blocks' store was never flushed"
        first_flush = rig.log.index(flushed[0])
        # That flush came before the forward of the step that reused the blocks.
        later_forwards = [i for i, e in enumerate(rig.log) if e[0] == "forward" and i > first_flush]
        assert later_forwards
        meta_flush = set().union(*(_message(rig, i).jobs_to_flush for i in range(len(rig.steps))))
        assert set(stores) & meta_flush
        _release_all(rig)
        rig.run_until_idle()
        sched = rig.connector.scheduler
        assert sched is not None and sched.stats.fence_flushes >= 1
        _reload(rig, PROMPT_A)  # a's bytes, loaded from its CPU copy, are a's and not b's
        assert sched.stats.committed_loads >= 1
        assert not rig.mismatches, rig.mismatches[:3]
    finally:
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- preemption


def test_preemption_flushes_the_preempted_requests_stores(model_dir: Path) -> None:
    """vLLM preempts a running request whose stores are in flight: the step flushes them (its blocks are
    freed and may be reused at once); the request is looked up again and resumes with the right bytes."""
    rig = Rig(model_dir, num_gpu_blocks=11, max_num_batched_tokens=128)
    try:
        rig.add(list(range(1, 65)), max_tokens=40, req_id="p")
        rig.add(list(range(2000, 2064)), max_tokens=40, req_id="q")
        preempted = False
        # No store is released by the test (loads are): only a flush (a fence or the preemption's) lets one
        # finish, so the victim, whose lookup waits for its own stores, resumes only if they were flushed.
        for _ in range(300):
            if not rig.scheduler.requests:
                break
            rec = rig.step()
            for load in _message(rig, len(rig.steps) - 1).load_jobs:
                rig.release(load.job_id)
            if rec.output.preempted_req_ids:
                preempted = True
                victim = next(iter(rec.output.preempted_req_ids))
                msg = _message(rig, len(rig.steps) - 1)
                sched = rig.connector.scheduler
                assert sched is not None
                assert sched.stats.preemption_flushes >= 1
                assert msg.jobs_to_flush, f"{victim} was preempted with stores in flight and none was flushed"
        assert preempted, "the GPU pool was meant to force a preemption"
        assert not rig.scheduler.requests, "a preempted request never resumed"
        _drain(rig)
        assert not rig.mismatches, rig.mismatches[:3]
    finally:
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- abort


def test_abort_while_loading(rig: Rig) -> None:
    """A request aborted while its load is in flight: vLLM keeps its blocks until the workers report the
    load; kvfsm finishes it, unpins the load's slots, and later requests load the same chunks right."""
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish_request(rig, "a")
    _release_all(rig)
    rig.run_until_idle()
    assert rig.scheduler.reset_prefix_cache()
    rig.add(PROMPT_A, max_tokens=2, req_id="x")
    rig.step()
    loads = _message(rig, len(rig.steps) - 1).load_jobs
    assert len(loads) == 1 and loads[0].job_id in rig.held()
    rig.abort("x")
    sched = rig.connector.scheduler
    assert sched is not None
    assert rig.connector.has_pending_push_work()
    rig.add(PROMPT_B, max_tokens=1, req_id="y")
    rig.step()
    assert "x" in rig.scheduler.requests  # vLLM holds x's blocks until the load reports
    rig.release(loads[0].job_id)
    _drain(rig)
    assert "x" not in rig.scheduler.requests and not sched.is_tracked("x")
    assert sched.stats.committed_loads == 1
    _reload(rig, PROMPT_A)
    assert sched.stats.committed_loads == 2
    assert not rig.mismatches, rig.mismatches[:3]


# ---------------------------------------------------------------------------------------------- reset_cache


def test_reset_cache_with_a_store_in_flight(rig: Rig) -> None:
    """vLLM's reset_connector_cache with a store in flight: the store is flushed at the next step, its
    late report is ignored by id, nothing offloaded before the reset is ever loaded again, and the
    engine goes idle."""
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish_request(rig, "a")
    stores = _jobs(rig, JobKind.STORE)
    assert stores and all(j in rig.held() for j in stores)
    assert rig.scheduler.reset_connector_cache()
    rig.step()
    assert set(stores) <= set(_message(rig, len(rig.steps) - 1).jobs_to_flush)
    rig.run_until_idle()
    sched = rig.connector.scheduler
    assert sched is not None
    assert sched.stats.stale_reports_ignored >= 1
    assert not rig.connector.has_pending_push_work()
    before = sched.stats.committed_loads
    _reload(rig, PROMPT_A)
    assert sched.stats.committed_loads == before  # the reset dropped a's chunks: recomputed, not loaded
    assert not rig.mismatches, rig.mismatches[:3]


# ---------------------------------------------------------------------------------------------- failures


def test_failed_load_is_reported_as_invalid_blocks_and_recomputed(model_dir: Path) -> None:
    rig = Rig(model_dir, extra={})
    rig.vllm_config.kv_transfer_config.kv_load_failure_policy = "recompute"
    try:
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish_request(rig, "a")
        _release_all(rig)
        rig.run_until_idle()
        assert rig.scheduler.reset_prefix_cache()
        rig.add(PROMPT_A, max_tokens=2, req_id="f")
        rig.step()
        loads = _message(rig, len(rig.steps) - 1).load_jobs
        assert len(loads) == 1
        rig.release(loads[0].job_id, ok=False)
        rig.run_until_idle()
        sched = rig.connector.scheduler
        assert sched is not None and sched.stats.failed_loads == 1
        assert "f" not in rig.scheduler.requests
        assert not rig.mismatches, rig.mismatches[:3]  # the failed blocks were recomputed, never used as loaded
    finally:
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- the boundary


def test_the_step_message_is_plain_data(rig: Rig) -> None:
    """What crosses the process boundary is ints, strings and lists: it survives JSON unchanged."""
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish_request(rig, "a")
    for i in range(len(rig.steps)):
        msg = _message(rig, i)
        assert StepMessage.from_wire(json.loads(json.dumps(msg.to_wire()))) == msg
    _release_all(rig)
    rig.run_until_idle()


def test_a_bad_extra_config_key_is_a_typed_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="num_slotz"):
        parse_settings({"num_slots": 4, "num_slotz": 4})
    with pytest.raises(ConfigError, match="num_slots"):
        parse_settings({})
    with pytest.raises(ConfigError, match="policy"):
        parse_settings({"num_slots": 4, "policy": "fifo"})
    with pytest.raises(ConfigError, match="load_deadline_s"):
        parse_settings({"num_slots": 4, "load_deadline_s": -1})


def test_reset_prefix_cache_of_running_requests_preempts_before_the_notice(rig: Rig) -> None:
    """vLLM's reset_prefix_cache(reset_running_requests=True) preempts a running request and looks it up
    again before the step's preempted_req_ids says so: the connector preempts it then (its stores are
    flushed), and the request resumes with the right bytes."""
    rig.add(list(range(1, 70)), max_tokens=30, req_id="r")
    for _ in range(3):
        rig.step()
    sched = rig.connector.scheduler
    assert sched is not None and sched.request_state("r").value == "running"
    assert rig.held(), "r's prompt stores are meant to be in flight"
    assert rig.scheduler.reset_prefix_cache(reset_running_requests=True)
    rec = rig.step()  # the lookup comes first, then the notice
    assert "r" in (rec.output.preempted_req_ids or set())
    assert sched.stats.preemption_flushes >= 1
    _drain(rig)
    assert "r" not in rig.scheduler.requests and not sched.is_tracked("r")
    assert not rig.mismatches, rig.mismatches[:3]


def test_bounded_shutdown_with_a_copy_that_never_finishes(model_dir: Path) -> None:
    """Shutdown with a store whose copy never reported: the scheduler gives the job up (timed out, its
    quarantined memory released at shutdown, nothing pending any more) without waiting for any worker."""
    rig = Rig(model_dir, extra={"shutdown_s": 0.2})
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish_request(rig, "a")
    assert rig.held() and rig.connector.has_pending_push_work()
    sched = rig.connector.scheduler
    assert sched is not None
    rig.connector.shutdown()
    assert not rig.connector.has_pending_push_work()
    assert sched.stats.timed_out_stores >= 1 and sched.stats.quarantine_abandoned >= 1
    assert rig.held()  # the scheduler did not wait: the copy is still held on its copy thread
    # Let the held copy go and stop the workers: a copy thread left blocked at its gate would keep the
    # interpreter from exiting (the thread pool joins its threads at exit).
    for backend in rig.backends:
        backend.copy_gate.open()
    for worker in rig.workers:
        worker.shutdown()
