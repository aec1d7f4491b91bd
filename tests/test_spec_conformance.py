"""Code and spec agree, checked in both directions.

Rule 1 of spec/README.md: every state, event, guard and effect lives in spec/*.toml. These tests check
that the state, event and effect enums, the registered guards, the invariant table and the README
diagrams all match the tables, and that the loader and SpecMachine refuse to start when they do not.
(Effects are enum members, so mypy --strict catches a misspelled one in code.)
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterator
from enum import StrEnum
from pathlib import Path
from typing import Any

import pytest

import kvfsm
import kvfsm.machines.loader
import kvfsm.observe.diagrams
from kvfsm.errors import SpecError
from kvfsm.machines import engine_machine, job_machine, request_machine, slot_machine
from kvfsm.machines.compiled import SpecMachine, build_transitions_machine
from kvfsm.machines.loader import (
    MACHINE_NAMES,
    MachineSpec,
    TransitionSpec,
    load_invariants,
    load_machine,
)
from kvfsm.machines.names import (
    EngineEffect,
    EngineEvent,
    EngineState,
    JobEffect,
    JobEvent,
    JobKind,
    JobState,
    RequestEffect,
    RequestEvent,
    RequestState,
    SlotEffect,
    SlotEvent,
    SlotState,
)
from kvfsm.observe.diagrams import all_diagrams, main, mermaid, mermaid_for, readme_path, render_readme

ENUMS: dict[str, tuple[type[StrEnum], type[StrEnum], type[StrEnum]]] = {
    "job": (JobState, JobEvent, JobEffect),
    "slot": (SlotState, SlotEvent, SlotEffect),
    "request": (RequestState, RequestEvent, RequestEffect),
    "engine": (EngineState, EngineEvent, EngineEffect),
}

FACTORIES: dict[str, Callable[[], SpecMachine[Any, Any, Any]]] = {
    "job": job_machine,
    "slot": slot_machine,
    "request": request_machine,
    "engine": engine_machine,
}

PACKAGE_DIR = Path(kvfsm.__file__).resolve().parent
README = readme_path()


def _spec_guards(name: str) -> dict[str, Callable[[Any, int], bool]]:
    """The guard functions the real machine registered."""
    return dict(FACTORIES[name]().guards)


# --------------------------------------------------------------------------------------------------
# States, events, kinds


def test_every_machine_has_enums_and_a_factory() -> None:
    assert set(ENUMS) == set(MACHINE_NAMES) == set(FACTORIES)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_state_enum_equals_spec_states(name: str) -> None:
    spec = load_machine(name)
    state_enum, _, _ = ENUMS[name]
    code = {s.value for s in state_enum}
    assert code == set(spec.states), f"in code only: {code - set(spec.states)}; in spec only: " + str(
        set(spec.states) - code
    )
    assert len(spec.states) == len(state_enum)
    assert state_enum(spec.initial).value == spec.initial
    assert spec.terminal <= code


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_event_enum_equals_spec_events(name: str) -> None:
    spec = load_machine(name)
    _, event_enum, _ = ENUMS[name]
    code = {e.value for e in event_enum}
    assert code == set(spec.events), f"in code only: {code - set(spec.events)}; in spec only: " + str(
        set(spec.events) - code
    )


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_effect_enum_equals_spec_effects(name: str) -> None:
    spec = load_machine(name)
    _, _, effect_enum = ENUMS[name]
    code = {e.value for e in effect_enum}
    assert code == set(spec.effects), f"in code only: {code - set(spec.effects)}; in spec only: " + str(
        set(spec.effects) - code
    )


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_enum_member_names_follow_values(name: str) -> None:
    for enum in ENUMS[name]:
        for member in enum:
            assert member.name == member.value.upper(), member


def test_job_kind_equals_spec_kinds() -> None:
    assert {k.value for k in JobKind} == set(load_machine("job").extra["kinds"])


def test_job_terminal_constant_equals_spec() -> None:
    from kvfsm.machines.names import JOB_TERMINAL

    assert {s.value for s in JOB_TERMINAL} == load_machine("job").terminal


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_machine_instances_carry_their_spec(name: str) -> None:
    machine = FACTORIES[name]()
    assert machine.spec == load_machine(name)
    assert machine.events is ENUMS[name][1]
    assert machine.effects is ENUMS[name][2]


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_effect_in_the_table_is_an_enum_member(name: str) -> None:
    machine = FACTORIES[name]()
    effects = {edge.effect for edges in machine.table().values() for edge in edges if edge.effect}
    assert effects == {e.value for e in ENUMS[name][2]}


def test_engine_machine_is_always_checked() -> None:
    assert engine_machine().checked


# --------------------------------------------------------------------------------------------------
# Guards


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_registered_guards_equal_spec_guards(name: str) -> None:
    registered = _spec_guards(name)
    assert set(registered) == set(load_machine(name).guards)
    assert all(callable(fn) for fn in registered.values())


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_declared_guard_and_effect_is_used_by_a_transition(name: str) -> None:
    spec = load_machine(name)
    assert {t.guard for t in spec.transitions if t.guard} == set(spec.guards)
    assert {t.effect for t in spec.transitions if t.effect} == set(spec.effects)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_guard_and_effect_names_are_disjoint_identifiers(name: str) -> None:
    spec = load_machine(name)
    assert not set(spec.guards) & set(spec.effects)
    for word in (*spec.states, *spec.events, *spec.guards, *spec.effects):
        assert word.isidentifier() and word == word.lower(), word


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_declared_guards_and_effects_have_prose(name: str) -> None:
    spec = load_machine(name)
    for text in (*spec.guards.values(), *spec.effects.values(), spec.description):
        assert text.strip()


# --------------------------------------------------------------------------------------------------
# Effects


def test_only_shutdown_may_block_the_engine() -> None:
    # The non-blocking drain (#45595): flush_all appears on shutdown rows and nowhere else.
    spec = load_machine("engine")
    blocking = {(t.source, t.event) for t in spec.transitions if t.effect == EngineEffect.FLUSH_ALL}
    assert blocking
    assert {event for _, event in blocking} == {"shutdown"}
    into_idle = [t for t in spec.transitions if t.dest == "idle"]
    assert into_idle and all(t.effect is None and t.guard == "no_pending_push_work" for t in into_idle)


# --------------------------------------------------------------------------------------------------
# Invariants


def test_invariants_have_name_title_prose_and_machines() -> None:
    invariants = load_invariants()
    assert invariants
    names = [inv.name for inv in invariants]
    assert len(names) == len(set(names)), "invariant names must be unique"
    for inv in invariants:
        assert inv.name.isidentifier() and inv.name == inv.name.lower(), inv.name
        assert inv.title.strip(), inv.name
        assert inv.prose.strip(), inv.name
        assert inv.machines and set(inv.machines) <= set(MACHINE_NAMES), inv.name


def test_every_invariant_is_explained_in_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    for inv in load_invariants():
        assert f"**{inv.name}**" in text, f"spec/README.md does not explain invariant {inv.name}"


# --------------------------------------------------------------------------------------------------
# Diagrams


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_readme_has_one_marker_pair_per_machine(name: str) -> None:
    text = README.read_text(encoding="utf-8")
    assert text.count(f"<!-- diagram:{name}:start -->") == 1
    assert text.count(f"<!-- diagram:{name}:end -->") == 1


def test_readme_diagrams_are_up_to_date() -> None:
    text = README.read_text(encoding="utf-8")
    assert render_readme(text) == text, "spec/README.md is stale: run python -m kvfsm.observe.diagrams --write"
    for name, diagram in all_diagrams().items():
        assert f"<!-- diagram:{name}:start -->\n```mermaid\n{diagram}```\n<!-- diagram:{name}:end -->" in text


def test_diagrams_check_passes_on_the_repository() -> None:
    assert main(["--check"]) == 0


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_diagram_draws_every_spec_row(name: str) -> None:
    spec = load_machine(name)
    diagram = mermaid(name)
    assert diagram == mermaid(name), "output must be deterministic"
    assert diagram.startswith(f"---\ntitle: {name}\n---\nstateDiagram-v2\n")
    assert f"    [*] --> {spec.initial}\n" in diagram
    edges = [line for line in diagram.splitlines() if re.match(r"    \w+ --> \w+: ", line)]
    assert len(edges) == len(spec.transitions)
    for t in spec.transitions:
        label = t.event + (f" [{t.guard}]" if t.guard else "") + (f" / {t.effect}" if t.effect else "")
        assert f"    {t.source} --> {t.dest}: {label}" in edges
    ends = {line.split()[0] for line in diagram.splitlines() if line.endswith("--> [*]")}
    assert ends == set(spec.terminal)


def _modified_job_spec() -> MachineSpec:
    spec = load_machine("job")
    extra = TransitionSpec("cancel", "in_flight", "cancelled", None, "release")
    return dataclasses.replace(spec, transitions=(*spec.transitions, extra))


def test_a_changed_table_changes_the_diagram_and_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    modified = _modified_job_spec()
    assert mermaid_for(modified) != mermaid("job")
    assert "    in_flight --> cancelled: cancel / release\n" in mermaid_for(modified)

    real_load = load_machine

    def load(name: str) -> MachineSpec:
        return modified if name == "job" else real_load(name)

    monkeypatch.setattr(kvfsm.observe.diagrams, "load_machine", load)
    text = README.read_text(encoding="utf-8")
    assert render_readme(text) != text
    assert main(["--check"]) == 1

    copy = tmp_path / "README.md"
    copy.write_text(text, encoding="utf-8")
    assert main(["--write", "--readme", str(copy)]) == 0
    assert "in_flight --> cancelled: cancel / release" in copy.read_text(encoding="utf-8")
    assert main(["--check", "--readme", str(copy)]) == 0
    assert README.read_text(encoding="utf-8") == text, "the real README must not be touched"


def test_render_readme_rejects_unknown_machine_markers() -> None:
    with pytest.raises(SpecError, match="unknown machine"):
        render_readme("<!-- diagram:nope:start -->\n<!-- diagram:nope:end -->\n")


def test_render_readme_leaves_text_outside_markers_alone() -> None:
    text = "before\n<!-- diagram:slot:start -->\nstale\n<!-- diagram:slot:end -->\nafter\n"
    out = render_readme(text)
    assert out.startswith("before\n<!-- diagram:slot:start -->\n```mermaid\n---\ntitle: slot\n")
    assert out.endswith("```\n<!-- diagram:slot:end -->\nafter\n")
    assert "stale" not in out
    assert render_readme(out) == out


def test_diagrams_main_prints_every_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 0
    printed = capsys.readouterr().out
    for name in MACHINE_NAMES:
        assert f"title: {name}\n" in printed


def test_diagram_labels_reject_mermaid_separators() -> None:
    spec = load_machine("slot")
    bad = dataclasses.replace(
        spec,
        effects={**spec.effects, "a;b": "bad"},
        transitions=(*spec.transitions, TransitionSpec("evict", "absent", "absent", None, "a;b")),
    )
    with pytest.raises(SpecError, match="must not contain"):
        mermaid_for(bad)


# --------------------------------------------------------------------------------------------------
# SpecMachine refuses code that drifted from the spec


class JobStateMissing(StrEnum):
    SUBMITTED = "submitted"
    IN_FLIGHT = "in_flight"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"


class JobStateExtra(StrEnum):
    SUBMITTED = "submitted"
    IN_FLIGHT = "in_flight"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    STALE = "stale"
    PAUSED = "paused"


class JobEventMissing(StrEnum):
    LAUNCH = "launch"
    ACK = "ack"
    FAIL = "fail"
    CANCEL = "cancel"


class JobEventRenamed(StrEnum):
    LAUNCH = "launch"
    ACK = "acknowledge"
    FAIL = "fail"
    CANCEL = "cancel"
    DISCARD = "discard"


def test_spec_machine_accepts_the_real_enums_and_guards() -> None:
    machine = SpecMachine("job", JobState, JobEvent, JobEffect, _spec_guards("job"), checked=False)
    assert machine.spec == load_machine("job")


@pytest.mark.parametrize(
    ("states", "events", "what"),
    [
        (JobStateMissing, JobEvent, "states"),
        (JobStateExtra, JobEvent, "states"),
        (JobState, JobEventMissing, "events"),
        (JobState, JobEventRenamed, "events"),
    ],
)
def test_spec_machine_rejects_drifted_enums(states: type[StrEnum], events: type[StrEnum], what: str) -> None:
    with pytest.raises(SpecError, match=f"code {what}"):
        SpecMachine("job", states, events, JobEffect, _spec_guards("job"))


class JobEffectMissing(StrEnum):
    START_COPY = "start_copy"
    COMMIT = "commit"


class JobEffectExtra(StrEnum):
    START_COPY = "start_copy"
    COMMIT = "commit"
    RELEASE = "release"
    EVICT_ALL = "evict_all"


class JobEffectRenamed(StrEnum):
    START_COPY = "start_copy"
    COMMIT = "comit"
    RELEASE = "release"


@pytest.mark.parametrize("effects", [JobEffectMissing, JobEffectExtra, JobEffectRenamed, SlotEffect])
def test_spec_machine_rejects_drifted_effects(effects: type[StrEnum]) -> None:
    with pytest.raises(SpecError, match="code effects"):
        SpecMachine("job", JobState, JobEvent, effects, _spec_guards("job"))


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_fire_returns_effect_members(name: str) -> None:
    spec = load_machine(name)
    machine = FACTORIES[name]()
    rows = [t for t in spec.transitions if t.effect and t.guard is None]
    for t in rows:

        @dataclasses.dataclass
        class Model:
            state: StrEnum

        model = Model(ENUMS[name][0](t.source))
        effect = machine.fire(model, ENUMS[name][1](t.event))
        assert type(effect) is ENUMS[name][2] and effect == t.effect


def _always(_model: Any, _arg: int) -> bool:
    return True


@pytest.mark.parametrize(
    "change",
    ["missing", "extra", "renamed"],
)
def test_spec_machine_rejects_drifted_guards(change: str) -> None:
    guards = _spec_guards("job")
    if change == "missing":
        del guards["ack_is_last"]
    elif change == "extra":
        guards["worker_alive"] = _always
    else:
        guards["ack_is_final"] = guards.pop("ack_is_last")
    with pytest.raises(SpecError, match="code guards"):
        SpecMachine("job", JobState, JobEvent, JobEffect, guards)


def test_spec_machine_rejects_an_unknown_machine() -> None:
    with pytest.raises(SpecError, match="unknown machine"):
        SpecMachine("tier", JobState, JobEvent, JobEffect, {})


def test_transitions_machine_rejects_overlapping_guard_and_effect_names() -> None:
    spec = load_machine("job")
    bad = dataclasses.replace(spec, effects={**spec.effects, "ack_is_last": "also a guard"})
    with pytest.raises(SpecError, match="guard and effect names must differ"):
        build_transitions_machine(bad)


# --------------------------------------------------------------------------------------------------
# spec_loader refuses malformed tables

GOOD_TABLE = """
name = "slot"
description = "a tiny machine"
initial = "absent"
states = ["absent", "writing"]
terminal = []

