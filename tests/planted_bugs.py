"""Bugs planted on purpose, for the self-tests that prove the verification suite can fail (issue 4, part 5).

Each ``plant_<name>(monkeypatch)`` swaps one pure decision of the implementation for a wrong one, through
``monkeypatch`` only, so pytest undoes it when the test ends: nothing buggy is ever left in the code. The
decisions are the functions that both the real system and the model checker (:mod:`kvfsm.check`) call,
so a bug planted here is seen by both, and by the Hypothesis stateful machine too.

``PLANTED_BUGS`` maps each name to its function; tests parametrize over it::

    @pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
    def test_finds(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
        PLANTED_BUGS[name](monkeypatch)
        ...

Plant the bug before building the system under test or calling the checker: every component looks the
decision up when it runs, but the job machine's guards are compiled into a table when the (cached) machine
is first built, so :func:`plant_readable_on_first_ack` patches those tables in place.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Any

import pytest

import kvfsm.control.cpu as cpu_mod
import kvfsm.control.scheduler as scheduler_mod
from kvfsm.fsm import SpecMachine
from kvfsm.machines import job_machine
from kvfsm.states import SlotState

__all__ = [
    "PLANTED_BUGS",
    "plant_evict_reading_slot",
    "plant_fence_flush_skipped",
    "plant_idle_with_manager_work",
    "plant_partial_acks_ignored",
    "plant_readable_on_first_ack",
    "plant_reset_keeps_stale_threshold",
]


def plant_partial_acks_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """``has_pending_push_work()`` ignores jobs whose acks are partial (some, not all, workers acked)."""

    def buggy(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return any(job.pending == job.world_size for job in jobs) or manager_has_pending_work()

    monkeypatch.setattr(scheduler_mod, "pending_push_work", buggy)


def plant_idle_with_manager_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine goes idle when only the manager has pending work (its tier transfers are forgotten)."""

    def buggy(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return bool(jobs)

    monkeypatch.setattr(scheduler_mod, "pending_push_work", buggy)


def _patch_guards(monkeypatch: pytest.MonkeyPatch, overrides: Mapping[str, Callable[[Any, int], bool]]) -> None:
    """Swap named guards of every cached job machine (all checked-mode variants), tables included."""
    for args in ((), (None,), (False,), (True,)):
        machine: SpecMachine[Any, Any] = job_machine(*args)
        by_function = {fn: name for name, fn in machine._guards.items()}
        table = {
            key: tuple(
                (overrides.get(by_function[guard], guard) if guard is not None else None, dest, effect)
                for guard, dest, effect in edges
            )
            for key, edges in machine._table.items()
        }
        monkeypatch.setattr(machine, "_table", table)
        monkeypatch.setattr(machine, "_guards", {**machine._guards, **overrides})


def plant_readable_on_first_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store commits (its slots become readable) on the first worker's ack instead of the last."""

    def first_is_last(job: Any, count: int) -> bool:
        pending: int = job.pending
        return 0 < count <= pending

    _patch_guards(
        monkeypatch,
        {
            "acks_still_pending": lambda job, count: False,
            "ack_is_last": first_is_last,
            "last_ack_clean": lambda job, count: first_is_last(job, count) and job.failed_reports == 0,
            "last_ack_after_failure": lambda job, count: first_is_last(job, count) and job.failed_reports > 0,
        },
    )


def plant_evict_reading_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eviction may take a slot that is being read (a load or cascade still copies out of it)."""

    def buggy(state: SlotState) -> bool:
        return state in (SlotState.READY, SlotState.READING)

    monkeypatch.setattr(cpu_mod, "is_evictable", buggy)


def plant_fence_flush_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fenced store is not flushed when its GPU source block is re-allocated."""

    def buggy(allocated: Iterable[int], fences: Mapping[int, AbstractSet[int]]) -> set[int]:
        return set()

    monkeypatch.setattr(scheduler_mod, "fenced_jobs", buggy)


def plant_reset_keeps_stale_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """reset_cache forgets to raise the stale threshold: late reports of discarded jobs are not ignored."""

    def buggy(job_counter: int, threshold: int) -> int:
        return threshold

    monkeypatch.setattr(scheduler_mod, "stale_threshold_after_reset", buggy)


PLANTED_BUGS: dict[str, Callable[[pytest.MonkeyPatch], None]] = {
    "partial_acks_ignored": plant_partial_acks_ignored,
    "idle_with_manager_work": plant_idle_with_manager_work,
    "readable_on_first_ack": plant_readable_on_first_ack,
    "evict_reading_slot": plant_evict_reading_slot,
    "fence_flush_skipped": plant_fence_flush_skipped,
    "reset_keeps_stale_threshold": plant_reset_keeps_stale_threshold,
}
