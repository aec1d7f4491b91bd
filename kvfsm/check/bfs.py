"""Breadth-first exploration of :class:`~kvfsm.check.model.Model`, with the shortest counterexample.

:func:`explore` visits every reachable canonical state once, in breadth-first order, recording for each
its BFS parent and the event that reached it, so the first violation found has a shortest path. Every
spec invariant is checked in every state as it is discovered; a transition that breaks one (or asks a
spec machine for an event it disables) is a violation on that edge. Once every state is known, a
liveness check runs on the explored graph by reverse reachability: every state must be able to reach an
idle engine with nothing pending using only the engine's own steps, the requests' ends and transfer
completions (no new arrivals, no reset), so no execution can stay in ``draining`` (or anywhere else)
forever while transfers keep completing. A liveness violation is the shortest path to the first state that
cannot, followed by a run from it by those events alone that never reaches the goal: into the nearest cycle
(one with nothing left to do first), or to a state that none of them leaves (:attr:`Violation.lasso`).
"""

from __future__ import annotations

import gc
import hashlib
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

from typing_extensions import override

from kvfsm.check.model import (
    E_DONE,
    E_NAMES,
    E_RUN,
    KIND_NAMES,
    SHARD_NAMES,
    Bounds,
    Canonical,
    Label,
    Model,
    ModelViolation,
    State,
    compiled,
    slot_state,
    sync_loads,
)
from kvfsm.check.properties import DrainMode
from kvfsm.machines.names import EngineState, JobState

__all__ = [
    "LIVENESS",
    "RESPONSIVENESS",
    "ExplorationResult",
    "Graph",
    "Violation",
    "describe_label",
    "describe_state",
    "explore",
    "format_trace",
    "graph_digest",
    "stable_trace",
]

#: The names under which the spec's temporal properties (spec/invariants.toml ``[[property]]``) are reported.
LIVENESS: Final = "liveness"
RESPONSIVENESS: Final = "responsiveness"

#: Engine states in which an arriving request arrives "while the engine drains" (responsiveness).
_DRAINING: Final = frozenset({EngineState.FINISHING, EngineState.DRAINING})

#: Labels that the liveness check may not rely on: new work and resets are the environment's choice.
_NOT_PROGRESS: Final = frozenset({"arrive", "reset", "shutdown"})

#: The default bound on the model's memos, in results held (Model.trim_memos). The default bounds hold
#: about 190,000; each result costs about 750 bytes, so this caps them near 1.5 GB.
MEMO_LIMIT: Final = 2_000_000
#: How often (in states expanded) the exploration looks at the memos' size.
_TRIM_EVERY: Final = 4096

#: Called every so often with (states, edges, queue length, seconds).
ProgressCallback = Callable[[int, int, int, float], None]


@dataclass(frozen=True, slots=True)
class Violation:
    """An invariant broken in a reachable state (``label`` None) or by one transition from it."""

    invariant: str
    detail: str
    path: tuple[Label, ...]  #: shortest sequence of events from the initial state
    states: tuple[State, ...]  #: the canonical states along the path, the initial one first
    label: Label | None = None  #: the violating event itself, applied to ``states[-1]``
    #: liveness only: a run from ``states[-1]`` by progress events alone (no arrival, reset or shutdown) that
    #: never reaches the goal: its events, the canonical state after each, and ``loop``, the index of the
    #: first event of the cycle that ``lasso[loop:]`` repeats forever (-1: the run ends in a state that no
    #: progress event leaves). Not counted in :attr:`length`.
    lasso: tuple[Label, ...] = ()
    lasso_states: tuple[State, ...] = ()
    loop: int = -1

    @property
    def length(self) -> int:
        """Events in the counterexample, the violating one included."""
        return len(self.path) + (self.label is not None)

    @override
    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail} (counterexample of {self.length} events)"


@dataclass(slots=True)
class Graph:
    """The explored graph: canonical states by id (0 is the initial one), BFS parents, and every edge."""

    states: list[State]
    parent: array[int]  #: BFS parent of each state (-1 for the initial one)
    parent_label: list[int]  #: index into ``labels`` of the event from the parent
    src: array[int] = field(default_factory=lambda: array("i"))
    dst: array[int] = field(default_factory=lambda: array("i"))
    label: array[int] = field(default_factory=lambda: array("i"))
    labels: list[Label] = field(default_factory=list)  #: distinct labels, interned

    def path_to(self, sid: int) -> list[tuple[int, Label]]:
        """The shortest path to state ``sid``: (source state id, event) pairs from the initial state."""
        out: list[tuple[int, Label]] = []
        while self.parent[sid] >= 0:
            out.append((self.parent[sid], self.labels[self.parent_label[sid]]))
            sid = self.parent[sid]
        out.reverse()
        return out

    def edges(self) -> list[tuple[int, Label, int]]:
        return [(s, self.labels[lab], d) for s, lab, d in zip(self.src, self.label, self.dst, strict=True)]


