"""Planted bugs, stateful half: each bug of tests/planted_bugs.py must be found by the state machines.

Three families: the bugs in the shared pure functions (PLANTED_BUGS, also seen by the model checker); the
lies of the copy backend (DATA_PLANE_LIES, engine machine); and the bugs outside the pure functions
(PENDING_TERM_MUTANTS: every has-pending term of the scheduler, the tiering manager and the file-system tier
dropped in turn; OUTSIDE_LIES: a tier reporting before its I/O ran, a promotion from the wrong tier, a
deadline queue that loses order), each caught by the machine named in :data:`CATCHERS`.

Every bug is planted through ``monkeypatch`` (undone when the test ends) and the machine then runs with a
bounded, deterministic budget (``derandomize``, ``database=None``, generation only). The test asserts that
Hypothesis finds a failing example and that the failure is about the planted bug (its message matches
what the checks say about that bug), and records after how many examples it was found: the count of
machine instances created up to and including the first failing one. The counts are printed (``-s``)
and collected in :data:`EXAMPLES_TO_FAILURE`.
"""

from __future__ import annotations

import importlib
import inspect
import re
import sys
from typing import ClassVar

import pytest
from helpers import defect_search
from hypothesis.errors import HypothesisException, StopTest
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
from planted_bugs import DATA_PLANE_LIES, OUTSIDE_LIES, PENDING_TERM_MUTANTS, PLANTED_BUGS
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
    machine: type[RuleBasedStateMachine],
    name: str,
    steps: int,
    expected: dict[str, str] = EXPECTED,
    max_examples: int = MAX_EXAMPLES,
) -> tuple[int, str]:
    counted = _counted(machine)
    with pytest.raises(Exception) as info:
        run_state_machine_as_test(
            counted,
            settings=defect_search(max_examples, steps, print_blob=False),
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


# ------------------------------------------------------------------------------- outside the pure functions
# Bugs planted in methods the model checker never calls (tests/planted_bugs.py): the has-pending terms of the
# scheduler, the tiering manager and the file-system tier, a tier that reports before its I/O ran, a
# promotion served by the wrong tier, a deadline queue that loses order. Each is caught by a spec-generated
# machine of the ci profile: the whole-system control machine (two secondary tiers, deadlines that expire out
# of order), or the tier conformance machine over the real FileSystemTier with its I/O held on its threads.

_PENDING = (
    r"has_pending_push_work\(\) is False|idle while|pending_work_covers_jobs|not terminal after the engine drained"
)
_TIER_OWN_WORK = r"its own work queued or running, but has_pending_work\(\) is False"

#: Which machine catches each mutant or lie, and what it must say.
CATCHERS: dict[str, tuple[str, str]] = {
    "scheduler.jobs": ("control", _PENDING),
    "scheduler.quarantine": ("control", _PENDING),
    "scheduler.manager": ("control", _PENDING),
    "tiering.transfers": ("control", _PENDING),
    "tiering.quarantine": ("control", _PENDING),
    "tiering.tiers": ("durable_fs", _TIER_OWN_WORK),
    "fs_tier.durability": ("durable_fs", _TIER_OWN_WORK),
    "tier_reports_before_io": ("fs", r"reported done, but the tier's copy"),
    "promotion_from_wrong_tier": ("control", r"served by the wrong tier"),
    "deadline_queue_loses_order": ("control", r"outlived its deadline"),
}


#: Budgets above MAX_EXAMPLES, with the reason: these need a rare coincidence (a load still in flight when
#: time reaches its deadline and not an older store's; a timed-out copy or tier transfer that has not
#: reported yet, with deadlines drawn in one config of three), found after tens to hundreds of examples here,
#: and derandomized seeds move with the install path, so the budget leaves room. A budget costs time only
#: when the mutant survives.
BUDGETS: dict[str, int] = {
    "deadline_queue_loses_order": 4000,
    "scheduler.quarantine": 4000,
    "tiering.quarantine": 4000,
}


def _catcher(kind: str) -> tuple[type[RuleBasedStateMachine], int]:
    """The machine class of ``kind`` and the steps per example it runs with in the ci profile."""
    if kind == "control":
        return ControlPlaneStateMachine, 50
    from test_conformance_kit import DurableFileSystemTierMachine, FileSystemTierMachine

    return (DurableFileSystemTierMachine if kind == "durable_fs" else FileSystemTierMachine), 30


def test_every_has_pending_term_has_a_mutant_that_matches_the_code() -> None:
    """The mutants drop terms that are really there: each term's source text is in the method it names, and
    every method that holds a term is mutated once per term it has."""
    per_method: dict[str, list[str]] = {}
    for name, mutant in PENDING_TERM_MUTANTS.items():
        module, _, qual = mutant.owner.partition(":")
        cls_name, _, method = qual.partition(".")
        source = inspect.getsource(getattr(getattr(importlib.import_module(module), cls_name), method))
        assert mutant.fragment in source, f"{name}: {mutant.fragment!r} is no longer in {mutant.owner}"
        per_method.setdefault(mutant.owner, []).append(name)
    # has_pending_push_work = jobs or _other_pending_work(); _other_pending_work = quarantine or manager;
    # TieringManager.has_pending_work = transfers or quarantine or tiers; FileSystemTier = durability.
    assert {m: len(n) for m, n in per_method.items()} == {
        "kvfsm.control.scheduler:OffloadingScheduler.has_pending_push_work": 1,
        "kvfsm.control.scheduler:OffloadingScheduler._other_pending_work": 2,
        "kvfsm.control.tiering:TieringManager.has_pending_work": 3,
        "kvfsm.tiers.fs:FileSystemTier.has_pending_work": 1,
    }
    assert set(CATCHERS) == set(PENDING_TERM_MUTANTS) | set(OUTSIDE_LIES)


@pytest.mark.parametrize("name", sorted(PENDING_TERM_MUTANTS))
def test_every_has_pending_term_mutant_is_killed(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, expected = CATCHERS[name]
    machine, steps = _catcher(kind)
    budget = BUDGETS.get(name, MAX_EXAMPLES)
    with PENDING_TERM_MUTANTS[name].plant(monkeypatch):
        first, _ = _find(machine, name, steps=steps, expected={name: expected}, max_examples=budget)
        assert first <= budget


@pytest.mark.parametrize("name", sorted(OUTSIDE_LIES))
def test_lies_outside_the_pure_functions_are_caught(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    kind, expected = CATCHERS[name]
    machine, steps = _catcher(kind)
    budget = BUDGETS.get(name, MAX_EXAMPLES)
    with OUTSIDE_LIES[name](monkeypatch):
        first, _ = _find(machine, name, steps=steps, expected={name: expected}, max_examples=budget)
        assert first <= budget
