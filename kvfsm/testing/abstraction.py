"""One coarse abstraction of the protocol state, for the model checker's states and a running system.

The model checker (:mod:`kvfsm.check`) explores abstract states; the state machines of
:mod:`kvfsm.testing.system` drive the real implementation. :func:`project_model_state` and
:func:`project_system` map both onto the same :data:`ProtocolState`: the engine state, the phases of the
requests the connector tracks, the awaited jobs (kind, state, reports still pending, world size, whether a
worker failed), the states of the held CPU slots, and the number of tier transfers in flight. Everything
the two do not share (token counts, GPU block ids, prefix caching, job and request identities) is left out,
so the share of the checker's reachable projections that a Hypothesis run visits measures how much of the
protocol it covers.

:func:`measure_coverage` computes that share (``python scripts/coverage.py`` prints it): every reachable
state of the checker at some bounds, projected, against the projections a stateful machine visits after
every step of a derandomized Hypothesis run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from kvfsm.check.model import ABSENT, WRITING, Bounds, State
from kvfsm.control.types import OffloadKey
from kvfsm.machines.names import JobKind, JobState, RequestState, SlotState
from kvfsm.testing.system import SystemHarness, SystemStateMachine

__all__ = [
    "CI_RUNS",
    "PROFILES",
    "Coverage",
    "ProtocolState",
    "measure_coverage",
    "project_machine",
    "project_model_state",
    "project_system",
    "reachable_projections",
    "visited_projections",
]

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


# ---------------------------------------------------------------------------------------------- coverage

#: The Hypothesis profiles of tests/conftest.py: name -> max_examples (tests/test_coverage_command.py
#: checks they agree).
PROFILES: dict[str, int] = {"ci": 60, "dev": 100, "nightly": 2000}
#: How tests/test_stateful.py runs each machine: (stateful_step_count, scale of the profile's max_examples).
#: "paths" is :class:`kvfsm.testing.paths.CheckerPathStateMachine` (the checker's paths on the real control
#: plane, at the checker's granularity).
CI_RUNS: dict[str, tuple[int, float]] = {"control": (50, 15.0), "engine": (40, 8.0), "paths": (40, 20.0)}


def reachable_projections(bounds: Bounds | None = None) -> set[ProtocolState]:
    """The projections of every state the model checker reaches at ``bounds`` (default: the defaults)."""
    from kvfsm.testing.paths import checker_graph

    return {project_model_state(s) for s in checker_graph(bounds if bounds is not None else Bounds()).states}


def project_machine(m: RuleBasedStateMachine) -> ProtocolState | None:
    """The projection of the system a stateful machine drives (None before it is configured)."""
    from kvfsm.testing.paths import CheckerPathStateMachine

    if isinstance(m, SystemStateMachine):
        if not m.configured:
            return None
        request_ids, keys = m.observed()
        return project_system(m.h, request_ids, keys)
    if isinstance(m, CheckerPathStateMachine):
        # The implementation as the checker's abstraction reads it back, which the machine has just
        # compared with the checker's state.
        return project_model_state(m.current_state()) if m.configured else None
    raise TypeError(f"no projection for {type(m).__name__}")


def visited_projections(
    machine: type[RuleBasedStateMachine], max_examples: int, steps: int, seen: set[ProtocolState] | None = None
) -> set[ProtocolState]:
    """The projections of the system ``machine`` drives, recorded after every step (initialisation
    included) of a derandomized run of ``max_examples`` examples of at most ``steps`` steps."""
    out: set[ProtocolState] = set() if seen is None else seen

    def check_invariants(self: RuleBasedStateMachine, *args: Any, **kwargs: Any) -> None:
        machine.check_invariants(self, *args, **kwargs)
        state = project_machine(self)
        if state is not None:
            out.add(state)

    # Hypothesis checks the invariants after every step: a subclass that records there sees each state.
    recording = type(machine.__name__, (machine,), {"check_invariants": check_invariants})
    cfg = settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
        report_multiple_bugs=False,
    )
    run_state_machine_as_test(recording, settings=cfg)
    return out


@dataclass(frozen=True, slots=True)
class Coverage:
    """The reachable projections, the visited ones, and the share of the first the second covers."""

    reachable: frozenset[ProtocolState]
    visited: frozenset[ProtocolState]

    @property
    def covered(self) -> frozenset[ProtocolState]:
        return self.reachable & self.visited

    @property
    def outside(self) -> frozenset[ProtocolState]:
        """Visited projections the checker does not reach (the implementation is larger than the bounds)."""
        return self.visited - self.reachable

    @property
    def percent(self) -> float:
        return 100.0 * len(self.covered) / len(self.reachable) if self.reachable else 100.0

    def line(self) -> str:
        return f"coverage: {self.percent:.1f}% of {len(self.reachable)} reachable abstract states"


def machine_class(name: str) -> type[RuleBasedStateMachine]:
    """``"control"``, ``"engine"`` (needs torch) or ``"paths"``."""
    if name == "control":
        from kvfsm.testing.control import ControlPlaneStateMachine

        return ControlPlaneStateMachine
    if name == "engine":
        from kvfsm.testing.engine import EngineStateMachine

        return EngineStateMachine
    if name == "paths":
        from kvfsm.testing.paths import CheckerPathStateMachine

        return CheckerPathStateMachine
    raise ValueError(f"unknown machine {name!r}; expected control, engine or paths")


def measure_coverage(
    machines: Iterable[str],
    profile: str = "ci",
    bounds: Bounds | None = None,
    *,
    examples: int | None = None,
    steps: int | None = None,
) -> Coverage:
    """The share of the reachable projections at ``bounds`` that ``machines`` visit, each run as
    tests/test_stateful.py runs it under ``profile`` (``examples`` / ``steps`` override the run's size)."""
    reachable = reachable_projections(bounds)
    visited: set[ProtocolState] = set()
    for name in machines:
        default_steps, scale = CI_RUNS[name]
        n = examples if examples is not None else max(1, int(PROFILES[profile] * scale))
        machine = machine_class(name)
        if name == "paths" and bounds is not None:
            # The same class name (derandomized runs are seeded from it), walking the graph at ``bounds``.
            machine = type(machine.__name__, (machine,), {"bounds": bounds})
        visited_projections(machine, n, steps if steps is not None else default_steps, visited)
    return Coverage(frozenset(reachable), frozenset(visited))