[guards]
ok = "always"

[effects]
emit = "emit something"

[[transitions]]
event = "begin_write"
source = "absent"
dest = "writing"
guard = "ok"
effect = "emit"
"""


@pytest.fixture
def spec_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A temporary spec folder the loader reads instead of spec/; the caches are cleared around it."""
    kvfsm.machines.loader.load_machine.cache_clear()
    kvfsm.machines.loader.load_invariants.cache_clear()
    monkeypatch.setattr(kvfsm.machines.loader, "spec_dir", lambda: tmp_path)
    yield tmp_path
    monkeypatch.undo()
    kvfsm.machines.loader.load_machine.cache_clear()
    kvfsm.machines.loader.load_invariants.cache_clear()


def test_loader_reads_a_well_formed_temp_table(spec_folder: Path) -> None:
    (spec_folder / "slot.toml").write_text(GOOD_TABLE, encoding="utf-8")
    spec = load_machine("slot")
    assert spec.states == ("absent", "writing")
    assert spec.transitions == (TransitionSpec("begin_write", "absent", "writing", "ok", "emit"),)


MALFORMED: list[tuple[str, str, str]] = [
    ("undeclared dest", 'dest = "writing"', 'dest = "nowhere"'),
    ("undeclared source", 'source = "absent"', 'source = ["absent", "limbo"]'),
    ("undeclared guard", 'guard = "ok"', 'guard = "maybe"'),
    ("undeclared effect", 'effect = "emit"', 'effect = "shout"'),
    ("bad initial", 'initial = "absent"', 'initial = "start"'),
    ("source not a name", 'source = "absent"', "source = 3"),
    ("missing dest", 'dest = "writing"\n', ""),
    ("missing states", 'states = ["absent", "writing"]\n', ""),
    ("duplicate state", 'states = ["absent", "writing"]', 'states = ["absent", "writing", "absent"]'),
    ("terminal not a state", "terminal = []", 'terminal = ["gone"]'),
    ("terminal with exit", "terminal = []", 'terminal = ["absent"]'),
    ("wrong name", 'name = "slot"', 'name = "slots"'),
    ("not toml", 'name = "slot"', "name = slot"),
]


