"""State machines built from spec/ with ``transitions``, and their compiled transition tables.

Each spec table becomes one shared ``transitions.Machine`` (``model=None``, ``auto_transitions=False``,
guards as ``conditions``, effects as ``after`` callbacks). At start-up that Machine object is compiled
into a plain ``dict[(state, event)] -> edges`` table, because a table lookup costs ~0.15 µs against
~7 µs for a transitions trigger and a per-job model would cost kilobytes. ``tests/test_compiled.py``
proves the table equal to the Machine over every (state, event, guard valuation).

In checked mode (``KVFSM_CHECKED=1`` or ``checked=True``) every fire also runs through transitions
itself and any disagreement raises :class:`~kvfsm.errors.SpecError`.

``fire`` returns the transition's effect as a member of the machine's effect enum
(:mod:`kvfsm.machines.names`), for the caller to carry out (h2-style). ``fire_many`` applies one event to
many distinct models at once: one table lookup per distinct source state, the same rows and guards as
``fire``, all or nothing (an invalid transition anywhere in the batch raises and changes no model).
Transition tracers are registered with :func:`add_tracer` / :func:`remove_tracer` (any number, removed
in any order). Tests plant a wrong guard or table row through :meth:`SpecMachine.planted`, never by
touching the compiled table.
The rules these machines follow are written down in ``spec/README.md``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from itertools import compress, repeat
from types import MappingProxyType
from typing import Any, Generic, NoReturn, Protocol, TypeVar

from transitions import Machine, MachineError

from kvfsm.errors import InvalidTransition, SpecError
from kvfsm.machines.loader import MachineSpec, load_machine

__all__ = [
    "CompiledEdge",
    "FiredGroup",
    "Guard",
    "SpecMachine",
    "Stateful",
    "TracerHandle",
    "TransitionTracer",
    "add_tracer",
    "build_transitions_machine",
    "checked_mode_default",
    "compile_table",
    "evaluate_table",
    "evaluate_transitions",
    "remove_tracer",
    "set_tracer",
    "tracing",
]

S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)
F = TypeVar("F", bound=StrEnum)
M = TypeVar("M", bound="Stateful[Any]")

#: A guard: ``(model, arg) -> bool``, pure.
Guard = Callable[[Any, int], bool]


class Stateful(Protocol[S]):
    """Anything a spec machine drives: it has a mutable ``state``."""

    state: S


#: Called after every transition of every spec machine: (machine, model, event, source, dest).
TransitionTracer = Callable[[str, object, str, str, str], None]


@dataclass(frozen=True, slots=True)
class TracerHandle:
    """What :func:`add_tracer` returns; :func:`remove_tracer` takes it back."""

    id: int


_tracers: dict[int, TransitionTracer] = {}
_next_tracer_id = 1
_LEGACY = TracerHandle(0)  # the one slot ``set_tracer`` replaces
#: The function ``fire`` calls: None (no tracer), the only tracer, or a fan-out over all of them.
_tracer: TransitionTracer | None = None


def _rebuild_dispatch() -> None:
    global _tracer
    tracers = tuple(_tracers.values())
    if not tracers:
        _tracer = None
    elif len(tracers) == 1:
        _tracer = tracers[0]
    else:

        def fan_out(machine: str, model: object, event: str, source: str, dest: str) -> None:
            for tracer in tracers:
                tracer(machine, model, event, source, dest)

        _tracer = fan_out


def add_tracer(tracer: TransitionTracer) -> TracerHandle:
    """Register a process-wide transition tracer; every registered tracer sees every transition, in
    registration order. Off by default: the hot path then pays one global None check per transition."""
    global _next_tracer_id
    handle = TracerHandle(_next_tracer_id)
    _next_tracer_id += 1
    _tracers[handle.id] = tracer
    _rebuild_dispatch()
    return handle


def remove_tracer(handle: TracerHandle) -> None:
    """Unregister the tracer ``handle`` names (any order; removing it twice is a no-op)."""
    if _tracers.pop(handle.id, None) is not None:
        _rebuild_dispatch()


def set_tracer(tracer: TransitionTracer | None) -> TransitionTracer | None:
    """Replace the one tracer slot kept for simple callers (None empties it); returns what it held.

    Tracers added with :func:`add_tracer` are unaffected and keep running beside it.
    """
    previous = _tracers.pop(_LEGACY.id, None)
    if tracer is not None:
        _tracers[_LEGACY.id] = tracer
    _rebuild_dispatch()
    return previous


def tracing() -> bool:
    """Whether any transition tracer is installed (a caller may then keep an order it could skip)."""
    return _tracer is not None


def checked_mode_default() -> bool:
    """Checked mode is on when the environment variable KVFSM_CHECKED is set to 1/true/yes."""
    return os.environ.get("KVFSM_CHECKED", "").strip().lower() in {"1", "true", "yes", "on"}


@dataclass(frozen=True, slots=True)
class CompiledEdge:
    """One guarded edge of a compiled table: tried in order, the first whose guard holds fires."""

    guard: str | None
    dest: str
    effect: str | None


def build_transitions_machine(spec: MachineSpec) -> Machine:
    """A model-less transitions Machine with exactly the spec's states, events, guards and effects."""
    if set(spec.guards) & set(spec.effects):
        raise SpecError(f"spec/{spec.name}.toml: guard and effect names must differ")
    machine = Machine(
        model=None,
        states=list(spec.states),
        initial=spec.initial,
        auto_transitions=False,
        ignore_invalid_triggers=False,
        name=spec.name,
    )
    for t in spec.transitions:
        machine.add_transition(
            t.event,
            t.source,
            t.dest,
            conditions=[t.guard] if t.guard else [],
            after=[t.effect] if t.effect else [],
        )
    return machine