@dataclass(slots=True)
class ExplorationResult:
    bounds: Bounds
    states: int
    edges: int
    seconds: float
    violations: list[Violation]
    graph: Graph | None
    complete: bool  #: every reachable state was explored (no stop at a first violation)
    pruned: int = 0  #: edges not explored because of Bounds.max_jobs
    liveness_checked: bool = False
    responsiveness_checks: int = 0  #: arrivals while the engine drained, each checked for responsiveness
    drain: DrainMode = DrainMode.NON_BLOCKING
    cpu_seconds: float = 0.0  #: CPU time of the exploration (time.process_time), liveness included
    memos_trimmed: int = 0  #: how many times the model's memos were dropped at memo_limit
    #: the most chunks a blocked step waits to be copied, over every explored state (Model.step_wait_chunks):
    #: with Bounds.sync_load_budget, at most the budget (spec property step_wait_bounded)
    max_step_wait_chunks: int = 0
    #: arrivals while a step waited for its sync loads (the engine running, so not a responsiveness check)
    step_wait_arrivals: int = 0

    @property
    def ok(self) -> bool:
        return not self.violations

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    @property
    def states_per_cpu_second(self) -> float:
        """States per second of CPU time: the checker's speed on one core, whatever else the machine runs."""
        return self.states / self.cpu_seconds if self.cpu_seconds > 0 else 0.0

    def summary(self) -> dict[str, object]:
        return {
            "bounds": self.bounds.as_dict(),
            "states": self.states,
            "edges": self.edges,
            "seconds": round(self.seconds, 3),
            "states_per_second": round(self.states_per_second),
            "cpu_seconds": round(self.cpu_seconds, 3),
            "states_per_cpu_second": round(self.states_per_cpu_second),
            "complete": self.complete,
            "pruned_edges": self.pruned,
            "liveness_checked": self.liveness_checked,
            "responsiveness_checks": self.responsiveness_checks,
            "drain": self.drain.value,
            "compiled": compiled(),
            "memos_trimmed": self.memos_trimmed,
            "max_step_wait_chunks": self.max_step_wait_chunks,
            "step_wait_arrivals": self.step_wait_arrivals,
            "violations": [
                {
                    "invariant": v.invariant,
                    "detail": v.detail,
                    "length": v.length,
                    "trace": [
                        describe_label(st, lab)
                        for st, lab in zip(v.states, (*v.path, v.label), strict=False)
                        if lab is not None
                    ],
                    "lasso": [
                        describe_label(st, lab)
                        for st, lab in zip((v.states[-1], *v.lasso_states), v.lasso, strict=False)
                    ],
                    "loop": v.loop,
                }
                for v in self.violations
            ],
        }


def explore(
    bounds: Bounds | None = None,
    *,
    stop_at_first: bool = True,
    keep_graph: bool = True,
    check_liveness: bool = True,
    max_states: int = 0,
    memo_limit: int = MEMO_LIMIT,
    symmetry: bool = True,
    progress: ProgressCallback | None = None,
    progress_every: int = 20_000,
    model: Model | None = None,
    drain: DrainMode = DrainMode.NON_BLOCKING,
) -> ExplorationResult:
    """Explore every reachable state of the model at ``bounds``.

    ``stop_at_first``: return at the first violation (its counterexample is a shortest one). Otherwise keep
    going and report the first violation of each invariant. ``keep_graph`` keeps every edge (needed for
    the liveness check and for model-based tests). ``max_states`` > 0 stops early (``complete`` False).
    ``symmetry=False`` explores raw states (no symmetry reduction), for comparison. ``memo_limit`` bounds
    the model's memos (:meth:`Model.trim_memos`): the graph is the same, only memory and time change.
    ``drain`` picks the engine's drain mode (ignored when ``model`` is given: the model's own mode is used).

    Besides the invariants, every arrival taken while the engine is finishing, draining or blocked in
    flush_all is checked for responsiveness: the new request must be looked up within one engine step with no
    transfer finishing (:meth:`Model.responsiveness`). The most chunks a blocked step waits for, over every
    state, is :attr:`ExplorationResult.max_step_wait_chunks`.
    """
    # The exploration allocates millions of long-lived tuples and frees next to no cycles (refcounting
    # frees the rest): the cyclic collector's repeated scans of the growing graph are pure overhead, about
    # a fifth of the run at the default bounds. It is off while the graph is built, and back on after.
    collecting = gc.isenabled()
    gc.disable()
    try:
        return _explore(
            bounds,
            stop_at_first=stop_at_first,
            keep_graph=keep_graph,
            check_liveness=check_liveness,
            max_states=max_states,
            memo_limit=memo_limit,
            symmetry=symmetry,
            progress=progress,
            progress_every=progress_every,
            model=model,
            drain=drain,
        )
    finally:
        if collecting:
            gc.enable()


