"""SPIN on the Promela model generated from spec/ (kvfsm.check.promela, kvfsm.check.spin).

Real SPIN 6.5 and a real C compiler, never a stand-in: without ``spin`` on PATH every test here is skipped with
the install hint. The generated model must verify clean; the #42611 blocking drain must be found unresponsive;
every planted bug of tests/planted_bugs.py that the generated composition can express must be found by SPIN
*and* by the native checker, with the same invariant named; a bitstate run must report its states and rate.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import pytest
from planted_bugs import PLANTED_BUGS

from kvfsm.check import Bounds, Model, explore
from kvfsm.check.promela import PROPERTIES, PromelaBounds, generate
from kvfsm.check.properties import DrainMode, load_properties
from kvfsm.check.spin import INSTALL_HINT, format_trace, parse_pan, parse_replay, run_spin
from kvfsm.cli import main as cli_main
from kvfsm.errors import ConfigError
from kvfsm.machines import engine_machine, job_machine
from kvfsm.machines.compiled import CompiledEdge
from kvfsm.machines.loader import load_invariants

needs_spin = pytest.mark.skipif(
    shutil.which("spin") is None or (shutil.which("gcc") or shutil.which("cc")) is None,
    reason=f"SPIN or a C compiler is missing; {INSTALL_HINT}",
)

#: planted bug -> the property both checkers report for it: every planted bug of tests/planted_bugs.py is
#: expressed by the generated composition (GPU groups and fences for fence_flush_skipped, reset_cache and the
#: stale threshold for reset_keeps_stale_threshold).
AGREEMENT: dict[str, str] = {
    "partial_acks_ignored": "pending_work_covers_jobs",
    "idle_with_manager_work": "pending_work_covers_jobs",
    "readable_on_first_ack": "readable_only_after_commit",
    "evict_reading_slot": "evict_only_ready_unreferenced",
    "fence_flush_skipped": "gpu_source_not_overwritten",
    "reset_keeps_stale_threshold": "stale_ids_ignored",
}


def test_every_planted_bug_has_an_expected_invariant() -> None:
    assert set(AGREEMENT) == set(PLANTED_BUGS)


def test_generated_model_names_every_spec_state() -> None:
    text = generate()
    for state in ("J_in_flight", "J_stale", "S_reading", "R_finished_signalled", "R_preempted", "E_draining"):
        assert state in text
    assert "inline job_ack(i, arg)" in text and "G_job_last_ack_clean" in text
    assert "FENCETAB" in text and "STHTAB" in text


@needs_spin
def test_clean_model_verifies() -> None:
    safety = run_spin(PromelaBounds(), optimize=False)
    assert safety.ok, safety.report
    assert safety.errors == 0 and safety.violated == ()
    assert safety.states > 1000 and safety.states_per_second > 0
    live = run_spin(PromelaBounds(slots=1, resets=0, liveness=True), optimize=False)
    assert live.ok, live.report


@needs_spin
def test_blocking_drain_is_unresponsive_with_a_readable_trace() -> None:
    r = run_spin(PromelaBounds(drain=DrainMode.BLOCKING), optimize=False)
    assert r.errors == 1
    assert r.violated == ("responsiveness",)
    # The replayed (shortened) trail, in the spec's words: a request arrives while the engine is blocked in
    # flush_all, and nothing can look it up.
    events = [t.event for t in r.trace]
    assert 0 < len(events) <= 12, format_trace(r)
    assert events[-1] == "nothing else can move" and r.trace[-1].state is None
    blocked = [n for n, t in enumerate(r.trace) if t.state is not None and "BLOCKED in flush_all" in t.state]
    arrivals = [n for n, e in enumerate(events) if e.endswith("arrives")]
    assert blocked and arrivals and arrivals[-1] > blocked[0], format_trace(r)
    text = format_trace(r)
    assert text.startswith("VIOLATION responsiveness (spin)")
    assert "   0. initial: engine=idle" in text and "<-- responsiveness" in text
    assert f"  {len(events):2}. nothing else can move" in text
    # what --json prints for it
    summary = json.loads(json.dumps(r.summary()))
    assert summary["violated"] == ["responsiveness"] and summary["trace"][-1] == {
        "event": "nothing else can move",
        "state": None,
    }
    assert any("BLOCKED in flush_all" in (step["state"] or "") for step in summary["trace"])


@needs_spin
@pytest.mark.parametrize("name", sorted(AGREEMENT))
def test_spin_and_native_checker_agree_on_planted_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with PLANTED_BUGS[name](monkeypatch):
        spin = run_spin(PromelaBounds(), optimize=False)
        native = explore(Bounds(), model=Model(Bounds()), keep_graph=False, check_liveness=False)
    assert spin.errors == 1, spin.report
    assert native.violations, f"the native checker missed {name}"
    assert spin.violated == (AGREEMENT[name],)
    assert native.violations[0].invariant == AGREEMENT[name]
    assert spin.trace and spin.initial is not None, "the counterexample was not replayed"
    assert f"<-- {AGREEMENT[name]}" in format_trace(spin) or "this state breaks" in format_trace(spin)


@needs_spin
def test_spin_and_native_checker_agree_with_the_full_scope() -> None:
    """Two tiers with promotions, store deadlines (time_out, quarantine) and a bounded shutdown (flush_all,
    give up, stop) in scope: the clean model verifies in both checkers, at bounds both reach quickly."""
    b = PromelaBounds(slots=1, resets=0, preemptions=0, deadlines=1, shutdown=True, tiers=2, promotions=True)
    text = generate(b)
    assert "inline job_time_out(i, arg)" in text and "inline engine_stop(i, arg)" in text and "QUARANTINE" in text
    assert "the promotion into slot s0 finishes ok" in text and "tier 1's cascade of slot s0" in text
    spin = run_spin(b, optimize=False)
    tiny = Bounds(
        requests=2,
        prompts=1,
        chunks=1,
        slots=1,
        resets=0,
        preemptions=0,
        deadlines=1,
        shutdown=True,
        tiers=2,
        promotions=True,
    )
    native = explore(tiny, model=Model(tiny), keep_graph=False, check_liveness=False)
    assert spin.ok and spin.violated == (), spin.report
    assert native.ok and not native.violations


@needs_spin
def test_bitstate_run_reports_states_and_rate() -> None:
    # About 0.4M states exhaustively; bitstate holds them in 32 MiB.
    r = run_spin(PromelaBounds(slots=1), bitstate=True, hash_bits=28, optimize=False)
    assert r.errors == 0 and r.complete, r.report
    assert r.bitstate and r.states > 100_000 and r.states_per_second > 0


@needs_spin
def test_multi_core_search_agrees_with_one_core() -> None:
    """pan -DNCORE=2 (the model without hidden variables) stores the same states and finds the same bug."""
    b = PromelaBounds(slots=1, resets=0, preemptions=0)
    one = run_spin(b, optimize=False)
    two = run_spin(b, optimize=False, cores=2)
    assert one.ok and two.ok, two.report
    assert two.cores == 2 and two.states == one.states and two.states_per_second > 0
    blocking = run_spin(
        PromelaBounds(slots=1, resets=0, preemptions=0, drain=DrainMode.BLOCKING), cores=2, optimize=False
    )
    assert blocking.violated == ("responsiveness",) and blocking.trace, blocking.report


@needs_spin
def test_cli_check_engine_spin(capsys: pytest.CaptureFixture[str]) -> None:
    # One run (each compiles pan with -O2): the clean path of run_spin is covered by test_clean_model_verifies.
    small = ["--jobs", "1", "--requests", "2", "--slots", "1", "--resets", "0", "--preemptions", "0"]
    assert cli_main(["check", "--engine", "spin", "--drain", "blocking", "--no-liveness", *small]) == 1
    out = capsys.readouterr().out
    assert "spin safety assertions" in out and "errors: 1" in out and "violated: responsiveness" in out
    assert "VIOLATION responsiveness (spin)" in out and "nothing else can move  <-- responsiveness" in out


def test_cli_refuses_native_only_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--engine", "spin", "--prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert "--prompts" in err and len(err.strip().splitlines()) == 1
    assert cli_main(["check", "--bitstate"]) == 2
    assert "--engine spin" in capsys.readouterr().err
    assert cli_main(["check", "--engine", "spin", "--cores", "2"]) == 2
    assert "--no-liveness" in capsys.readouterr().err


def test_cli_export_promela(tmp_path: Path) -> None:
    out = tmp_path / "kvfsm.pml"
    assert cli_main(["export", "promela", "--jobs", "3", "--ranks", "2", "-o", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "#define J 3" in text and "mtype = {" in text


def test_missing_spin_is_one_line_with_the_install_hint(tmp_path: Path) -> None:
    # A real run of the command line with a PATH that holds no spin.
    code = "import sys; from kvfsm.cli import main; sys.exit(main(['check', '--engine', 'spin']))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={"PATH": str(tmp_path)}, check=False
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [f"kvfsm: error: spin is not on PATH; {INSTALL_HINT}"]


@contextmanager
def _plant_commit_on_first_ack() -> Iterator[None]:
    """A planted *table row* (not a guard): in_flight --ack [acks_still_pending]--> complete / commit."""
    bad = (
        CompiledEdge("acks_still_pending", "complete", "commit"),
        CompiledEdge("last_ack_clean", "complete", "commit"),
        CompiledEdge("last_ack_after_failure", "failed", "release"),
    )
    with ExitStack() as stack:
        for args in ((), (None,), (False,), (True,)):
            stack.enter_context(job_machine(*args).planted(table_edits={("in_flight", "ack"): bad}))
        yield


@needs_spin
def test_spin_and_native_checker_agree_on_planted_table_row() -> None:
    with _plant_commit_on_first_ack():
        assert "G_job_acks_still_pending" in generate()
        spin = run_spin(PromelaBounds(), optimize=False)
        native = explore(Bounds(), model=Model(Bounds()), keep_graph=False, check_liveness=False)
    assert spin.violated == ("readable_only_after_commit",), spin.report
    assert native.violations and native.violations[0].invariant == "readable_only_after_commit"


@needs_spin
def test_spin_and_native_checker_agree_on_draining_forever() -> None:
    """A planted engine guard pair that never lets the engine settle idle: a liveness bug, found by SPIN's LTL
    claim under weak fairness and by the native checker's reverse-reachability check."""
    never_idle = {"no_pending_push_work": lambda m, a: False, "pending_push_work": lambda m, a: True}
    with engine_machine().planted(guards=never_idle):
        safety = run_spin(PromelaBounds(jobs=1, requests=1), optimize=False)
        live = run_spin(PromelaBounds(jobs=1, requests=1, liveness=True), optimize=False)
        tiny = Bounds(requests=1, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=0, resets=0, preemptions=0)
        native = explore(tiny, model=Model(tiny), keep_graph=True, check_liveness=True)
    assert safety.ok, safety.report  # no invariant breaks: only the path property does
    assert live.violated == ("liveness",), live.report
    assert any(t.cycle for t in live.trace), format_trace(live)  # the acceptance cycle, replayed
    assert [v.invariant for v in native.violations] == ["liveness"]


