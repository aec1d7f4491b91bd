"""The compiled tables equal the transitions Machines they are compiled from.

``kvfsm.machines.compiled`` runs every transition through a ``dict[(state, event)] -> edges`` table compiled from a
model-less ``transitions.Machine`` (spec/README.md, "The compiled table and checked mode"). This file is
the proof that the shortcut is sound:

- exhaustively, for every machine, state, event and truth assignment of the guards, the table and
  transitions give the same answer;
- checked mode really runs through transitions, agrees with the compiled path on random event
  sequences, and catches a tampered table;
- an event the table does not enable raises InvalidTransition and changes nothing (h2's totality test:
  every (state, event) pair either transitions or raises).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvfsm.machines.compiled
from kvfsm.control.job import Job
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.errors import AckCountError, InvalidTransition, SpecError
from kvfsm.machines import engine_machine, job_machine, request_machine, slot_machine
from kvfsm.machines.compiled import (
    CompiledEdge,
    SpecMachine,
    build_transitions_machine,
    checked_mode_default,
    compile_table,
    evaluate_table,
    evaluate_transitions,
)
from kvfsm.machines.loader import MACHINE_NAMES, load_machine
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

ENUMS: dict[str, tuple[type[StrEnum], type[StrEnum], type[StrEnum]]] = {
    "job": (JobState, JobEvent, JobEffect),
    "slot": (SlotState, SlotEvent, SlotEffect),
    "request": (RequestState, RequestEvent, RequestEffect),
    "engine": (EngineState, EngineEvent, EngineEffect),
}


def _valuations(guards: list[str]) -> Iterator[dict[str, bool]]:
    for values in itertools.product((False, True), repeat=len(guards)):
        yield dict(zip(guards, values, strict=True))


# --------------------------------------------------------------------------------------------------
# The exhaustive equivalence proof


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_table_equals_transitions_for_every_state_event_and_guard_valuation(name: str) -> None:
    spec = load_machine(name)
    machine = build_transitions_machine(spec)
    table = compile_table(machine)
    effects = frozenset(spec.effects)
    guards = sorted(spec.guards)
    events = list(machine.events)
    assert set(events) == set(spec.events), "every event of the machine, enabled or not"
    cases = enabled = 0
    for state in machine.states:
        for event in events:
            for valuation in _valuations(guards):
                asked: list[str] = []

                def guard(g: str, valuation: dict[str, bool] = valuation, asked: list[str] = asked) -> bool:
                    asked.append(g)
                    return valuation[g]

                mine = evaluate_table(table, state, event, guard)
                ref = evaluate_transitions(machine, effects, state, event, guard)
                assert mine == ref, f"{name}: {state} {event} {valuation}: table {mine} != transitions {ref}"
                assert set(asked) <= set(guards)
                cases += 1
                enabled += mine is not None
    assert cases == len(spec.states) * len(spec.events) * 2 ** len(spec.guards)
    assert 0 < enabled < cases


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_table_keys_are_exactly_the_spec_rows(name: str) -> None:
    spec = load_machine(name)
    table = compile_table(build_transitions_machine(spec))
    assert set(table) == {(t.source, t.event) for t in spec.transitions}
    for key, edges in table.items():
        rows = [t for t in spec.transitions if (t.source, t.event) == key]
        assert edges == tuple(CompiledEdge(t.guard, t.dest, t.effect) for t in rows), key


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_guarded_groups_have_only_guarded_edges_after_the_first(name: str) -> None:
    # An unguarded edge shadows every edge after it: the spec must never rely on that.
    table = compile_table(build_transitions_machine(load_machine(name)))
    for key, edges in table.items():
        if len(edges) > 1:
            assert all(e.guard is not None for e in edges), key


def test_spec_machine_table_is_the_compiled_table() -> None:
    for name, factory in (
        ("job", job_machine),
        ("slot", slot_machine),
        ("request", request_machine),
        ("engine", engine_machine),
    ):
        sm: SpecMachine[Any, Any, Any] = factory()
        assert sm.table() == compile_table(build_transitions_machine(load_machine(name)))
        assert set(sm.guards) == set(load_machine(name).guards)


# --------------------------------------------------------------------------------------------------
# Models for driving SpecMachines


@dataclass(slots=True)
class JobModel:
    state: JobState = JobState.SUBMITTED
    world_size: int = 2
    launched_mask: int = 0
    reported_mask: int = 0
    failed_reports: int = 0


@dataclass(slots=True)
class SlotModel:
    state: SlotState = SlotState.ABSENT
    readers: int = 0


def _apply_job(job: JobModel, event: JobEvent, arg: int) -> None:
    """The bookkeeping Job does around a successful fire."""
    if event is JobEvent.LAUNCH:
        job.launched_mask |= 1 << arg
    elif event is JobEvent.ACK:
        job.reported_mask |= 1 << arg
    elif event is JobEvent.FAIL and job.launched_mask:  # a report (not a refusal before any launch)
        job.reported_mask |= 1 << arg
        job.failed_reports += 1


def _apply_slot(slot: SlotModel, event: SlotEvent) -> None:
    """The reader count a tier keeps around a successful fire."""
    if event is SlotEvent.BEGIN_READ:
        slot.readers += 1
    elif event is SlotEvent.END_READ:
        slot.readers -= 1
    elif event in (SlotEvent.EVICT, SlotEvent.RESET, SlotEvent.ABORT_WRITE):
        slot.readers = 0


def _fire(sm: SpecMachine[Any, Any, Any], model: Any, event: StrEnum, arg: int) -> tuple[str, str | None]:
    """Fire and report (outcome, effect); outcome is 'ok' or 'invalid'."""
    before = model.state
    try:
        effect = sm.fire(model, event, arg)
    except InvalidTransition as exc:
        assert model.state is before
        assert exc.state == str(before) and exc.event == str(event)
        return "invalid", None
    return "ok", effect


job_steps = st.lists(st.tuples(st.sampled_from(list(JobEvent)), st.integers(0, 3)), max_size=40)
slot_steps = st.lists(st.sampled_from(list(SlotEvent)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(steps=job_steps, world=st.integers(1, 3))
def test_checked_job_machine_agrees_with_compiled_path(steps: list[tuple[JobEvent, int]], world: int) -> None:
    checked, fast = job_machine(checked=True), job_machine(checked=False)
    assert checked.checked and not fast.checked
    a, b = JobModel(world_size=world), JobModel(world_size=world)
    for event, arg in steps:
        ra, rb = _fire(checked, a, event, arg), _fire(fast, b, event, arg)
        assert ra == rb
        if ra[0] == "ok":
            _apply_job(a, event, arg)
            _apply_job(b, event, arg)
        assert a == b


@settings(max_examples=200, deadline=None)
@given(steps=slot_steps)
def test_checked_slot_machine_agrees_with_compiled_path(steps: list[SlotEvent]) -> None:
    checked, fast = slot_machine(checked=True), slot_machine(checked=False)
    a, b = SlotModel(), SlotModel()
    for event in steps:
        ra, rb = _fire(checked, a, event, 0), _fire(fast, b, event, 0)
        assert ra == rb
        if ra[0] == "ok":
            _apply_slot(a, event)
            _apply_slot(b, event)
        assert a == b


def _count_transitions_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    real = kvfsm.machines.compiled.evaluate_transitions

    def spy(
        machine: Any, effects: frozenset[str], state: str, event: str, guard: Callable[[str], bool]
    ) -> tuple[str, str | None] | None:
        calls.append(event)
        return real(machine, effects, state, event, guard)

    monkeypatch.setattr(kvfsm.machines.compiled, "evaluate_transitions", spy)
    return calls


def _random_job_run(sm: SpecMachine[JobState, JobEvent, JobEffect], seed: int, n: int = 300) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    job = JobModel()
    trace: list[tuple[str, str]] = []
    for _ in range(n):
        if job.state not in (JobState.SUBMITTED, JobState.IN_FLIGHT):
            job = JobModel(world_size=rng.randint(1, 3))
        event, arg = rng.choice(list(JobEvent)), rng.randint(0, 3)
        outcome, effect = _fire(sm, job, event, arg)
        if outcome == "ok":
            _apply_job(job, event, arg)
        trace.append((f"{event}:{outcome}", f"{job.state}:{effect}"))
    return trace


def test_checked_mode_runs_every_fire_through_transitions(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _count_transitions_calls(monkeypatch)
    fast = SpecMachine("job", JobState, JobEvent, JobEffect, job_machine().guards, checked=False)
    fast_trace = _random_job_run(fast, seed=7)
    assert calls == []
    checked = SpecMachine("job", JobState, JobEvent, JobEffect, job_machine().guards, checked=True)
    checked_trace = _random_job_run(checked, seed=7)
    assert len(calls) == len(checked_trace) == 300
    assert checked_trace == fast_trace
    assert any(":ok" in step for step, _ in fast_trace) and any(":invalid" in step for step, _ in fast_trace)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("1", True), ("true", True), ("YES", True), (" on ", True), ("0", False), ("", False), ("no", False)],
)
def test_checked_mode_environment_variable(monkeypatch: pytest.MonkeyPatch, value: str, expected: bool) -> None:
    monkeypatch.setenv("KVFSM_CHECKED", value)
    assert checked_mode_default() is expected
    sm = SpecMachine("slot", SlotState, SlotEvent, SlotEffect, slot_machine().guards)
    assert sm.checked is expected
    # An explicit argument wins over the environment.
    assert SpecMachine(
        "slot", SlotState, SlotEvent, SlotEffect, slot_machine().guards, checked=not expected
    ).checked is (not expected)


def test_checked_mode_from_environment_goes_through_transitions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFSM_CHECKED", raising=False)
    fast_trace = _random_job_run(SpecMachine("job", JobState, JobEvent, JobEffect, job_machine().guards), seed=11)
    monkeypatch.setenv("KVFSM_CHECKED", "1")
    calls = _count_transitions_calls(monkeypatch)
    sm = SpecMachine("job", JobState, JobEvent, JobEffect, job_machine().guards)
    assert sm.checked
    assert _random_job_run(sm, seed=11) == fast_trace
    assert len(calls) == 300


# --------------------------------------------------------------------------------------------------
# Tampered tables


def _fresh_job_machine(checked: bool) -> SpecMachine[JobState, JobEvent, JobEffect]:
    return SpecMachine("job", JobState, JobEvent, JobEffect, job_machine().guards, checked=checked)


def test_tampered_destination_is_caught_in_checked_mode() -> None:
    key = (JobState.SUBMITTED.value, JobEvent.CANCEL.value)
    wrong = {key: (CompiledEdge(None, "complete", "release"),)}
    checked, fast = _fresh_job_machine(True), _fresh_job_machine(False)
    with checked.planted(table_edits=wrong), fast.planted(table_edits=wrong):
        assert fast.table()[key] == wrong[key] and checked.table()[key] == wrong[key]
        # The compiled path alone silently follows the tampered row ...
        job = JobModel()
        assert fast.fire(job, JobEvent.CANCEL) is JobEffect.RELEASE
        assert job.state is JobState.COMPLETE
        # ... checked mode refuses it, and the model keeps its state.
        job = JobModel()
        with pytest.raises(SpecError, match="compiled table gave"):
            checked.fire(job, JobEvent.CANCEL)
        assert job.state is JobState.SUBMITTED
    # Leaving the block restores the spec's row.
    assert fast.table() == compile_table(fast.machine)
    job = JobModel()
    assert fast.fire(job, JobEvent.CANCEL) is JobEffect.RELEASE and job.state is JobState.CANCELLED


def test_tampered_effect_is_caught_in_checked_mode() -> None:
    checked = _fresh_job_machine(True)
    key = (JobState.IN_FLIGHT.value, JobEvent.FAIL.value)
    with checked.planted(table_edits={key: (CompiledEdge(None, "failed", "commit"),)}), pytest.raises(SpecError):
        checked.fire(JobModel(state=JobState.IN_FLIGHT), JobEvent.FAIL)


def test_removed_row_is_caught_in_checked_mode() -> None:
    checked = _fresh_job_machine(True)
    with checked.planted(table_edits={(JobState.SUBMITTED.value, JobEvent.DISCARD.value): None}):
        job = JobModel()
        with pytest.raises(SpecError, match="transitions gave"):
            checked.fire(job, JobEvent.DISCARD)
        assert job.state is JobState.SUBMITTED


def test_planted_guards_change_the_compiled_table_and_are_restored() -> None:
    fast = _fresh_job_machine(False)
    real = dict(fast.guards)
    job = JobModel(state=JobState.IN_FLIGHT, launched_mask=0b11)
    with fast.planted(guards={"acks_still_pending": lambda _job, _n: False, "last_ack_clean": lambda _j, _n: True}):
        assert fast.guards["acks_still_pending"] is not real["acks_still_pending"]
        assert fast.fire(job, JobEvent.ACK, 1) is JobEffect.COMMIT  # commits on the first of two acks
    assert dict(fast.guards) == real
    job = JobModel(state=JobState.IN_FLIGHT, launched_mask=0b11)
    assert fast.fire(job, JobEvent.ACK, 1) is None and job.state is JobState.IN_FLIGHT
    with pytest.raises(SpecError, match="guards the spec lacks"), fast.planted(guards={"no_such_guard": _never}):
        pass


def _never(_model: Any, _arg: int) -> bool:
    return False


def test_guards_mapping_is_read_only() -> None:
    guards: Any = _fresh_job_machine(False).guards
    with pytest.raises(TypeError):
        guards["ack_is_last"] = _never


def test_tampered_compile_step_is_caught_in_checked_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    real = kvfsm.machines.compiled.compile_table

    def tampered(machine: Any) -> dict[tuple[str, str], tuple[CompiledEdge, ...]]:
        table = real(machine)
        key = ("in_flight", "ack")
        table[key] = tuple(
            CompiledEdge(e.guard, "failed" if e.dest == "complete" else e.dest, e.effect) for e in table[key]
        )
        return table

    monkeypatch.setattr(kvfsm.machines.compiled, "compile_table", tampered)
    checked = _fresh_job_machine(True)
    job = JobModel(state=JobState.IN_FLIGHT, launched_mask=0b11, reported_mask=0b01)
    with pytest.raises(SpecError):
        checked.fire(job, JobEvent.ACK, 1)
    assert job.state is JobState.IN_FLIGHT


# --------------------------------------------------------------------------------------------------
# Invalid events and totality


@dataclass(slots=True)
class ValuationModel:
    """A model whose guards answer from a fixed truth assignment."""

    state: Any
    valuation: dict[str, bool] = field(default_factory=dict)


def _valuation_machine(name: str, checked: bool) -> SpecMachine[Any, Any, Any]:
    spec = load_machine(name)

    def make(g: str) -> Callable[[Any, int], bool]:
        return lambda model, _arg: bool(model.valuation[g])

    state_enum, event_enum, effect_enum = ENUMS[name]
    return SpecMachine(name, state_enum, event_enum, effect_enum, {g: make(g) for g in spec.guards}, checked=checked)


@pytest.mark.parametrize("checked", [False, True], ids=["compiled", "checked"])
@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_every_state_event_pair_transitions_or_raises(name: str, checked: bool) -> None:
    """h2's totality test, over every guard valuation as well."""
    spec = load_machine(name)
    sm = _valuation_machine(name, checked)
    reference = build_transitions_machine(spec)
    state_enum, event_enum, _ = ENUMS[name]
    for state, event in itertools.product(state_enum, event_enum):
        for valuation in _valuations(sorted(spec.guards)):
            model = ValuationModel(state, valuation)
            expected = evaluate_transitions(
                reference, frozenset(spec.effects), state.value, event.value, valuation.__getitem__
            )
            assert sm.can_fire(model, event) is (expected is not None)
            try:
                effect = sm.fire(model, event)
            except InvalidTransition as exc:
                assert expected is None, (state, event, valuation)
                assert model.state is state
                assert (exc.machine, exc.state, exc.event) == (name, state.value, event.value)
                assert f"spec/{name}.toml" in str(exc)
            else:
                assert expected == (model.state.value, effect), (state, event, valuation)
                assert isinstance(model.state, state_enum)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_disabled_events_raise_and_leave_the_state_unchanged(name: str) -> None:
    spec = load_machine(name)
    sm = _valuation_machine(name, checked=False)
    state_enum, event_enum, _ = ENUMS[name]
    table = sm.table()
    all_true = dict.fromkeys(spec.guards, True)
    disabled = [(s, e) for s, e in itertools.product(state_enum, event_enum) if (s.value, e.value) not in table]
    assert disabled, "every machine has events that some state does not accept"
    for state, event in disabled:
        model = ValuationModel(state, all_true)
        with pytest.raises(InvalidTransition) as info:
            sm.fire(model, event)
        assert model.state is state
        assert "no guard held" not in str(info.value)