def _explore(
    bounds: Bounds | None,
    *,
    stop_at_first: bool,
    keep_graph: bool,
    check_liveness: bool,
    max_states: int,
    memo_limit: int,
    symmetry: bool,
    progress: ProgressCallback | None,
    progress_every: int,
    model: Model | None,
    drain: DrainMode,
) -> ExplorationResult:
    model = model if model is not None else Model(bounds, drain)
    model.forget()  # nothing carried over from an earlier exploration with the same model
    bounds = model.bounds
    # The model's methods are called on it directly (no bound-method locals): the compiled build then makes
    # native calls, without boxing their arguments.
    start = time.perf_counter()
    cpu_start = time.process_time()

    init = model.canonical(model.initial) if symmetry else model.initial
    ids: dict[State, int] = {init: 0}
    states: list[State] = [init]
    parent = array("i", [-1])
    parent_label: list[int] = [-1]
    label_ids: dict[Label, int] = {}
    labels: list[Label] = []
    src = array("i")
    dst = array("i")
    lab_arr = array("i")
    violations: list[Violation] = []
    seen_invariants: set[str] = set()
    graph = Graph(states, parent, parent_label, src, dst, lab_arr, labels)
    pruned = 0
    edges = 0
    arrivals_checked = 0
    memos_trimmed = 0
    max_wait = 0
    wait_arrivals = 0
    flush_all_blocks = model.drain is DrainMode.BLOCKING

    def label_id(label: Label) -> int:
        lid = label_ids.get(label)
        if lid is None:
            lid = label_ids[label] = len(labels)
            labels.append(label)
        return lid

    def record(
        invariant: str,
        detail: str,
        sid: int,
        label: Label | None,
        lasso: tuple[list[int], list[int], int] | None = None,
    ) -> bool:
        if invariant in seen_invariants:
            return False
        seen_invariants.add(invariant)
        path = graph.path_to(sid)
        run_labels: tuple[Label, ...] = ()
        run_states: tuple[State, ...] = ()
        loop = -1
        if lasso is not None:
            run_labels = tuple(labels[lab] for lab in lasso[1])
            run_states = tuple(states[s] for s in lasso[0])
            loop = lasso[2]
        violations.append(
            Violation(
                invariant,
                detail,
                tuple(lab for _, lab in path),
                tuple([states[s] for s, _ in path] + [states[sid]]),
                label,
                run_labels,
                run_states,
                loop,
            )
        )
        return stop_at_first

    def finish(complete: bool, liveness: bool) -> ExplorationResult:
        return ExplorationResult(
            bounds,
            len(states),
            edges,
            time.perf_counter() - start,
            violations,
            graph if keep_graph else None,
            complete,
            pruned,
            liveness,
            arrivals_checked,
            model.drain,
            time.process_time() - cpu_start,
            memos_trimmed,
            max_wait,
            wait_arrivals,
        )

    for name, detail in model.invariants(init):
        if record(name, detail, 0, None):
            return finish(False, False)

    # Bound once: the compiled build would otherwise look the method up by name on every edge.
    src_append = src.append
    dst_append = dst.append
    label_append = lab_arr.append
    i = 0
    while i < len(states):
        s = states[i]
        # An arrival from this state is checked for responsiveness (decided once, not on every edge).
        # (flush_all blocks a finishing or draining engine; a step that waits for its sync loads runs one.)
        draining = s.engine in _DRAINING or (s.blocked and flush_all_blocks)
        if s.blocked:
            waits = model.step_wait_chunks(s)
            if waits > max_wait:
                max_wait = waits
        for label, nxt in model.successors(s):
            if nxt is None:
                pruned += 1
                continue
            if isinstance(nxt, ModelViolation):
                if record(nxt.invariant, nxt.detail, i, label):
                    return finish(False, False)
                continue
            # A known state is its own canonical form (canonical() is idempotent): skip the renumbering.
            # One hash of the canonical form: setdefault looks it up and inserts it at once.
            sid = ids.get(nxt)
            new = False
            if sid is None:
                c = model.canonical(nxt) if symmetry else nxt
                n = len(states)
                sid = ids.setdefault(c, n)
                new = sid == n
            if new:
                states.append(c)
                parent.append(i)
                parent_label.append(label_id(label))
                for name, detail in model.invariants(c):
                    if record(name, detail, sid, None):
                        edges += 1
                        return finish(False, False)
            if s.blocked and not draining and label[0] == "arrive":
                wait_arrivals += 1
            if draining and label[0] == "arrive":
                arrivals_checked += 1
                late = model.responsiveness(nxt, len(nxt.reqs) - 1)
                # Reported in the state after the arrival when this edge discovered it (so the trace shows
                # it), else on the edge itself.
                if late is not None and record(RESPONSIVENESS, late, sid if new else i, None if new else label):
                    edges += 1
                    return finish(False, False)
            edges += 1
            if keep_graph:
                src_append(i)
                dst_append(sid)
                lid = label_ids.get(label)  # label_id(label), inline: this runs on every edge
                if lid is None:
                    lid = label_id(label)
                label_append(lid)
        i += 1
        if progress is not None and i % progress_every == 0:
            progress(len(states), edges, len(states) - i, time.perf_counter() - start)
        if i % _TRIM_EVERY == 0:
            memos_trimmed += model.trim_memos(memo_limit)
        if max_states and len(states) >= max_states:
            return finish(False, False)
    if progress is not None:
        progress(len(states), edges, 0, time.perf_counter() - start)

    liveness = False
    if check_liveness and keep_graph and not (violations and stop_at_first):
        liveness = True
        dead = _liveness(graph, model, pruned > 0)
        if dead is not None:
            record(LIVENESS, _liveness_detail(states[dead]), dead, None, _lasso(graph, dead))
    return finish(True, liveness)


