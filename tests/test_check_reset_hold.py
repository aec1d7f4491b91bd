"""The reset hold (vLLM 0.34's ``TieringOffloadingManager._promotions_held``): after ``reset_cache``, a store
copy the reset discarded may still write the primary slot that the reset freed, until a step flushes it; a
promotion submitted before then may fill that very slot, and the late copy overwrite it (spec/README.md,
"The reset hold").

``kvfsm check --late-writes`` checks for that late write where a promotion is submitted; ``--reset-hold``
models the hold as kvfsm implements it (the scheduler's reset fence, ``on_reset_flushed``, the tiering
manager's ``promotions_held``). The model without the hold (the graph the checker explores by default)
breaks ``stale_ids_ignored`` once the late write is checked; with it, ``--replay`` follows the
implementation edge for edge.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from planted_model_bugs import PATCHES_MODEL, PLANTED_MODEL_BUGS

from kvfsm.check import Bounds, Model, explore, format_trace
from kvfsm.check.model import COPYING, STORE, UNLAUNCHED, State
from kvfsm.check.replay import replay_edges
from kvfsm.cli import main
from kvfsm.control.tiering import TieringManager
from kvfsm.errors import ConfigError
from kvfsm.machines.names import JobState

#: The default bounds with promotions, one worker and no failures: a reset, a preemption, about 28k states.
PROMOTING = Bounds(promotions=True, workers=1, failures=False)
ARGS = ["--promotions", "--workers", "1", "--no-failures", "--quiet"]


def _late_copy(s: State) -> bool:
    """A store copy that reset_cache discarded still runs."""
    return any(j.kind == STORE and (j.state is JobState.STALE or j.ignored) and COPYING in j.shards for j in s.jobs)


def _queued_promotion(s: State) -> bool:
    return any(t.promote and t.status == UNLAUNCHED for t in s.tier)


def test_the_options_are_off_by_default_and_need_promotions() -> None:
    assert not Bounds().late_writes and not Bounds().reset_hold
    for option in ("late_writes", "reset_hold"):
        with pytest.raises(ConfigError, match="promotions"):
            Bounds(**{option: True})


def test_without_the_check_the_late_write_is_not_seen() -> None:
    """The graph the checker explores by default has the hazard in it: a promotion queued while a discarded
    copy still runs. No invariant looks at it there."""
    result = explore(PROMOTING)
    assert result.ok and result.graph is not None
    assert any(_late_copy(s) and _queued_promotion(s) for s in result.graph.states)


def test_promotions_not_held_after_a_reset_meet_a_late_write() -> None:
    model = Model(dataclasses.replace(PROMOTING, late_writes=True))
    result = explore(model=model)
    (v,) = result.violations
    assert v.invariant == "stale_ids_ignored" and v.length == 11 and v.label == ("step",)
    assert "reset" in [lab[0] for lab in v.path]
    before = v.states[-1]
    # A store the reset discarded is still copying, and the lookup after the reset queued a promotion, which
    # this step submits before it flushes the discarded copy.
    assert _late_copy(before) and _queued_promotion(before)
    assert "reset_cache discarded may still write" in v.detail
    assert "VIOLATION stale_ids_ignored" in format_trace(v, model)


def test_the_reset_hold_keeps_every_promotion_after_the_late_writes() -> None:
    model = Model(dataclasses.replace(PROMOTING, late_writes=True, reset_hold=True))
    result = explore(model=model)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None and result.liveness_checked
    states = result.graph.states
    assert not any(_late_copy(s) and _queued_promotion(s) for s in states)
    # The hold is not vacuous: discarded copies run beside a lookup's reservations, and promotions happen.
    assert any(_late_copy(s) for s in states)
    assert any(_queued_promotion(s) for s in states)


def test_kvfsm_check_finds_the_late_write(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *ARGS, "--late-writes", "--brief"]) == 1
    out = capsys.readouterr().out
    assert "VIOLATION stale_ids_ignored" in out and "counterexample: 11 events" in out
    assert main(["check", *ARGS, "--late-writes", "--reset-hold"]) == 0
    assert "no invariant violated" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quiet", "--late-writes"], "need promotions=True"),
        (["--quiet", "--reset-hold"], "need promotions=True"),
        # The implementation holds promotions after a reset: the model without the hold diverges from it.
        ([*ARGS, "--replay"], "add --reset-hold"),
        ([*ARGS, "--late-writes", "--replay"], "add --reset-hold"),
        ([*ARGS, "--late-writes", "--engine", "spin"], "not in the generated Promela model"),
    ],
)
def test_bad_uses_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


#: Promotions after a reset meet a discarded copy still running here (the counterexample of
#: test_promotions_not_held_after_a_reset_meet_a_late_write, with one GPU group): about 11k states.
REPLAYED = Bounds(
    requests=2, prompts=2, chunks=2, workers=1, slots=2, groups=1, tiers=1, promotions=True, failures=False
)
REPLAY_ARGS = ["--requests", "2", "--prompts", "2", "--chunks", "2", "--workers", "1", "--slots", "2"]
REPLAY_ARGS += ["--groups", "1", "--tiers", "1", "--promotions", "--no-failures", "--quiet"]


def test_the_implementation_replays_the_reset_hold(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvfsm check --promotions --late-writes --reset-hold --replay``: every edge of the model with the hold
    replays on kvfsm's scheduler and TieringManager, every disabled event probed, at bounds where promotions
    after a reset meet a discarded copy that still runs."""
    result = explore(dataclasses.replace(REPLAYED, late_writes=True, reset_hold=True))
    assert result.ok and result.graph is not None
    # Not vacuous: the lookups after a reset meet a discarded copy that still runs (held), and promote
    # what the tier holds once it has reported.
    assert any(_late_copy(s) for s in result.graph.states)
    assert any(_queued_promotion(s) for s in result.graph.states)
    assert main(["check", *REPLAY_ARGS, "--late-writes", "--reset-hold", "--json", "--replay"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["violations"] == [] and data["states"] == result.states
    assert data["replay"]["edges_replayed"] == data["edges"] == result.edges
    assert data["replay"]["mismatches"] == [] and data["replay"]["probe_failures"] == []
    assert data["replay"]["probes"] > 0


def test_a_manager_without_the_hold_is_caught_by_the_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TieringManager that forgets its hold at reset_cache (as kvfsm's did before the fix) promotes where
    the model with the hold answers MISS: the replay of the model's graph is not vacuous."""
    result = explore(dataclasses.replace(REPLAYED, reset_hold=True))
    assert result.ok
    reset_cache = TieringManager.reset_cache

    def forgetful(self: TieringManager) -> None:
        reset_cache(self)
        self.on_reset_flushed()

    monkeypatch.setattr(TieringManager, "reset_cache", forgetful)
    report = replay_edges(result, probes=False, max_mismatches=1)
    assert report.mismatches
    assert "looks up" in str(report.mismatches[0]) and "reset" in str(report.mismatches[0])


@PATCHES_MODEL
def test_the_model_without_the_hold_is_caught_and_the_implementation_does_not_follow_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The planted manager without the hold (tests/planted_model_bugs.py) breaks stale_ids_ignored under
    ``--reset-hold --replay``, and the implementation, which holds, does not follow its counterexample."""
    plant, _ = PLANTED_MODEL_BUGS["promotions_not_held_after_reset"]
    with plant(monkeypatch):
        code = main(["check", *REPLAY_ARGS, "--late-writes", "--reset-hold", "--brief", "--replay"])
    out = capsys.readouterr().out
    assert code == 1 and "VIOLATION stale_ids_ignored" in out
    assert "the implementation does NOT follow the stale_ids_ignored counterexample" in out