def test_a_tier_always_pending_is_generated_into_the_other_pending_work() -> None:
    assert "#define TIER_PENDING_ALWAYS 0" in generate()
    text = generate(PromelaBounds(tier_pending_always=True))
    assert "#define TIER_PENDING_ALWAYS 1" in text
    assert "#define OTHER_PENDING (!abandoned && (QUARANTINE || MGR_PENDING || TIER_PENDING_ALWAYS))" in text
    with pytest.raises(ConfigError, match="tier_pending_always"):
        PromelaBounds(tiers=0, tier_pending_always=True)


@needs_spin
def test_spin_and_native_checker_agree_on_a_tier_that_is_never_idle() -> None:
    """vLLM's KVCR tier, whose has_pending_work() is always True (kvfsm check --tier-pending always): no safety
    assertion breaks, and SPIN's LTL claim finds the acceptance cycle of empty steps in draining, as the native
    checker's liveness check finds the engine that never goes idle."""
    small = PromelaBounds(jobs=1, requests=1, slots=1, resets=0, preemptions=0, tier_pending_always=True)
    safety = run_spin(small, optimize=False)
    live = run_spin(dataclasses.replace(small, liveness=True), optimize=False)
    assert safety.ok, safety.report
    assert live.violated == ("liveness",), live.report
    cycle = [t for t in live.trace if t.cycle]
    assert cycle and all(t.event == "the engine runs a step" for t in cycle), format_trace(live)
    assert all(t.state is not None and t.state.startswith("engine=draining") for t in cycle)
    tiny = Bounds(requests=1, prompts=1, chunks=1, slots=1, groups=1, resets=0, preemptions=0, tier_pending_always=True)
    native = explore(tiny)
    assert [v.invariant for v in native.violations] == ["liveness"]


