"""State machines built from spec/ with ``transitions``, and their compiled transition tables.

Each spec table becomes one shared ``transitions.Machine`` (``model=None``, ``auto_transitions=False``,
guards as ``conditions``, effects as ``after`` callbacks). At start-up that Machine object is compiled
into a plain ``dict[(state, event)] -> edges`` table, because a table lookup costs ~0.15 µs against
~7 µs for a transitions trigger and a per-job model would cost kilobytes. ``tests/test_compiled.py``
proves the table equal to the Machine over every (state, event, guard valuation).

In checked mode (``KVFSM_CHECKED=1`` or ``checked=True``) every fire also runs through transitions
itself and any disagreement raises :class:`~kvfsm.errors.SpecError`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Generic, Protocol, TypeVar

from transitions import Machine, MachineError

from kvfsm.errors import InvalidTransition, SpecError
from kvfsm.spec_loader import MachineSpec, load_machine

__all__ = [
    "CompiledEdge",
    "SpecMachine",
    "Stateful",
    "build_transitions_machine",
    "checked_mode_default",
    "compile_table",
    "evaluate_table",
    "evaluate_transitions",
    "set_tracer",
]

S = TypeVar("S", bound=StrEnum)
E = TypeVar("E", bound=StrEnum)


class Stateful(Protocol[S]):
    """Anything a spec machine drives: it has a mutable ``state``."""

    state: S


#: Called after every transition of every spec machine: (machine, model, event, source, dest).
TransitionTracer = Callable[[str, object, str, str, str], None]
_tracer: TransitionTracer | None = None


def set_tracer(tracer: TransitionTracer | None) -> TransitionTracer | None:
    """Install a process-wide transition tracer (None removes it); returns the previous one.

    Off by default: the hot path then pays one global None check per transition.
    """
    global _tracer
    previous, _tracer = _tracer, tracer
    return previous


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


_Edge = tuple[Callable[[Any, int], bool] | None, S, str | None]


class SpecMachine(Generic[S, E]):
    """One spec machine shared by all of its models; ``fire`` is the only way a model changes state.

    Models are plain slotted objects with a ``state`` attribute holding a member of ``state_enum``.
    Guards are functions ``(model, arg) -> bool`` registered by name; the names must be exactly the
    spec's. ``fire`` returns the transition's effect name (h2-style side effect) for the caller to run.
    """

    __slots__ = ("_effects", "_guards", "_machine", "_states", "_table", "checked", "events", "spec")

    def __init__(
        self,
        name: str,
        state_enum: type[S],
        event_enum: type[E],
        guards: Mapping[str, Callable[[Any, int], bool]],
        *,
        checked: bool | None = None,
    ) -> None:
        spec = load_machine(name)
        self.spec = spec
        code_states = {s.value for s in state_enum}
        if code_states != set(spec.states):
            raise SpecError(f"{name}: code states {sorted(code_states)} != spec states {sorted(spec.states)}")
        code_events = {e.value for e in event_enum}
        if code_events != set(spec.events):
            raise SpecError(f"{name}: code events {sorted(code_events)} != spec events {sorted(spec.events)}")
        if set(guards) != set(spec.guards):
            raise SpecError(f"{name}: code guards {sorted(guards)} != spec guards {sorted(spec.guards)}")
        self._machine = build_transitions_machine(spec)
        self._effects = frozenset(spec.effects)
        self._states = state_enum
        self.events = event_enum
        raw = compile_table(self._machine)
        # Resolve names to members and functions once, so the hot path is one dict lookup.
        self._table: dict[tuple[str, str], tuple[_Edge[S], ...]] = {
            key: tuple((guards[e.guard] if e.guard else None, state_enum(e.dest), e.effect) for e in edges)
            for key, edges in raw.items()
        }
        self._guards = dict(guards)
        self.checked = checked_mode_default() if checked is None else checked

    @property
    def machine(self) -> Machine:
        """The transitions Machine the table was compiled from (diagrams, checked mode)."""
        return self._machine

    def table(self) -> dict[tuple[str, str], tuple[CompiledEdge, ...]]:
        return compile_table(self._machine)

    def can_fire(self, model: Stateful[S], event: E, arg: int = 0) -> bool:
        for guard, _dest, _effect in self._table.get((model.state, event), ()):
            if guard is None or guard(model, arg):
                return True
        return False

    def fire(self, model: Stateful[S], event: E, arg: int = 0) -> str | None:
        """Apply ``event`` to ``model``; raise InvalidTransition (state unchanged) if it is not enabled."""
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

    def _check(self, model: Stateful[S], event: E, arg: int, dest: S | None, effect: str | None) -> None:
        def guard(name: str) -> bool:
            return self._guards[name](model, arg)

        ref = evaluate_transitions(self._machine, self._effects, str(model.state), str(event), guard)
        mine = None if dest is None else (str(dest), effect)
        if ref != mine:
            raise SpecError(
                f"{self.spec.name}: compiled table gave {mine} but transitions gave {ref} "
                f"for event {event!r} in state {model.state!r}"
            )
