"""Planted-bug self-test, model-checker side (issue 4, part 5).

Each bug of tests/planted_bugs.py is planted through monkeypatch in a pure decision that the real system
and the model checker share. For each, the checker must find a violation at the default bounds, with a
shortest counterexample whose length is recorded here; and the real implementation, driven along that
counterexample, must follow it event for event (so the violation is one of the real system, not an
artefact of the model).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from planted_bugs import PLANTED_BUGS

from kvfsm.check import Bounds, Model, explore, format_trace
from kvfsm.check.invariants import SystemView, check_all
from kvfsm.check.replay import abstract, replay_path
from kvfsm.errors import InvalidTransition, KvfsmError, UnknownJobError

BOUNDS = Bounds()  # the CLI's default bounds

#: name -> (the invariant the checker reports, the counterexample length in events, BFS-shortest).
EXPECTED: dict[str, tuple[str, int]] = {
    "partial_acks_ignored": ("pending_work_covers_jobs", 5),
    "idle_with_manager_work": ("pending_work_covers_jobs", 4),
    "readable_on_first_ack": ("readable_only_after_commit", 5),
    "evict_reading_slot": ("evict_only_ready_unreferenced", 7),
    "fence_flush_skipped": ("gpu_source_not_overwritten", 10),
    "reset_keeps_stale_threshold": ("stale_ids_ignored", 5),
}

#: What the implementation itself does at the counterexample's last event, where it can tell.
RAISES: dict[str, type[KvfsmError]] = {
    "evict_reading_slot": InvalidTransition,  # the slot machine refuses to evict a reading slot
    "reset_keeps_stale_threshold": UnknownJobError,  # the late ack of a discarded job is not ignored
}


def test_every_planted_bug_has_an_expectation() -> None:
    assert set(EXPECTED) == set(PLANTED_BUGS)


def test_no_violation_without_a_planted_bug() -> None:
    result = explore(BOUNDS, check_liveness=False, keep_graph=False)
    assert result.ok and result.complete


@pytest.mark.parametrize("name", sorted(PLANTED_BUGS))
def test_model_checker_finds_planted_bug(
    name: str, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    with PLANTED_BUGS[name](monkeypatch):
        model = Model(BOUNDS)
        result = explore(BOUNDS, model=model, keep_graph=False)
        assert result.violations, f"the model checker missed planted bug {name}"
        v = result.violations[0]
        record_property("counterexample_length", v.length)
        print(f"\n{name}: {v.invariant}, counterexample of {v.length} events ({result.states} states explored)")
        print(format_trace(v, model, states=False))
        invariant, length = EXPECTED[name]
        assert v.invariant == invariant
        assert v.length == length

        # The real implementation, with the same bug, follows the counterexample event for event...
        h = replay_path(BOUNDS, model, v.path, v.states)
        if v.label is None:
            # ...into the violating state itself; where the implementation's own checkers can see it, they do.
            seen = {viol.invariant for viol in check_all(SystemView(h.sched, h.engine.state))}
            if name in ("partial_acks_ignored", "idle_with_manager_work"):
                assert invariant in seen
            return
        # ...up to the violating event, which it then either refuses with a typed error or takes unguarded.
        _, refs = abstract(h, model)
        if name in RAISES:
            with pytest.raises(RAISES[name]):
                h.apply(v.label, refs)
        else:
            h.apply(v.label, refs)
