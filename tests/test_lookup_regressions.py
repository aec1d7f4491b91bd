"""Regressions in the lookup path found by the stateful tests."""

from __future__ import annotations

from helpers import FakeRequest, keys_of, tokens

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines, ManualClock
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import OffloadKey, ReqContext
from kvfsm.machines.names import SlotState
from kvfsm.tiers.memory import InMemoryTier

TPB = 4


def test_expired_wait_never_loads_a_hit_evicted_by_the_same_scans_promotion() -> None:
    # Two CPU slots. The scan hits chunk 0; chunk 1 is only in the secondary tier, and reserving its
    # promotion used to evict chunk 0 (the least recently used ready slot). With the lookup wait already
    # expired the request must not be told to load a chunk the reservation may have evicted.
    primary = CPUOffloadingManager(2)
    tier = InMemoryTier("mem")
    manager = TieringManager(primary, [tier])
    clock = ManualClock()
    sched = OffloadingScheduler(OffloadConfig(TPB), manager, deadlines=Deadlines(lookup_wait_s=1.0), clock=clock)
    req = FakeRequest("r", tokens("p", 2 * TPB + 1), TPB)
    k0, k1 = keys_of(req.block_hashes, 1)
    k2 = OffloadKey(b"other-chunk-key-0000")
    ctx = ReqContext("writer")
    assert primary.prepare_store([k0], ctx) is not None
    primary.complete_store([k0], ctx)
    assert primary.prepare_store([k1], ctx) is not None  # chunk 1's store is still in flight

    assert sched.get_num_new_matched_tokens(req, 0) == (None, False)  # waits on chunk 1: the wait starts
    primary.complete_store([k1], ctx, success=False)  # that store fails; the tier has a copy
    tier.put(k1)
    assert primary.prepare_store([k2], ctx) is not None
    primary.complete_store([k2], ctx)  # k2 is more recent than k0, so k0 is the eviction victim
    clock.advance(2.0)

    num, _ = sched.get_num_new_matched_tokens(req, 0)
    assert sched.stats.lookup_wait_timeouts == 1
    # Chunk 0 is this scan's hit, so chunk 1's reservation may not evict it (spec/README.md, "A lookup
    # always makes progress"): k2 goes instead.
    assert primary.slot_state(k0) is SlotState.READY and primary.slot_state(k2) is SlotState.ABSENT
    assert num == 0  # the wait expired on a chunk that is not a HIT: the request computes both chunks
    sched.update_state_after_alloc(req, [0, 1, 2], 0)
    assert sched.request_jobs("r") == frozenset()
