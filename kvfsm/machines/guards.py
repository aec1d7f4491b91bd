"""The spec machines with their guards bound: the only code that says *when* a transition may fire.

Each guard is a function ``(model, arg) -> bool``; ``arg`` is the event's one integer argument (a worker
rank: the launching or the reporting one) or 0. Names must match the ``[guards]`` tables in spec/ exactly.
Each machine is typed by its state, event and effect enums from :mod:`kvfsm.machines.names`; the rules are
in ``spec/README.md``.
"""

from __future__ import annotations

import functools
from typing import Protocol

from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import (
    EngineEffect,
    EngineEvent,
    EngineState,
    JobEffect,
    JobEvent,
    JobState,
    RequestEffect,
    RequestEvent,
    RequestState,
    SlotEffect,
    SlotEvent,
    SlotState,
)

__all__ = ["engine_machine", "job_machine", "request_machine", "slot_machine"]


class _JobModel(Protocol):
    state: JobState
    world_size: int
    launched_mask: int
    reported_mask: int
    failed_reports: int


class _SlotModel(Protocol):
    state: SlotState
    readers: int


class _RequestModel(Protocol):
    state: RequestState

    def has_jobs(self) -> bool: ...


class _EngineModel(Protocol):
    state: EngineState

    def has_pending_push_work(self) -> bool: ...


def _worker_not_launched(job: _JobModel, rank: int) -> bool:
    return not (job.launched_mask >> rank) & 1


# Every report guard is built from two premises (spec/job.toml):
# - rank_launched_not_reported: 0 <= rank < W, and the reporting rank launched the job and has not reported it;
# - is_last_report: with this report every one of the W ranks has reported (reported_mask | 1 << rank is all W).
# Each guard below writes them out in one expression: a guard runs on every report of every job, and a
# nested call per premise is a Python frame each. tests/test_compiled.py checks the four guards against
# the premises over every small job.


def _acks_still_pending(job: _JobModel, rank: int) -> bool:
    reported, everyone = job.reported_mask, (1 << job.world_size) - 1
    return (
        0 <= rank < job.world_size
        and bool((job.launched_mask & ~reported) >> rank & 1)
        and reported | (1 << rank) != everyone
    )


def _ack_is_last(job: _JobModel, rank: int) -> bool:
    reported, everyone = job.reported_mask, (1 << job.world_size) - 1
    return (
        0 <= rank < job.world_size
        and bool((job.launched_mask & ~reported) >> rank & 1)
        and reported | (1 << rank) == everyone
    )


def _last_ack_clean(job: _JobModel, rank: int) -> bool:
    reported, everyone = job.reported_mask, (1 << job.world_size) - 1
    return (
        job.failed_reports == 0
        and 0 <= rank < job.world_size
        and bool((job.launched_mask & ~reported) >> rank & 1)
        and reported | (1 << rank) == everyone
    )


def _last_ack_after_failure(job: _JobModel, rank: int) -> bool:
    reported, everyone = job.reported_mask, (1 << job.world_size) - 1
    return (
        job.failed_reports > 0
        and 0 <= rank < job.world_size
        and bool((job.launched_mask & ~reported) >> rank & 1)
        and reported | (1 << rank) == everyone
    )


def _other_readers_remain(slot: _SlotModel, _: int) -> bool:
    return slot.readers > 1


def _last_reader(slot: _SlotModel, _: int) -> bool:
    return slot.readers == 1


def _no_jobs(req: _RequestModel, _: int) -> bool:
    return not req.has_jobs()


def _pending_push_work(engine: _EngineModel, _: int) -> bool:
    return engine.has_pending_push_work()


def _no_pending_push_work(engine: _EngineModel, _: int) -> bool:
    return not engine.has_pending_push_work()


@functools.cache
def job_machine(checked: bool | None = None) -> SpecMachine[JobState, JobEvent, JobEffect]:
    return SpecMachine(
        "job",
        JobState,
        JobEvent,
        JobEffect,
        {
            "worker_not_launched": _worker_not_launched,
            "acks_still_pending": _acks_still_pending,
            "ack_is_last": _ack_is_last,
            "last_ack_clean": _last_ack_clean,
            "last_ack_after_failure": _last_ack_after_failure,
        },
        checked=checked,
    )


@functools.cache
def slot_machine(checked: bool | None = None) -> SpecMachine[SlotState, SlotEvent, SlotEffect]:
    return SpecMachine(
        "slot",
        SlotState,
        SlotEvent,
        SlotEffect,
        {
            "other_readers_remain": _other_readers_remain,
            "last_reader": _last_reader,
        },
        checked=checked,
    )


@functools.cache
def request_machine(checked: bool | None = None) -> SpecMachine[RequestState, RequestEvent, RequestEffect]:
    return SpecMachine("request", RequestState, RequestEvent, RequestEffect, {"no_jobs": _no_jobs}, checked=checked)


@functools.cache
def engine_machine() -> SpecMachine[EngineState, EngineEvent, EngineEffect]:
    """The engine machine always runs through transitions (checked): one instance, a few fires a step."""
    return SpecMachine(
        "engine",
        EngineState,
        EngineEvent,
        EngineEffect,
        {
            "pending_push_work": _pending_push_work,
            "no_pending_push_work": _no_pending_push_work,
        },
        checked=True,
    )