@pytest.mark.parametrize(("case", "old", "new"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_loader_rejects_malformed_tables(spec_folder: Path, case: str, old: str, new: str) -> None:
    assert old in GOOD_TABLE, case
    (spec_folder / "slot.toml").write_text(GOOD_TABLE.replace(old, new, 1), encoding="utf-8")
    with pytest.raises(SpecError):
        load_machine("slot")


def test_loader_rejects_a_missing_table(spec_folder: Path) -> None:
    with pytest.raises(SpecError, match="missing"):
        load_machine("job")


def test_loader_rejects_an_unknown_machine_name(spec_folder: Path) -> None:
    (spec_folder / "tier.toml").write_text(GOOD_TABLE.replace('"slot"', '"tier"'), encoding="utf-8")
    with pytest.raises(SpecError, match="unknown machine"):
        load_machine("tier")


def test_loader_rejects_invariant_of_unknown_machine(spec_folder: Path) -> None:
    (spec_folder / "invariants.toml").write_text(
        '[[invariant]]\nname = "x"\ntitle = "t"\nprose = "p"\nmachines = ["tier"]\n', encoding="utf-8"
    )
    with pytest.raises(SpecError, match="unknown machine"):
        load_invariants()


def test_loader_rejects_invariant_without_prose(spec_folder: Path) -> None:
    (spec_folder / "invariants.toml").write_text(
        '[[invariant]]\nname = "x"\ntitle = "t"\nmachines = ["job"]\n', encoding="utf-8"
    )
    with pytest.raises(SpecError, match="prose"):
        load_invariants()