def test_no_guard_held_is_reported_and_changes_nothing() -> None:
    sm = job_machine(checked=True)
    job = JobModel(state=JobState.IN_FLIGHT, launched_mask=0b11)
    with pytest.raises(InvalidTransition, match="no guard held"):
        sm.fire(job, JobEvent.ACK, 3)  # rank 3 is outside W=2: it never launched
    assert job.state is JobState.IN_FLIGHT and job.reported_mask == 0


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_terminal_states_accept_no_event(name: str) -> None:
    spec = load_machine(name)
    sm = _valuation_machine(name, checked=True)
    state_enum, event_enum, _ = ENUMS[name]
    for terminal in spec.terminal:
        for event in event_enum:
            model = ValuationModel(state_enum(terminal), dict.fromkeys(spec.guards, True))
            with pytest.raises(InvalidTransition):
                sm.fire(model, event)
            assert model.state == terminal


# --------------------------------------------------------------------------------------------------
# fire_many: the batched path equals firing each model alone


def _single_outcomes(
    sm: SpecMachine[Any, Any, Any], models: list[ValuationModel], event: Any
) -> list[tuple[Any, Any, Any] | None]:
    """What ``fire`` does to a copy of each model alone: (source, dest, effect), or None if it raises."""
    out: list[tuple[Any, Any, Any] | None] = []
    for model in models:
        copy = ValuationModel(model.state, dict(model.valuation))
        try:
            effect = sm.fire(copy, event)
        except InvalidTransition:
            assert copy.state is model.state
            out.append(None)
        else:
            out.append((model.state, copy.state, effect))
    return out


