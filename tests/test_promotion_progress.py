"""Bug 1 of issue 13, as a property: a lookup always makes progress, with no deadline at all.

Requests whose prefixes sit only in a secondary tier, with a CPU primary of any size (smaller than the
prefixes included), are all scheduled within a bounded number of steps, each loading what fits and
computing the rest (spec/README.md, "A lookup always makes progress"). ``Deadlines.none()`` makes sure
no ``lookup_wait_s`` breaks a livelock for it.
"""

from __future__ import annotations

from helpers import FakeRequest, LoopbackWorkers, keys_of, tokens
from hypothesis import given, settings
from hypothesis import strategies as st
from typing_extensions import override

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.tiers.memory import InMemoryTier

TPB = 4


def _run(
    num_slots: int, prefix_chunks: list[int], max_steps: int, arrivals: list[int] | None = None
) -> tuple[dict[str, int], TieringManager]:
    """Look every arrived request up each step (oldest first) until all are scheduled; request ``i``
    arrives at step ``arrivals[i]`` (default 0). Scheduled requests compute the rest of their prompt,
    so their GPU stores compete for the primary too. Returns the step each was scheduled at and the
    manager."""
    arrive = arrivals if arrivals is not None else [0] * len(prefix_chunks)
    tier = InMemoryTier("mem", autocomplete=True)
    manager = TieringManager(CPUOffloadingManager(num_slots), [tier], deadlines=Deadlines.none())
    sched = OffloadingScheduler(OffloadConfig(TPB), manager, deadlines=Deadlines.none())
    workers = LoopbackWorkers(1)
    waiting: list[FakeRequest] = []
    for i, n in enumerate(prefix_chunks):
        req = FakeRequest(f"r{i}", tokens(f"seed{i}", n * TPB + 1), TPB)
        for key in keys_of(req.block_hashes, 1):
            tier.put(key)  # left by an earlier process
        waiting.append(req)
    scheduled_at: dict[str, int] = {}
    next_block = 0
    for step in range(max_steps):
        admitted = []
        for req in [r for r in waiting if arrive[int(r.req_id[1:])] <= step]:
            external, _ = sched.get_num_new_matched_tokens(req, 0)
            if external is None:
                continue  # deferred: asks again next step
            blocks = list(range(next_block, next_block + len(req.block_hashes) + 1))
            next_block += len(blocks)
            sched.update_state_after_alloc(req, blocks, external)
            admitted.append(ScheduledRequest(req.req_id, tuple(blocks), req.num_tokens - external, admitted=True))
            scheduled_at[req.req_id] = step
            waiting.remove(req)
        meta = sched.build_connector_meta(SchedulerOutput(tuple(admitted)))
        workers.deliver(meta)
        sched.update_connector_output(workers.report_all())
        if not waiting:
            return scheduled_at, manager
    return scheduled_at, manager


@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(1, 4), chunks=st.integers(1, 7))
def test_one_request_loads_what_fits_and_is_scheduled_without_a_deadline(num_slots: int, chunks: int) -> None:
    scheduled_at, manager = _run(num_slots, [chunks], max_steps=chunks + 3)
    assert "r0" in scheduled_at, f"a {chunks}-chunk prefix over {num_slots} slots was still deferred"
    stats = manager.stats()
    # Promote what fits, compute the rest: never more promotions than chunks or slots, and no chunk twice.
    assert stats.promotions_completed == min(chunks, num_slots)
    assert stats.promotions_refused == (1 if chunks > num_slots else 0)
    assert stats.primary.evictions == 0  # a scan never evicts its own hits


@settings(max_examples=60, deadline=None)
@given(num_slots=st.integers(1, 4), prefixes=st.lists(st.integers(1, 5), min_size=2, max_size=3))
def test_competing_requests_are_all_scheduled_without_a_deadline(num_slots: int, prefixes: list[int]) -> None:
    scheduled_at, _ = _run(num_slots, prefixes, max_steps=sum(prefixes) + 4)
    assert len(scheduled_at) == len(prefixes), f"deferred forever: {set(range(len(prefixes))) - set(scheduled_at)}"


@settings(max_examples=60, deadline=None)
@given(
    num_slots=st.integers(1, 4),
    requests=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 6)), min_size=2, max_size=4),
)
def test_requests_arriving_over_time_are_each_scheduled_within_a_bound(
    num_slots: int, requests: list[tuple[int, int]]
) -> None:
    prefixes = [n for n, _ in requests]
    arrivals = [a for _, a in requests]
    bound = sum(prefixes) + 4
    scheduled_at, _ = _run(num_slots, prefixes, max_steps=max(arrivals) + bound + 1, arrivals=arrivals)
    for i, arrived in enumerate(arrivals):
        assert f"r{i}" in scheduled_at, f"r{i} (arrived at step {arrived}) was never scheduled"
        assert scheduled_at[f"r{i}"] - arrived <= bound


class _AnsweringLaterTier(InMemoryTier):
    """A tier whose first lookup of a key answers RETRY and whose verdict is ready at the next step, as the
    Redis tier's staged existence checks are (kvfsm/tiers/redis.py); records the keys it was asked about."""

    def __init__(self) -> None:
        super().__init__("later", autocomplete=True)
        self.asked: list[OffloadKey] = []
        self.staged: set[OffloadKey] = set()
        self.answered: set[OffloadKey] = set()

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self.asked.append(key)
        if key in self.answered:
            return super().lookup(key, ctx)
        self.staged.add(key)
        return LookupResult.RETRY

    @override
    def on_schedule_end(self) -> None:
        super().on_schedule_end()
        self.answered |= self.staged


def test_one_scan_stages_every_unanswered_chunk_and_reserves_one_promotion() -> None:
    """The scan-on rule (spec/README.md): past a chunk that answers RETRY the scan goes on over the later
    unanswered chunks, so a prefix's existence checks are staged by one scan; it stops at the first
    promotion it reserves, so a scan still takes at most one new primary slot."""
    tier = _AnsweringLaterTier()
    manager = TieringManager(CPUOffloadingManager(8), [tier], deadlines=Deadlines.none())
    sched = OffloadingScheduler(OffloadConfig(TPB), manager, deadlines=Deadlines.none())
    req = FakeRequest("r0", tokens("later", 4 * TPB + 1), TPB)
    keys = keys_of(req.block_hashes, 1)
    for key in keys:
        tier.put(key)
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert tier.asked == keys  # every chunk's check staged by the first scan
    sched.build_connector_meta(SchedulerOutput(()))  # the step ends: the checks are answered
    tier.asked.clear()
    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)
    assert tier.asked == keys[:1]  # the first chunk's promotion is reserved, and the scan stops there
    assert manager.stats().promotions_reserved == 1
