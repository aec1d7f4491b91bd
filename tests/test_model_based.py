"""Model-based tests generated from the model checker's graph, run against the real implementation.

For every edge of the explored abstract graph, a copy of the real control plane (OffloadingScheduler,
CPUOffloadingManager, a TieringManager over kvfsm's in-memory tiers, held-copy workers, the engine machine,
an injected clock and the scheduler's expiry queue) in the edge's source state takes the edge's event, and
its abstraction must equal the model's target state. In every reachable state, every event the spec
disables is applied through the implementation's own entry points: it must raise a typed KvfsmError and
change nothing. No torch.

The full scope (two tiers, promotions, a durable tier, store deadlines, bounded shutdown) is replayed at
small bounds, shutdown included: the model's give_up and stop do what EngineLoop.shutdown does (the loads
given up hand their requests back; every worker's shutdown finishes and reports the copies it holds; the
tiering manager's shutdown polls the tiers and invalidates a promotion that did not succeed), which this
replay found missing from the model.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from planted_model_bugs import PATCHES_MODEL

from kvfsm.check import Bounds, Model, explore
from kvfsm.check.invariants import SystemView, check_all
from kvfsm.check.model import State
from kvfsm.check.replay import (
    Harness,
    ReplayReport,
    abstract,
    disabled_events,
    probe_state,
    replay_edges,
)
from kvfsm.cli import main
from kvfsm.control.job import Job, Quarantined
from kvfsm.control.scheduler import OffloadingScheduler, SchedulerOutput
from kvfsm.control.tiering import TieringManager
from kvfsm.machines.names import EngineState, JobState, SlotEvent
from kvfsm.testing.paths import CheckerPathStateMachine
from kvfsm.testing.system import GROUND_TRUTH_CHECKS

#: W = 2 with a tier, a reset and a preemption; two prompts of two chunks with eviction (LRU order); and
#: the full scope at small bounds, one mechanism at a time (each a few thousand states).
CI_BOUNDS = {
    "w2-tier-reset-preempt": Bounds(
        requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, resets=1, preemptions=1
    ),
    "two-prompts-eviction": Bounds(
        requests=2, prompts=2, chunks=2, workers=2, slots=2, groups=2, tiers=0, resets=0, preemptions=0
    ),
    "two-tiers-promotions": Bounds(
        requests=2, prompts=2, chunks=2, workers=1, slots=2, groups=1, tiers=2, promotions=True, resets=0, preemptions=0
    ),
    "durable-reset": Bounds(
        requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, durable=True, resets=1, preemptions=0
    ),
    "deadline-reset": Bounds(
        requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=0, deadlines=1, resets=1, preemptions=0
    ),
}

#: Bounds with shutdown in scope, replayed against the model with the loop's shutdown put back.
SHUTDOWN_BOUNDS = {
    "shutdown-reset": Bounds(
        requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, shutdown=True, resets=1, preemptions=0
    ),
    "full-scope": Bounds(
        requests=2,
        prompts=1,
        chunks=1,
        workers=1,
        slots=1,
        groups=1,
        tiers=2,
        durable=True,
        promotions=True,
        deadlines=1,
        shutdown=True,
        resets=0,
        preemptions=0,
    ),
}


#: Filled by the tests, printed at the end of the session by the summary test.
NUMBERS: dict[str, ReplayReport] = {}


def _replay_all(name: str, bounds: Bounds) -> ReplayReport:
    # With shutdown in scope, the model's shutdown is the engine loop's (see the module docs).
    result = explore(bounds)
    assert result.ok and result.graph is not None
    report = replay_edges(result)
    NUMBERS[name] = report
    assert not report.mismatches, "\n\n".join(str(m) for m in report.mismatches)
    assert not report.probe_failures, "\n".join(report.probe_failures[:20])
    assert report.states == result.states
    assert report.edges_replayed == result.edges
    assert report.probes > 4 * result.states
    print(
        f"\n{name}: {result.states} states, {report.edges_replayed} edges replayed, {report.probes} negative "
        f"probes in {report.seconds:.1f} s"
    )
    return report


@pytest.mark.parametrize("name", sorted(CI_BOUNDS))
def test_every_edge_replays_and_every_disabled_event_is_refused(name: str) -> None:
    _replay_all(name, CI_BOUNDS[name])


@pytest.mark.parametrize("name", sorted(SHUTDOWN_BOUNDS))
def test_every_edge_replays_with_shutdown_in_scope(name: str) -> None:
    _replay_all(name, SHUTDOWN_BOUNDS[name])


def test_an_expire_event_times_out_that_job_alone() -> None:
    """The held expiry queue passes one job's deadline: of two stores awaited, the next step times out
    the one the event names, through the scheduler's own expire_jobs and quarantine."""
    bounds = Bounds(requests=2, prompts=2, chunks=2, workers=1, slots=3, groups=2, tiers=0, deadlines=1)
    model = Model(bounds)
    h = Harness(bounds)
    h.arrive(0)
    h.arrive(1)
    h.lookup("r0")
    h.lookup("r1")
    h.step()
    state, refs = abstract(h, model)
    assert [j.state for j in state.jobs] == [JobState.IN_FLIGHT] * 2
    h.apply(("expire", 1), refs)
    expired = refs.jobs[1]
    h.step()
    assert h.sched.job(expired) is None and h.sched.is_quarantined(expired)
    assert set(h.sched.jobs()) == {refs.jobs[0]}
    assert h.sched.stats.timed_out_stores == 1


