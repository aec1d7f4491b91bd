"""Hypothesis stateful tests generated from spec/: the reference engine with real copies, and the
control plane alone.

The machines live in :mod:`kvfsm.testing` (:mod:`kvfsm.testing.engine`, :mod:`kvfsm.testing.control`);
this file runs them under the profile chosen by HYPOTHESIS_PROFILE (ci, dev, nightly; see conftest.py)
and checks that they stay tied to the spec: every spec event has a rule (checked when the class is
created), an event exempted from that rule is never fired by the implementation, and the run reached
the events its rules claim.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test, rule

from kvfsm.testing.control import CONTROL_EXEMPT, ControlPlaneStateMachine
from kvfsm.testing.coverage import SpecCoverageError, TransitionLog, covers, spec_covered, spec_events

_SUPPRESS = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]


def _run(machine: type[RuleBasedStateMachine], steps: int, scale: float = 1.0) -> Counter[str]:
    """Run ``machine`` under the loaded profile (examples scaled by ``scale``); the events it fired."""
    base = settings()
    log = TransitionLog()
    with log:
        run_state_machine_as_test(
            machine,
            settings=settings(
                base,
                max_examples=max(1, int(base.max_examples * scale)),
                stateful_step_count=steps,
                deadline=None,
                suppress_health_check=_SUPPRESS,
            ),
        )
    return Counter({f"{m}.{e}": n for (m, e), n in log.counts.items()})


def _check_reached(fired: Counter[str], exempt: dict[str, str], claimed: set[str]) -> None:
    wrongly_exempt = sorted(set(exempt) & set(fired))
    assert not wrongly_exempt, f"exempt events were fired by the implementation: {wrongly_exempt}; add rules for them"
    print(f"events fired: {len(set(fired) & claimed)}/{len(claimed)}; never fired: {sorted(claimed - set(fired))}")


# ---------------------------------------------------------------------------------------------- engine


def test_engine_machine_drives_the_reference_engine_against_the_spec() -> None:
    pytest.importorskip("torch")
    from kvfsm.testing.engine import ENGINE_EXEMPT, EngineStateMachine

    fired = _run(EngineStateMachine, steps=40, scale=1.0)
    claimed = set(EngineStateMachine.spec_coverage.covered)  # type: ignore[attr-defined]
    _check_reached(fired, ENGINE_EXEMPT, claimed)
    # The ci profile is deterministic: it must reach every event some rule claims.
    if settings().derandomize:
        assert claimed <= set(fired), f"the ci run never fired {sorted(claimed - set(fired))}"


# ---------------------------------------------------------------------------------------------- control


def test_control_machine_drives_the_control_plane_against_the_spec() -> None:
    fired = _run(ControlPlaneStateMachine, steps=50, scale=2.0)
    claimed = set(ControlPlaneStateMachine.spec_coverage.covered)  # type: ignore[attr-defined]
    _check_reached(fired, CONTROL_EXEMPT, claimed)
    if settings().derandomize:
        assert claimed <= set(fired), f"the ci run never fired {sorted(claimed - set(fired))}"


# ---------------------------------------------------------------------------------------------- coverage


def test_a_spec_event_without_a_rule_fails_when_the_class_is_created() -> None:
    with pytest.raises(SpecCoverageError, match=r"spec events with no rule: .*engine\.stop"):

        @spec_covered("engine")
        class Partial(RuleBasedStateMachine):
            @covers("engine.admit", "engine.all_finished", "engine.settle", "engine.shutdown")
            @rule()
            def go(self) -> None:
                pass


def test_a_rule_claiming_an_event_the_spec_lacks_fails() -> None:
    with pytest.raises(SpecCoverageError, match="not_an_event"):

        @spec_covered("engine")
        class Typo(RuleBasedStateMachine):
            @covers(*spec_events("engine"), "engine.not_an_event")
            @rule()
            def go(self) -> None:
                pass


def test_an_exemption_needs_a_reason_and_must_not_shadow_a_rule() -> None:
    with pytest.raises(SpecCoverageError, match="drop the exemption"):

        @spec_covered("engine", exempt={"engine.stop": "not reachable"})
        class Shadowed(RuleBasedStateMachine):
            @covers(*spec_events("engine"))
            @rule()
            def go(self) -> None:
                pass

    with pytest.raises(SpecCoverageError, match="gives no reason"):

        @spec_covered("engine", exempt={"engine.stop": " "})
        class Unexplained(RuleBasedStateMachine):
            @covers("engine.admit", "engine.all_finished", "engine.settle", "engine.shutdown")
            @rule()
            def go(self) -> None:
                pass


def test_covers_on_a_method_that_is_not_a_rule_fails() -> None:
    with pytest.raises(SpecCoverageError, match="is not a @rule"):

        @spec_covered("engine")
        class NotARule(RuleBasedStateMachine):
            @covers(*spec_events("engine"))
            def helper(self) -> None:
                pass

            @rule()
            def go(self) -> None:
                pass
