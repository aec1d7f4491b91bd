"""Bugs planted on purpose, for the self-tests that prove the verification suite can fail (issue 4, part 5).

Each ``plant_<name>(monkeypatch)`` is a context manager that swaps one pure decision of the
implementation for a wrong one while it is open: module functions through ``monkeypatch``, job-machine
guards through the public :meth:`kvfsm.machines.compiled.SpecMachine.planted`. Both are undone when the block ends
(and monkeypatch again when the test ends): nothing buggy is ever left in the code. The decisions are the
functions that both the real system and the model checker (:mod:`kvfsm.check`) call, so a bug planted
here is seen by both, and by the Hypothesis stateful machine too.

``PLANTED_BUGS`` maps each name to its function; tests parametrize over it::

    @pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
    def test_finds(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        with PLANTED_BUGS[name](monkeypatch):
            ...

Plant the bug before building the system under test or calling the checker: every component looks the
decision up when it runs, and the job machine's guards are planted into every cached job machine (whose
compiled tables ``SpecMachine.planted`` rebuilds).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, ExitStack, contextmanager
from typing import Any

import pytest

import kvfsm.control.cpu as cpu_mod
import kvfsm.control.scheduler as scheduler_mod
from kvfsm.machines import job_machine
from kvfsm.machines.compiled import Guard
from kvfsm.machines.names import SlotState

__all__ = [
    "DATA_PLANE_LIES",
    "PLANTED_BUGS",
    "plant_evict_reading_slot",
    "plant_fence_flush_skipped",
    "plant_future_done_early",
    "plant_idle_with_manager_work",
    "plant_partial_acks_ignored",
    "plant_poll_reports_unfinished",
    "plant_readable_on_first_ack",
    "plant_reset_keeps_stale_threshold",
]


@contextmanager
def plant_partial_acks_ignored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``has_pending_push_work()`` ignores jobs whose acks are partial (some, not all, workers acked)."""

    def buggy(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return any(job.pending == job.world_size for job in jobs) or manager_has_pending_work()

    with monkeypatch.context() as mp:
        mp.setattr(scheduler_mod, "pending_push_work", buggy)
        yield


@contextmanager
def plant_idle_with_manager_work(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The engine goes idle when only the manager has pending work (its tier transfers are forgotten)."""

    def buggy(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return bool(jobs)

    with monkeypatch.context() as mp:
        mp.setattr(scheduler_mod, "pending_push_work", buggy)
        yield


@contextmanager
def _patch_guards(overrides: Mapping[str, Guard]) -> Iterator[None]:
    """Swap named guards of every cached job machine (all checked-mode variants), tables included."""
    with ExitStack() as stack:
        for args in ((), (None,), (False,), (True,)):
            stack.enter_context(job_machine(*args).planted(guards=overrides))
        yield


@contextmanager
def plant_readable_on_first_ack(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A store commits (its slots become readable) on the first worker's ack instead of the last."""

    def first_is_last(job: Any, rank: int) -> bool:
        """Any report from a rank that launched and has not reported counts as the last one."""
        open_ranks: int = job.launched_mask & ~job.reported_mask
        return 0 <= rank < job.world_size and bool(open_ranks >> rank & 1)

    with _patch_guards(
        {
            "acks_still_pending": lambda job, count: False,
            "ack_is_last": first_is_last,
            "last_ack_clean": lambda job, count: first_is_last(job, count) and job.failed_reports == 0,
            "last_ack_after_failure": lambda job, count: first_is_last(job, count) and job.failed_reports > 0,
        }
    ):
        yield


@contextmanager
def plant_evict_reading_slot(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Eviction may take a slot that is being read (a load or cascade still copies out of it)."""

    def buggy(state: SlotState) -> bool:
        return state in (SlotState.READY, SlotState.READING)

    with monkeypatch.context() as mp:
        mp.setattr(cpu_mod, "is_evictable", buggy)
        yield


@contextmanager
def plant_fence_flush_skipped(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A fenced store is not flushed when its GPU source block is re-allocated."""

    def buggy(allocated: Iterable[int], fences: Mapping[int, AbstractSet[int]]) -> set[int]:
        return set()

    with monkeypatch.context() as mp:
        mp.setattr(scheduler_mod, "fenced_jobs", buggy)
        yield


@contextmanager
def plant_reset_keeps_stale_threshold(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """reset_cache forgets to raise the stale threshold: late reports of discarded jobs are not ignored."""

    def buggy(job_counter: int, threshold: int) -> int:
        return threshold

    with monkeypatch.context() as mp:
        mp.setattr(scheduler_mod, "stale_threshold_after_reset", buggy)
        yield


PLANTED_BUGS: dict[str, Callable[[pytest.MonkeyPatch], AbstractContextManager[None]]] = {
    "partial_acks_ignored": plant_partial_acks_ignored,
    "idle_with_manager_work": plant_idle_with_manager_work,
    "readable_on_first_ack": plant_readable_on_first_ack,
    "evict_reading_slot": plant_evict_reading_slot,
    "fence_flush_skipped": plant_fence_flush_skipped,
    "reset_keeps_stale_threshold": plant_reset_keeps_stale_threshold,
}


# ---------------------------------------------------------------------------------------------- data-plane lies
#
# Lies told by the real copy backend (kvfsm.data.backend.ThreadPoolCopyBackend), not by a pure decision: the
# model checker cannot see them (it has no data plane), so only the engine state machine, whose ground truth
# and report-time byte checks come from the data plane, is run against them.


@contextmanager
def plant_poll_reports_unfinished(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The copy backend's ``poll`` reports every submitted job, finished or not: jobs whose copy thread is
    still running (or has not started writing) are reported as done."""
    pytest.importorskip("torch")
    from kvfsm.data.backend import ThreadPoolCopyBackend

    def lying_poll(self: ThreadPoolCopyBackend) -> list[tuple[int, bool]]:
        inflight = self._inflight
        finished = [(job_id, not (f.done() and f.exception() is not None)) for job_id, f in inflight.items()]
        inflight.clear()
        return finished

    with monkeypatch.context() as mp:
        mp.setattr(ThreadPoolCopyBackend, "poll", lying_poll)
        yield


@contextmanager
def plant_future_done_early(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A copy's future completes when the copy is submitted, before its thread has written any byte."""
    pytest.importorskip("torch")
    from concurrent.futures import Future

    from kvfsm.data.backend import ThreadPoolCopyBackend

    real_submit = ThreadPoolCopyBackend.submit

    def early_submit(self: ThreadPoolCopyBackend, job_id: int, *args: Any) -> Future[None]:
        real_submit(self, job_id, *args)  # the copy really runs, on its thread, later
        early: Future[None] = Future()
        early.set_result(None)
        self._inflight[job_id] = early
        return early

    with monkeypatch.context() as mp:
        mp.setattr(ThreadPoolCopyBackend, "submit", early_submit)
        yield


DATA_PLANE_LIES: dict[str, Callable[[pytest.MonkeyPatch], AbstractContextManager[None]]] = {
    "poll_reports_unfinished": plant_poll_reports_unfinished,
    "future_done_early": plant_future_done_early,
}
