"""Planted bugs outside the shared pure decisions (tests/planted_model_bugs.py), each caught by
``kvfsm check``'s own ground truth: the model's shard and tier states (issue 10, item 9).

For each bug the checker must find a violation with a short counterexample. The expected invariant and
the BFS-shortest length are recorded here, so a change in what the checker sees is a visible diff.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from planted_model_bugs import PATCHES_MODEL, PLANTED_MODEL_BUGS

from kvfsm.check import Bounds, Model, explore, format_trace
from kvfsm.check.model import COPYING, SYNCING
from kvfsm.machines.names import EngineState, JobState

pytestmark = PATCHES_MODEL

#: name -> (the invariant the checker reports, the counterexample length in events, BFS-shortest).
EXPECTED: dict[str, tuple[str, int]] = {
    "tiering_ignores_transfers": ("pending_work_covers_jobs", 4),
    "tiering_ignores_tiers": ("pending_work_covers_jobs", 6),
    "backend_reports_running_copies": ("readable_only_after_commit", 3),
    "tier_reports_before_io": ("evict_only_ready_unreferenced", 5),
    "promotion_from_wrong_tier": ("readable_only_after_commit", 7),
    "deadline_queue_loses_entries": ("deadlines_noticed", 8),
    "quarantine_not_pending": ("pending_work_covers_jobs", 5),
    "sync_wait_covers_the_stream": ("step_wait_bounded", 10),
    "promotions_not_held_after_reset": ("stale_ids_ignored", 11),
    "promotion_released_at_time_out": ("readable_only_after_commit", 11),
    "deferred_release_not_pending": ("pending_work_covers_jobs", 12),
}


def test_every_planted_model_bug_has_an_expectation() -> None:
    assert set(EXPECTED) == set(PLANTED_MODEL_BUGS)


@pytest.mark.parametrize("name", sorted(PLANTED_MODEL_BUGS))
def test_kvfsm_check_catches_planted_model_bug(
    name: str, monkeypatch: pytest.MonkeyPatch, record_property: Callable[[str, object], None]
) -> None:
    plant, bounds = PLANTED_MODEL_BUGS[name]
    with plant(monkeypatch):
        model = Model(bounds)
        result = explore(model=model, keep_graph=False)
    assert result.violations, f"kvfsm check missed planted model bug {name}"
    v = result.violations[0]
    record_property("counterexample_length", v.length)
    print(f"\n{name}: {v.invariant}, {v.length} events ({result.states} states explored)")
    print(format_trace(v, model, states=False))
    assert (v.invariant, v.length) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(PLANTED_MODEL_BUGS))
def test_the_clean_model_holds_at_the_bounds_each_bug_needs(name: str) -> None:
    _, bounds = PLANTED_MODEL_BUGS[name]
    small = dataclasses.replace(bounds, requests=1, prompts=1, resets=0)
    result = explore(small)
    assert result.ok, [str(v) for v in result.violations]


def test_two_tiers_and_a_durable_tier_hold_every_property() -> None:
    bounds = Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, tiers=2, durable=True, preemptions=1)
    model = Model(bounds)
    result = explore(model=model)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None and result.liveness_checked
    states = result.graph.states
    assert any({t.tier for t in s.tier} == {0, 1} for s in states)  # both tiers' cascades at once
    # The tiers term of has_pending_work() is live: states where only a tier's own sync is pending.
    only_tier = [
        s
        for s in states
        if not any(j.state in (JobState.SUBMITTED, JobState.IN_FLIGHT) for j in s.jobs)
        and s.tier
        and all(t.harvested and t.status == SYNCING for t in s.tier)
    ]
    assert only_tier and all(model.has_pending_push_work(s.jobs, s.tier) for s in only_tier)
    assert all(not model.transfers_pending(s.tier) for s in only_tier)


def test_promotions_from_two_tiers_hold_every_property() -> None:
    """Both tiers hit what they hold; a lookup promotes from the first that does, and a failed cascade to
    tier 0 leaves tier 1 as the only source."""
    bounds = Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, tiers=2, promotions=True, resets=1)
    result = explore(bounds)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None
    promoted_from = {t.tier for s in result.graph.states for t in s.tier if t.promote}
    assert promoted_from == {0, 1}


def test_store_deadlines_time_out_into_a_quarantine_that_is_pending_work() -> None:
    """With deadlines in scope, a timed-out store whose copy still runs is quarantined: its slots stay
    writing, it counts as pending work, and once its launched copies report the slots are freed."""
    bounds = Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, deadlines=1, resets=1, preemptions=1)
    model = Model(bounds)
    result = explore(model=model)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None and result.liveness_checked
    quarantined = [
        s
        for s in result.graph.states
        if any(j.state is JobState.TIMED_OUT and j.shards.count(COPYING) and not j.ignored for j in s.jobs)
    ]
    assert quarantined
    for s in quarantined:
        assert model.quarantine_pending(s.jobs) and model.has_pending_push_work(s.jobs, s.tier)
        assert s.engine is not EngineState.IDLE


def test_bounded_shutdown_drains_or_gives_up_and_stops_with_nothing_pinned() -> None:
    bounds = Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, shutdown=True, deadlines=1)
    result = explore(bounds)
    assert result.ok, [str(v) for v in result.violations]
    assert result.graph is not None and result.liveness_checked
    stopped = [s for s in result.graph.states if s.engine is EngineState.STOPPED]
    assert {s.abandoned for s in stopped} == {False, True}  # drained cleanly, and given up at the deadline
    for s in stopped:
        assert not any(j.state in (JobState.SUBMITTED, JobState.IN_FLIGHT) for j in s.jobs)
        assert all(code in (-2, 0) for code in s.slots) and not s.tier
    # Given up while a copy still ran: the copy is abandoned, not pending, so stop is enabled.
    model = Model(bounds)
    given_up = [s for s in result.graph.states if s.abandoned and any(COPYING in j.shards for j in s.jobs)]
    assert given_up
    for s in given_up:
        assert s.engine is EngineState.SHUTTING_DOWN and not model.has_pending_push_work(s.jobs, s.tier, True)
        assert ("stop",) in [label for label, _ in model.successors(s)]