@pytest.mark.parametrize("mode", ["compiled", "checked", "traced"])
@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_fire_many_equals_fire_on_each_model(name: str, mode: str) -> None:
    """Random batches (mixed states, random guard valuations, every event): fire_many takes each model's
    row exactly as fire would, groups by row in the order given, tells tracers in that order, and when
    any model cannot fire it raises InvalidTransition and leaves every model as it was."""
    spec = load_machine(name)
    sm = _valuation_machine(name, checked=mode == "checked")
    state_enum, event_enum, _ = ENUMS[name]
    guards = sorted(spec.guards)
    rng = random.Random(f"fire_many/{name}/{mode}")
    raised = fired = 0
    for _ in range(400):
        event = rng.choice(list(event_enum))
        # Mostly one state (the fast path), sometimes a mix.
        states = [rng.choice(list(state_enum))] if rng.random() < 0.5 else list(state_enum)
        models = [
            ValuationModel(rng.choice(states), {g: rng.random() < 0.5 for g in guards})
            for _ in range(rng.randint(1, 12))
        ]
        expected = _single_outcomes(sm, models, event)
        before = [m.state for m in models]
        traced: list[tuple[str, object, str, str, str]] = []
        handle = kvfsm.machines.compiled.add_tracer(lambda *t, log=traced: log.append(t)) if mode == "traced" else None
        try:
            if None in expected:
                with pytest.raises(InvalidTransition) as info:
                    sm.fire_many(models, event)
                assert [m.state for m in models] == before, "a failed batch changes nothing"
                assert traced == []
                assert info.value.machine == name and info.value.event == event.value
                assert info.value.state in {str(s) for s, e in zip(before, expected, strict=True) if e is None}
                raised += 1
                continue
            groups = sm.fire_many(models, event)
        finally:
            if handle is not None:
                kvfsm.machines.compiled.remove_tracer(handle)
        fired += 1
        seen: list[int] = []
        for source, dest, effect, members in groups:
            assert members, "no empty groups"
            for model in members:
                i = next(j for j, m in enumerate(models) if m is model)
                assert expected[i] == (source, dest, effect)
                assert model.state is dest
                seen.append(i)
            positions = [next(j for j, m in enumerate(models) if m is model) for model in members]
            assert positions == sorted(positions), "a group keeps the order given"
        assert sorted(seen) == list(range(len(models))), "every model is in exactly one group"
        if mode == "traced":
            assert traced == [
                (name, model, event.value, str(out[0]), str(out[1]))
                for model, out in zip(models, expected, strict=True)
                if out is not None
            ]
    assert raised > 20 and fired > 20, (raised, fired)


