"""Bugs planted on purpose, for the self-tests that prove the verification suite can fail (issue 4, part 5).

Each ``plant_<name>(monkeypatch)`` is a context manager that swaps one pure decision of the
implementation for a wrong one while it is open: module functions through ``monkeypatch``, job-machine
guards through the public :meth:`kvfsm.machines.compiled.SpecMachine.planted`. Both are undone when the block ends
(and monkeypatch again when the test ends): nothing buggy is ever left in the code. The decisions are the
functions that both the real system and the model checker (:mod:`kvfsm.check`) call, so a bug planted
here is seen by both, and by the Hypothesis stateful machine too.

Further down: lies of the data plane (``DATA_PLANE_LIES``), and bugs planted outside the shared pure
functions, in methods the model checker never calls (``PENDING_TERM_MUTANTS``: each has-pending term
dropped; ``OUTSIDE_LIES``: a tier, the tiering manager or the deadline queue lying), which only the stateful
machines can catch.

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

from collections.abc import Callable, Collection, Container, Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest

import kvfsm.control.cpu as cpu_mod
import kvfsm.control.scheduler as scheduler_mod
from kvfsm.machines import job_machine
from kvfsm.machines.compiled import Guard
from kvfsm.machines.names import SlotState

__all__ = [
    "DATA_PLANE_LIES",
    "OUTSIDE_LIES",
    "PENDING_TERM_MUTANTS",
    "PLANTED_BUGS",
    "PendingTermMutant",
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


# ---------------------------------------------------------------------------------------------- pending-work terms
#
# Mutants of each term of the has-pending methods (the scheduler's, the tiering manager's, the tiers'), made
# on the methods themselves, outside the shared pure functions: the model checker does not call these
# methods, so only the stateful machines can catch them. ``fragment`` is the source text of the term the
# mutant drops: tests/test_planted_bugs_stateful.py checks that it is still in the method, so a mutant cannot
# silently stop matching the code.


@dataclass(frozen=True, slots=True)
class PendingTermMutant:
    """One has-pending term, dropped: where it lives and what the mutant puts there instead."""

    owner: str  #: "module:Class.method" of the method that holds the term
    fragment: str  #: the term's source text in that method
    plant: Callable[[pytest.MonkeyPatch], AbstractContextManager[None]]


@contextmanager
def _patched(target: object, name: str, value: object, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with monkeypatch.context() as mp:
        mp.setattr(target, name, value)
        yield


def _scheduler_without_jobs(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """has_pending_push_work() forgets the awaited jobs (asks only the quarantine and the manager)."""
    return _patched(
        scheduler_mod.OffloadingScheduler,
        "has_pending_push_work",
        lambda self: self._other_pending_work(),
        monkeypatch,
    )


def _scheduler_without_quarantine(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """Quarantined (timed-out) copies that have not reported are not pending work."""
    return _patched(
        scheduler_mod.OffloadingScheduler,
        "_other_pending_work",
        lambda self: self.manager.has_pending_work(),
        monkeypatch,
    )


def _scheduler_without_manager(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """The manager's own pending work (its tier transfers) is forgotten."""
    return _patched(
        scheduler_mod.OffloadingScheduler,
        "_other_pending_work",
        lambda self: bool(self._quarantine) and not self._abandoned,
        monkeypatch,
    )


