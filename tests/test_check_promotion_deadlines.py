"""Promotion deadlines with deferred release (vLLM 0.34's ``JobResult.deferred_release``; kvfsm's quarantine):
``kvfsm check --promotions --deadlines N --promotion-deadlines`` lets a promotion's deadline pass; the manager's
next ``on_schedule_end`` times it out (after its poll, so a promotion whose I/O is over commits first). It is
failed at once and leaves the transfer map, but its slot stays reserved until its tier I/O is over, and it is
pending work until the poll that hands the slot back (spec/README.md, "Promotion deadlines and deferred
release"). Planted bugs (tests/planted_model_bugs.py): the slot handed back at the time-out, and the deferred
release not counted as pending work.
"""

from __future__ import annotations

import pytest
from planted_model_bugs import PROMOTION_DEADLINES

from kvfsm.check import Bounds, Model, explore
from kvfsm.check.model import EXPIRED, READY, RELEASE_DEFERRED, RELEASE_DUE, WRITING, State
from kvfsm.cli import main
from kvfsm.errors import ConfigError

ARGS = ["--promotions", "--deadlines", "1", "--promotion-deadlines", "--workers", "1", "--no-failures"]
ARGS += ["--preemptions", "0", "--quiet"]


def _timed_out(s: State) -> list[int]:
    return [c for c, t in enumerate(s.tier) if t.promote and t.status in (RELEASE_DEFERRED, RELEASE_DUE)]


def test_the_option_is_off_by_default_and_needs_promotions_and_a_deadline() -> None:
    assert not Bounds().promotion_deadlines
    with pytest.raises(ConfigError, match="promotion_deadlines"):
        Bounds(promotion_deadlines=True, deadlines=1)
    with pytest.raises(ConfigError, match="promotion_deadlines"):
        Bounds(promotion_deadlines=True, promotions=True)


def test_a_timed_out_promotion_holds_its_slot_until_its_io_is_over() -> None:
    model = Model(PROMOTION_DEADLINES)
    result = explore(model=model)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None and result.liveness_checked
    states = result.graph.states
    held = [s for s in states if _timed_out(s)]
    assert any(s.tier[c].status == RELEASE_DEFERRED for s in held for c in _timed_out(s))
    assert any(s.tier[c].status == RELEASE_DUE for s in held for c in _timed_out(s))
    for s in held:
        # Out of the transfer map, yet its slot is still reserved and it is still pending work.
        assert all(s.tier[c].harvested for c in _timed_out(s))
        assert all(s.slots[k] == WRITING for c in _timed_out(s) for k in s.tier[c].keys)
        assert model.has_pending_push_work(s.jobs, s.tier) and not model.transfers_pending(
            [s.tier[c] for c in _timed_out(s)]
        )
    # Every step notices a passed deadline: no promotion is still past its deadline after a step.
    graph = result.graph
    for _src, label, dst in graph.edges():
        if label == ("step",):
            assert not any(t.status == EXPIRED for t in states[dst].tier)
    # A timed-out promotion is never committed: once its I/O is over, the next poll frees its slot.
    for s in held:
        for c in _timed_out(s):
            rec = s.tier[c]
            after = s if rec.status == RELEASE_DUE else model.apply(s, ("tier", c, True))
            assert isinstance(after, State)
            nxt = model.apply(after, ("step",))
            if not isinstance(nxt, State):
                continue
            for key in rec.keys:
                assert nxt.slots[key] != READY and not (nxt.held[rec.tier] >> key & 1)


def test_kvfsm_check_runs_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *ARGS]) == 0
    assert "no invariant violated" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--promotion-deadlines", "--quiet"], "needs promotions=True and deadlines >= 1"),
        ([*ARGS, "--replay"], "drop --promotion-deadlines"),
        ([*ARGS, "--engine", "spin"], "not in the generated Promela model"),
    ],
)
def test_bad_uses_are_one_line_errors(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check", *args]) != 0
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