def test_fire_many_of_nothing_and_a_model_listed_twice() -> None:
    sm = slot_machine()
    assert sm.fire_many([], SlotEvent.BEGIN_WRITE) == []
    a, b = SlotModel(), SlotModel()
    with pytest.raises(InvalidTransition, match="listed twice"):
        sm.fire_many([a, b, a], SlotEvent.BEGIN_WRITE)
    assert (a.state, b.state) == (SlotState.ABSENT, SlotState.ABSENT)
    groups = sm.fire_many([a, b], SlotEvent.BEGIN_WRITE)
    assert groups == [(SlotState.ABSENT, SlotState.WRITING, None, [a, b])]


def test_fire_many_evaluates_the_real_guards_per_model() -> None:
    """end_read over slots with one and with two readers: the spec's two guarded rows split the batch."""
    sm = slot_machine()
    one, two, other = (SlotModel(SlotState.READING, n) for n in (1, 2, 1))
    groups = sm.fire_many([one, two, other], SlotEvent.END_READ)
    assert sorted((str(d), [m.readers for m in ms]) for _s, d, _e, ms in groups) == [
        ("reading", [2]),
        ("ready", [1, 1]),
    ]
    assert (one.state, two.state, other.state) == (SlotState.READY, SlotState.READING, SlotState.READY)
    stuck = SlotModel(SlotState.READING, 0)  # no guard holds with no reader
    with pytest.raises(InvalidTransition, match="no guard held"):
        sm.fire_many([two, stuck], SlotEvent.END_READ)
    assert (two.state, stuck.state) == (SlotState.READING, SlotState.READING)


