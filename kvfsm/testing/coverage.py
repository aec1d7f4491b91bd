"""Tie a Hypothesis state machine to the spec: every spec event must be driven by some rule.

A rule says which spec events it drives with :func:`covers` (``"machine.event"`` names, e.g.
``"job.ack"``); the class decorator :func:`spec_covered` then reads the events of the named machines from
``spec/*.toml`` (through :mod:`kvfsm.machines.loader`) when the class is created, and raises
:class:`SpecCoverageError` if one of them is neither covered by a rule nor exempted with a written reason.
Adding an event to the spec without a rule therefore fails at import time, before any example runs::

    @spec_covered("job", "engine", exempt={"job.cancel": "no caller in the implementation"})
    class MyMachine(RuleBasedStateMachine):
        @covers("job.ack")
        @precondition(lambda self: self.has_copies())
        @rule(data=st.data())
        def complete_copy(self, data: st.DataObject) -> None: ...

:class:`TransitionLog` records every transition the implementation fires (through
:func:`kvfsm.machines.compiled.add_tracer`), so a test can also check which events a run actually reached.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvfsm.machines.compiled import TracerHandle, add_tracer, remove_tracer
from kvfsm.machines.loader import MACHINE_NAMES, load_machine

__all__ = [
    "SpecCoverage",
    "SpecCoverageError",
    "TransitionLog",
    "covers",
    "rule_events",
    "spec_coverage",
    "spec_covered",
    "spec_events",
]

F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

_ATTR = "_kvfsm_spec_events"
# hypothesis.stateful marks rule functions with this attribute (RULE_MARKER); read by name so that this
# module does not depend on a private constant.
_RULE_MARKER = "hypothesis_stateful_rule"


class SpecCoverageError(AssertionError):
    """A state machine does not drive every spec event, or claims an event the spec does not have."""


def spec_events(*machines: str) -> tuple[str, ...]:
    """Every event of the named spec machines, as ``"machine.event"``, in spec order."""
    out: list[str] = []
    for name in machines:
        if name not in MACHINE_NAMES:
            raise SpecCoverageError(f"unknown spec machine {name!r}; expected one of {MACHINE_NAMES}")
        out.extend(f"{name}.{event}" for event in load_machine(name).events)
    return tuple(out)


def covers(*events: str) -> Callable[[F], F]:
    """Mark a rule as a driver of spec ``events`` (``"machine.event"``). Put it above ``@rule``."""
    for event in events:
        machine, sep, name = event.partition(".")
        if not sep or not name or machine not in MACHINE_NAMES:
            raise SpecCoverageError(f"covers({event!r}): expected 'machine.event' with machine in {MACHINE_NAMES}")

    def mark(f: F) -> F:
        setattr(f, _ATTR, (*getattr(f, _ATTR, ()), *events))
        return f

    return mark


def rule_events(cls: type) -> dict[str, tuple[str, ...]]:
    """Rule name -> the spec events it covers, over the whole class hierarchy (subclasses win)."""
    out: dict[str, tuple[str, ...]] = {}
    for klass in reversed(cls.__mro__):
        for name, attr in vars(klass).items():
            events = getattr(attr, _ATTR, None)
            if events is None:
                continue
            if getattr(attr, _RULE_MARKER, None) is None:
                raise SpecCoverageError(
                    f"{cls.__name__}.{name} is marked @covers{tuple(events)} but is not a @rule; "
                    "only rules can drive spec events"
                )
            out[name] = tuple(events)
    return out


@dataclass(frozen=True, slots=True)
class SpecCoverage:
    """Which rules drive each spec event of a machine class, and what is exempt (with the reason)."""

    events: tuple[str, ...]
    covered: dict[str, tuple[str, ...]]
    exempt: dict[str, str] = field(default_factory=dict)

    @property
    def missing(self) -> tuple[str, ...]:
        return tuple(e for e in self.events if e not in self.covered and e not in self.exempt)


def spec_coverage(cls: type, machines: Iterable[str], exempt: Mapping[str, str] | None = None) -> SpecCoverage:
    """The coverage of ``machines``' events by ``cls``'s rules; raises SpecCoverageError on any gap."""
    events = spec_events(*machines)
    known = set(events)
    exempt = dict(exempt or {})
    covered: dict[str, list[str]] = {}
    unknown: list[str] = []
    for rule_name, claimed in rule_events(cls).items():
        for event in claimed:
            if event.partition(".")[0] not in machines:
                continue  # a machine this class does not promise to cover
            if event not in known:
                unknown.append(f"{rule_name} covers {event!r}")
            covered.setdefault(event, []).append(rule_name)
    problems: list[str] = []
    if unknown:
        problems.append(f"rules claim events the spec does not have: {', '.join(unknown)}")
    for event, reason in exempt.items():
        if event not in known:
            problems.append(f"exemption for {event!r}, which is not a spec event")
        elif event in covered:
            problems.append(f"{event!r} is exempt ({reason}) but covered by {covered[event]}: drop the exemption")
        elif not reason.strip():
            problems.append(f"exemption for {event!r} gives no reason")
    cov = SpecCoverage(events, {e: tuple(r) for e, r in covered.items()}, exempt)
    if cov.missing:
        problems.append(
            f"spec events with no rule: {', '.join(cov.missing)}; add a rule marked @covers(...) that drives "
            "each of them (or an exemption with a reason)"
        )
    if problems:
        raise SpecCoverageError(f"{cls.__name__}: " + "; ".join(problems))
    return cov


def spec_covered(*machines: str, exempt: Mapping[str, str] | None = None) -> Callable[[C], C]:
    """Class decorator: check :func:`spec_coverage` when the class is created; stores it as
    ``cls.spec_coverage``."""

    def check(cls: C) -> C:
        cls.spec_coverage = spec_coverage(cls, machines, exempt)  # type: ignore[attr-defined]
        return cls

    return check


class TransitionLog:
    """Record every spec transition while installed (chains any tracer that was installed before).

    ``counts[(machine, event)]`` counts fired events; ``edges`` holds ``(machine, event, source, dest)``.
    ``on_transition`` callbacks see each transition with its model.
    """

    __slots__ = ("_handle", "counts", "edges", "on_transition")

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, str]] = Counter()
        self.edges: set[tuple[str, str, str, str]] = set()
        self.on_transition: list[Callable[[str, object, str, str, str], None]] = []
        self._handle: TracerHandle | None = None  # set while installed

    def __call__(self, machine: str, model: object, event: str, source: str, dest: str) -> None:
        self.counts[(machine, event)] += 1
        self.edges.add((machine, event, source, dest))
        for callback in self.on_transition:
            callback(machine, model, event, source, dest)

    def install(self) -> TransitionLog:
        if self._handle is None:
            self._handle = add_tracer(self)
        return self

    def uninstall(self) -> None:
        if self._handle is not None:
            remove_tracer(self._handle)
            self._handle = None

    def __enter__(self) -> TransitionLog:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def fired(self) -> set[str]:
        """Events fired at least once, as ``"machine.event"``."""
        return {f"{m}.{e}" for (m, e), n in self.counts.items() if n}
