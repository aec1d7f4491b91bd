"""The invariant checkers match spec/invariants.toml both ways, and each can fail."""

from __future__ import annotations

from kvfsm.check.invariants import CHECKERS, SystemView, check_all
from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import ReqContext
from kvfsm.machines.loader import load_invariants
from kvfsm.machines.names import EngineState


class _Req:
    def __init__(self, req_id: str, h: bytes) -> None:
        self.req_id = req_id
        self.block_hashes = [h]
        self.num_tokens = 17
        self.num_prompt_tokens = 17
        self.num_computed_tokens = 0
        self.is_aborted = False


def test_checker_names_equal_spec_names() -> None:
    assert set(CHECKERS) == {inv.name for inv in load_invariants()}


def _scheduler_with_store_in_flight() -> OffloadingScheduler:
    sched = OffloadingScheduler(OffloadConfig(16), CPUOffloadingManager(4))
    r = _Req("a", b"h" * 16)
    sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, [0], 0)
    meta = sched.build_connector_meta(
        SchedulerOutput((ScheduledRequest("a", (0,), 17, admitted=True),), allocated_block_ids=frozenset({0}))
    )
    assert len(meta.store_jobs) == 1
    return sched


def test_healthy_system_has_no_violation() -> None:
    sched = _scheduler_with_store_in_flight()
    assert check_all(SystemView(sched, EngineState.RUNNING)) == []


def test_idle_with_pending_work_is_reported() -> None:
    sched = _scheduler_with_store_in_flight()
    assert sched.has_pending_push_work()
    names = {v.invariant for v in check_all(SystemView(sched, EngineState.IDLE))}
    assert names == {"idle_only_when_nothing_pending"}


def test_readable_before_commit_is_reported() -> None:
    sched = _scheduler_with_store_in_flight()
    job = next(iter(sched.jobs().values()))
    assert isinstance(sched.manager, CPUOffloadingManager)
    # A buggy manager that publishes the keys before the workers acked:
    sched.manager.complete_store(job.keys, ReqContext("a"))
    names = {v.invariant for v in check_all(SystemView(sched, EngineState.RUNNING))}
    assert "readable_only_after_commit" in names


def test_stale_threshold_discards_jobs() -> None:
    sched = _scheduler_with_store_in_flight()
    sched.reset_cache()
    assert not sched.has_pending_push_work()
    assert check_all(SystemView(sched, EngineState.IDLE)) == []
