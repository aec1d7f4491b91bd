"""The reset hold (vLLM 0.34's ``TieringOffloadingManager._promotions_held``): after ``reset_cache``, a store
copy the reset discarded may still write the primary slot that the reset freed, until a step flushes it; a
promotion submitted before then may fill that very slot, and the late copy overwrite it (spec/README.md,
"The reset hold").

``kvfsm check --late-writes`` checks for that late write where a promotion is submitted; ``--reset-hold``
models the hold. kvfsm's own TieringManager does not hold promotions, so the model without the hold (the
graph the checker explores by default) breaks ``stale_ids_ignored`` once the late write is checked.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfsm.check import Bounds, Model, explore, format_trace
from kvfsm.check.model import COPYING, STORE, UNLAUNCHED, State
from kvfsm.cli import main
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
        ([*ARGS, "--reset-hold", "--replay"], "drop --reset-hold"),
        ([*ARGS, "--late-writes", "--engine", "spin"], "not in the generated Promela model"),
    ],
)
def test_bad_uses_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
