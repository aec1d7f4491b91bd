"""KvfsmConnector's KV cache events inside vLLM 0.33's real Scheduler, judged against kvfsm's CPU manager.

vLLM publishes what ``take_events`` returns at the end of every ``update_from_output``; the tests record the
published batches (vLLM's publisher is the sink, nothing of the connector is replaced) and keep the CPU
medium's view: keys announced by ``BlockStored`` and not withdrawn by ``BlockRemoved``. After every step that
view must equal the keys the manager's slots hold readable (ground truth: the slots, not the events), a failed
store must never be announced nor removed, and ``reset_cache`` must withdraw everything.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

from connector_support import Rig, opt_config_dir
from vllm.distributed.kv_events import (
    BlockRemoved,
    BlockStored,
    EventBatch,
    ExternalBlockHash,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.types import OffloadKey, make_offload_key
from kvfsm.machines.names import SlotState

READABLE = (SlotState.READY, SlotState.READING)


class RecordingPublisher:
    """A KV event publisher (vLLM's ``EventPublisher`` interface: ``publish``, ``shutdown``) that keeps every
    batch the scheduler publishes instead of sending it."""

    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, events: EventBatch) -> None:
        assert isinstance(events, KVEventBatch)
        self.batches.append(events)

    def shutdown(self) -> None:
        pass


class CpuView:
    """The CPU medium as an event subscriber sees it."""

    def __init__(self, publisher: RecordingPublisher) -> None:
        self.publisher = publisher
        self.seen = 0
        self.held: set[ExternalBlockHash] = set()
        self.stored: list[ExternalBlockHash] = []
        self.removed: list[ExternalBlockHash] = []

    def update(self) -> None:
        for batch in self.publisher.batches[self.seen :]:
            for event in batch.events:
                if isinstance(event, BlockStored) and event.medium == "CPU":
                    assert event.group_idx == 0 and event.block_size == 0 and event.token_ids == []
                    for h in event.block_hashes:
                        assert h not in self.held, "a key announced twice without a removal between"
                        self.held.add(h)
                        self.stored.append(h)
                elif isinstance(event, BlockRemoved) and event.medium == "CPU":
                    assert event.group_idx == 0
                    for h in event.block_hashes:
                        assert h in self.held, "a removal of a key never announced"
                        self.held.discard(h)
                        self.removed.append(h)
        self.seen = len(self.publisher.batches)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return opt_config_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture
def events_rig(model_dir: Path) -> Iterator[tuple[Rig, CpuView]]:
    rig = Rig(model_dir, num_slots=6, kv_events=True)
    publisher = RecordingPublisher()
    rig.scheduler.kv_event_publisher = publisher
    yield rig, CpuView(publisher)
    rig.shutdown()


def _manager(rig: Rig) -> CPUOffloadingManager:
    sched = rig.connector.scheduler
    assert sched is not None and isinstance(sched.manager, CPUOffloadingManager)
    return sched.manager


def _readable(rig: Rig) -> set[ExternalBlockHash]:
    """Every block hash of every request the test added whose key the manager's slots hold readable, as
    vLLM publishes it (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``: its low 64 bits as an int)."""
    manager = _manager(rig)
    out: set[ExternalBlockHash] = set()
    for req in rig.requests.values():
        for h in req.block_hashes:
            key: OffloadKey = make_offload_key(bytes(h), 0)
            if manager.slot_state(key) in READABLE:
                out.add(maybe_convert_block_hash(BlockHash(bytes(h))))
    return out


def _step_and_check(rig: Rig, view: CpuView, release_ok: bool | None = True) -> None:
    if release_ok is not None:
        for job_id in rig.held():
            rig.release(job_id, ok=release_ok)
    rig.step()
    view.update()
    assert view.held == _readable(rig)


def test_events_follow_stores_and_evictions(events_rig: tuple[Rig, CpuView]) -> None:
    """Three 2-4 block prompts through 6 CPU slots: stores announce, evictions withdraw, and after every
    step the announced keys are exactly the slots' readable keys."""
    rig, view = events_rig
    prompts = [list(range(1, 70)), list(range(500, 540)), list(range(900, 965))]
    for i, prompt in enumerate(prompts):
        rig.add(prompt, max_tokens=2, req_id=f"p{i}")
        for _ in range(60):
            if not rig.has_work():
                break
            _step_and_check(rig, view)
    assert not rig.has_work()
    assert view.stored, "no BlockStored event for a stored prompt"
    assert view.removed, "6 slots for 10 stored blocks: an eviction must be announced"
    assert set(view.removed) <= set(view.stored)
    assert len(view.held) == len(_readable(rig)) <= 6
    assert not rig.mismatches, rig.mismatches[:3]


def test_a_failed_store_is_never_announced_nor_removed(events_rig: tuple[Rig, CpuView]) -> None:
    """Every copy fails: kvfsm's manager emits metadata_only removals, which (as in vLLM) publish nothing."""
    rig, view = events_rig
    rig.add(list(range(1, 70)), max_tokens=2, req_id="a")
    for _ in range(60):
        if not rig.has_work():
            break
        _step_and_check(rig, view, release_ok=False)
    assert not rig.has_work()
    sched = rig.connector.scheduler
    assert sched is not None and sched.stats.committed_stores == 0
    assert view.stored == [] and view.removed == []
    assert view.held == set() == _readable(rig)
    # The same prompt again, now succeeding: its keys are announced once each.
    rig.add(list(range(1, 70)), max_tokens=2, req_id="b")
    for _ in range(60):
        if not rig.has_work():
            break
        _step_and_check(rig, view)
    assert view.stored and len(view.stored) == len(set(view.stored))
    assert view.removed == []


def test_reset_cache_withdraws_every_announced_key(events_rig: tuple[Rig, CpuView]) -> None:
    rig, view = events_rig
    rig.add(list(range(1, 70)), max_tokens=2, req_id="a")
    for _ in range(60):
        if not rig.has_work():
            break
        _step_and_check(rig, view)
    announced = set(view.held)
    assert announced
    assert rig.scheduler.reset_connector_cache()
    rig.add(list(range(500, 540)), max_tokens=1, req_id="b")
    _step_and_check(rig, view)
    assert announced <= set(view.removed)
    assert not announced & view.held
    for _ in range(60):
        if not rig.has_work():
            break
        _step_and_check(rig, view)
    assert view.held == _readable(rig)


def test_events_off_without_kv_events_config(model_dir: Path) -> None:
    """As vLLM's connector: no kv_events_config, no events (and the manager records none)."""
    rig = Rig(model_dir, num_slots=6)
    try:
        rig.add(list(range(1, 70)), max_tokens=2, req_id="a")
        for _ in range(60):
            for job_id in rig.held():
                rig.release(job_id)
            if not rig.has_work():
                break
            rig.step()
        assert _readable(rig)
        assert list(rig.connector.take_events()) == []
        assert not _manager(rig).enable_events
    finally:
        rig.shutdown()
