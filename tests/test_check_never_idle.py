"""A tier whose pending work never ends (vLLM's KVCRSecondaryTierManager.has_pending_work() returns True
unconditionally): ``kvfsm check --tier-pending always`` must find that the engine never goes idle, by the
liveness check alone, with a counterexample that ends in the cycle the engine cannot leave
(spec/README.md, "A tier whose pending work never ends: vLLM's KVCR tier").
"""

from __future__ import annotations

import dataclasses
import json
from array import array

import pytest

from kvfsm.check import LIVENESS, Bounds, Model, explore, format_trace
from kvfsm.check.bfs import Graph, _lasso
from kvfsm.check.model import E_RUN, State
from kvfsm.cli import main
from kvfsm.errors import ConfigError
from kvfsm.machines.names import EngineState

#: One request of one chunk, one tier: the smallest scope that shows the hazard (under a hundred states).
TINY = Bounds(requests=1, prompts=1, chunks=1, slots=1, groups=1, tiers=1, resets=0, preemptions=0)
#: W = 2, a tier, a reset and a preemption: a few thousand states.
SMALL = Bounds(requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, resets=1, preemptions=1)
TINY_ARGS = ["--requests", "1", "--prompts", "1", "--chunks", "1", "--slots", "1", "--groups", "1"]
TINY_ARGS += ["--resets", "0", "--preemptions", "0", "--quiet"]


def _always(bounds: Bounds) -> Bounds:
    return dataclasses.replace(bounds, tier_pending_always=True)


def test_the_default_tier_is_honest_and_the_variant_needs_a_tier() -> None:
    assert not Bounds().tier_pending_always
    with pytest.raises(ConfigError, match="tier_pending_always"):
        Bounds(tiers=0, tier_pending_always=True)


def test_an_honest_tier_lets_the_engine_go_idle() -> None:
    result = explore(TINY)
    assert result.ok and result.liveness_checked
    # After its request has come and gone, the engine is idle again.
    assert result.graph is not None and any(
        s.engine is EngineState.IDLE and s.arrivals == 1 for s in result.graph.states
    )
    assert explore(SMALL).ok


def test_a_tier_always_pending_never_lets_the_engine_go_idle() -> None:
    bounds = _always(TINY)
    model = Model(bounds)
    result = explore(model=model)
    assert [v.invariant for v in result.violations] == [LIVENESS]
    v = result.violations[0]
    # The shortest path to the first state that cannot reach idle: the first arrival (admitted at once).
    assert [lab[0] for lab in v.path] == ["arrive"] and v.label is None and v.length == 1
    assert v.states[-1].engine is EngineState.RUNNING
    # Then a run by progress events only, ending in a cycle where nothing is left and the engine drains.
    assert v.lasso and 0 <= v.loop < len(v.lasso)
    assert all(lab[0] not in ("arrive", "reset", "shutdown") for lab in v.lasso)
    cycle_states = v.lasso_states[v.loop :]
    before_cycle = v.lasso_states[v.loop - 1] if v.loop > 0 else v.states[-1]
    assert cycle_states[-1] == before_cycle  # the lasso closes
    for s in cycle_states:
        assert s.engine is EngineState.DRAINING and not s.reqs and not s.jobs and not s.tier
        assert Model.transfer_remains(s) is None and model.has_pending_push_work(s.jobs, s.tier)
    assert [lab[0] for lab in v.lasso[v.loop :]] == ["step"]
    text = format_trace(v, model)
    assert "VIOLATION liveness" in text and "this state breaks liveness" in text
    assert "the engine runs a step (engine draining)  <-- the cycle starts here" in text
    assert "repeats forever" in text
    assert "no transfer remains, yet has_pending_push_work() is True: the engine never goes idle" in text
    # Without the model (canonical indices) the run is printed too.
    assert "repeats forever" in format_trace(v)


def test_the_variant_breaks_nothing_but_liveness() -> None:
    """A signal that is True too often breaks no invariant and not responsiveness: every arrival while the
    engine drains is still looked up at the next step."""
    result = explore(_always(SMALL), stop_at_first=False)
    assert {v.invariant for v in result.violations} == {LIVENESS}
    assert result.complete and result.responsiveness_checks > 0


def test_two_tiers_with_a_kvcr_tier_below_never_go_idle() -> None:
    bounds = _always(dataclasses.replace(TINY, tiers=2, slots=2))
    result = explore(bounds)
    assert [v.invariant for v in result.violations] == [LIVENESS]


