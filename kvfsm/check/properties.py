"""The temporal properties and drain modes of ``spec/invariants.toml``, as the model checker reads them.

The per-state invariants are read by :func:`kvfsm.machines.loader.load_invariants`; the ``[[property]]``
tables (decided on paths of the explored graph) and the ``[[drain_mode]]`` tables (the non-blocking engine
and the #42611 blocking baseline) are read here, because only the checkers use them.
"""

from __future__ import annotations

import enum
import tomllib
from dataclasses import dataclass
from functools import cache

from kvfsm.errors import SpecError
from kvfsm.machines.loader import spec_dir
from kvfsm.machines.names import EngineEffect

__all__ = ["DrainMode", "DrainModeSpec", "PropertySpec", "load_drain_modes", "load_properties"]


class DrainMode(enum.StrEnum):
    """How a settle with pending push work behaves (spec/invariants.toml ``[[drain_mode]]``)."""

    NON_BLOCKING = "non_blocking"  #: #45595: go to draining and return (the engine table as written)
    BLOCKING = "blocking"  #: #42611: flush_all, a blocking wait for every in-flight job, inside the step


@dataclass(frozen=True, slots=True)
class PropertySpec:
    name: str
    title: str
    kind: str
    machines: tuple[str, ...]
    prose: str


@dataclass(frozen=True, slots=True)
class DrainModeSpec:
    mode: DrainMode
    default: bool
    settle_effect: EngineEffect | None  #: the effect the pending_push_work settle rows carry in this mode
    prose: str


def _raw() -> dict[str, object]:
    path = spec_dir() / "invariants.toml"
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SpecError(f"spec/invariants.toml: cannot read it: {exc}") from exc


def _rows(raw: dict[str, object], table: str) -> list[dict[str, object]]:
    rows = raw.get(table, [])
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise SpecError(f"spec/invariants.toml: [[{table}]] must be an array of tables")
    return rows


def _text(row: dict[str, object], key: str, where: str) -> str:
    value = row.get(key)
    if not isinstance(value, str):
        raise SpecError(f"{where}: {key} must be a string, got {value!r}")
    return value


@cache
def load_properties() -> tuple[PropertySpec, ...]:
    """The ``[[property]]`` tables: responsiveness and liveness."""
    out = []
    for i, row in enumerate(_rows(_raw(), "property")):
        where = f"spec/invariants.toml property #{i}"
        machines = row.get("machines")
        if not isinstance(machines, list) or not all(isinstance(m, str) for m in machines):
            raise SpecError(f"{where}: machines must be a list of machine names")
        out.append(
            PropertySpec(
                _text(row, "name", where),
                _text(row, "title", where),
                _text(row, "kind", where),
                tuple(machines),
                _text(row, "prose", where).strip(),
            )
        )
    return tuple(out)


@cache
def load_drain_modes() -> dict[DrainMode, DrainModeSpec]:
    """The ``[[drain_mode]]`` tables, one per :class:`DrainMode` member (SpecError on any difference)."""
    out: dict[DrainMode, DrainModeSpec] = {}
    for i, row in enumerate(_rows(_raw(), "drain_mode")):
        where = f"spec/invariants.toml drain_mode #{i}"
        name = _text(row, "name", where)
        try:
            mode = DrainMode(name)
        except ValueError:
            expected = [m.value for m in DrainMode]
            raise SpecError(f"{where}: unknown drain mode {name!r}; expected one of {expected}") from None
        effect_name = _text(row, "settle_effect", where)
        try:
            effect = EngineEffect(effect_name) if effect_name else None
        except ValueError:
            raise SpecError(f"{where}: settle_effect {effect_name!r} is not an engine effect") from None
        default = row.get("default")
        if not isinstance(default, bool):
            raise SpecError(f"{where}: default must be true or false")
        out[mode] = DrainModeSpec(mode, default, effect, _text(row, "prose", where).strip())
    if set(out) != set(DrainMode):
        raise SpecError(f"spec/invariants.toml: drain modes {sorted(out)} differ from {[m.value for m in DrainMode]}")
    return out
