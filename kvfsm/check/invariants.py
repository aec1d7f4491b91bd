"""Checkers for the invariants named in spec/invariants.toml, one function per name.

They read a running system through public accessors only (scheduler, manager, engine state) and
return the violations they find; tests call :func:`check_all` after every step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.machines.loader import load_invariants
from kvfsm.machines.names import JOB_TERMINAL, EngineState, JobKind, RequestState, SlotState

__all__ = ["CHECKERS", "SystemView", "Violation", "check_all"]


@dataclass(frozen=True, slots=True)
class SystemView:
    scheduler: OffloadingScheduler
    engine_state: EngineState | None = None


@dataclass(frozen=True, slots=True)
class Violation:
    invariant: str
    detail: str

    @override
    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def _primary(view: SystemView) -> CPUOffloadingManager | None:
    return view.scheduler.manager.primary


def pending_work_covers_jobs(view: SystemView) -> list[str]:
    s = view.scheduler
    live = [j for j in s.jobs().values() if j.state not in JOB_TERMINAL]
    out = []
    if live and not s.has_pending_push_work():
        out.append(f"{len(live)} live jobs (first {live[0]!r}) but has_pending_push_work() is False")
    if s.abandoned:
        return out  # a bounded shutdown gave up: what is left is not pending work (spec prose)
    if s.num_quarantined and not s.has_pending_push_work():
        out.append(f"{s.num_quarantined} quarantined copies have not reported but has_pending_push_work() is False")
    m = s.manager
    if m.num_transfer_jobs and not s.has_pending_push_work():
        out.append(f"{m.num_transfer_jobs} tier transfers in flight but has_pending_push_work() is False")
    return out


def idle_only_when_nothing_pending(view: SystemView) -> list[str]:
    if view.engine_state in (EngineState.IDLE, EngineState.STOPPED) and view.scheduler.has_pending_push_work():
        return [f"engine is {view.engine_state.value} while has_pending_push_work() is True"]
    return []


def readable_only_after_commit(view: SystemView) -> list[str]:
    primary = _primary(view)
    if primary is None:
        return []
    out = []
    for job in view.scheduler.jobs().values():
        if job.kind is JobKind.STORE:
            for key in job.keys:
                state = primary.slot_state(key)
                if state is not SlotState.WRITING:
                    out.append(f"key {key.hex()[:12]} of uncommitted store job {job.job_id} is {state.value}")
    return out


def evict_only_ready_unreferenced(view: SystemView) -> list[str]:
    primary = _primary(view)
    if primary is None:
        return []
    out = []
    for job in view.scheduler.jobs().values():
        if job.kind is JobKind.LOAD:
            for key in job.keys:
                if primary.slot_state(key) is not SlotState.READING:
                    out.append(f"key {key.hex()[:12]} read by load job {job.job_id} is no longer reading")
    return out


def gpu_source_not_overwritten(view: SystemView) -> list[str]:
    s = view.scheduler
    fences = s.fenced_blocks()
    out = []
    for job in s.jobs().values():
        if job.kind is not JobKind.STORE:
            continue
        if s.is_tracked(job.req_id) and s.request_state(job.req_id) not in (
            RequestState.FINISHED_UNSIGNALLED,
            RequestState.FINISHED_SIGNALLED,
        ):
            continue  # the running request's own reference protects its blocks
        for block in job.gpu.block_ids:
            if job.job_id not in fences.get(block, frozenset()):
                out.append(f"block {block} read by store job {job.job_id} of a finished request is not fenced")
    return out


def one_load_per_request(view: SystemView) -> list[str]:
    kinds: dict[str, list[JobKind]] = {}
    for job in view.scheduler.jobs().values():
        kinds.setdefault(job.req_id, []).append(job.kind)
    out = []
    for req_id, ks in kinds.items():
        loads = ks.count(JobKind.LOAD)
        if loads > 1 or (loads == 1 and len(ks) > 1):
            out.append(f"request {req_id!r} has jobs {sorted(k.value for k in ks)}")
    return out


def single_loader_per_chunk(view: SystemView) -> list[str]:
    seen: dict[bytes, int] = {}
    out = []
    for job in view.scheduler.jobs().values():
        if job.kind is not JobKind.LOAD:
            continue
        for key in job.keys:
            if key in seen:
                out.append(f"key {key.hex()[:12]} loaded by jobs {seen[key]} and {job.job_id}")
            seen[key] = job.job_id
    return out


def complete_exactly_once(view: SystemView) -> list[str]:
    out = []
    for job_id, job in view.scheduler.jobs().items():
        if job.is_terminal:
            out.append(f"job {job_id} is {job.state.value} but still awaited")
        if not 1 <= job.pending <= job.world_size:
            out.append(f"job {job_id} has pending={job.pending}, expected 1..{job.world_size}")
        if job.reported_mask & ~job.launched_mask:
            out.append(
                f"job {job_id} has reports from ranks that never launched it "
                f"(reported {job.reported_mask:#b}, launched {job.launched_mask:#b})"
            )
    return out


def stale_ids_ignored(view: SystemView) -> list[str]:
    s = view.scheduler
    return [
        f"job {job_id} is below the stale threshold {s.stale_threshold} but still awaited"
        for job_id in s.jobs()
        if job_id < s.stale_threshold
    ]


CHECKERS: dict[str, Callable[[SystemView], list[str]]] = {
    "pending_work_covers_jobs": pending_work_covers_jobs,
    "idle_only_when_nothing_pending": idle_only_when_nothing_pending,
    "readable_only_after_commit": readable_only_after_commit,
    "evict_only_ready_unreferenced": evict_only_ready_unreferenced,
    "gpu_source_not_overwritten": gpu_source_not_overwritten,
    "one_load_per_request": one_load_per_request,
    "single_loader_per_chunk": single_loader_per_chunk,
    "complete_exactly_once": complete_exactly_once,
    "stale_ids_ignored": stale_ids_ignored,
}


def check_all(view: SystemView) -> list[Violation]:
    """Every spec invariant, in spec order."""
    out = []
    for inv in load_invariants():
        for detail in CHECKERS[inv.name](view):
            out.append(Violation(inv.name, detail))
    return out
