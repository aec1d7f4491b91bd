"""Read spec/*.toml into typed records.

The tables are package data (``kvfsm.spec``) in an installed wheel and the top-level ``spec/`` folder
in a source checkout; both are the same files.
"""

from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvfsm.errors import SpecError

__all__ = [
    "MACHINE_NAMES",
    "BoundaryInvariantSpec",
    "InvariantSpec",
    "MachineSpec",
    "TransitionSpec",
    "load_boundary_invariants",
    "load_invariants",
    "load_machine",
    "spec_dir",
]

MACHINE_NAMES: tuple[str, ...] = ("job", "slot", "request", "engine")


@dataclass(frozen=True, slots=True)
class TransitionSpec:
    event: str
    source: str
    dest: str
    guard: str | None
    effect: str | None


@dataclass(frozen=True, slots=True)
class MachineSpec:
    name: str
    description: str
    initial: str
    states: tuple[str, ...]
    terminal: frozenset[str]
    guards: dict[str, str]
    effects: dict[str, str]
    transitions: tuple[TransitionSpec, ...]
    extra: dict[str, Any]

    @property
    def events(self) -> tuple[str, ...]:
        """Event names in first-appearance order."""
        return tuple(dict.fromkeys(t.event for t in self.transitions))


@dataclass(frozen=True, slots=True)
class InvariantSpec:
    name: str
    title: str
    prose: str
    machines: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class BoundaryInvariantSpec:
    """A rule of the seam between kvfsm and its engine (spec/invariants.toml, ``[[boundary_invariant]]``)."""

    name: str
    title: str
    prose: str
    #: Which seam: ``scheduler/worker`` (kvfsm's jobs against the engine's block table).
    boundary: str


def spec_dir() -> Path:
    """The folder holding the spec tables."""
    try:
        packaged = resources.files("kvfsm.spec")
        candidate = Path(str(packaged))
        if (candidate / "job.toml").is_file():
            return candidate
    except ModuleNotFoundError:  # pragma: no cover - only without an install
        pass
    checkout = Path(__file__).resolve().parents[2] / "spec"
    if (checkout / "job.toml").is_file():
        return checkout
    raise SpecError("cannot find the spec tables: expected kvfsm.spec package data or ./spec/job.toml")


def _read(name: str) -> dict[str, Any]:
    path = spec_dir() / f"{name}.toml"
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise SpecError(f"spec table {path} is missing") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(f"spec table {path} is not valid TOML: {exc}") from exc


def _require(row: dict[str, Any], keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise SpecError(f"{where}: missing required key(s) {missing}")


def _as_list(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise SpecError(f"{where}: expected a state name or a list of state names, got {value!r}")


@functools.cache
def load_machine(name: str) -> MachineSpec:
    """Load and validate one machine table."""
    if name not in MACHINE_NAMES:
        raise SpecError(f"unknown machine {name!r}; expected one of {MACHINE_NAMES}")
    raw = _read(name)
    _require(raw, ("name", "description", "initial", "states"), f"spec/{name}.toml")
    if raw["name"] != name:
        raise SpecError(f"spec/{name}.toml: name is {raw['name']!r}, expected {name!r}")
    states = tuple(_as_list(raw["states"], f"spec/{name}.toml states"))
    if len(set(states)) != len(states):
        raise SpecError(f"spec/{name}.toml: duplicate state in {states}")
    guards = dict(raw.get("guards", {}))
    effects = dict(raw.get("effects", {}))
    transitions: list[TransitionSpec] = []
    for i, row in enumerate(raw.get("transitions", [])):
        where = f"spec/{name}.toml transition #{i}"
        _require(row, ("event", "source", "dest"), where)
        for source in _as_list(row["source"], where):
            t = TransitionSpec(row["event"], source, row["dest"], row.get("guard"), row.get("effect"))
            for state in (t.source, t.dest):
                if state not in states:
                    raise SpecError(f"{where}: state {state!r} is not in states {states}")
            if t.guard is not None and t.guard not in guards:
                raise SpecError(f"{where}: guard {t.guard!r} is not declared in [guards]")
            if t.effect is not None and t.effect not in effects:
                raise SpecError(f"{where}: effect {t.effect!r} is not declared in [effects]")
            transitions.append(t)
    initial = raw["initial"]
    if initial not in states:
        raise SpecError(f"spec/{name}.toml: initial state {initial!r} is not in states")
    terminal = frozenset(_as_list(raw.get("terminal", []), f"spec/{name}.toml terminal"))
    if not terminal <= set(states):
        extra_terminal = sorted(terminal - set(states))
        raise SpecError(f"spec/{name}.toml: terminal states {extra_terminal} are not in states")
    for t in transitions:
        if t.source in terminal:
            raise SpecError(f"spec/{name}.toml: terminal state {t.source!r} has an outgoing {t.event!r} transition")
    known = {"name", "description", "initial", "states", "terminal", "guards", "effects", "transitions"}
    return MachineSpec(
        name=raw["name"],
        description=raw["description"],
        initial=initial,
        states=states,
        terminal=terminal,
        guards=guards,
        effects=effects,
        transitions=tuple(transitions),
        extra={k: v for k, v in raw.items() if k not in known},
    )


@functools.cache
def load_invariants() -> tuple[InvariantSpec, ...]:
    raw = _read("invariants")
    out = []
    for i, row in enumerate(raw.get("invariant", [])):
        _require(row, ("name", "title", "prose", "machines"), f"spec/invariants.toml invariant #{i}")
        machines = tuple(row["machines"])
        for m in machines:
            if m not in MACHINE_NAMES:
                raise SpecError(f"invariant {row['name']!r} names unknown machine {m!r}")
        out.append(InvariantSpec(row["name"], row["title"], row["prose"].strip(), machines))
    return tuple(out)


@functools.cache
def load_boundary_invariants() -> tuple[BoundaryInvariantSpec, ...]:
    raw = _read("invariants")
    out = []
    for i, row in enumerate(raw.get("boundary_invariant", [])):
        _require(row, ("name", "title", "prose", "boundary"), f"spec/invariants.toml boundary_invariant #{i}")
        out.append(BoundaryInvariantSpec(row["name"], row["title"], row["prose"].strip(), row["boundary"]))
    return tuple(out)