def graph_digest(graph: Graph) -> str:
    """A digest of the explored graph: every state in BFS order and every edge, with its label. Two
    explorations agree on it only if they discovered the same states in the same order and the same edges
    (the fingerprint that pins the graph against a change in how fast it is explored)."""
    digest = hashlib.sha256()
    for s in graph.states:
        digest.update(repr(tuple(s)).encode())
    digest.update(graph.src.tobytes())
    digest.update(graph.dst.tobytes())
    digest.update(graph.label.tobytes())
    digest.update(repr(graph.labels).encode())
    return digest.hexdigest()[:16]


def _is_goal(s: State) -> bool:
    engine = s.engine
    if engine is _STOPPED:
        return True
    if engine is not _IDLE or s.tier:
        return False
    for j in s.jobs:  # noqa: SIM110 (not any() over a generator: this runs once per state)
        if j.state is _SUBMITTED or j.state is _IN_FLIGHT:
            return False
    return True


_LIVE: Final = (JobState.SUBMITTED, JobState.IN_FLIGHT)
# Final names for the members _is_goal compares (C statics in the compiled build, no attribute lookups).
_STOPPED: Final = EngineState.STOPPED
_IDLE: Final = EngineState.IDLE
_SUBMITTED: Final = JobState.SUBMITTED
_IN_FLIGHT: Final = JobState.IN_FLIGHT


def _liveness(graph: Graph, model: Model, pruned: bool) -> int | None:
    """The first state (in BFS order) that cannot reach an idle engine with nothing pending, or None.

    Reverse reachability from the goal states over progress edges only. With pruned edges (max_jobs) a
    state that lost an edge is optimistically assumed live.
    """
    n = len(graph.states)
    progress_label = [lab[0] not in _NOT_PROGRESS for lab in graph.labels]
    # Reverse adjacency in CSR form: the predecessors of d are rev[start[d]:start[d + 1]]. ``start`` is one
    # array, first of in-degrees, then of the ends of each range, filled backwards into their starts (no
    # second array). Arrays and a bytearray rather than lists: at the full scope's 20M states a list would
    # hold a boxed int per state (about 0.8 GB) where the array holds 4 bytes.
    start = array("i", bytes(4 * (n + 1)))
    for d, lab in zip(graph.dst, graph.label, strict=True):
        if progress_label[lab]:
            start[d] += 1
    total = 0
    for k in range(n):
        total += start[k]
        start[k] = total
    start[n] = total
    rev = array("i", bytes(4 * max(total, 1)))
    for s, d, lab in zip(graph.src, graph.dst, graph.label, strict=True):
        if progress_label[lab]:
            start[d] -= 1
            rev[start[d]] = s
    live = bytearray(n)
    stack = [sid for sid, st in enumerate(graph.states) if _is_goal(st)]
    for sid in stack:
        live[sid] = 1
    if pruned:
        # Any state with a pruned successor might reach the goal through it: count it as live.
        for sid, st in enumerate(graph.states):
            if not live[sid] and any(nxt is None for _, nxt in model.successors(st)):
                live[sid] = 1
                stack.append(sid)
    while stack:
        d = stack.pop()
        for k in range(start[d], start[d + 1]):
            s = rev[k]
            if not live[s]:
                live[s] = 1
                stack.append(s)
    for sid in range(n):
        if not live[sid]:
            return sid
    return None


