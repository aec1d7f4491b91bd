"""The copy gate (kvfsm.data.gate) inside ThreadPoolCopyBackend's real copy path, the backend's ground-truth
queries, and GatedCopyBackend's report-time byte check. Every wait is on an event, none on the clock."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.gate import CopyGate
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError
from kvfsm.testing.backend import GatedCopyBackend

SHAPE = (2, 4)


def _rig(threads: int = 4) -> tuple[list[torch.Tensor], CPUSlotPool, ThreadPoolCopyBackend, CopyGate]:
    kv = [torch.arange(8 * 8, dtype=torch.float32).reshape(8, *SHAPE) + 100 * layer for layer in range(2)]
    pool = CPUSlotPool(4, 1, SHAPE, 2, torch.float32, pin_memory=False)
    gate = CopyGate()
    backend = ThreadPoolCopyBackend(kv, pool, 1, max_workers=threads, copy_path="staged", gate=gate)
    return kv, pool, backend, gate


def test_a_gated_copy_is_in_flight_on_its_thread_until_released() -> None:
    kv, pool, backend, gate = _rig()
    try:
        future = backend.submit(7, True, GPUBlockSpec((3, 5)), SlotSpec((1, 2)))
        assert backend.unfinished_job_ids() == [7] and backend.unreported_job_ids() == [7]
        assert backend.poll() == [] and not future.done()
        assert not torch.equal(pool.block(0, 1), kv[0][3])  # nothing written yet
        gate.release(7)
        gate.wait_left(7)
        future.result()
        assert backend.unfinished_job_ids() == [] and backend.unreported_job_ids() == [7]  # finished, unpolled
        assert torch.equal(pool.block(0, 1), kv[0][3]) and torch.equal(pool.block(1, 2), kv[1][5])
        assert backend.poll() == [(7, True)]
        assert backend.unreported_job_ids() == []
    finally:
        gate.open()
        backend.shutdown()


def test_a_copy_released_to_fail_moves_nothing_and_reports_failure() -> None:
    _, pool, backend, gate = _rig()
    try:
        before = pool.data.clone()
        future = backend.submit(1, True, GPUBlockSpec((0,)), SlotSpec((0,)))
        gate.release(1, ok=False)
        gate.wait_left(1)
        assert future.exception() is not None
        assert backend.poll() == [(1, False)]
        assert torch.equal(pool.data, before)
    finally:
        gate.open()
        backend.shutdown()


def test_open_releases_held_and_later_copies() -> None:
    _, _, backend, gate = _rig()
    held = backend.submit(1, True, GPUBlockSpec((0,)), SlotSpec((0,)))
    gate.open()
    held.result()
    backend.submit(2, True, GPUBlockSpec((1,)), SlotSpec((1,))).result()
    backend.shutdown()
    assert sorted(backend.poll()) == [(1, True), (2, True)]


def test_the_gated_backend_checks_the_bytes_at_report_time() -> None:
    kv, _, inner, _ = _rig()
    gated = GatedCopyBackend(inner, max_held=2)
    try:
        gated.submit(1, True, GPUBlockSpec((2,)), SlotSpec((3,)))
        assert list(gated.held_ids) == [1] and gated.in_flight_ids() == {1} and gated.running_ids() == {1}
        gated.complete(1)
        assert list(gated.held_ids) == [] and gated.running_ids() == set() and gated.in_flight_ids() == {1}
        assert gated.poll() == [(1, True)] and gated.problems == [] and gated.reports_checked == 1
        # A load whose bytes are changed behind the backend's back after it copied: the report is wrong.
        gated.submit(2, False, GPUBlockSpec((6,)), SlotSpec((3,)))
        gated.complete(2)
        kv[1][6].fill_(-1)
        assert gated.poll() == [(2, True)]
        assert any("load job 2 finished, but GPU block 6 (layer 1)" in p for p in gated.problems)
        with pytest.raises(ConfigError, match="not held"):
            gated.complete(2)
        gated.submit(3, True, GPUBlockSpec((0,)), SlotSpec((0,)))
        gated.submit(4, True, GPUBlockSpec((1,)), SlotSpec((1,)))
        with pytest.raises(AssertionError, match="no thread left"):
            gated.submit(5, True, GPUBlockSpec((4,)), SlotSpec((2,)))
        gated.wait([4, 3])  # a flush releases the copies it waits for
        assert sorted(gated.poll()) == [(3, True), (4, True)]
    finally:
        gated.close()


def test_the_gated_backend_needs_a_gate() -> None:
    kv = [torch.zeros(2, *SHAPE)]
    pool = CPUSlotPool(1, 1, SHAPE, 1, torch.float32, pin_memory=False)
    backend = ThreadPoolCopyBackend(kv, pool, 1)
    try:
        with pytest.raises(ConfigError, match="gate"):
            GatedCopyBackend(backend)
    finally:
        backend.shutdown()
