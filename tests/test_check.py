"""The model checker (kvfsm.check): exploration, symmetry, invariants, liveness, traces and the CLI."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Collection, Iterator

import pytest
from planted_model_bugs import PATCHES_MODEL

import kvfsm.control.scheduler as scheduler_mod
from kvfsm.check import LIVENESS, Bounds, Model, explore, format_trace
from kvfsm.check.bfs import describe_state, stable_trace
from kvfsm.check.model import CHECKED_INVARIANTS, Label, ModelViolation, State
from kvfsm.cli import main
from kvfsm.errors import ConfigError
from kvfsm.machines.loader import load_invariants
from kvfsm.machines.names import EngineState

#: Small bounds that still have W = 2, a tier, a reset and a preemption: a few thousand states.
SMALL = Bounds(requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, resets=1, preemptions=1)
TINY = Bounds(requests=1, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=0, resets=0, preemptions=0)


def test_every_spec_invariant_is_checked_by_the_model() -> None:
    assert set(CHECKED_INVARIANTS) == {inv.name for inv in load_invariants()}


def test_small_bounds_hold_every_invariant_and_liveness() -> None:
    result = explore(SMALL)
    assert result.ok, [format_trace(v) for v in result.violations]
    assert result.complete and result.liveness_checked
    assert result.states > 1000 and result.edges > result.states
    assert result.graph is not None and len(result.graph.states) == result.states
    assert len(result.graph.src) == result.edges
    # Every state is reachable from the initial one along its recorded BFS path.
    model = Model(SMALL)
    for sid in range(0, result.states, max(1, result.states // 50)):
        s = model.initial
        for _src, label in result.graph.path_to(sid):
            nxt = model.apply(model.canonical(s), label)
            assert isinstance(nxt, State)
            s = nxt
        assert model.canonical(s) == result.graph.states[sid]


def test_the_engine_reaches_every_engine_state_but_shutdown() -> None:
    result = explore(SMALL)
    assert result.graph is not None
    seen = {s.engine for s in result.graph.states}
    assert seen == {EngineState.IDLE, EngineState.RUNNING, EngineState.FINISHING, EngineState.DRAINING}


def test_canonical_form_is_idempotent_and_symmetry_only_merges() -> None:
    model = Model(SMALL)
    result = explore(SMALL)
    assert result.graph is not None
    for s in result.graph.states:
        assert model.canonical(s) == s
    raw = explore(SMALL, symmetry=False)
    assert raw.ok and raw.graph is not None
    assert raw.states > result.states  # symmetric states merged...
    assert {model.canonical(s) for s in raw.graph.states} == set(result.graph.states)  # ...and nothing lost


def test_bounds_are_validated() -> None:
    with pytest.raises(ConfigError, match="workers"):
        Bounds(workers=0)
    with pytest.raises(ConfigError, match="tier"):
        Bounds(tiers=3)
    with pytest.raises(ConfigError, match="resets"):
        Bounds(resets=-1)


def test_max_states_stops_early_and_max_jobs_prunes() -> None:
    early = explore(SMALL, max_states=100)
    assert not early.complete and early.states >= 100
    pruned = explore(dataclasses.replace(SMALL, max_jobs=2))
    assert pruned.ok and pruned.liveness_checked
    assert pruned.pruned > 0  # (the job count is part of the state, so states are not fewer)


def test_liveness_catches_an_engine_that_never_goes_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """has_pending_push_work() stuck at True breaks no safety invariant, but the engine busy-spins in
    draining forever (LMCache #4998): only the liveness check sees it."""

    def stuck(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return True

    monkeypatch.setattr(scheduler_mod, "pending_push_work", stuck)
    result = explore(TINY)
    assert [v.invariant for v in result.violations] == [LIVENESS]
    v = result.violations[0]
    assert v.label is None and v.states[-1].engine is not EngineState.IDLE
    assert "never reach idle" in format_trace(v)
    # The run after it, by progress events only, ends in a cycle the engine never leaves.
    assert v.lasso and v.loop >= 0 and "repeats forever" in format_trace(v)
    assert all(s.engine is not EngineState.IDLE for s in v.lasso_states)


def test_a_violation_has_a_shortest_readable_trace(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(scheduler_mod, "stale_threshold_after_reset", lambda counter, threshold: threshold)
    bounds = dataclasses.replace(TINY, resets=1)
    model = Model(bounds)
    result = explore(bounds, model=model)
    (v,) = result.violations
    assert v.invariant == "stale_ids_ignored"
    assert [lab[0] for lab in v.path] == ["arrive", "lookup", "step", "reset"]
    assert v.label == ("step",) and v.length == 5
    # Breadth-first: no shorter path reaches a violation.
    assert len(v.states) == len(v.path) + 1
    text = format_trace(v, model)
    assert "VIOLATION stale_ids_ignored" in text and "request R1" in text and "reset_cache()" in text
    steps = stable_trace(model, v)
    assert len(steps) == v.length and steps[-1][1] is None
    assert describe_state(v.states[-1]).startswith("engine=running")


def test_keep_going_reports_each_invariant_once(monkeypatch: pytest.MonkeyPatch) -> None:
    def buggy(jobs: Collection[scheduler_mod.PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
        return False

    monkeypatch.setattr(scheduler_mod, "pending_push_work", buggy)
    result = explore(TINY, stop_at_first=False)
    names = [v.invariant for v in result.violations]
    assert len(names) == len(set(names))
    assert {"pending_work_covers_jobs", "idle_only_when_nothing_pending"} <= set(names)
    assert result.complete


def test_cli_check_prints_the_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--requests", "1", "--prompts", "1", "--chunks", "1", "--slots", "1", "--groups", "1"]
    assert main([*args, "--tiers", "0", "--resets", "0", "--preemptions", "0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "states" in out and "edges" in out and "states/s" in out and "no invariant violated" in out


def test_cli_check_json_and_replay(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["check", "--requests", "1", "--prompts", "1", "--chunks", "1", "--slots", "1", "--groups", "1"]
    assert main([*args, "--resets", "0", "--preemptions", "0", "--json", "--replay"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["states"] > 0 and data["edges"] > 0 and data["violations"] == []
    assert data["replay"]["edges_replayed"] == data["edges"] and data["replay"]["mismatches"] == []
    assert data["replay"]["probes"] > 0 and data["replay"]["probe_failures"] == []


def test_cli_check_exits_1_with_the_counterexample(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(scheduler_mod, "stale_threshold_after_reset", lambda counter, threshold: threshold)
    args = ["check", "--requests", "1", "--prompts", "1", "--chunks", "1", "--slots", "1", "--groups", "1"]
    assert main([*args, "--tiers", "0", "--preemptions", "0", "--quiet", "--brief"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION stale_ids_ignored" in out and "shortest counterexample: 5 events" in out


def test_plain_progress_lines(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfsm.check.cli import progress_display

    lines: list[str] = []

    class Sink:
        def write(self, text: str) -> int:
            lines.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    import builtins

    real_import = builtins.__import__

    def no_bars(name: str, *a: object, **k: object) -> object:
        if name.startswith(("rich", "tqdm")):
            raise ImportError(name)
        return real_import(name, *a, **k)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builtins, "__import__", no_bars)
        with progress_display(True, Sink()) as progress:  # type: ignore[arg-type]
            assert progress is not None
            explore(TINY, progress=progress, progress_every=5)
    assert any("states" in line and "queued" in line for line in lines)


def test_the_checker_and_the_replay_harness_need_no_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvfsm.check, kvfsm.check.replay, kvfsm.check.cli\n"
        "from kvfsm.check import Bounds, explore\n"
        "r = explore(Bounds(requests=1, prompts=1, chunks=1, workers=1, slots=1, groups=1, tiers=0, resets=0,"
        " preemptions=0))\n"
        "assert r.ok and r.states > 0\n"
        "assert 'torch' not in {k for k, v in sys.modules.items() if v is not None}\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


# --------------------------------------------------------------------------- drain modes and responsiveness


def test_spec_names_the_temporal_properties_and_both_drain_modes() -> None:
    from kvfsm.check.properties import DrainMode, load_drain_modes, load_properties
    from kvfsm.machines.names import EngineEffect

    assert {p.name for p in load_properties()} == {
        "responsiveness",
        "liveness",
        "deadlines_noticed",
        "step_wait_bounded",
    }
    modes = load_drain_modes()
    assert modes[DrainMode.BLOCKING].settle_effect is EngineEffect.FLUSH_ALL
    assert modes[DrainMode.NON_BLOCKING].settle_effect is None
    assert [m for m, spec in modes.items() if spec.default] == [DrainMode.NON_BLOCKING]


def test_blocking_drain_breaks_responsiveness_with_a_short_trace() -> None:
    """The #42611 baseline: a request that arrives while the engine waits in flush_all cannot be looked up
    until the flushed copies finish. The default bounds find it in a handful of events."""
    from kvfsm.check import RESPONSIVENESS
    from kvfsm.check.properties import DrainMode

    model = Model(Bounds(), DrainMode.BLOCKING)
    result = explore(model=model)
    (v,) = result.violations
    assert v.invariant == RESPONSIVENESS and v.label is None
    assert v.length <= 12
    assert [lab[0] for lab in v.path][-1] == "arrive"
    assert v.states[-1].blocked and v.states[-1].engine in (EngineState.FINISHING, EngineState.DRAINING)
    text = format_trace(v, model)
    assert "BLOCKED in flush_all" in text and "breaks responsiveness" in text


def test_non_blocking_drain_is_responsive_on_every_arrival_while_draining() -> None:
    result = explore(SMALL)
    assert result.ok and result.responsiveness_checks > 0


@PATCHES_MODEL
def test_responsiveness_is_decided_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose lookups wait for every transfer to finish (an engine that ignores its queue while work
    is in flight, without blocking) is caught."""
    from kvfsm.check import RESPONSIVENESS

    real = Model._lookup_all

    def deaf(self: Model, s: State, i: int) -> Iterator[tuple[Label, State | ModelViolation | None]]:
        if s.tier or any(j.state.value in ("submitted", "in_flight") for j in s.jobs):
            return iter(())
        return real(self, s, i)

    monkeypatch.setattr(Model, "_lookup_all", deaf)
    result = explore(SMALL)
    assert RESPONSIVENESS in {v.invariant for v in result.violations}


def test_blocking_mode_holds_every_other_property() -> None:
    from kvfsm.check import RESPONSIVENESS
    from kvfsm.check.properties import DrainMode

    result = explore(SMALL, drain=DrainMode.BLOCKING, stop_at_first=False)
    assert {v.invariant for v in result.violations} == {RESPONSIVENESS}
    assert result.graph is not None and any(s.blocked for s in result.graph.states)


def test_cli_check_drain_blocking_exits_1_with_a_diagram(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--drain", "blocking", "--quiet", "--diagram"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION responsiveness" in out and "sequenceDiagram" in out and "flush_all" in out
    n = int(out.split("shortest counterexample: ")[1].split()[0])
    assert n <= 12


def test_cli_check_refuses_replay_of_the_blocking_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", "--drain", "blocking", "--replay", "--quiet"]) != 0
    err = capsys.readouterr().err
    assert "non_blocking" in err and "Traceback" not in err


def test_cli_check_replay_drives_the_implementation_along_the_counterexample(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug planted in a shared decision: the real scheduler follows the checker's counterexample and then
    refuses the violating late ack (UnknownJobError), and the command says so."""
    monkeypatch.setattr(scheduler_mod, "stale_threshold_after_reset", lambda counter, threshold: threshold)
    args = ["check", "--requests", "1", "--prompts", "1", "--chunks", "1", "--slots", "1", "--groups", "1"]
    assert main([*args, "--tiers", "0", "--preemptions", "0", "--quiet", "--brief", "--replay"]) == 1
    out = capsys.readouterr().out
    assert "the implementation follows the stale_ids_ignored counterexample for 4 events" in out
    assert "UnknownJobError" in out


def test_default_bounds_graph_is_pinned() -> None:
    # The explored graph at the default bounds, pinned: a speed-up of the checker (issue 11) must explore
    # exactly the same canonical states and edges, with the same verdict.
    result = explore(Bounds(), keep_graph=False, check_liveness=False)
    assert (result.states, result.edges, result.pruned) == (90_029, 337_276, 0)
    assert result.ok and result.complete and result.responsiveness_checks == 628