def _lasso(graph: Graph, dead: int) -> tuple[list[int], list[int], int]:
    """A run from state ``dead`` (which cannot reach the goal) by progress edges alone, as (the state after
    each event, the label id of each event, ``loop``): the events from index ``loop`` on form a cycle that
    repeats forever, or ``loop`` is -1 and the run ends in a state that no progress edge leaves.

    Every state it visits is as dead as ``dead`` (a progress edge out of a state that cannot reach the goal
    leads to one that cannot either). The run ends in the state nearest ``dead`` (breadth-first) that lies on
    a cycle, preferring one where nothing is left to do: no transfer remains and no request is unfinished,
    so the cycle is fair (no completion is starved) and the engine still never goes idle. Without any cycle,
    it ends in the nearest state that no progress edge leaves. Computed only when liveness fails.
    """
    n = len(graph.states)
    progress_label = [lab[0] not in _NOT_PROGRESS for lab in graph.labels]
    # Forward adjacency over progress edges in CSR form: the successors of s are succ[first[s]:first[s + 1]].
    first = array("i", bytes(4 * (n + 1)))
    for s, lab in zip(graph.src, graph.label, strict=True):
        if progress_label[lab]:
            first[s + 1] += 1
    for k in range(n):
        first[k + 1] += first[k]
    size = max(first[n], 1)
    succ = array("i", bytes(4 * size))
    succ_label = array("i", bytes(4 * size))
    fill = array("i", first)
    for s, d, lab in zip(graph.src, graph.dst, graph.label, strict=True):
        if progress_label[lab]:
            k = fill[s]
            succ[k] = d
            succ_label[k] = lab
            fill[s] = k + 1
    # Breadth-first from ``dead``: the reachable states in order, each with its parent and edge.
    parent: dict[int, int] = {dead: -1}
    order = [dead]
    at = 0
    while at < len(order):
        v = order[at]
        at += 1
        for k in range(first[v], first[v + 1]):
            w = succ[k]
            if w not in parent:
                parent[w] = k
                order.append(w)
    # Strongly connected components of the reachable states (Kosaraju, iteratively): first the finishing
    # order of a depth-first search, then components on the reversed edges in the reverse of that order.
    post: list[int] = []
    seen: set[int] = set()
    for root in order:
        if root in seen:
            continue
        seen.add(root)
        stack = [(root, first[root])]
        while stack:
            v, k = stack[-1]
            if k < first[v + 1]:
                stack[-1] = (v, k + 1)
                w = succ[k]
                if w not in seen:
                    seen.add(w)
                    stack.append((w, first[w]))
            else:
                stack.pop()
                post.append(v)
    preds: dict[int, list[int]] = {v: [] for v in order}
    for v in order:
        for k in range(first[v], first[v + 1]):
            preds[succ[k]].append(v)
    comp: dict[int, int] = {}
    comp_size: list[int] = []
    for root in reversed(post):
        if root in comp:
            continue
        c = len(comp_size)
        comp[root] = c
        members = 1
        todo = [root]
        while todo:
            v = todo.pop()
            for u in preds[v]:
                if u not in comp:
                    comp[u] = c
                    members += 1
                    todo.append(u)
        comp_size.append(members)

    def on_cycle(v: int) -> bool:
        if comp_size[comp[v]] > 1:
            return True
        return any(succ[k] == v for k in range(first[v], first[v + 1]))

    target = -1
    for v in order:
        st = graph.states[v]
        if on_cycle(v) and Model.transfer_remains(st) is None and all(r.eng == E_DONE for r in st.reqs):
            target = v
            break
    if target < 0:
        for v in order:
            if on_cycle(v):
                target = v
                break
    cyclic = target >= 0
    if not cyclic:
        for v in order:
            if first[v] == first[v + 1]:
                target = v
                break
    # The path from ``dead`` to the target, then (on a cycle) the shortest way back to the target.
    edges_taken: list[int] = []
    v = target
    while parent[v] >= 0:
        k = parent[v]
        edges_taken.append(k)
        v = _edge_source(first, k)
    edges_taken.reverse()
    loop = -1
    if cyclic:
        loop = len(edges_taken)
        back: dict[int, int] = {}
        queue = [target]
        at = 0
        closing = -1
        while closing < 0 and at < len(queue):
            v = queue[at]
            at += 1
            for k in range(first[v], first[v + 1]):
                w = succ[k]
                if w == target:
                    closing = k
                    break
                if w not in back and comp[w] == comp[target]:
                    back[w] = k
                    queue.append(w)
        cycle = [closing]
        v = _edge_source(first, closing)
        while v != target:
            k = back[v]
            cycle.append(k)
            v = _edge_source(first, k)
        cycle.reverse()
        edges_taken += cycle
    return [succ[k] for k in edges_taken], [succ_label[k] for k in edges_taken], loop