def _tiering_without_transfers(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """The tiering manager ignores its in-flight transfers (cascades, promotions) in has_pending_work."""
    from kvfsm.control.tiering import TieringManager

    def buggy(self: TieringManager) -> bool:
        if self._abandoned:
            return False
        return bool(self._quarantine) or any(t.has_pending_work() for t in self._tiers)

    return _patched(TieringManager, "has_pending_work", buggy, monkeypatch)


def _tiering_without_quarantine(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """The tiering manager ignores its timed-out transfers whose tier has not reported."""
    from kvfsm.control.tiering import TieringManager

    def buggy(self: TieringManager) -> bool:
        if self._abandoned:
            return False
        return bool(self._transfer_jobs) or any(t.has_pending_work() for t in self._tiers)

    return _patched(TieringManager, "has_pending_work", buggy, monkeypatch)


def _tiering_without_tiers(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """The tiering manager ignores the tiers' own pending work (the tier term)."""
    from kvfsm.control.tiering import TieringManager

    def buggy(self: TieringManager) -> bool:
        if self._abandoned:
            return False
        return bool(self._transfer_jobs or self._quarantine)

    return _patched(TieringManager, "has_pending_work", buggy, monkeypatch)


def _fs_tier_under_reports(monkeypatch: pytest.MonkeyPatch) -> AbstractContextManager[None]:
    """The file-system tier says it has no pending work while its durable-mode syncs are queued or running."""
    from kvfsm.tiers.fs import FileSystemTier

    return _patched(FileSystemTier, "has_pending_work", lambda self: False, monkeypatch)


PENDING_TERM_MUTANTS: dict[str, PendingTermMutant] = {
    "scheduler.jobs": PendingTermMutant(
        "kvfsm.control.scheduler:OffloadingScheduler.has_pending_push_work",
        "self._jobs.values()",
        _scheduler_without_jobs,
    ),
    "scheduler.quarantine": PendingTermMutant(
        "kvfsm.control.scheduler:OffloadingScheduler._other_pending_work",
        "bool(self._quarantine) and not self._abandoned",
        _scheduler_without_quarantine,
    ),
    "scheduler.manager": PendingTermMutant(
        "kvfsm.control.scheduler:OffloadingScheduler._other_pending_work",
        "self.manager.has_pending_work()",
        _scheduler_without_manager,
    ),
    "tiering.transfers": PendingTermMutant(
        "kvfsm.control.tiering:TieringManager.has_pending_work", "self._transfer_jobs", _tiering_without_transfers
    ),
    "tiering.quarantine": PendingTermMutant(
        "kvfsm.control.tiering:TieringManager.has_pending_work", "self._quarantine", _tiering_without_quarantine
    ),
    "tiering.tiers": PendingTermMutant(
        "kvfsm.control.tiering:TieringManager.has_pending_work",
        "any(tier.has_pending_work() for tier in self._tiers)",
        _tiering_without_tiers,
    ),
    "fs_tier.durability": PendingTermMutant(
        "kvfsm.tiers.fs:FileSystemTier.has_pending_work", "self.durability_pending > 0", _fs_tier_under_reports
    ),
}


# ---------------------------------------------------------------------------------------------- tier and deadline lies


@contextmanager
def plant_tier_reports_before_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The file-system tier reports every cascade done as soon as it is submitted, before its file is
    written (the real result, when it comes, is dropped)."""
    from kvfsm.control.manager import JobResult, TierJob
    from kvfsm.tiers.fs import FileSystemTier

    early: dict[int, set[int]] = {}
    due: dict[int, list[JobResult]] = {}
    real_submit, real_finished = FileSystemTier.submit_store, FileSystemTier.get_finished_jobs

    def submit_store(self: FileSystemTier, job: TierJob) -> None:
        real_submit(self, job)
        early.setdefault(id(self), set()).add(job.job_id)
        due.setdefault(id(self), []).append(JobResult(job.job_id, True))

    def get_finished_jobs(self: FileSystemTier) -> list[JobResult]:
        mine = early.get(id(self), set())
        real = [r for r in real_finished(self) if r.job_id not in mine]
        now, due[id(self)] = due.get(id(self), []), []
        return now + real

    with monkeypatch.context() as mp:
        mp.setattr(FileSystemTier, "submit_store", submit_store)
        mp.setattr(FileSystemTier, "get_finished_jobs", get_finished_jobs)
        yield


@contextmanager
def plant_promotion_from_wrong_tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tiering manager submits each promotion to the tier after the one that answered HIT (its
    bookkeeping consistent with that choice, so only the tiers can tell)."""
    from kvfsm.control.tiering import TieringManager
    from kvfsm.control.types import SlotSpec
    from kvfsm.machines.names import JobKind

    def flush_promotions(self: TieringManager) -> None:
        primary = self._primary
        n = len(self._tiers)
        for i in range(n):
            per_req = self._queued[i]
            while per_req:
                req_id, keys = next(iter(per_req.items()))
                del per_req[req_id]
                keys_t = tuple(keys)
                slots = SlotSpec(tuple(self._slot_id(k) for k in keys_t))
                job = self._new_job(JobKind.PROMOTE, req_id, keys_t, slots)
                wrong = (i + 1) % n
                self._submit(wrong, job, self._tiers[wrong].submit_load, partial(primary.complete_write, keys_t, False))
                self._stats.promotions_submitted += len(keys_t)

    with monkeypatch.context() as mp:
        mp.setattr(TieringManager, "_flush_promotions", flush_promotions)
        yield


@contextmanager
def plant_deadline_queue_loses_order(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The deadline queue keeps its entries in the order they were pushed and pops from the front while the
    front has expired: a deadline set later but due earlier waits behind one that is not due."""
    from kvfsm.control.deadlines import DeadlineQueue

    def push(self: DeadlineQueue, item: int, deadline: float) -> None:
        self._heap.append((deadline, item))

    def pop_expired(self: DeadlineQueue, now: float) -> list[int]:
        out: list[int] = []
        while self._heap and self._heap[0][0] <= now:
            out.append(self._heap.pop(0)[1])
        return out

    def compact(self: DeadlineQueue, live: Container[int], live_count: int) -> None:
        if len(self._heap) > 2 * live_count + 64:
            self._heap = [e for e in self._heap if e[1] in live]

    with monkeypatch.context() as mp:
        mp.setattr(DeadlineQueue, "push", push)
        mp.setattr(DeadlineQueue, "pop_expired", pop_expired)
        mp.setattr(DeadlineQueue, "compact", compact)
        yield


OUTSIDE_LIES: dict[str, Callable[[pytest.MonkeyPatch], AbstractContextManager[None]]] = {
    "tier_reports_before_io": plant_tier_reports_before_io,
    "promotion_from_wrong_tier": plant_promotion_from_wrong_tier,
    "deadline_queue_loses_order": plant_deadline_queue_loses_order,
}