def test_every_asserted_property_is_named_in_the_spec() -> None:
    names = {i.name for i in load_invariants()} | {p.name for p in load_properties()}
    assert set(PROPERTIES) <= names
    text = generate(PromelaBounds(liveness=True))
    for name in PROPERTIES:
        assert f"violated_{name}" in text
    assert "ltl liveness" in text


def test_parse_pan_reads_large_counts() -> None:
    report = (
        "State-vector 180 byte, depth reached 1803, errors: 0\n"
        " 39505009 states, stored\n"
        "2.1582e+08 transitions (= stored+matched)\n"
        "pan: elapsed time 316 seconds\n"
        "pan: rate 125087.37 states/second\n"
    )
    r = parse_pan(report, PromelaBounds(), bitstate=True)
    assert (r.states, r.transitions, r.errors, r.depth) == (39_505_009, 215_820_000, 0, 1803)
    assert r.seconds == 316.0 and round(r.states_per_second) == 125_087 and r.complete


def test_parse_replay_reads_events_and_states() -> None:
    b = PromelaBounds(jobs=1, requests=1, slots=1, groups=1)
    replay = (
        "ST|E_idle,0,0|R_tracked,0,0,0,0|J_submitted,0,0,0,0,0|S_absent,0,0,0,0|0,0|0,0\n"
        "EV|request R1 arrives\n"
        "ST|E_idle,0,0|R_tracked,1,1,0,0|J_submitted,0,0,0,0,0|S_absent,0,0,0,0|0,0|0,0\n"
        "  <<<<<START OF CYCLE>>>>>\n"
        "EV|job J1 rank 0: ack\n"
        "spin: trail ends after 9 steps\n"
    )
    initial, steps = parse_replay(replay, b)
    assert initial == "engine=idle | requests: - | jobs: - | slots: s0=absent | gpu: g0=free"
    assert [s.event for s in steps] == ["request R1 arrives", "job J1 rank 0: ack"]
    assert steps[0].state is not None and "R1 queued" in steps[0].state and not steps[0].cycle
    assert steps[1].state is None and steps[1].cycle
