"""The reset hold (spec/README.md, "The reset hold"), judged by the bytes in the primary's slots.

A store copy that ``reset_cache`` discarded may still write the primary slot the reset freed (here: its copy is
held by the worker's backend until the next step's flush runs it). A promotion into that slot, submitted before
the flush, would be overwritten by the late copy and serve another chunk's bytes under its key. The scheduler
fences the reset's copies and the tiering manager holds promotions until every one has reported: the lookup is
a MISS meanwhile, and a promotion after the flush holds the tier's bytes.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest
from helpers import FakeRequest, keys_of, tokens

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.messages import RemoteWorker, StepMessage
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import GPUBlockSpec, LookupResult, ReqContext, SlotSpec
from kvfsm.control.worker import HeldCopyBackend, OffloadingWorker
from kvfsm.tiers.memory import InMemoryTier
from kvfsm.tiers.slotio import DictSlotIO

TPB = 4
LATE = b"the discarded store's late copy"
FROM_TIER = b"the tier's bytes of the promoted chunk"


class _Rig:
    """One worker whose copies run only when flushed; its store copies write ``LATE`` into their slots. One
    primary slot, so a promotion after the reset is handed the very slot the discarded store was given."""

    def __init__(self, *, remote: bool) -> None:
        self.memory = DictSlotIO()
        self.tier = InMemoryTier("mem", slot_io=self.memory)
        self.manager = TieringManager(CPUOffloadingManager(1), [self.tier], deadlines=Deadlines.none())
        self.sched = OffloadingScheduler(OffloadConfig(TPB), self.manager, deadlines=Deadlines.none())
        self.backend = HeldCopyBackend(self._copy)
        worker = OffloadingWorker(0, 1, self.backend)
        self.remote = RemoteWorker(worker) if remote else None
        self.worker = worker
        self.next_block = 0

    def _copy(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        if is_store:
            for sid in slots.slot_ids:
                self.memory.write_slot(sid, LATE)

    def step(
        self, scheduled: tuple[ScheduledRequest, ...] = (), *, before_flush: Callable[[], None] | None = None
    ) -> None:
        """One engine step: metadata, (``before_flush()``: the tier's I/O getting there first), the workers'
        flush, loads and stores, their reports."""
        out = SchedulerOutput(scheduled)
        if self.remote is not None:
            # What crosses a process boundary: the step's message as JSON, the rank's report back.
            wire = json.dumps(self.sched.build_step_message(out).to_wire())
            if before_flush is not None:
                before_flush()
            self.remote.bind(StepMessage.from_wire(json.loads(wire)))
            self.remote.before_forward()
            self.remote.after_forward()
            self.sched.apply_reports([self.remote.poll().report])
            return
        meta = self.sched.build_connector_meta(out)
        if before_flush is not None:
            before_flush()
        self.worker.before_forward(meta)
        self.worker.after_forward(meta)
        self.sched.update_connector_output(self.worker.poll())

    def admit(self, req: FakeRequest) -> int | None:
        external, _ = self.sched.get_num_new_matched_tokens(req, 0)
        if external is None:
            return None
        blocks = tuple(range(self.next_block, self.next_block + len(req.block_hashes) + 1))
        self.next_block += len(blocks)
        self.sched.update_state_after_alloc(req, list(blocks), external)
        self.step((ScheduledRequest(req.req_id, blocks, req.num_tokens - external, admitted=True),))
        return external


def _one_chunk(seed: str) -> FakeRequest:
    return FakeRequest(seed, tokens(seed, TPB + 1), TPB)


@pytest.mark.parametrize("remote", [False, True], ids=["in-process", "across-a-process-boundary"])
@pytest.mark.parametrize("hold", [True, False], ids=["hold", "planted-no-hold"])
def test_a_promotion_never_races_a_discarded_copy(remote: bool, hold: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    rig = _Rig(remote=remote)
    writer = _one_chunk("writer")
    assert rig.admit(writer) == 0
    for _ in range(3):  # its store is planned and launched; the backend holds the copy
        if rig.backend.held:
            break
        rig.step()
    assert rig.backend.held, "the writer's store was never launched"
    if not hold:
        # The bug the hold fixes: the manager is told at once that nothing discarded can still write.
        reset = rig.manager.reset_cache

        def reset_without_hold() -> None:
            reset()
            rig.manager.on_reset_flushed()

        monkeypatch.setattr(rig.manager, "reset_cache", reset_without_hold)
    rig.sched.reset_cache()
    # A reset stops the pending signal for what it discarded; the hold lasts until the flush has reported.
    assert not rig.sched.has_pending_push_work()
    assert rig.manager.promotions_held is hold

    reader = _one_chunk("reader")
    (key,) = keys_of(reader.block_hashes, 1)
    rig.tier.put(key, FROM_TIER)  # left by an earlier process

    def tier_io_first() -> None:  # the promotion's tier I/O lands before the late copy (either order is real)
        for job_id in rig.tier.pending_job_ids():
            rig.tier.complete(job_id)

    external, _ = rig.sched.get_num_new_matched_tokens(reader, 0)
    if hold:
        assert external == 0  # MISS: computed, never promoted into a slot the late copy may write
        assert rig.manager.stats().promotions_held == 1
        rig.step(before_flush=tier_io_first)  # the flush runs the late copy; its report ends the fence
        assert not rig.manager.promotions_held and not rig.sched.has_pending_push_work()
        again = FakeRequest("reader-again", list(reader.token_ids), TPB)
        assert rig.sched.get_num_new_matched_tokens(again, 0)[0] is None  # promoted now: wait for it
        rig.step(before_flush=tier_io_first)
        rig.step()
        assert rig.manager.lookup(key, _ctx(again)) is LookupResult.HIT
    else:
        assert external is None  # HIT_PENDING: a promotion reserved the freed slot
        rig.step(before_flush=tier_io_first)  # tier I/O writes the slot, then the flush's late copy does
        rig.step()
        assert rig.manager.lookup(key, _ctx(reader)) is LookupResult.HIT
    (slot,) = rig.manager.prepare_load([key], _ctx(reader)).slot_ids
    served = rig.memory.read_slot(slot)
    if hold:
        assert served == FROM_TIER
    else:
        assert served == LATE  # another chunk's bytes, readable under the promoted key


def _ctx(req: FakeRequest) -> ReqContext:
    return ReqContext(req.req_id)


def test_a_reset_with_nothing_in_flight_holds_nothing() -> None:
    rig = _Rig(remote=False)
    rig.sched.reset_cache()
    assert not rig.manager.promotions_held and not rig.sched.has_pending_push_work()