@pytest.mark.parametrize("name", MACHINE_NAMES)
def test_fire_many_of_one_model_is_fire_exactly(name: str) -> None:
    """A batch of one (the single-model shortcut of fire_many): for every state, event and guard valuation
    it takes fire's row, moves the model the same way, and refuses with the same InvalidTransition text."""
    spec = load_machine(name)
    sm = _valuation_machine(name, checked=False)
    state_enum, event_enum, _ = ENUMS[name]
    guards = sorted(spec.guards)
    refused = moved = 0
    for state in state_enum:
        for event in event_enum:
            for valuation in _valuations(guards):
                alone, batched = ValuationModel(state, valuation), ValuationModel(state, valuation)
                try:
                    effect = sm.fire(alone, event)
                except InvalidTransition as exc:
                    with pytest.raises(InvalidTransition) as info:
                        sm.fire_many([batched], event)
                    assert str(info.value) == str(exc)
                    assert batched.state is state
                    refused += 1
                    continue
                batch = [batched]
                groups = sm.fire_many(batch, event)
                assert groups == [(state, alone.state, effect, batch)] and groups[0][3] is batch
                assert batched.state is alone.state
                moved += 1
    assert refused and moved


def test_job_report_guards_are_their_two_premises() -> None:
    """The report guards, written out as one expression each, equal the spec's prose over every small
    job: rank_launched_not_reported (0 <= rank < W, launched, not yet reported) and is_last_report (with
    this report every one of the W ranks has reported), with the failure count for the last-ack pair."""
    guards = job_machine().guards
    checked = 0
    for world in (1, 2, 3):
        everyone = (1 << world) - 1
        for launched in range(everyone + 1):
            for reported in range(everyone + 1):
                if reported & ~launched:
                    continue  # reported_mask is always a subset of launched_mask
                for failed in (0, 1):
                    job = JobModel(JobState.IN_FLIGHT, world, launched, reported, failed)
                    for rank in range(-1, world + 1):
                        premise = 0 <= rank < world and bool(launched >> rank & 1) and not reported >> rank & 1
                        last = premise and reported | (1 << rank) == everyone
                        assert guards["acks_still_pending"](job, rank) is (premise and not last)
                        assert guards["ack_is_last"](job, rank) is last
                        assert guards["last_ack_clean"](job, rank) is (last and failed == 0)
                        assert guards["last_ack_after_failure"](job, rank) is (last and failed > 0)
                        checked += 1
    assert checked > 300


