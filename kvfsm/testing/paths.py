"""A Hypothesis state machine seeded from the model checker's paths (issue 10, item 7). No torch.

:class:`CheckerPathStateMachine` drives the real control plane at the checker's granularity: the replay
harness of :mod:`kvfsm.check.replay` (the real :class:`~kvfsm.control.scheduler.OffloadingScheduler`, CPU
manager and :class:`~kvfsm.control.tiering.TieringManager`, ``W`` real
:class:`~kvfsm.control.worker.OffloadingWorker` ranks over held copy backends, kvfsm's in-memory tiers,
whose cascades and promotions finish only when told, an injected clock and expiry queue), where a lookup,
a step, one rank's copy and a finish are separate events. So the states the whole-system machines cannot
stop in (a job planned and not launched, one rank of two reported, a request looked up and not yet
stepped) are reached, and checked, here.

Each example picks one abstract protocol state (:func:`kvfsm.testing.abstraction.project_model_state`) of
the checker's reachable graph at :attr:`CheckerPathStateMachine.bounds`, follows the checker's shortest
(BFS) path to it one event per rule, then wanders along any enabled edge of the checker's graph. After
every event:

* the implementation, read back through the checker's own abstraction (:func:`kvfsm.check.replay.abstract`),
  is the state the checker says the edge leads to;
* every invariant of ``spec/invariants.toml`` holds (:func:`kvfsm.check.invariants.check_all`);
* while the data plane holds work (a copy a backend holds or has finished and not reported, a transfer a
  tier holds or has finished and not reported, a durable tier's sync), judged from the backends and the
  tiers alone, never from the scheduler's or the tiering manager's jobs, and no bounded shutdown gave it
  up: ``has_pending_push_work()`` is True and the engine is not idle (counted in
  :data:`kvfsm.testing.system.GROUND_TRUTH_CHECKS`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfsm.check.bfs import describe_label, explore
from kvfsm.check.invariants import SystemView, check_all
from kvfsm.check.model import Bounds, Label, Model, State
from kvfsm.check.replay import Harness, Refs, abstract
from kvfsm.machines.names import EngineState
from kvfsm.testing.system import GROUND_TRUTH_CHECKS

__all__ = ["CheckerGraph", "CheckerPathStateMachine", "checker_graph"]


@dataclass(frozen=True, slots=True)
class CheckerGraph:
    """The checker's reachable graph at some bounds, as the machine walks it."""

    bounds: Bounds
    model: Model
    states: tuple[State, ...]
    #: State id -> its outgoing edges (event, target state id).
    out: tuple[tuple[tuple[Label, int], ...], ...]
    #: State id -> (BFS parent id, event from it); -1 for the initial state.
    parent: tuple[tuple[int, Label | None], ...]
    #: One state id per distinct abstract protocol state (the shallowest one), in a fixed order: what an
    #: example aims for.
    targets: tuple[int, ...]

    def path_to(self, sid: int) -> list[tuple[Label, int]]:
        """The checker's shortest path to ``sid``: (event, state id it leads to) from the initial state."""
        out: list[tuple[Label, int]] = []
        while self.parent[sid][0] >= 0:
            parent, label = self.parent[sid]
            assert label is not None
            out.append((label, sid))
            sid = parent
        out.reverse()
        return out


@cache
def checker_graph(bounds: Bounds) -> CheckerGraph:
    """Explore the checker at ``bounds`` once per process."""
    # Imported here: kvfsm.testing.abstraction imports this module (to project its states).
    from kvfsm.testing.abstraction import project_model_state

    model = Model(bounds)
    result = explore(bounds, stop_at_first=False, keep_graph=True, check_liveness=False, model=model)
    g = result.graph
    assert g is not None
    n = len(g.states)
    out: list[list[tuple[Label, int]]] = [[] for _ in range(n)]
    for s, lab, d in zip(g.src, g.label, g.dst, strict=True):
        out[s].append((g.labels[lab], d))
    parent = tuple((g.parent[i], g.labels[g.parent_label[i]] if g.parent[i] >= 0 else None) for i in range(n))
    first: dict[object, int] = {}
    for sid, state in enumerate(g.states):  # BFS order: the first state of a projection is a shallowest one
        first.setdefault(project_model_state(state), sid)
    return CheckerGraph(
        bounds,
        model,
        tuple(g.states),
        tuple(tuple(edges) for edges in out),
        parent,
        tuple(sorted(first.values())),
    )


