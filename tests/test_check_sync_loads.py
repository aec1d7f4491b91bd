"""Bounded synchronous loads (vLLM 0.34's ``sync_load_budget_bytes``): ``kvfsm check --sync-load-budget N``
lets a lookup hit of at most the step's remaining budget load in the step that schedules its request, the
step waiting for that load's copies before its forward (spec/README.md, "Bounded synchronous loads").

The checker must say that responsiveness still holds (a sync load is only issued in a step that runs its own
request, so the engine is never finishing or draining then), report the most chunks a blocked step waits for
(at most the budget), and catch a worker whose wait covers more than the step's sync loads
(``step_wait_bounded``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from planted_model_bugs import PATCHES_MODEL, plant_sync_wait_covers_the_stream

from kvfsm.check import Bounds, Model, explore, format_trace
from kvfsm.check.model import COPYING, DONE_FAIL, E_RUN, LOAD, STORE, State, sync_loads
from kvfsm.check.properties import DrainMode
from kvfsm.cli import main
from kvfsm.errors import ConfigError
from kvfsm.machines.names import EngineState, JobState, RequestState

#: The default bounds (two prompts sharing chunk 0, so a hit may be one chunk or two; W = 2; a preemption)
#: without the tier and the reset: about ten thousand states.
SMALL = Bounds(tiers=0, resets=0)
#: Three requests of one chunk: a sync step with a request arriving while it waits.
THREE = Bounds(requests=3, prompts=1, chunks=1, slots=1, groups=2, resets=0, preemptions=0)
SMALL_ARGS = ["--tiers", "0", "--resets", "0", "--quiet"]


def _budget(bounds: Bounds, n: int) -> Bounds:
    return dataclasses.replace(bounds, sync_load_budget=n)


def _sync_blocked(s: State) -> bool:
    return s.blocked and bool(sync_loads(s.reqs, s.jobs))


def test_the_option_is_off_by_default_and_checked() -> None:
    assert Bounds().sync_load_budget == 0
    with pytest.raises(ConfigError, match="sync_load_budget"):
        Bounds(sync_load_budget=-1)
    with pytest.raises(ConfigError, match="non_blocking"):
        Model(_budget(SMALL, 1), DrainMode.BLOCKING)


def test_without_a_budget_no_step_waits() -> None:
    result = explore(SMALL)
    assert result.ok and result.max_step_wait_chunks == 0 and result.step_wait_arrivals == 0
    assert result.graph is not None and not any(s.blocked for s in result.graph.states)


@pytest.mark.parametrize("budget", [1, 2])
def test_a_budget_keeps_responsiveness_and_bounds_the_wait(budget: int) -> None:
    model = Model(_budget(SMALL, budget))
    result = explore(model=model)
    assert result.ok, [str(v) for v in result.violations]
    assert result.liveness_checked and result.responsiveness_checks > 0
    # Some step waits for sync loads, never for more chunks than the budget.
    assert 1 <= result.max_step_wait_chunks <= budget
    assert result.graph is not None
    blocked = [s for s in result.graph.states if s.blocked]
    assert blocked and all(_sync_blocked(s) for s in blocked)
    for s in blocked:
        # The engine runs the step: it is never finishing or draining while it waits for its sync loads.
        assert s.engine is EngineState.RUNNING
        assert model.step_wait_chunks(s) <= budget
        for j in sync_loads(s.reqs, s.jobs):
            job = s.jobs[j]
            assert job.kind == LOAD and s.reqs[job.req].eng == E_RUN
            assert s.reqs[job.req].phase is RequestState.LOADING
        # Only the step's own loads are sync: no store of the request beside it (one_load_per_request).
        assert not any(
            j.kind == STORE and j.req in {s.jobs[k].req for k in sync_loads(s.reqs, s.jobs)}
            for j in s.jobs
            if j.state in (JobState.SUBMITTED, JobState.IN_FLIGHT)
        )


def test_an_arrival_waits_for_a_sync_step_only_while_the_engine_runs() -> None:
    result = explore(_budget(THREE, 1))
    assert result.ok and result.max_step_wait_chunks == 1
    assert result.step_wait_arrivals > 0 and result.responsiveness_checks > 0


def test_a_failed_sync_load_throws_its_forward_away() -> None:
    model = Model(_budget(SMALL, 2))
    result = explore(model=model)
    assert result.graph is not None
    failed = [
        s
        for s in result.graph.states
        if _sync_blocked(s)
        and any(DONE_FAIL in s.jobs[j].shards for j in sync_loads(s.reqs, s.jobs))
        and not any(COPYING in s.jobs[j].shards for j in sync_loads(s.reqs, s.jobs))
    ]
    assert failed
    for s in failed:
        (j,) = sync_loads(s.reqs, s.jobs)
        i = s.jobs[j].req
        nxt = model.apply(s, ("unblock",))
        assert isinstance(nxt, State) and not nxt.blocked
        kept = model.last_kept
        r = nxt.reqs[i if kept is None else kept[0].index(i)]
        # The forward ran from the loaded tokens; the failure sends the request back to recompute them.
        assert r.eng == E_RUN and r.computed == 0 and r.phase is RequestState.RUNNING


@PATCHES_MODEL
def test_a_worker_that_syncs_the_whole_stream_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    bounds = _budget(Bounds(), 1)
    with plant_sync_wait_covers_the_stream(monkeypatch):
        model = Model(bounds)
        result = explore(model=model)
        text = format_trace(result.violations[0], model) if result.violations else ""
    (v,) = result.violations
    assert v.invariant == "step_wait_bounded" and v.length == 10
    assert v.label == ("step",)
    before = v.states[-1]
    # A store of the other request is still copying, and the step's sync load is about to launch.
    assert any(j.kind == STORE and COPYING in j.shards for j in before.jobs)
    (j,) = sync_loads(before.reqs, before.jobs)
    assert len(before.jobs[j].keys) == 1 and all(sh == 0 for sh in before.jobs[j].shards)
    assert "not one of its sync loads" in v.detail and "store job" in v.detail
    assert "VIOLATION step_wait_bounded" in text


def test_kvfsm_check_reports_the_wait(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *SMALL_ARGS, "--sync-load-budget", "2"]) == 0
    out = capsys.readouterr().out
    assert "sync loads of at most 2 chunk(s) per step: a blocked step waits for at most 2 chunk(s)" in out
    assert main(["check", *SMALL_ARGS, "--sync-load-budget", "1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["bounds"]["sync_load_budget"] == 1 and summary["max_step_wait_chunks"] == 1
    assert summary["violations"] == []


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sync-load-budget", "-1"], "expected an integer from 0 to 16"),
        (["--sync-load-budget", "17"], "expected an integer from 0 to 16"),
        (["--sync-load-budget", "x"], "expected an integer from 0 to 16"),
        (["--sync-load-budget", "1", "--drain", "blocking"], "needs the non_blocking drain"),
        (["--sync-load-budget", "1", "--replay"], "drop --sync-load-budget"),
        (["--sync-load-budget", "1", "--engine", "spin"], "not in the generated Promela model"),
    ],
)
def test_bad_uses_of_the_option_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code: int | str | None
    try:
        code = main(["check", *SMALL_ARGS, *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    assert code not in (0, None)
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_help_shows_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    assert "--sync-load-budget N" in capsys.readouterr().out