@pytest.mark.parametrize("shared_machine", [True, False])
def test_launch_all_launches_as_launch_does_job_by_job(shared_machine: bool) -> None:
    """Job.launch_all: the batch (one machine) and its fallback (jobs on two machines) leave every job as
    launching it job by job does, skip a job the rank already launched, and refuse a bad rank changing nothing."""
    machine = _fresh_job_machine(False)

    def jobs(other: SpecMachine[JobState, JobEvent, JobEffect]) -> list[Job]:
        made = [
            Job(n, JobKind.STORE, "r", (), GPUBlockSpec(()), SlotSpec(()), 2, other if n == 2 else machine)
            for n in range(3)
        ]
        made[1].launch(0)
        return made

    batched = jobs(machine if shared_machine else _fresh_job_machine(False))
    one_by_one = jobs(machine)
    with pytest.raises(AckCountError):
        Job.launch_all(batched, 2)
    untouched = [(JobState.SUBMITTED, 0), (JobState.IN_FLIGHT, 1), (JobState.SUBMITTED, 0)]
    assert [(j.state, j.launched_mask) for j in batched] == untouched
    Job.launch_all(batched, 0)
    for job in one_by_one:
        if not job.launched_mask & 1:
            job.launch(0)
    assert [(j.state, j.launched_mask) for j in batched] == [(j.state, j.launched_mask) for j in one_by_one]
    assert all(j.state is JobState.IN_FLIGHT and j.launched_mask == 1 for j in batched)
