"""The graphs that ``kvfsm check`` explores, pinned: a change that makes the checker faster must not change
what it explores (issue 11, item 3).

Each case pins the state, edge and pruned-edge counts, the responsiveness checks, the violations found
(invariant and counterexample length) and :func:`~kvfsm.check.bfs.graph_digest`, a digest of every state
in BFS order and every edge. The figures were recorded with the checker as it was before it was made
faster (scripts/checker_fingerprint.py prints these and more, the default bounds included). A change to
the model itself changes them on purpose: re-record them then, with the reason in the commit ("shutdown"
was re-recorded when the model's give_up and stop took on what the engine loop does there).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvfsm.check import Bounds, ExplorationResult, Model, explore
from kvfsm.check.bfs import graph_digest
from kvfsm.check.properties import DrainMode

SMALL = Bounds(requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, resets=1, preemptions=1)

#: name -> (bounds, drain mode, (states, edges, pruned, responsiveness checks, violations, graph digest))
PINNED: dict[str, tuple[Bounds, DrainMode, tuple[int, int, int, int, list[tuple[str, int]], str]]] = {
    "small": (SMALL, DrainMode.NON_BLOCKING, (5288, 17845, 0, 160, [], "93126ee3b7973128")),
    "two-tiers": (
        dataclasses.replace(SMALL, tiers=2, slots=2),
        DrainMode.NON_BLOCKING,
        (14096, 54569, 0, 256, [], "e40b88a0a11b3c8d"),
    ),
    "durable": (
        dataclasses.replace(SMALL, durable=True, tiers=2, slots=2),
        DrainMode.NON_BLOCKING,
        (17040, 67805, 0, 292, [], "1b2412b912abb9e3"),
    ),
    "deadlines": (
        Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, deadlines=1, resets=1, preemptions=1),
        DrainMode.NON_BLOCKING,
        (13678, 47764, 0, 544, [], "3020e0d7936b4186"),
    ),
    "two-deadlines": (
        dataclasses.replace(Bounds(), deadlines=2, resets=0, slots=3, requests=1),
        DrainMode.NON_BLOCKING,
        (1023, 2756, 0, 0, [], "a285864eb2b91230"),
    ),
    "shutdown": (
        Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, shutdown=True, deadlines=1),
        DrainMode.NON_BLOCKING,
        (23908, 87385, 0, 544, [], "0f621ce8c1691d56"),
    ),
    "blocking-drain": (
        SMALL,
        DrainMode.BLOCKING,
        (5300, 17751, 0, 148, [("responsiveness", 7)], "3c119a1dc9b7f37e"),
    ),
    "tier-pending-always": (
        dataclasses.replace(SMALL, tier_pending_always=True),
        DrainMode.NON_BLOCKING,
        (5284, 17855, 0, 166, [("liveness", 1)], "88a793e5f61a7f6a"),
    ),
    "no-failures-three-workers": (
        dataclasses.replace(SMALL, failures=False, workers=3),
        DrainMode.NON_BLOCKING,
        (2949, 9901, 0, 118, [], "caac208d4aa4d169"),
    ),
    "max-jobs": (
        dataclasses.replace(SMALL, max_jobs=2),
        DrainMode.NON_BLOCKING,
        (5784, 19013, 289, 192, [], "c6f45a6d810ba9b5"),
    ),
    "no-tiers-three-workers": (
        dataclasses.replace(SMALL, tiers=0, workers=3, chunks=2, slots=2),
        DrainMode.NON_BLOCKING,
        (6106, 21362, 0, 297, [], "141901f19e251653"),
    ),
    # Two chunks promoted from a tier: a scan stops at the chunk whose promotion it reserved, so the two
    # promotions are reserved by two scans (spec/README.md, "A lookup always makes progress").
    "promotions-two-chunks": (
        dataclasses.replace(SMALL, chunks=2, slots=2, promotions=True, workers=1),
        DrainMode.NON_BLOCKING,
        (6174, 17372, 0, 149, [], "3a9c805b82384f00"),
    ),
    "two-prompts": (
        dataclasses.replace(SMALL, prompts=2, chunks=2, slots=2, resets=0),
        DrainMode.NON_BLOCKING,
        (9934, 29543, 0, 156, [], "21fab7f5c91325e0"),
    ),
}


def _fingerprint(result: ExplorationResult) -> tuple[int, int, int, int, list[tuple[str, int]], str]:
    assert result.graph is not None
    return (
        result.states,
        result.edges,
        result.pruned,
        result.responsiveness_checks,
        [(v.invariant, v.length) for v in result.violations],
        graph_digest(result.graph),
    )


@pytest.mark.parametrize("name", sorted(PINNED))
def test_explored_graph_is_pinned(name: str) -> None:
    bounds, drain, expected = PINNED[name]
    result = explore(model=Model(bounds, drain), stop_at_first=False)
    assert result.graph is not None and result.complete
    assert _fingerprint(result) == expected


def test_a_model_explored_twice_explores_the_same_graph() -> None:
    """The memos of one Model are dropped at the start of each exploration: a second run of the same
    model computes everything again and finds the same graph."""
    model = Model(SMALL)
    first = explore(model=model)
    second = explore(model=model)
    assert first.graph is not None and second.graph is not None
    assert graph_digest(first.graph) == graph_digest(second.graph)
    assert (first.states, first.edges) == (second.states, second.edges)


@pytest.mark.parametrize("name", ["small", "durable", "shutdown", "blocking-drain"])
def test_trimming_the_memos_explores_the_same_graph(name: str) -> None:
    """A large exploration drops the model's memos whenever they outgrow ``memo_limit``: with a limit small
    enough to drop them every few thousand states, the graph, its violations and its counts are the
    pinned ones, only computed more often."""
    bounds, drain, expected = PINNED[name]
    result = explore(model=Model(bounds, drain), stop_at_first=False, memo_limit=1_000)
    assert result.graph is not None and result.complete
    assert result.memos_trimmed > 0
    assert _fingerprint(result) == expected