def test_the_initial_harness_is_the_initial_model_state() -> None:
    bounds = CI_BOUNDS["two-prompts-eviction"]
    model = Model(bounds)
    state, refs = abstract(Harness(bounds), model)
    assert state == model.canonical(model.initial)
    assert refs.reqs == [] and refs.jobs == []


@PATCHES_MODEL
def test_edge_replay_catches_a_model_that_disagrees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison is not vacuous: a model that commits a store's keys in reverse order (so LRU order
    differs from the implementation's) is caught."""
    import kvfsm.check.model as mm

    def reversed_commit(self: Model, w: mm._World, keys: tuple[int, ...], success: bool) -> None:
        writing = [k for k in dict.fromkeys(keys) if w.slots[k] == mm.WRITING]
        for key in reversed(writing):
            w.slots[key] = self.slot_event(mm.WRITING, SlotEvent.COMMIT_WRITE if success else SlotEvent.ABORT_WRITE)
            if success:
                w.lru.append(key)

    monkeypatch.setattr(Model, "_complete_store", reversed_commit)
    bounds = Bounds(requests=1, prompts=1, chunks=2, workers=1, slots=2, groups=1, tiers=0, resets=0, preemptions=0)
    result = explore(bounds)
    report = replay_edges(result, probes=False, max_mismatches=1)
    assert report.mismatches and "after" in str(report.mismatches[0])


def _plant_tiers_pending_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiering manager that forgets its tiers' own pending work (a durable tier's sync)."""
    monkeypatch.setattr(
        TieringManager, "has_pending_work", lambda self: bool(self.num_transfer_jobs or self.num_quarantined)
    )


def _plant_quarantine_released_at_first_report(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed-out job's memory handed back at its first late report, while another rank still copies."""

    def report(self: Quarantined, rank: int = 0) -> bool:
        self.check_report(rank)
        self.outstanding = 0
        return True

    monkeypatch.setattr(Quarantined, "report", report)


def _plant_failed_promotion_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed promotion that does not invalidate the tier's copy (vLLM #49176)."""
    monkeypatch.setattr(TieringManager, "_invalidate", staticmethod(lambda tier, keys: None))


def _plant_abandoned_still_pending(monkeypatch: pytest.MonkeyPatch) -> None:
    """Quarantined copies still pending work after a bounded shutdown gave up: the engine cannot stop."""
    monkeypatch.setattr(
        OffloadingScheduler,
        "_other_pending_work",
        lambda self: bool(self.num_quarantined) or self.manager.has_pending_work(),
    )