def test_cli_tier_pending_always_exits_1_with_the_cycle(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *TINY_ARGS]) == 0
    assert "no invariant violated" in capsys.readouterr().out
    assert main(["check", *TINY_ARGS, "--tier-pending", "always"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION liveness" in out and "shortest counterexample: 1 events" in out
    assert "<-- the cycle starts here" in out and "the engine never goes idle" in out
    assert main(["check", *TINY_ARGS, "--tier-pending", "always", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    (v,) = data["violations"]
    assert v["invariant"] == LIVENESS and data["bounds"]["tier_pending_always"] is True
    assert v["lasso"][v["loop"] :] == ["the engine runs a step (engine draining)"]


def test_cli_refuses_the_variant_where_it_cannot_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *TINY_ARGS, "--tier-pending", "always", "--tiers", "0"]) == 2
    assert "needs a secondary tier" in capsys.readouterr().err
    assert main(["check", *TINY_ARGS, "--tier-pending", "always", "--replay"]) == 2
    err = capsys.readouterr().err
    assert "--tier-pending always" in err and "Traceback" not in err
    assert main(["check", *TINY_ARGS, "--tier-pending", "honest"]) == 0
    capsys.readouterr()


# --------------------------------------------------------------------------- the run after a liveness violation


def _graph(n: int, edges: list[tuple[int, str, int]], nothing_left_in: frozenset[int] = frozenset()) -> Graph:
    """A synthetic explored graph of ``n`` states, edges as (source, event kind, destination). Each state is
    one where a request still runs, except those in ``nothing_left_in``: an engine draining with nothing left."""
    explored = explore(TINY).graph
    assert explored is not None
    busy = next(s for s in explored.states if s.reqs and s.reqs[0].eng == E_RUN)
    nothing_left = Model(TINY).initial._replace(engine=EngineState.DRAINING)
    states: list[State] = [nothing_left if k in nothing_left_in else busy for k in range(n)]
    labels: list[tuple[str]] = []
    for _, kind, _ in edges:
        if (kind,) not in labels:
            labels.append((kind,))
    return Graph(
        states,
        array("i", [-1] * n),
        [-1] * n,
        array("i", [src for src, _, _ in edges]),
        array("i", [dst for _, _, dst in edges]),
        array("i", [labels.index((kind,)) for _, kind, _ in edges]),
        list(labels),
    )


def test_the_run_ends_in_the_nearest_cycle() -> None:
    # 0 -> 1 -> 2 -> 3 -> 1, and 0 -> 4 (a dead end); an arrival edge 3 -> 0 is not progress.
    g = _graph(5, [(0, "step", 1), (0, "finish", 4), (1, "copy", 2), (2, "step", 3), (3, "step", 1), (3, "arrive", 0)])
    after, events, loop = _lasso(g, 0)
    assert after == [1, 2, 3, 1] and loop == 1
    assert [g.labels[e][0] for e in events] == ["step", "copy", "step", "step"]


def test_without_a_cycle_the_run_ends_where_no_progress_event_leaves() -> None:
    g = _graph(4, [(0, "step", 1), (1, "copy", 2), (2, "step", 3), (3, "reset", 0)])
    after, events, loop = _lasso(g, 0)
    assert after == [1, 2, 3] and loop == -1 and len(events) == 3


def test_a_state_on_its_own_cycle_is_its_own_run() -> None:
    g = _graph(2, [(0, "step", 0), (0, "step", 1)])
    after, _, loop = _lasso(g, 0)
    assert after == [0] and loop == 0


def test_the_run_prefers_a_cycle_where_nothing_is_left() -> None:
    # 0 -> 1 -> 1 (a request still runs there) is nearer than 0 -> 2 -> 3 -> 3 (nothing left in 3).
    g = _graph(4, [(0, "step", 1), (0, "copy", 2), (1, "step", 1), (2, "step", 3), (3, "step", 3)], frozenset({3}))
    after, _, loop = _lasso(g, 0)
    assert after == [2, 3, 3] and loop == 2
    plain = _graph(4, [(0, "step", 1), (0, "copy", 2), (1, "step", 1), (2, "step", 3), (3, "step", 3)])
    assert _lasso(plain, 0)[0] == [1, 1]
