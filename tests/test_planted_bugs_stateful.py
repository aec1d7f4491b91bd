"""Planted bugs, stateful half: each bug of tests/planted_bugs.py must be found by the state machines.

Every bug is planted through ``monkeypatch`` (undone when the test ends) and the machine then runs with a
bounded, deterministic budget (``derandomize``, ``database=None``, generation only). The test asserts that
Hypothesis finds a failing example and that the failure is about the planted bug (its message matches
what the checks say about that bug), and records after how many examples it was found: the count of
machine instances created up to and including the first failing one. The counts are printed (``-s``)
and collected in :data:`EXAMPLES_TO_FAILURE`.
"""

from __future__ import annotations

import re
import sys
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import HypothesisException, StopTest
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
from planted_bugs import DATA_PLANE_LIES, PLANTED_BUGS
from typing_extensions import override

from kvfsm.testing.control import ControlPlaneStateMachine

#: What each machine's checks say when they see each bug (a failure with another message does not count).
EXPECTED: dict[str, str] = {
    "partial_acks_ignored": r"has_pending_push_work\(\) is False|pending_work_covers_jobs|idle while",
    "idle_with_manager_work": r"has_pending_push_work\(\) is False|pending_work_covers_jobs|idle while"
    r"|not terminal after the engine drained",
    "readable_on_first_ack": r"readable_only_after_commit|wrong bytes|differ from what was stored|expected writing"
    r"|has_pending_push_work\(\) is False while: copy|which is not awaited"
    r"|data plane: has_pending_push_work\(\) is False while copy",
    "evict_reading_slot": r"evict_only_ready_unreferenced|expected reading|wrong bytes|differ from what was stored"
    r"|cannot handle event 'evict'",
    "fence_flush_skipped": r"wrong bytes|differ from what was stored|overwritten",
    "reset_keeps_stale_threshold": r"stale|which is not awaited|UnknownJobError"
    r"|has_pending_push_work\(\) is False while",
}

#: What the engine machine must say about each lie of the data plane: the report-time byte check at the poll
#: that reports the job (nothing else counts).
EXPECTED_LIES: dict[str, str] = {
    "poll_reports_unfinished": r"poll reported (store|load) job \d+ finished, but",
    "future_done_early": r"poll reported (store|load) job \d+ finished, but",
}

#: machine name -> bug -> examples until the first failure (filled as the tests run).
EXAMPLES_TO_FAILURE: dict[str, dict[str, int]] = {}

MAX_EXAMPLES = 1000  # a budget, not a target: each bug is found far sooner (see the report)


def _counted(base: type[RuleBasedStateMachine]) -> type[RuleBasedStateMachine]:
    """A subclass that counts the examples it ran and remembers the first one that failed.

    An example Hypothesis abandons (StopTest: it ran out of data, or an assumption failed) is not
    counted: only examples that ran to completion or failed.
    """

    class Counted(base):  # type: ignore[valid-type, misc]
        ran: ClassVar[int] = 0
        first_failure: ClassVar[int | None] = None

        def teardown(self) -> None:
            # teardown runs in the runner's ``finally``: a pending exception means this example failed; an
            # example can also fail in teardown itself (the final shutdown).
            exc = sys.exc_info()[1]
            if isinstance(exc, StopTest | HypothesisException):
                super().teardown()
                return
            cls = type(self)
            cls.ran += 1
            failed = exc is not None
            try:
                super().teardown()
            except BaseException:
                failed = True
                raise
            finally:
                if failed and cls.first_failure is None:
                    cls.first_failure = cls.ran

    Counted.__name__ = f"Counted{base.__name__}"
    return Counted


def _find(
    machine: type[RuleBasedStateMachine], name: str, steps: int, expected: dict[str, str] = EXPECTED
) -> tuple[int, str]:
    counted = _counted(machine)
    with pytest.raises(Exception) as info:
        run_state_machine_as_test(
            counted,
            settings=settings(
                max_examples=MAX_EXAMPLES,
                stateful_step_count=steps,
                database=None,
                derandomize=True,
                deadline=None,
                phases=[Phase.generate],
                report_multiple_bugs=False,
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            ),
        )
    first = counted.first_failure  # type: ignore[attr-defined]
    assert first is not None, f"{name}: Hypothesis raised {info.value!r} but no example failed"
    message = f"{type(info.value).__name__}: {info.value}"
    assert re.search(expected[name], message), f"{name}: the failure is not about the planted bug: {message[:500]}"
    EXAMPLES_TO_FAILURE.setdefault(machine.__name__, {})[name] = first
    print(f"{machine.__name__}: {name} found after {first} example(s): {message.splitlines()[0][:160]}")
    return first, message


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_engine_machine_finds_planted_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("torch")
    from kvfsm.testing.engine import EngineStateMachine

    with PLANTED_BUGS[name](monkeypatch):
        first, _ = _find(EngineStateMachine, name, steps=40)
        assert first <= MAX_EXAMPLES


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_control_machine_finds_planted_bug(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with PLANTED_BUGS[name](monkeypatch):
        first, _ = _find(ControlPlaneStateMachine, name, steps=50)
        assert first <= MAX_EXAMPLES


def test_planted_bugs_cover_the_six_of_the_issue() -> None:
    assert set(PLANTED_BUGS) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(DATA_PLANE_LIES))
def test_engine_machine_catches_a_lying_data_plane(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy backend that lies about completion is caught by the engine machine's report-time byte check,
    with its copies genuinely held on their threads when the lie is told."""
    pytest.importorskip("torch")
    from kvfsm.testing.engine import EngineStateMachine

    with DATA_PLANE_LIES[name](monkeypatch):
        first, _ = _find(EngineStateMachine, name, steps=40, expected=EXPECTED_LIES)
        assert first <= MAX_EXAMPLES


def test_data_plane_lies_are_the_two_of_the_issue() -> None:
    assert set(DATA_PLANE_LIES) == set(EXPECTED_LIES)


@pytest.mark.parametrize("name", ["partial_acks_ignored", "idle_with_manager_work"])
def test_the_data_plane_ground_truth_alone_finds_pending_work_bugs(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With every bookkeeping check switched off, the ground-truth invariant (copies held on their threads or
    unpolled in the real backends, transfers held by the tier) still finds the pending-work bugs."""
    pytest.importorskip("torch")
    from kvfsm.testing.engine import EngineStateMachine

    class DataPlaneOnly(EngineStateMachine):
        @override
        def system_violations(self) -> list[str]:
            return self.h.data_plane_problems()

    with PLANTED_BUGS[name](monkeypatch):
        first, _ = _find(DataPlaneOnly, name, steps=40, expected={name: r"data plane: "})
        assert first <= MAX_EXAMPLES