def _edge_source(first: array[int], k: int) -> int:
    """The state whose range of the forward CSR ``first`` holds edge ``k`` (binary search)."""
    lo, hi = 0, len(first) - 2
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if first[mid] <= k:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _liveness_detail(s: State) -> str:
    pending = sum(1 for j in s.jobs if j.state in _LIVE)
    return (
        f"from this state the engine ({s.engine.value}, {pending} awaited job(s), {len(s.tier)} tier "
        "transfer(s)) can never reach idle with nothing pending, even if every transfer completes"
    )


# --------------------------------------------------------------------------------------------- traces

Names = tuple[Sequence[str], Sequence[str]]


def describe_label(s: State, label: Label, names: Names | None = None) -> str:
    """One event in words, read against its source state ``s`` (``names``: stable request and job names)."""
    kind = label[0]
    if kind == "arrive":
        return f"a request with prompt {label[1]} arrives"
    if kind == "lookup":
        i, g = label[1], label[2]
        where = "" if g < 0 else f" (into the freed GPU blocks of group {g})"
        return f"the engine looks up {_req(s, i, names)}{where}"
    if kind == "step":
        return f"the engine runs a step (engine {s.engine.value})"
    if kind == "preempt":
        return f"the engine runs a step that preempts {_req(s, label[1], names)}"
    if kind == "finish":
        r = s.reqs[label[1]]
        verb = "finishes" if r.eng == E_RUN else "is aborted"
        return f"{_req(s, label[1], names)} {verb}"
    if kind == "reset":
        return "reset_cache()"
    if kind == "copy":
        j, w, ok = label[1], label[2], label[3]
        return f"worker {w}'s copy of {_job(s, j, names)} {'finishes' if ok else 'FAILS'}"
    if kind == "tier":
        rec = s.tier[label[1]]
        what = "promotion" if rec.promote else "cascade"
        return f"tier {rec.tier}'s {what} I/O of keys {list(rec.keys)} {'finishes' if label[2] else 'FAILS'}"
    if kind == "sync":
        rec = s.tier[label[1]]
        return f"tier {rec.tier}'s background sync of keys {list(rec.keys)} finishes (the cascade is durable)"
    if kind == "expire":
        return f"the deadline of {_job(s, label[1], names)} passes (Deadlines.store_s)"
    if kind == "expire_promotion":
        rec = s.tier[label[1]]
        return f"the deadline of tier {rec.tier}'s promotion of keys {list(rec.keys)} passes (Deadlines.promote_s)"
    if kind == "shutdown":
        return "shutdown(timeout): every live request is aborted, shutdown / flush_all fires"
    if kind == "give_up":
        return "the shutdown deadline passes: unlaunched jobs are cancelled, launched ones time out, transfers given up"
    if kind == "stop":
        return "stop [no_pending_push_work]: quarantined memory and abandoned transfers are released"
    if kind == "unblock":
        if sync_loads(s.reqs, s.jobs):
            return (
                "the step's wait for its sync loads returns: it runs its forward, launches its stores, polls, "
                "commits and settles"
            )
        return "flush_all's wait returns (every flushed copy finished): the step polls, commits and settles"
    return repr(label)


def _blocked_in(s: State) -> str:
    """What a blocked engine-core thread waits in: a step's sync loads, or flush_all."""
    return "waiting for the step's sync loads" if sync_loads(s.reqs, s.jobs) else "in flush_all"


def _req(s: State, i: int, names: Names | None) -> str:
    r = s.reqs[i]
    name = names[0][i] if names is not None else f"#{i}"
    return f"request {name} (prompt {r.prompt}, {r.phase.value})"


def _job(s: State, j: int, names: Names | None) -> str:
    job = s.jobs[j]
    name = names[1][j] if names is not None else f"#{j}"
    owner = ""
    if job.req >= 0:
        owner = f" of request {names[0][job.req] if names is not None else f'#{job.req}'}"
    stale = " (stale)" if job.state is JobState.STALE else ""
    return f"{KIND_NAMES[job.kind]} job {name} keys {list(job.keys)}{owner}{stale}"