def compile_table(machine: Machine) -> dict[tuple[str, str], tuple[CompiledEdge, ...]]:
    """Derive the lookup table from the transitions Machine object (not from the TOML)."""
    table: dict[tuple[str, str], tuple[CompiledEdge, ...]] = {}
    for event_name, event in machine.events.items():
        for source, transitions in event.transitions.items():
            edges = []
            for tr in transitions:
                conds = [c.func for c in tr.conditions if c.target and isinstance(c.func, str)]
                if len(conds) != len(tr.conditions) or len(conds) > 1 or tr.dest is None:
                    raise SpecError(f"{machine.name}: each transition needs a destination and at most one named guard")
                afters = [a for a in tr.after if isinstance(a, str)]
                if len(afters) != len(tr.after) or len(afters) > 1:
                    raise SpecError(f"{machine.name}: transitions may carry at most one named effect")
                edges.append(
                    CompiledEdge(
                        guard=conds[0] if conds else None,
                        dest=tr.dest,
                        effect=afters[0] if afters else None,
                    )
                )
            table[(source, event_name)] = tuple(edges)
    return table


class _Probe:
    """A throw-away model for transitions: answers guard names and records effect names."""

    def __init__(self, state: str, guard: Callable[[str], bool], effects: frozenset[str]) -> None:
        self.state = state
        self._guard = guard
        self._effects = effects
        self.fired: list[str] = []

    def __getattr__(self, name: str) -> Callable[..., bool | None]:
        if name.startswith("_"):
            raise AttributeError(name)
        if name in self._effects:
            return lambda *a, **k: self.fired.append(name)
        return lambda *a, **k: self._guard(name)


def evaluate_transitions(
    machine: Machine, effects: frozenset[str], state: str, event: str, guard: Callable[[str], bool]
) -> tuple[str, str | None] | None:
    """Run one event through transitions itself: (dest, effect), or None if not enabled."""
    probe = _Probe(state, guard, effects)
    try:
        ok = machine.events[event].trigger(probe)
    except MachineError:
        return None
    if not ok:
        return None
    return probe.state, (probe.fired[0] if probe.fired else None)


