"""Bugs planted in the model checker's components, outside the pure decisions it shares (issue 10, item 9).

tests/planted_bugs.py plants bugs in the pure functions that the implementation and the checker both call
(``pending_push_work``, ``fenced_jobs``, ...). A checker whose ground truth re-evaluated those functions
would catch those bugs only because it asks the buggy function twice. The bugs here sit instead in the
model's rendering of one component (:class:`kvfsm.check.model.Model`'s component methods): the tiering
manager's pending-work terms, a worker's copy backend, a tier's completion report. ``kvfsm check`` must
catch each by its own ground truth, the shard and tier states of the model, which the bug does not touch.

Each ``plant_<name>(monkeypatch)`` is a context manager that swaps one method of ``Model`` while it is
open; ``PLANTED_MODEL_BUGS`` maps each name to (the plant, the bounds it needs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest

from kvfsm.check import Bounds, compiled
from kvfsm.check.model import COPYING, DONE_FAIL, DONE_OK, Model

__all__ = [
    "PATCHES_MODEL",
    "PLANTED_MODEL_BUGS",
    "plant_backend_reports_running_copies",
    "plant_deadline_queue_loses_entries",
    "plant_deferred_release_not_pending",
    "plant_promotion_from_wrong_tier",
    "plant_promotion_released_at_time_out",
    "plant_promotions_not_held_after_reset",
    "plant_quarantine_not_pending",
    "plant_sync_wait_covers_the_stream",
    "plant_tier_reports_before_io",
    "plant_tiering_ignores_tiers",
    "plant_tiering_ignores_transfers",
]

#: Marks a test that plants a bug by patching a method of Model. A compiled checker (a KVFSM_MYPYC=1 build,
#: setup.py) calls its own methods directly, so a patched class attribute is never seen there: such a
#: test would pass for the wrong reason or fail for one, and is skipped. The interpreted build (tox env
#: tests) runs it; the compiled one is held to the same graphs by tests/test_check_fingerprints.py.
PATCHES_MODEL = pytest.mark.skipif(
    compiled(), reason="plants a bug by patching Model, whose compiled methods do not see the patch"
)

#: The checker's default bounds; the durable tier's bug needs a tier with pending work of its own.
DEFAULT = Bounds()
DURABLE = dataclasses.replace(DEFAULT, durable=True)


@contextmanager
def plant_tiering_ignores_transfers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TieringManager.has_pending_work() forgets its transfer map: in-flight cascades are not pending."""

    def buggy(self: Model, tier: Sequence[Any]) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "transfers_pending", buggy)
        yield


@contextmanager
def plant_tiering_ignores_tiers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """TieringManager.has_pending_work() never asks its tiers: a durable tier's background sync is not
    pending, so the engine may go idle before the data is durable."""

    def buggy(self: Model, tier: Sequence[Any]) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "tiers_pending", buggy)
        yield