def describe_state(s: State, names: Names | None = None) -> str:
    """A compact one-line summary of a state."""
    rn = names[0] if names is not None else [f"#{i}" for i in range(len(s.reqs))]
    jn = names[1] if names is not None else [f"#{j}" for j in range(len(s.jobs))]
    reqs = ", ".join(
        f"{rn[i]} p{r.prompt} {r.phase.value}/{E_NAMES[r.eng]}" + (f" g{r.group}" if r.group >= 0 else "")
        for i, r in enumerate(s.reqs)
    )
    jobs = ", ".join(
        f"{jn[n]} {KIND_NAMES[j.kind]}{list(j.keys)} {j.state.value} pending={j.pending} "
        + "/".join(SHARD_NAMES[sh] for sh in j.shards)
        for n, j in enumerate(s.jobs)
    )
    slots = " ".join(
        f"k{k}={slot_state(code).value}" + (f"({code})" if code > 0 else "") for k, code in enumerate(s.slots)
    )
    tier = ", ".join(
        f"t{t.tier}{'>promote' if t.promote else ''}{list(t.keys)} {SHARD_NAMES[t.status]}"
        + (" (polled)" if t.harvested else "")
        for t in s.tier
    )
    if s.held:
        tier += " held: " + " ".join(
            f"t{t}={[k for k in range(len(s.slots)) if mask >> k & 1]}" for t, mask in enumerate(s.held)
        )
    engine = s.engine.value + (f" BLOCKED {_blocked_in(s)}" if s.blocked else "")
    return (
        f"engine={engine} | requests: {reqs or '-'} | jobs: {jobs or '-'} | slots: {slots} "
        f"lru={list(s.lru)} | tier: {tier or '-'}"
    )


def stable_trace(model: Model, v: Violation, *, lasso: bool = False) -> list[tuple[str, State | None, Names]]:
    """The counterexample re-derived without symmetry, so that requests and jobs keep their names.

    Each entry: (the event in words, the state after it or None for the violating event, the names).
    With ``lasso``, a liveness violation's run that never reaches the goal (:attr:`Violation.lasso`)
    follows the counterexample's events.
    """
    s = model.initial
    rnames: list[str] = []
    jnames: list[str] = []
    counters = [0, 0]
    out: list[tuple[str, State | None, Names]] = []
    labels = [*v.path, *([v.label] if v.label is not None else []), *(v.lasso if lasso else ())]
    for lab in labels:
        local = _translate(lab, model.canonical_with_maps(s))
        text = describe_label(s, local, (rnames, jnames))
        nxt = model.apply(s, local)
        if not isinstance(nxt, State):
            out.append((text, None, (list(rnames), list(jnames))))
            break
        kept = model.last_kept
        if local[0] == "arrive":
            counters[0] += 1
            rnames.append(f"R{counters[0]}")
        extra = len(nxt.jobs) if kept is None else max(kept[1], default=-1) + 1
        extra -= len(jnames)
        for _ in range(max(extra, 0)):
            counters[1] += 1
            jnames.append(f"J{counters[1]}")
        if kept is not None:
            rnames = [rnames[i] for i in kept[0]]
            jnames = [jnames[j] for j in kept[1]]
        out.append((text, nxt, (list(rnames), list(jnames))))
        s = nxt
    return out


def _translate(label: Label, maps: Canonical) -> Label:
    """A label of the canonical state, in the indices of the state it was derived from."""
    kind = label[0]
    if kind == "lookup":
        inverse = {new: old for old, new in maps.groups.items()}
        g = label[2]
        return (kind, maps.reqs[label[1]], inverse[g] if g >= 0 else g)
    if kind in ("preempt", "finish"):
        return (kind, maps.reqs[label[1]])
    if kind == "copy":
        return (kind, maps.jobs[label[1]], maps.workers[label[2]], label[3])
    if kind == "tier":
        return (kind, maps.tier[label[1]], label[2])
    if kind in ("sync", "expire_promotion"):
        return (kind, maps.tier[label[1]])
    if kind == "expire":
        return (kind, maps.jobs[label[1]])
    return label