class CheckerPathStateMachine(RuleBasedStateMachine):
    """The real control plane driven along the checker's paths (see the module docs)."""

    #: The checker's bounds (the defaults of ``kvfsm check``).
    bounds: ClassVar[Bounds] = Bounds()

    def __init__(self) -> None:
        super().__init__()
        self._graph = checker_graph(self.bounds)
        self._h: Harness | None = None
        self._refs = Refs()
        self._sid = 0
        self._path: list[tuple[Label, int]] = []

    @property
    def configured(self) -> bool:
        return self._h is not None

    @property
    def h(self) -> Harness:
        assert self._h is not None, "the choose_target rule has not run"
        return self._h

    def current_state(self) -> State:
        """The implementation read back as a checker state (what the last event led to)."""
        return self._graph.states[self._sid]

    # ------------------------------------------------------------------ rules

    @initialize(data=st.data())
    def choose_target(self, data: st.DataObject) -> None:
        """Aim for one abstract protocol state of the checker's graph: its shortest path is walked first."""
        self._start_toward(data)

    @precondition(lambda self: not self._path and not self._graph.out[self._sid])
    @rule(data=st.data())
    def start_again(self, data: st.DataObject) -> None:
        """The checker's graph ends here (every request done, every bound spent): a fresh system, aiming for
        another target."""
        self._start_toward(data)

    def _start_toward(self, data: st.DataObject) -> None:
        g = self._graph
        # A wide integer, reduced: Hypothesis draws small integers far more often than large ones, so a
        # draw in range(len(targets)) keeps aiming for the first few targets.
        target = g.targets[data.draw(st.integers(0, 2**32 - 1), label="target") % len(g.targets)]
        self._h = Harness(self.bounds)
        self._sid = 0
        self._path = g.path_to(target)
        self._read_back("the initial state")

    @precondition(lambda self: bool(self._path))
    @rule()
    def follow_path(self) -> None:
        """The next event of the checker's shortest path to the target."""
        label, dst = self._path.pop(0)
        self._apply(label, dst)

    @precondition(lambda self: not self._path and bool(self._graph.out[self._sid]))
    @rule(data=st.data())
    def take_edge(self, data: st.DataObject) -> None:
        """Any event the checker enables in the current state."""
        label, dst = data.draw(st.sampled_from(self._graph.out[self._sid]), label="event")
        self._apply(label, dst)

    def _apply(self, label: Label, dst: int) -> None:
        what = describe_label(self._graph.states[self._sid], label)
        self.h.apply(label, self._refs)
        self._sid = dst
        self._read_back(f"after {what}")

    def _read_back(self, when: str) -> None:
        actual, self._refs = abstract(self.h, self._graph.model)
        expected = self._graph.states[self._sid]
        if actual != expected:
            raise AssertionError(f"{when}: the implementation is in {actual}; the checker says {expected}")

    # ------------------------------------------------------------------ checks

    def data_plane_work(self) -> list[str]:
        """What the backends and the tier still hold (never read from the scheduler's or manager's jobs);
        a stale job's copies (below the stale threshold: given up on by the spec) are not work."""
        h = self.h
        threshold = h.sched.stale_threshold
        name = type(self).__name__
        work: list[str] = []
        kinds: set[str] = set()
        for rank, backend in enumerate(h.backends):
            for job_id in sorted(backend.in_flight_ids()):
                if job_id < threshold:
                    GROUND_TRUTH_CHECKS[(name, "given up")] += 1
                    continue
                kinds.add("copy held" if job_id in backend.held else "copy unpolled")
                work.append(f"copy of job {job_id} on rank {rank}")
        for tier in h.tiers:
            copying = tier.pending_job_ids()
            if copying or tier.unreported:
                kinds.add("tier job")
                work.append(f"{tier.name} jobs {copying} copying, {sorted(tier.unreported)} unreported")
            if tier.syncing:
                kinds.add("tier sync")
                work.append(f"{tier.name} jobs {sorted(tier.syncing)} syncing")
        for kind in kinds:
            GROUND_TRUTH_CHECKS[(name, kind)] += 1
        if work:
            GROUND_TRUTH_CHECKS[(name, "any")] += 1
        return work

    @invariant()
    def invariants_hold(self) -> None:
        if self._h is None:
            return
        h = self._h
        out = [str(v) for v in check_all(SystemView(h.sched, h.engine.state))]
        work = self.data_plane_work()
        # After a bounded shutdown gave up (abandon_jobs), what is left is abandoned, not pending work
        # (spec/README.md, "Bounded shutdown").
        if work and not h.sched.abandoned:
            if not h.sched.has_pending_push_work():
                out.append(f"data plane: has_pending_push_work() is False while {', '.join(work[:4])}")
            if h.engine.state is EngineState.IDLE:
                out.append(f"data plane: the engine is idle while {', '.join(work[:4])}")
        if out:
            raise AssertionError("; ".join(out[:6]))