def evaluate_table(
    table: Mapping[tuple[str, str], tuple[CompiledEdge, ...]],
    state: str,
    event: str,
    guard: Callable[[str], bool],
) -> tuple[str, str | None] | None:
    """The same question answered by the compiled table."""
    for edge in table.get((state, event), ()):
        if edge.guard is None or guard(edge.guard):
            return edge.dest, edge.effect
    return None


_Edge = tuple[Guard | None, S, F | None]

#: One outcome of :meth:`SpecMachine.fire_many`: (source, dest, effect, the models that took it, in the
#: order given). Every model of a group took the same row of the table.
FiredGroup = tuple[S, S, F | None, Sequence[M]]


class SpecMachine(Generic[S, E, F]):
    """One spec machine shared by all of its models; ``fire`` is the only way a model changes state.

    Models are plain slotted objects with a ``state`` attribute holding a member of ``state_enum``.
    Guards are functions ``(model, arg) -> bool`` registered by name; the names must be exactly the
    spec's. ``state_enum``, ``event_enum`` and ``effect_enum`` must name exactly the spec's states,
    events and ``[effects]`` (SpecError otherwise, either direction). ``fire`` returns the transition's
    effect as an ``effect_enum`` member (h2-style side effect) for the caller to carry out. See
    ``spec/README.md`` for the rules.
    """

    __slots__ = (
        "_effects",
        "_guards",
        "_machine",
        "_rows",
        "_states",
        "_table",
        "checked",
        "effects",
        "events",
        "spec",
    )

    def __init__(
        self,
        name: str,
        state_enum: type[S],
        event_enum: type[E],
        effect_enum: type[F],
        guards: Mapping[str, Guard],
        *,
        checked: bool | None = None,
    ) -> None:
        spec = load_machine(name)
        self.spec = spec
        for what, enum, declared in (
            ("states", state_enum, spec.states),
            ("events", event_enum, spec.events),
            ("effects", effect_enum, spec.effects),
        ):
            code = {m.value for m in enum}
            if code != set(declared):
                raise SpecError(f"{name}: code {what} {sorted(code)} != spec {what} {sorted(declared)}")
        if set(guards) != set(spec.guards):
            raise SpecError(f"{name}: code guards {sorted(guards)} != spec guards {sorted(spec.guards)}")
        self._machine = build_transitions_machine(spec)
        self._effects = frozenset(spec.effects)
        self._states = state_enum
        self.events = event_enum
        self.effects = effect_enum
        self._guards: dict[str, Guard] = dict(guards)
        self._rows = compile_table(self._machine)  # by name; ``_table`` is the same, resolved
        self._table: dict[tuple[str, str], tuple[_Edge[S, F], ...]] = self._resolve(self._rows)
        self.checked = checked_mode_default() if checked is None else checked

    def _resolve(
        self, raw: Mapping[tuple[str, str], tuple[CompiledEdge, ...]]
    ) -> dict[tuple[str, str], tuple[_Edge[S, F], ...]]:
        """Names to members and functions, once, so that the hot path is one dict lookup."""
        guards, states, effects = self._guards, self._states, self.effects
        return {
            key: tuple(
                (
                    guards[e.guard] if e.guard else None,
                    states(e.dest),
                    effects(e.effect) if e.effect else None,
                )
                for e in edges
            )
            for key, edges in raw.items()
        }

    @property
    def machine(self) -> Machine:
        """The transitions Machine the table was compiled from (diagrams, checked mode)."""
        return self._machine

    @property
    def guards(self) -> Mapping[str, Guard]:
        """The guard functions by spec name (read-only; tests swap them with :meth:`planted`)."""
        return MappingProxyType(self._guards)

    def table(self) -> dict[tuple[str, str], tuple[CompiledEdge, ...]]:
        """The table ``fire`` uses, by names: equal to ``compile_table(self.machine)`` unless planted."""
        return dict(self._rows)

    @contextmanager
    def planted(
        self,
        *,
        guards: Mapping[str, Guard] | None = None,
        table_edits: Mapping[tuple[str, str], tuple[CompiledEdge, ...] | None] | None = None,
    ) -> Iterator[SpecMachine[S, E, F]]:
        """Plant a bug for a test, undone on exit: swap named guards (the compiled table included) and
        replace (or, with None, delete) rows of the compiled table by ``(state, event)``.

        The transitions Machine is left alone, so checked mode still compares against the spec and
        catches a planted row. Guard names must be the spec's; edits name spec guards, states, effects.
        """
        unknown = set(guards or {}) - set(self._guards)
        if unknown:
            raise SpecError(f"{self.spec.name}: cannot plant guards the spec lacks: {sorted(unknown)}")
        saved = self._guards, self._rows, self._table
        try:
            rows = dict(self._rows)
            for key, edges in (table_edits or {}).items():
                if edges is None:
                    rows.pop(key, None)
                else:
                    rows[key] = edges
            self._guards = {**self._guards, **(guards or {})}
            self._table = self._resolve(rows)
            self._rows = rows
            yield self
        finally:
            self._guards, self._rows, self._table = saved

    def can_fire(self, model: Stateful[S], event: E, arg: int = 0) -> bool:
        for guard, _dest, _effect in self._table.get((model.state, event), ()):
            if guard is None or guard(model, arg):
                return True
        return False

    def fire(self, model: Stateful[S], event: E, arg: int = 0) -> F | None:
        """Apply ``event`` to ``model`` and return the effect to carry out (None: nothing to do).

        Raise InvalidTransition (state unchanged) if no row of the table enables ``event``.
        """
        state = model.state
        for guard, dest, effect in self._table.get((state, event), ()):
            if guard is None or guard(model, arg):
                if self.checked:
                    self._check(model, event, arg, dest, effect)
                model.state = dest
                if _tracer is not None:
                    _tracer(self.spec.name, model, str(event), str(state), str(dest))
                return effect
        if self.checked:
            self._check(model, event, arg, None, None)
        detail = "no guard held" if (state, event) in self._table else ""
        raise InvalidTransition(self.spec.name, str(state), str(event), detail)

    def fire_many(
        self, models: Sequence[M], event: E, arg: int = 0, *, distinct: bool = False
    ) -> list[FiredGroup[S, F, M]]:
        """Apply ``event`` to each of ``models`` (distinct objects) as ``fire`` would, one after the other.

        Returns the outcomes grouped by the row taken: ``(source, dest, effect, models)``, each group's
        models in the order given (a group of every model is ``models`` itself). The table is looked up
        once per distinct source state; an unguarded row moves its whole group without a call per model,
        and a guarded row evaluates each guard once per model still undecided (guards are pure, so this
        takes the same row for each model as trying its rows in order). All or nothing: if any model
        has no enabled row, InvalidTransition is raised and no model changes. With a tracer installed or
        in checked mode every model goes through the same checks ``fire`` makes, and tracers see each
        transition in the order given. A model listed twice raises InvalidTransition (its second
        transition would start from a state the batch has not reached); ``distinct=True`` says the
        caller has made sure of that already, and skips the check.
        """
        if not models:
            return []
        if self.checked or _tracer is not None:
            return self._fire_many_observed(models, event, arg)
        if len(models) == 1:
            # A batch of one (a store of one chunk, the common step): the row ``fire`` takes, no grouping.
            model = models[0]
            state = model.state
            for guard, dest, effect in self._table.get((state, event), ()):
                if guard is None or guard(model, arg):
                    model.state = dest
                    return [(state, dest, effect, models)]
            detail = "no guard held" if (state, event) in self._table else ""
            raise InvalidTransition(self.spec.name, str(state), str(event), detail)
        if not distinct and len(set(map(id, models))) != len(models):
            self._raise_duplicate(models, event)
        state = models[0].state
        for model in models:
            if model.state is not state:
                groups = self._plan_mixed(models, event, arg)
                break
        else:
            edges = self._table.get((state, event))
            if edges and edges[0][0] is None:
                # One unguarded row (absent -> writing, writing -> ready, ...): the whole batch takes it.
                _guard, dest, effect = edges[0]
                for model in models:
                    model.state = dest
                return [(state, dest, effect, models)]
            groups = self._plan_group(state, models, event, arg)
        for _source, dest, _effect, members in groups:
            for model in members:
                model.state = dest
        return groups

    def _plan_group(self, state: S, members: Sequence[M], event: E, arg: int) -> list[FiredGroup[S, F, M]]:
        """The rows taken by ``members``, all in ``state``; changes nothing."""
        edges = self._table.get((state, event), ())
        if not edges:
            raise InvalidTransition(self.spec.name, str(state), str(event))
        groups: list[FiredGroup[S, F, M]] = []
        remaining = members
        for guard, dest, effect in edges:
            if guard is None:
                groups.append((state, dest, effect, remaining))
                return groups
            held = list(map(guard, remaining, repeat(arg)))
            if all(held):
                groups.append((state, dest, effect, remaining))
                return groups
            if any(held):
                groups.append((state, dest, effect, list(compress(remaining, held))))
                remaining = [model for model, ok in zip(remaining, held, strict=True) if not ok]
        raise InvalidTransition(self.spec.name, str(state), str(event), "no guard held")

    def _plan_mixed(self, models: Sequence[M], event: E, arg: int) -> list[FiredGroup[S, F, M]]:
        """The rows taken by models in several states; changes nothing."""
        by_state: dict[S, list[M]] = {}
        for model in models:
            members = by_state.get(model.state)
            if members is None:
                by_state[model.state] = [model]
            else:
                members.append(model)
        groups: list[FiredGroup[S, F, M]] = []
        for source, members in by_state.items():
            groups.extend(self._plan_group(source, members, event, arg))
        return groups

    def _fire_many_observed(self, models: Sequence[M], event: E, arg: int) -> list[FiredGroup[S, F, M]]:
        """``fire_many`` with checked mode or tracers: each model checked as ``fire`` checks it, the
        whole batch validated before any model changes, tracers told in the order given."""
        if len(set(map(id, models))) != len(models):
            self._raise_duplicate(models, event)
        planned: list[tuple[M, S, S, F | None]] = []
        for model in models:
            state = model.state
            for guard, dest, effect in self._table.get((state, event), ()):
                if guard is None or guard(model, arg):
                    if self.checked:
                        self._check(model, event, arg, dest, effect)
                    planned.append((model, state, dest, effect))
                    break
            else:
                if self.checked:
                    self._check(model, event, arg, None, None)
                detail = "no guard held" if (state, event) in self._table else ""
                raise InvalidTransition(self.spec.name, str(state), str(event), detail)
        grouped: dict[tuple[S, S, F | None], list[M]] = {}
        for model, source, dest, effect in planned:
            grouped.setdefault((source, dest, effect), []).append(model)
        name = self.spec.name
        for model, source, dest, _effect in planned:
            model.state = dest
            tracer = _tracer
            if tracer is not None:
                tracer(name, model, str(event), str(source), str(dest))
        return [(source, dest, effect, members) for (source, dest, effect), members in grouped.items()]

    def _raise_duplicate(self, models: Sequence[Stateful[S]], event: E) -> NoReturn:
        seen: set[int] = set()
        for model in models:
            if id(model) in seen:
                raise InvalidTransition(
                    self.spec.name,
                    str(model.state),
                    str(event),
                    "the model is listed twice in one fire_many batch; expected distinct models",
                )
            seen.add(id(model))
        raise AssertionError("unreachable: no model is listed twice")

    def _check(self, model: Stateful[S], event: E, arg: int, dest: S | None, effect: F | None) -> None:
        def guard(name: str) -> bool:
            return self._guards[name](model, arg)

        ref = evaluate_transitions(self._machine, self._effects, str(model.state), str(event), guard)
        mine = None if dest is None else (str(dest), None if effect is None else str(effect))
        if ref != mine:
            raise SpecError(
                f"{self.spec.name}: compiled table gave {mine} but transitions gave {ref} "
                f"for event {event!r} in state {model.state!r}"
            )