def format_trace(v: Violation, model: Model | None = None, *, states: bool = True) -> str:
    """The counterexample as numbered events (and, with ``states``, the state after each).

    With ``model`` (the one that found it), requests and jobs get stable names (R1, J1, ...) across the
    trace; without it, indices refer to each step's canonical state.
    """
    lines = [f"VIOLATION {v.invariant}: {v.detail}", f"shortest counterexample: {v.length} events"]
    if states:
        lines.append(f"   0. initial: {describe_state(v.states[0])}")
    run: list[tuple[str, State | None, Names | None]] = []
    if model is not None:
        steps = stable_trace(model, v, lasso=True)
        for n, (text, after, names) in enumerate(steps[: v.length], 1):
            mark = f"  <-- {v.invariant}" if after is None else ""
            lines.append(f"  {n:2}. {text}{mark}")
            if states and after is not None:
                lines.append(f"      -> {describe_state(after, names)}")
        run = [(text, after, names) for text, after, names in steps[v.length :]]
    else:
        for n, (lab, st) in enumerate(zip(v.path, v.states, strict=False), 1):
            lines.append(f"  {n:2}. {describe_label(st, lab)}")
            if states:
                lines.append(f"      -> {describe_state(v.states[n])}")
        if v.label is not None:
            lines.append(f"  {v.length:2}. {describe_label(v.states[-1], v.label)}  <-- {v.invariant}")
        sources = (v.states[-1], *v.lasso_states)
        run = [(describe_label(sources[k], lab), v.lasso_states[k], None) for k, lab in enumerate(v.lasso)]
    if v.label is None:
        lines.append(f"      this state breaks {v.invariant}")
    if v.lasso:
        lines.append(
            "      a run from it that never reaches idle (the engine's steps, the requests' ends and completions only):"
        )
        for k, (text, after, run_names) in enumerate(run):
            mark = "  <-- the cycle starts here" if k == v.loop else ""
            lines.append(f"  {v.length + k + 1:2}. {text}{mark}")
            if after is not None and (states or k == len(run) - 1):
                lines.append(f"      -> {describe_state(after, run_names)}")
        last = v.lasso_states[-1]
        if v.loop < 0:
            lines.append("      and from here no step, end or completion can move: only new work could")
        else:
            again, end = v.length + v.loop + 1, v.length + len(v.lasso)
            repeat = f"event {again} repeats" if again == end else f"events {again} to {end} repeat"
            lines.append(f"      back in the state before event {again}: {repeat} forever")
            if model is not None and Model.transfer_remains(last) is None:
                pending = model.has_pending_push_work(last.jobs, last.tier, last.abandoned)
                lines.append(
                    "      no transfer remains, yet has_pending_push_work() is "
                    + ("True: the engine never goes idle" if pending else "False")
                )
    return "\n".join(lines)


#: Who sends each event of the model to whom, for the sequence diagram.
_ARROWS: dict[str, tuple[str, str, str]] = {
    "arrive": ("Client", "Engine", "->>"),
    "finish": ("Client", "Engine", "->>"),
    "lookup": ("Engine", "Scheduler", "->>"),
    "step": ("Engine", "Scheduler", "->>"),
    "preempt": ("Engine", "Scheduler", "->>"),
    "reset": ("Engine", "Scheduler", "->>"),
    "copy": ("Workers", "Scheduler", "-->>"),
    "tier": ("Tier", "Scheduler", "-->>"),
    "sync": ("Tier", "Tier", "-->>"),
    "unblock": ("Workers", "Engine", "-->>"),
    "shutdown": ("Client", "Engine", "->>"),
    "give_up": ("Engine", "Scheduler", "->>"),
    "stop": ("Engine", "Engine", "->>"),
    "expire": ("Engine", "Scheduler", "-->>"),
    "expire_promotion": ("Tier", "Scheduler", "-->>"),
}


def mermaid_sequence(v: Violation, model: Model) -> str:
    """The counterexample as a Mermaid sequence diagram: one message per event, the engine's state after it."""
    lines = [
        "```mermaid",
        "sequenceDiagram",
        "    participant Client",
        "    participant Engine",
        "    participant Scheduler",
        "    participant Workers",
        "    participant Tier",
    ]
    labels = [*v.path, *([v.label] if v.label is not None else [])]
    for lab, (text, after, _names) in zip(labels, stable_trace(model, v), strict=False):
        src, dst, arrow = _ARROWS.get(lab[0], ("Engine", "Engine", "->>"))
        lines.append(f"    {src}{arrow}{dst}: {_mermaid_text(text)}")
        if after is None:
            lines.append(f"    Note over {src},{dst}: VIOLATES {v.invariant}")
        else:
            engine = after.engine.value + (f" (blocked {_blocked_in(after)})" if after.blocked else "")
            live = sum(1 for j in after.jobs if j.state in _LIVE)
            lines.append(f"    Note over Engine: {engine}, {live} awaited job(s), {len(after.tier)} cascade(s)")
    if v.label is None:
        lines.append(f"    Note over Client,Tier: VIOLATES {v.invariant}: {_mermaid_text(v.detail)}")
    lines.append("```")
    return "\n".join(lines)


def _mermaid_text(text: str) -> str:
    """Message text Mermaid accepts (no ';' or '#', which it parses)."""
    return text.replace(";", ",").replace("#", "no. ")
