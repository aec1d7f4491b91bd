"""Stream-ordering races of the CUDA backend: the bugs behind silently corrupted KV in peers (vLLM #31210,
#45704, #47282).

- A store must copy what the forward wrote, never the poison that was there before it (it waits for the
  compute stream).
- A load into a re-allocated block must not overwrite it before earlier readers (a store still copying it, the
  compute stream) have read it.
- A store into a slot must not overwrite it before a load still reading it has read it.

The ``cuda`` tests run on a GPU, many repetitions with the compute stream held back by a sleep kernel, so the
race window is wide; they are skipped without CUDA. The ``emulated`` tests run the same backend on the
EmulatedDevice, whose streams execute only when something needs them: every race is then deterministic, and each
test also shows that the check catches the bug when the ordering is removed (the mutation).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("torch")

import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data import CPUSlotPool
from kvfsm.data.cuda import CudaCopyBackend, EmulatedDevice

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

BLOCK = (2, 4, 16, 32)  # 8 KiB of float16 per block and layer
LAYERS = 2
REPEATS = 50
SLEEP_CYCLES = 20_000_000  # ~10 ms of compute-stream delay per repetition


# ---------------------------------------------------------------------------------------------- emulated


@dataclass
class EmuRig:
    api: EmulatedDevice
    kv: list[torch.Tensor]
    pool: CPUSlotPool
    backend: CudaCopyBackend

    @property
    def store_stream(self) -> object:
        return self.backend.stream(is_store=True)

    @property
    def load_stream(self) -> object:
        return self.backend.stream(is_store=False)


@pytest.fixture(params=["dma", "runs", "kernel"])
def emu(request: pytest.FixtureRequest) -> Iterator[EmuRig]:
    api = EmulatedDevice(auto_progress=False)
    kv = list(torch.zeros((LAYERS, 16, *BLOCK), dtype=torch.float16).unbind(0))
    pool = CPUSlotPool(8, 1, BLOCK, LAYERS, torch.float16, pin_memory=False)
    backend = CudaCopyBackend(kv, pool, 1, copy_path=request.param, staging_bytes=1 << 12, device_api=api)
    yield EmuRig(api, kv, pool, backend)
    api.run_all()
    backend.shutdown()


def _mutate(monkeypatch: pytest.MonkeyPatch, api: EmulatedDevice, what: str) -> None:
    """Remove one ordering edge, to show that the race checks catch it."""
    monkeypatch.setattr(api, what, lambda *a: None)


@pytest.mark.parametrize("mutated", [False, True], ids=["ordered", "mutation-no-wait-for-compute"])
def test_emulated_store_waits_for_the_forward(emu: EmuRig, mutated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if mutated:
        _mutate(monkeypatch, emu.api, "wait_stream")
    for layer in emu.kv:
        layer[3].fill_(-1.0)  # poison

    def forward() -> None:
        for layer in emu.kv:
            layer[3].fill_(7.0)

    emu.api.launch(emu.api.compute, forward)
    emu.backend.submit(1, True, GPUBlockSpec((3,)), SlotSpec((5,)))
    emu.api.run(emu.store_stream)  # the copy engine gets there first
    stored = emu.pool.data[5, :, 0]
    if mutated:
        assert stored.eq(-1.0).all(), "without the wait the store copies the poison (the race the test must see)"
    else:
        assert stored.eq(7.0).all(), "the store copied KV the forward had not finished writing"
    assert emu.backend.poll() == [(1, True)]


@pytest.mark.parametrize("mutated", [False, True], ids=["ordered", "mutation-no-cross-direction-wait"])
def test_emulated_load_into_reallocated_block_waits_for_its_store(
    emu: EmuRig, mutated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mutated:
        _mutate(monkeypatch, emu.api, "wait_event")
    for layer in emu.kv:
        layer[3].fill_(1.0)  # the block's old contents, being stored
    emu.pool.data[6].fill_(2.0)  # what a load brings into the re-allocated block
    emu.backend.submit(1, True, GPUBlockSpec((3,)), SlotSpec((5,)))
    emu.backend.submit(2, False, GPUBlockSpec((3,)), SlotSpec((6,)))
    emu.api.run(emu.load_stream)  # the load stream runs first
    emu.api.run_all()
    if mutated:
        assert emu.pool.data[5].eq(2.0).all(), "without the wait the store reads the loaded data"
    else:
        assert emu.pool.data[5].eq(1.0).all(), "the load overwrote the block before the store read it"
    assert all(layer[3].eq(2.0).all() for layer in emu.kv)
    assert sorted(emu.backend.poll()) == [(1, True), (2, True)]


@pytest.mark.parametrize("mutated", [False, True], ids=["ordered", "mutation-no-wait-for-compute"])
def test_emulated_load_waits_for_compute_readers(emu: EmuRig, mutated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if mutated:
        _mutate(monkeypatch, emu.api, "wait_stream")
    for layer in emu.kv:
        layer[4].fill_(1.0)
    seen: list[float] = []
    emu.api.launch(emu.api.compute, lambda: seen.append(float(emu.kv[0][4].flatten()[0])))  # a late reader
    emu.pool.data[2].fill_(3.0)
    emu.backend.submit(1, False, GPUBlockSpec((4,)), SlotSpec((2,)))
    emu.api.run(emu.load_stream)
    emu.api.run_all()
    assert seen == ([3.0] if mutated else [1.0])
    assert emu.backend.poll() == [(1, True)]


@pytest.mark.parametrize("mutated", [False, True], ids=["ordered", "mutation-no-cross-direction-wait"])
def test_emulated_store_into_slot_waits_for_the_load_reading_it(
    emu: EmuRig, mutated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    if mutated:
        _mutate(monkeypatch, emu.api, "wait_event")
    emu.pool.data[1].fill_(5.0)  # the slot a load is still reading
    for layer in emu.kv:
        layer[9].fill_(8.0)  # what a store then writes into the same (evicted, re-used) slot
    emu.backend.submit(1, False, GPUBlockSpec((2,)), SlotSpec((1,)))
    emu.backend.submit(2, True, GPUBlockSpec((9,)), SlotSpec((1,)))
    emu.api.run(emu.store_stream)
    emu.api.run_all()
    expected = 8.0 if mutated else 5.0
    assert all(layer[2].eq(expected).all() for layer in emu.kv)
    assert emu.pool.data[1].eq(8.0).all()


def test_emulated_one_direction_runs_in_submission_order(emu: EmuRig) -> None:
    """Two stores of different blocks into the same slot (after the first was committed and evicted): the
    later one wins, because one direction is one stream."""
    for layer in emu.kv:
        layer[1].fill_(1.0)
        layer[2].fill_(2.0)
    emu.backend.submit(1, True, GPUBlockSpec((1,)), SlotSpec((0,)))
    emu.backend.submit(2, True, GPUBlockSpec((2,)), SlotSpec((0,)))
    emu.api.run_all()
    assert emu.pool.data[0].eq(2.0).all()


def test_emulated_flush_blocks_only_on_wait(emu: EmuRig) -> None:
    """``wait`` (fence/preemption flush) is the one blocking call, and it makes the data visible."""
    for layer in emu.kv:
        layer[0].fill_(4.0)
    emu.backend.submit(1, True, GPUBlockSpec((0,)), SlotSpec((3,)))
    assert emu.api.synchronize_calls == 0 and not emu.pool.data[3].any()
    emu.backend.wait([1])
    assert emu.api.synchronize_calls == 1 and emu.pool.data[3].eq(4.0).all()
    assert emu.backend.poll() == [(1, True)]
    assert emu.backend.poll() == []


# ---------------------------------------------------------------------------------------------- real CUDA


@pytest.fixture
def gpu() -> Iterator[tuple[list[torch.Tensor], CPUSlotPool]]:
    kv = list(torch.zeros((LAYERS, 1024, *BLOCK), dtype=torch.float16, device="cuda").unbind(0))
    pool = CPUSlotPool(1024, 1, BLOCK, LAYERS, torch.float16)
    assert pool.pinned
    yield kv, pool
    torch.cuda.synchronize()
    pool.close()


def _backend(kv: list[torch.Tensor], pool: CPUSlotPool, path: str, staging_bytes: int = 64 << 20) -> CudaCopyBackend:
    if path == "kernel":
        try:
            return CudaCopyBackend(kv, pool, 1, copy_path="kernel", staging_bytes=staging_bytes)
        except Exception as exc:
            pytest.skip(f"no zero-copy kernel path here: {exc}")
    return CudaCopyBackend(kv, pool, 1, copy_path=path, staging_bytes=staging_bytes)


@needs_cuda
@pytest.mark.parametrize("path", ["dma", "kernel"])
def test_cuda_store_never_copies_the_poison(gpu: tuple[list[torch.Tensor], CPUSlotPool], path: str) -> None:
    kv, pool = gpu
    backend = _backend(kv, pool, path)
    for rep in range(REPEATS):
        block, slot = rep % 1024, (rep * 7) % 1024
        value = float(rep % 100 + 1)
        for layer in kv:
            layer[block].fill_(-1.0)  # poison, on the compute stream
        torch.cuda._sleep(SLEEP_CYCLES)  # the forward takes a while ...
        for layer in kv:
            layer[block].fill_(value)  # ... then writes the block
        backend.submit(rep, True, GPUBlockSpec((block,)), SlotSpec((slot,)))  # at once, no host sync
        backend.wait([rep])
        assert backend.poll() == [(rep, True)]
        got = pool.data[slot, :, 0]
        assert got.eq(value).all(), f"repetition {rep}: the store read KV before the forward wrote it"
    backend.shutdown()


@needs_cuda
@pytest.mark.parametrize("path", ["dma", "kernel"])
def test_cuda_load_into_reallocated_block_waits_for_its_store(
    gpu: tuple[list[torch.Tensor], CPUSlotPool], path: str
) -> None:
    """A long store (many pieces: one block of staging) reads block ``victim`` last; a load into ``victim`` is
    submitted right after it. The load must wait for the store, or the store copies the loaded bytes."""
    kv, pool = gpu
    backend = _backend(kv, pool, path, staging_bytes=LAYERS * 8192)
    n = 256
    for rep in range(REPEATS // 5):
        old, new = float(rep + 1), float(-(rep + 1))
        for layer in kv:
            layer[:n].fill_(old)
        pool.data[n + 1].fill_(new)  # the slot the load reads
        torch.cuda._sleep(SLEEP_CYCLES)
        blocks = tuple(range(n))  # stored into slots 0..n-1, in order: block n-1 (the victim) is copied last
        backend.submit(2 * rep, True, GPUBlockSpec(blocks), SlotSpec(tuple(range(n))))
        backend.submit(2 * rep + 1, False, GPUBlockSpec((n - 1,)), SlotSpec((n + 1,)))
        backend.wait([2 * rep, 2 * rep + 1])
        assert sorted(backend.poll()) == [(2 * rep, True), (2 * rep + 1, True)]
        assert pool.data[n - 1].eq(old).all(), (
            f"repetition {rep}: the load overwrote the block before the store read it"
        )
        assert all(layer[n - 1].eq(new).all() for layer in kv)
    backend.shutdown()


@needs_cuda
def test_cuda_load_waits_for_compute_readers(gpu: tuple[list[torch.Tensor], CPUSlotPool]) -> None:
    kv, pool = gpu
    backend = _backend(kv, pool, "dma")
    for rep in range(REPEATS):
        block, slot = rep % 1024, (rep * 3) % 1024
        for layer in kv:
            layer[block].fill_(1.0)
        pool.data[slot].fill_(2.0)
        torch.cuda._sleep(SLEEP_CYCLES)
        read = kv[0][block].clone()  # a late reader on the compute stream
        backend.submit(rep, False, GPUBlockSpec((block,)), SlotSpec((slot,)))
        backend.wait([rep])
        assert backend.poll() == [(rep, True)]
        torch.cuda.synchronize()
        assert read.eq(1.0).all(), f"repetition {rep}: the load overwrote a block the compute stream still read"
    backend.shutdown()


@needs_cuda
def test_cuda_store_into_slot_waits_for_the_load_reading_it(gpu: tuple[list[torch.Tensor], CPUSlotPool]) -> None:
    kv, pool = gpu
    backend = _backend(kv, pool, "dma", staging_bytes=LAYERS * 8192)
    n = 128
    for rep in range(REPEATS // 5):
        pool.data[:n].fill_(float(rep + 1))
        for layer in kv:
            layer[900].fill_(-5.0)
        torch.cuda._sleep(SLEEP_CYCLES)
        backend.submit(2 * rep, False, GPUBlockSpec(tuple(range(n))), SlotSpec(tuple(range(n))))  # reads slot n-1 last
        backend.submit(2 * rep + 1, True, GPUBlockSpec((900,)), SlotSpec((n - 1,)))
        backend.wait([2 * rep, 2 * rep + 1])
        backend.poll()
        assert all(layer[n - 1].eq(float(rep + 1)).all() for layer in kv), f"repetition {rep}"
        assert pool.data[n - 1].eq(-5.0).all()
    backend.shutdown()


@needs_cuda
def test_cuda_engine_path_never_synchronizes(
    gpu: tuple[list[torch.Tensor], CPUSlotPool], monkeypatch: pytest.MonkeyPatch
) -> None:
    """submit and poll return while the copy is still queued behind a slow compute stream."""
    kv, pool = gpu
    backend = _backend(kv, pool, "dma")
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda.Event, "synchronize", lambda self: calls.append("event"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("device"))
    torch.cuda._sleep(SLEEP_CYCLES * 5)
    backend.submit(1, True, GPUBlockSpec((1, 2, 3)), SlotSpec((1, 2, 3)))
    assert backend.poll() == []  # still behind the sleeping compute stream
    assert calls == []
    monkeypatch.undo()
    backend.wait([1])
    assert backend.poll() == [(1, True)]
    backend.shutdown()