@contextmanager
def plant_backend_reports_running_copies(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A copy backend whose poll reports every submitted shard as done, finished or not."""

    def lying(self: Model, shard: int) -> bool | None:
        if shard in (COPYING, DONE_OK):
            return True
        return False if shard == DONE_FAIL else None

    with monkeypatch.context() as mp:
        mp.setattr(Model, "backend_reports", lying)
        yield


@contextmanager
def plant_tier_reports_before_io(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A tier that reports a cascade finished at the first poll, before its I/O has run."""

    def lying(self: Model, rec: Sequence[Any]) -> bool:
        return True

    with monkeypatch.context() as mp:
        mp.setattr(Model, "tier_reports", lying)
        yield


Plant = Callable[[pytest.MonkeyPatch], AbstractContextManager[None]]

PLANTED_MODEL_BUGS: dict[str, tuple[Plant, Bounds]] = {
    "tiering_ignores_transfers": (plant_tiering_ignores_transfers, DEFAULT),
    "tiering_ignores_tiers": (plant_tiering_ignores_tiers, DURABLE),
    "backend_reports_running_copies": (plant_backend_reports_running_copies, DEFAULT),
    "tier_reports_before_io": (plant_tier_reports_before_io, DEFAULT),
}


@contextmanager
def plant_promotion_from_wrong_tier(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tiering manager promotes a key from its first tier whenever any tier answers HIT, even when
    only a later tier holds it (the first one's cascade failed)."""

    def buggy(self: Model, held: Sequence[int], key: int) -> int | None:
        return 0 if any(mask >> key & 1 for mask in held) else None

    with monkeypatch.context() as mp:
        mp.setattr(Model, "promotion_source", buggy)
        yield


#: Two tiers that hit what they hold, for the promotion bug.
PROMOTING = Bounds(requests=2, prompts=1, chunks=2, slots=2, groups=2, tiers=2, promotions=True, resets=1)

PLANTED_MODEL_BUGS["promotion_from_wrong_tier"] = (plant_promotion_from_wrong_tier, PROMOTING)


@contextmanager
def plant_deadline_queue_loses_entries(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The scheduler's deadline queue pops only the first expired job per step and loses the others."""
    real = Model.deadline_queue_pops

    def buggy(self: Model, jobs: Sequence[Any]) -> list[int]:
        return real(self, jobs)[:1]

    with monkeypatch.context() as mp:
        mp.setattr(Model, "deadline_queue_pops", buggy)
        yield


#: Two store deadlines that may pass before one step.
EXPIRING = dataclasses.replace(DEFAULT, deadlines=2, resets=0, slots=3)

PLANTED_MODEL_BUGS["deadline_queue_loses_entries"] = (plant_deadline_queue_loses_entries, EXPIRING)


@contextmanager
def plant_quarantine_not_pending(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A timed-out job whose copy still runs is not pending work: the engine may go idle while that copy
    touches memory that only a poll hands back (issue 10, "Quarantine is pending work")."""

    def buggy(self: Model, jobs: Sequence[Any]) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "quarantine_pending", buggy)
        yield


PLANTED_MODEL_BUGS["quarantine_not_pending"] = (
    plant_quarantine_not_pending,
    dataclasses.replace(DEFAULT, deadlines=1, resets=0),
)


@contextmanager
def plant_sync_wait_covers_the_stream(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A worker that, for a step's sync loads, synchronises its whole copy stream: the step waits, before its
    forward, for every copy in flight (the stores' too), not for its sync loads alone, so an arrival waits
    for whatever the store side has in flight, not for the budget (spec/README.md, "Bounded synchronous
    loads")."""

    def buggy(self: Model, reqs: Sequence[Any], jobs: Sequence[Any]) -> list[int]:
        return [j for j, job in enumerate(jobs) if COPYING in job[7]]  # job[7]: its shards (a record or a list)

    with monkeypatch.context() as mp:
        mp.setattr(Model, "sync_wait_jobs", buggy)
        yield


PLANTED_MODEL_BUGS["sync_wait_covers_the_stream"] = (
    plant_sync_wait_covers_the_stream,
    dataclasses.replace(DEFAULT, sync_load_budget=1),
)


@contextmanager
def plant_promotions_not_held_after_reset(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tiering manager forgets its reset hold (vLLM 0.34's ``_promotions_held``): right after a reset, a
    lookup promotes into a primary slot that a store copy the reset discarded may still write (spec/README.md,
    "The reset hold"). kvfsm's own TieringManager behaved so before it had the hold."""

    def buggy(self: Model, jobs: Sequence[Any]) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "promotions_held", buggy)
        yield


PLANTED_MODEL_BUGS["promotions_not_held_after_reset"] = (
    plant_promotions_not_held_after_reset,
    dataclasses.replace(DEFAULT, workers=1, failures=False, promotions=True, late_writes=True, reset_hold=True),
)


#: Promotions with their deadlines (one may pass), one worker, no failures, a reset (which makes the
#: promotions: the primary forgets what the tier still holds), no preemption: about 18k states.
PROMOTION_DEADLINES = dataclasses.replace(
    DEFAULT, promotions=True, deadlines=1, promotion_deadlines=True, workers=1, failures=False, preemptions=0
)


@contextmanager
def plant_promotion_released_at_time_out(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A timed-out promotion's slot is handed back at the time-out, while its tier I/O may still write it
    (no deferred release: vLLM before 0.34's JobResult.deferred_release, or a kvfsm tier adapter that reports
    a hung promotion early) (spec/README.md, "Promotion deadlines and deferred release")."""

    def buggy(self: Model) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "release_deferred", buggy)
        yield


PLANTED_MODEL_BUGS["promotion_released_at_time_out"] = (plant_promotion_released_at_time_out, PROMOTION_DEADLINES)


@contextmanager
def plant_deferred_release_not_pending(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The tiering manager's has_pending_work() forgets its deferred releases: the engine may go idle while a
    timed-out promotion's I/O still writes a slot that only a poll hands back."""

    def buggy(self: Model, tier: Sequence[Any]) -> bool:
        return False

    with monkeypatch.context() as mp:
        mp.setattr(Model, "promotions_quarantined", buggy)
        yield


PLANTED_MODEL_BUGS["deferred_release_not_pending"] = (plant_deferred_release_not_pending, PROMOTION_DEADLINES)
