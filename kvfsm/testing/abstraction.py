"""One coarse abstraction of the protocol state, for the model checker's states and a running system.

The model checker (:mod:`kvfsm.check`) explores abstract states; the state machines of
:mod:`kvfsm.testing.system` drive the real implementation. :func:`project_model_state` and
:func:`project_system` map both onto the same :data:`ProtocolState`: the engine state, the phases of the
requests the connector tracks, the awaited jobs (kind, state, reports still pending, world size, whether a
worker failed), the states of the held CPU slots, and the number of tier transfers in flight. Everything
the two do not share (token counts, GPU block ids, prefix caching, job and request identities) is left out,
so the share of the checker's reachable projections that a Hypothesis run visits measures how much of the
protocol it covers.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvfsm.check.model import ABSENT, WRITING, State
from kvfsm.control.types import OffloadKey
from kvfsm.machines.names import JobKind, JobState, RequestState, SlotState
from kvfsm.testing.system import SystemHarness

__all__ = ["ProtocolState", "project_model_state", "project_system"]

#: (engine, request phases, jobs, held slot states, tier transfers in flight); multisets as sorted tuples.
ProtocolState = tuple[str, tuple[str, ...], tuple[tuple[str, str, int, int, bool], ...], tuple[str, ...], int]

_LIVE = (JobState.SUBMITTED, JobState.IN_FLIGHT)
_KINDS = {0: JobKind.STORE.value, 1: JobKind.LOAD.value}


def project_model_state(s: State) -> ProtocolState:
    """The projection of a :class:`kvfsm.check.model.State`."""
    phases = tuple(sorted(r.phase.value for r in s.reqs if r.phase is not RequestState.DELETED))
    jobs = tuple(
        sorted(
            (_KINDS[j.kind], j.state.value, j.pending, j.world_size, j.failed_reports > 0)
            for j in s.jobs
            if j.state in _LIVE and not j.ignored
        )
    )
    slots = tuple(
        sorted(
            SlotState.WRITING.value if v == WRITING else SlotState.READY.value if v == 0 else SlotState.READING.value
            for v in s.slots
            if v != ABSENT
        )
    )
    return (s.engine.value, phases, jobs, slots, len(s.tier))


def project_system(h: SystemHarness, request_ids: Iterable[str], keys: Iterable[OffloadKey]) -> ProtocolState:
    """The projection of a running system (``request_ids``: every request created; ``keys``: every chunk)."""
    s = h.scheduler
    phases = tuple(
        sorted(
            state.value
            for state in (s.request_state(r) for r in request_ids if s.is_tracked(r))
            if state is not RequestState.DELETED
        )
    )
    jobs = tuple(
        sorted(
            (j.kind.value, j.state.value, j.pending, j.world_size, j.failed_reports > 0)
            for j in s.jobs().values()
            if j.state in _LIVE
        )
    )
    primary = h.primary
    slots = tuple(
        sorted(state.value for state in (primary.slot_state(k) for k in keys) if state is not SlotState.ABSENT)
    )
    tier = h.manager.num_transfer_jobs
    return (h.state.value, phases, jobs, slots, tier)