PLANTED = {
    "tiers-pending-ignored": (_plant_tiers_pending_ignored, CI_BOUNDS["durable-reset"]),
    "quarantine-released-early": (_plant_quarantine_released_at_first_report, CI_BOUNDS["deadline-reset"]),
    "failed-promotion-kept": (
        _plant_failed_promotion_kept,
        Bounds(requests=2, prompts=1, chunks=1, workers=1, slots=1, groups=1, tiers=1, promotions=True),
    ),
    "abandoned-still-pending": (_plant_abandoned_still_pending, SHUTDOWN_BOUNDS["shutdown-reset"]),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_the_full_scope_replay_catches_a_bug_planted_in_the_implementation(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plant, bounds = PLANTED[name]
    result = explore(bounds)
    assert result.ok
    plant(monkeypatch)
    report = replay_edges(result, probes=False, max_mismatches=1)
    assert report.mismatches, f"{name}: every edge replayed"


def test_what_a_bounded_shutdown_gave_up_is_not_pending_work() -> None:
    """After give_up a quarantined copy is not pending work (spec/invariants.toml, pending_work_covers_jobs):
    the implementation's invariant checker agrees (it used to flag it, found by the checker-path machine
    with shutdown in scope), and stop hands the memory back."""
    bounds = SHUTDOWN_BOUNDS["shutdown-reset"]
    h = Harness(bounds)
    h.arrive(0)
    h.lookup("r0")
    h.step()  # the store is launched on both ranks; the copies are held
    h.shutdown(["r0"])
    h.step()
    assert h.sched.has_pending_push_work()
    h.give_up()
    assert h.sched.abandoned and h.sched.num_quarantined == 1 and not h.sched.has_pending_push_work()
    assert check_all(SystemView(h.sched, h.engine.state)) == []
    h.stop()
    assert h.engine.state is EngineState.STOPPED and h.sched.num_quarantined == 0
    assert h.primary.ref_cnt(h.keys_by_id[0]) is None  # the quarantined slot was handed back
    assert check_all(SystemView(h.sched, h.engine.state)) == []


def _state_with_a_job(bounds: Bounds) -> tuple[Harness, Model, State]:
    h = Harness(bounds)
    h.arrive(0)
    h.lookup("r0")
    h.step()
    model = Model(bounds)
    state, _ = abstract(h, model)
    return h, model, state


def test_probes_catch_an_operation_that_changes_state_before_it_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the up-front check of build_connector_meta, preempting a request that is not running
    raised only after the step had started (a finding of these probes, since fixed)."""
    bounds = CI_BOUNDS["w2-tier-reset-preempt"]
    h, model, state = _state_with_a_job(bounds)
    h.finish("r0")
    state, refs = abstract(h, model)
    failures, count = probe_state(h, model, state, refs)
    assert count > 0 and failures == []
    monkeypatch.setattr(OffloadingScheduler, "_check_step", lambda self, output: None)
    failures, _ = probe_state(h, model, state, refs)
    assert any("build_connector_meta(preempted=r0)" in f and "changed the state" in f for f in failures), failures


def test_probes_catch_an_accepted_disabled_event(monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = CI_BOUNDS["w2-tier-reset-preempt"]
    h, model, state = _state_with_a_job(bounds)
    _, refs = abstract(h, model)
    monkeypatch.setattr(Job, "cancel", lambda self: None)
    failures, _ = probe_state(h, model, state, refs)
    assert any(f.startswith("cancel job 0") and "accepted" in f for f in failures), failures


def test_probes_cover_every_machine() -> None:
    bounds = CI_BOUNDS["w2-tier-reset-preempt"]
    h, model, state = _state_with_a_job(bounds)
    _, refs = abstract(h, model)
    names = " ".join(what for what, _ in disabled_events(h, state, refs))
    for needle in ("update_state_after_alloc", "ack job", "launch job", "cancel job", "prepare_load", "engine "):
        assert needle in names
    # The batch rule: reset_cache refuses a half-scheduled step.
    h2 = Harness(bounds)
    h2.arrive(0)
    h2.lookup("r0")
    state2, refs2 = abstract(h2, model)
    assert "reset_cache() with a step half scheduled" in [w for w, _ in disabled_events(h2, state2, refs2)]
    h2.sched.build_connector_meta(SchedulerOutput())


def test_checker_path_machine_follows_the_full_scope_graph() -> None:
    """kvfsm.testing.paths at full-scope bounds: the checker's paths (promotions from two tiers, a durable
    tier's sync, a deadline, a bounded shutdown) followed on the real control plane, every event read back
    and every invariant checked, the data plane's work judged from the backends and the tiers."""

    class FullScopePaths(CheckerPathStateMachine):
        bounds = SHUTDOWN_BOUNDS["full-scope"]

    key = ("FullScopePaths", "any")
    before = GROUND_TRUTH_CHECKS[key]
    run_state_machine_as_test(
        FullScopePaths,
        settings=settings(
            max_examples=60,
            stateful_step_count=30,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        ),
    )
    assert GROUND_TRUTH_CHECKS[key] > before
    assert GROUND_TRUTH_CHECKS[("FullScopePaths", "tier sync")] > 0


def test_kvfsm_check_replay_takes_the_full_scope(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvfsm check --replay`` with every scope option replays every edge (the shutdown the loop's)."""
    args = ["check", "--requests", "1", "--prompts", "1", "--chunks", "1", "--workers", "1", "--slots", "1"]
    args += ["--groups", "1", "--tiers", "2", "--durable", "--promotions", "--deadlines", "1", "--shutdown"]
    assert main([*args, "--resets", "0", "--preemptions", "0", "--json", "--replay"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["violations"] == [] and data["replay"]["edges_replayed"] == data["edges"] > 0
    assert data["replay"]["mismatches"] == [] and data["replay"]["probe_failures"] == []


def _nightly_bounds() -> Bounds:
    """Bounds() (the ``kvfsm check`` defaults), with ``KVFSM_REPLAY_BOUNDS`` overriding any of them, e.g.
    ``KVFSM_REPLAY_BOUNDS=tiers=2,durable=1,promotions=1,deadlines=1,shutdown=1`` for the full scope."""
    spec = os.environ.get("KVFSM_REPLAY_BOUNDS", "").strip()
    values: dict[str, Any] = {}
    defaults = Bounds().as_dict()
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        if name not in defaults:
            raise pytest.UsageError(f"KVFSM_REPLAY_BOUNDS: no bound {name!r}; expected one of {sorted(defaults)}")
        values[name] = bool(int(value)) if isinstance(defaults[name], bool) else int(value)
    return Bounds(**values)  # names checked against Bounds' fields above; values by Bounds.__post_init__


@pytest.mark.nightly
def test_nightly_every_edge_of_the_default_bounds_graph_replays() -> None:
    """The nightly profile (opt-in: ``pytest -m nightly tests/test_model_based.py -s``): every edge of the
    default-bounds graph replayed on the real scheduler, managers and workers, and every negative probe
    applied in every reachable state. Its time is recorded in the README. ``KVFSM_REPLAY_BOUNDS`` widens
    the bounds (see :func:`_nightly_bounds`)."""
    bounds = _nightly_bounds()
    result = explore(bounds)
    assert result.ok and result.graph is not None
    report = replay_edges(result)
    assert not report.mismatches, "\n\n".join(str(m) for m in report.mismatches)
    assert not report.probe_failures, "\n".join(report.probe_failures[:20])
    assert report.states == result.states and report.edges_replayed == result.edges
    print(
        f"\nnightly full-bounds replay at {bounds}: {result.states:,} states, {report.edges_replayed:,} edges "
        f"replayed, {report.probes:,} negative probes in {report.seconds:.0f} s"
    )
