"""The data plane: layout and sharding, the CPU slot pool, batched copies and the worker half.

The "GPU" KV caches are CPU tensors here; every completion is made deterministic by waiting on the real
copy futures (``wait`` / ``wait_all``), never by sleeping.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
from typing_extensions import override

pytest.importorskip("torch")

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data import (
    CPUSlotPool,
    KVCacheSpec,
    OffloadingWorker,
    ThreadPoolCopyBackend,
    allocate_kv_caches,
    chunk_rows,
    default_device,
    head_shard,
    make_workers,
    shard_kv_caches,
    validate_kv_caches,
)
from kvfsm.data.plan import JobPlan
from kvfsm.errors import ConfigError, InvalidTransition, KvfsmError
from kvfsm.machines.names import JobKind, JobState

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
NUM_HEADS = 4  # divisible by every world size tested


# ---------------------------------------------------------------------------------------------- helpers


def fill_random(kv_caches: list[torch.Tensor], seed: int) -> None:
    """Values in [0.5, 1.5): never zero, so a block that was not loaded is told apart from one that was."""
    gen = torch.Generator().manual_seed(seed)
    for layer in kv_caches:
        layer.copy_((torch.rand(layer.shape, generator=gen) + 0.5).to(layer.dtype))


def store_job(job_id: int, blocks: Sequence[int], slots: Sequence[int], world_size: int) -> Job:
    return Job(job_id, JobKind.STORE, "r", (), GPUBlockSpec(tuple(blocks)), SlotSpec(tuple(slots)), world_size)


def load_job(
    job_id: int, blocks: Sequence[int], slots: Sequence[int], offset: int, world_size: int, req: str = "r"
) -> Job:
    return Job(
        job_id,
        JobKind.LOAD,
        req,
        (),
        GPUBlockSpec(tuple(blocks), offset),
        SlotSpec(tuple(slots)),
        world_size,
    )


def meta(stores: Iterable[Job] = (), loads: Iterable[Job] = (), flush: Iterable[int] = ()) -> ConnectorMetadata:
    return ConnectorMetadata(
        load_jobs={j.job_id: j for j in loads},
        store_jobs={j.job_id: j for j in stores},
        jobs_to_flush=frozenset(flush),
    )


def engine_step(workers: Sequence[OffloadingWorker], m: ConnectorMetadata) -> None:
    for w in workers:
        w.before_forward(m)
    for w in workers:
        w.after_forward(m)


def drain(workers: Sequence[OffloadingWorker]) -> WorkerOutput:
    out = WorkerOutput()
    for w in workers:
        w.wait_all()
        out.merge(w.poll())
    return out


def backend_of(worker: OffloadingWorker) -> ThreadPoolCopyBackend:
    assert isinstance(worker.backend, ThreadPoolCopyBackend)
    return worker.backend


def layer_rows(pool: CPUSlotPool) -> list[torch.Tensor]:
    """Per layer, its blocks by chunk row (``slot * blocks_per_chunk + sub_block``): a read-only snapshot."""
    return [layer.reshape(-1, *pool.block_shape) for layer in pool.layers]


@dataclass
class Rig:
    """KV cache A (random) stores into per-rank pools; KV cache B (zeros) loads from the same pools."""

    spec: KVCacheSpec
    world_size: int
    blocks_per_chunk: int
    num_slots: int
    src: list[torch.Tensor] = field(init=False)
    dst: list[torch.Tensor] = field(init=False)
    pools: list[CPUSlotPool] = field(init=False)
    storers: list[OffloadingWorker] = field(init=False)
    loaders: list[OffloadingWorker] = field(init=False)

    def __post_init__(self) -> None:
        self.src = allocate_kv_caches(self.spec)
        fill_random(self.src, seed=1234)
        self.dst = allocate_kv_caches(self.spec)
        self.pools = []

        def factory(
            num_slots: int, bpc: int, block_shape: tuple[int, ...], num_layers: int, dtype: torch.dtype
        ) -> CPUSlotPool:
            pool = CPUSlotPool(num_slots, bpc, block_shape, num_layers, dtype, pin_memory=False)
            self.pools.append(pool)
            return pool

        self.storers = make_workers(self.src, factory, self.world_size, self.blocks_per_chunk, self.num_slots)
        self.loaders = [
            OffloadingWorker(
                rank,
                self.world_size,
                ThreadPoolCopyBackend(
                    shard_kv_caches(self.dst, self.world_size, rank), self.pools[rank], self.blocks_per_chunk
                ),
            )
            for rank in range(self.world_size)
        ]

    def close(self) -> None:
        for w in (*self.storers, *self.loaders):
            w.shutdown()


def make_rig(
    world_size: int = 2,
    blocks_per_chunk: int = 2,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
    num_blocks: int = 24,
    num_slots: int = 16,
) -> Rig:
    spec = KVCacheSpec(num_layers, num_blocks, NUM_HEADS, 4, 8, dtype=dtype, device="cpu")
    return Rig(spec, world_size, blocks_per_chunk, num_slots)


class RecordingBackend:
    """Wraps a real backend and records every call, in order."""

    def __init__(self, inner: ThreadPoolCopyBackend) -> None:
        self.inner = inner
        self.calls: list[tuple[str, tuple[int, ...]]] = []

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        self.calls.append(("submit", (job_id,)))
        return self.inner.submit(job_id, is_store, gpu, slots)

    def poll(self) -> list[tuple[int, bool]]:
        return self.inner.poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = tuple(job_ids)
        self.calls.append(("wait", ids))
        self.inner.wait(ids)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def submitted(self) -> list[int]:
        return [ids[0] for name, ids in self.calls if name == "submit"]


def recording_worker(rig: Rig, rank: int = 0, loader: bool = False) -> tuple[OffloadingWorker, RecordingBackend]:
    inner = backend_of(rig.loaders[rank] if loader else rig.storers[rank])
    rec = RecordingBackend(inner)
    return OffloadingWorker(rank, rig.world_size, rec), rec


def assert_blocks_equal(
    a: list[torch.Tensor], a_ids: Sequence[int], b: list[torch.Tensor], b_ids: Sequence[int]
) -> None:
    for la, lb in zip(a, b, strict=True):
        for x, y in zip(a_ids, b_ids, strict=True):
            assert torch.equal(la[x], lb[y]), f"block {x} of the source != block {y} of the destination"


def assert_zero_except(kv: list[torch.Tensor], keep: Iterable[int]) -> None:
    keep_set = set(keep)
    for layer in kv:
        for b in range(layer.shape[0]):
            if b not in keep_set:
                assert not layer[b].any(), f"block {b} should be untouched (zero)"


# ---------------------------------------------------------------------------------------------- round trips


def round_trip(
    rig: Rig,
    store_blocks: list[int],
    store_slots: list[int],
    loads: list[tuple[int, int, list[int]]],
) -> None:
    """Store ``store_blocks`` of A into ``store_slots``, then load logical ranges ``(start, length)`` to B.

    Each load ``(start, length, dst_blocks)`` starts part-way into a chunk when start % bpc > 0.
    """
    bpc = rig.blocks_per_chunk
    w = rig.world_size
    st_job = store_job(1, store_blocks, store_slots, w)
    engine_step(rig.storers, meta(stores=[st_job]))
    out = drain(rig.storers)
    assert out.completed == {1: set(range(w))} and not out.failed and not out.finished_recving
    for rank in range(w):
        st_job.ack(rank)
    assert st_job.current() is JobState.COMPLETE

    loaded_dst: list[int] = []
    jobs: list[Job] = []
    for k, (start, length, dst_blocks) in enumerate(loads):
        first_chunk, last_chunk = start // bpc, (start + length - 1) // bpc
        slots = store_slots[first_chunk : last_chunk + 1]
        jobs.append(load_job(10 + k, dst_blocks, slots, start % bpc, w, req=f"req{k}"))
        loaded_dst.extend(dst_blocks)
    engine_step(rig.loaders, meta(loads=jobs))
    out = drain(rig.loaders)
    assert out.completed == {j.job_id: set(range(w)) for j in jobs} and not out.failed
    assert out.finished_recving == {j.req_id for j in jobs}

    for start, length, dst_blocks in loads:
        assert_blocks_equal(rig.src, store_blocks[start : start + length], rig.dst, dst_blocks)
    assert_zero_except(rig.dst, loaded_dst)


def plan_round_trip(
    rng: random.Random, rig: Rig, n_store: int, n_loads: int, mid_chunk: bool = False
) -> tuple[list[int], list[int], list[tuple[int, int, list[int]]]]:
    """A random store of ``n_store`` blocks and up to ``n_loads`` loads of random logical ranges of it.

    With ``mid_chunk`` the first load starts at sub-block 1 of the store's second chunk.
    """
    bpc = rig.blocks_per_chunk
    n_chunks = (n_store + bpc - 1) // bpc
    store_blocks = rng.sample(range(rig.spec.num_blocks), n_store)
    store_slots = rng.sample(range(rig.num_slots), n_chunks)
    free_dst = list(range(rig.spec.num_blocks))
    rng.shuffle(free_dst)
    loads: list[tuple[int, int, list[int]]] = []
    if mid_chunk:
        start = bpc + 1
        assert start < n_store
        length = min(3, n_store - start)
        loads.append((start, length, [free_dst.pop() for _ in range(length)]))
    for _ in range(n_loads):
        if not free_dst:
            break
        start = rng.randrange(n_store)
        length = rng.randint(1, min(n_store - start, len(free_dst)))
        loads.append((start, length, [free_dst.pop() for _ in range(length)]))
    return store_blocks, store_slots, loads


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_layers", [1, 3])
def test_round_trip_is_byte_exact(world_size: int, blocks_per_chunk: int, dtype: torch.dtype, num_layers: int) -> None:
    rig = make_rig(world_size, blocks_per_chunk, num_layers, dtype)
    rng = random.Random(world_size * 1000 + blocks_per_chunk * 100 + num_layers)
    try:
        store_blocks, store_slots, loads = plan_round_trip(
            rng, rig, n_store=11, n_loads=3, mid_chunk=blocks_per_chunk > 1
        )
        if blocks_per_chunk > 1:
            assert loads[0][0] % blocks_per_chunk == 1  # a load with first_block_offset > 0
        round_trip(rig, store_blocks, store_slots, loads)
        block_bytes = rig.spec.bytes_per_block // world_size
        for w in rig.storers:
            assert backend_of(w).stats().bytes_stored == len(store_blocks) * block_bytes
        loaded = sum(length for _, length, _ in loads)
        assert sum(backend_of(w).bytes_loaded for w in rig.loaders) == loaded * block_bytes * world_size
    finally:
        rig.close()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world_size=st.sampled_from([1, 2, 4]),
    blocks_per_chunk=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    num_layers=st.integers(1, 3),
    n_store=st.integers(1, 12),
    n_loads=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_random_block_sets(
    world_size: int,
    blocks_per_chunk: int,
    dtype: torch.dtype,
    num_layers: int,
    n_store: int,
    n_loads: int,
    seed: int,
) -> None:
    rig = make_rig(world_size, blocks_per_chunk, num_layers, dtype, num_blocks=16, num_slots=12)
    try:
        store_blocks, store_slots, loads = plan_round_trip(random.Random(seed), rig, n_store, n_loads)
        round_trip(rig, store_blocks, store_slots, loads)
    finally:
        rig.close()


def test_store_places_blocks_in_chunk_rows() -> None:
    rig = make_rig(world_size=2, blocks_per_chunk=3)
    try:
        blocks, slots = [7, 2, 9, 4, 11], [5, 1]
        engine_step(rig.storers, meta(stores=[store_job(1, blocks, slots, 2)]))
        drain(rig.storers)
        rows = chunk_rows(GPUBlockSpec(tuple(blocks)), SlotSpec(tuple(slots)), 3)
        assert rows == [15, 16, 17, 3, 4]
        for rank, pool in enumerate(rig.pools):
            shard = shard_kv_caches(rig.src, 2, rank)
            for layer, flat in zip(shard, layer_rows(pool), strict=True):
                for b, row in zip(blocks, rows, strict=True):
                    assert torch.equal(layer[b], flat[row])
            # Row 5 (slot 1, sub-block 2) is past the job's last block: untouched.
            assert not layer_rows(pool)[0][5].any()
    finally:
        rig.close()


def test_chunk_rows_with_offset() -> None:
    assert chunk_rows(GPUBlockSpec((0, 1, 2, 3), 2), SlotSpec((4, 9)), 3) == [14, 27, 28, 29]
    assert chunk_rows(GPUBlockSpec((), 0), SlotSpec(()), 2) == []


def test_copies_are_batched_per_layer_group() -> None:
    """The staged path issues a fixed number of index kernels per layer group, whatever the number of blocks:
    one per group when the group's layers are one allocation, else one per layer, plus one on the pool side."""

    class CountOps(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.counts: dict[str, int] = {}

        @override
        def __torch_function__(
            self,
            func: Callable[..., Any],
            types: Iterable[type],
            args: Sequence[Any] = (),
            kwargs: Mapping[str, Any] | None = None,
        ) -> Any:
            name = getattr(func, "__name__", str(func))
            self.counts[name] = self.counts.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    rig = make_rig(world_size=1, blocks_per_chunk=2, num_layers=3, num_blocks=48, num_slots=24)
    try:
        stacked = backend_of(rig.storers[0])
        separate = ThreadPoolCopyBackend([t.clone() for t in rig.src], rig.pools[0], 2, copy_path="staged")
        for backend, kv_side in ((stacked, 1), (separate, 3)):
            assert (backend.registration.groups[0].stacked is not None) == (kv_side == 1)
            for is_store in (True, False):
                for n in (8, 20):
                    blocks = list(range(2 * n - 2, -1, -2))  # every other block, descending: nothing contiguous
                    slots = list(range(n // 2 - 1, -1, -1))
                    plan = backend.registration.plan(is_store, GPUBlockSpec(tuple(blocks)), SlotSpec(tuple(slots)))
                    assert backend.copier is not None
                    with CountOps() as mode:
                        backend.copier.copy_staged(plan, 0)
                    assert mode.counts.get("index_select", 0) == (kv_side if is_store else 1)
                    assert mode.counts.get("index_put_", 0) == (1 if is_store else kv_side)
                    assert mode.counts.get("copy_", 0) == 0
        separate.shutdown()
    finally:
        rig.close()


def test_empty_job_completes_without_copying() -> None:
    rig = make_rig(world_size=1)
    try:
        backend = backend_of(rig.storers[0])
        backend.submit(5, True, GPUBlockSpec(()), SlotSpec(())).result()
        assert backend.poll() == [(5, True)]
        assert backend.bytes_stored == 0
    finally:
        rig.close()


# ---------------------------------------------------------------------------------------------- failures


def test_copy_exception_is_reported_failed_never_completed(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(world_size=2)
    try:
        monkeypatch.setattr(ThreadPoolCopyBackend, "check", lambda *a: None)
        bad = rig.spec.num_blocks + 3  # slips past the disabled validation; index_select raises
        job = store_job(1, [0, bad], [0], 2)
        engine_step(rig.storers, meta(stores=[job]))
        out = drain(rig.storers)
        assert out.failed == {1: {0, 1}}
        assert out.completed == {}
        assert job.current() is JobState.IN_FLIGHT  # the worker never fails the job itself
        job.fail(0)
        job.fail(1)
        assert job.current() is JobState.FAILED
        assert all(backend_of(w).stats().jobs_failed == 1 for w in rig.storers)
        assert all(backend_of(w).bytes_stored == 0 for w in rig.storers)
        assert all(not flat.any() for pool in rig.pools for flat in layer_rows(pool))
    finally:
        rig.close()


def test_failed_load_leaves_destination_untouched(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(world_size=1, blocks_per_chunk=2, num_slots=4)
    try:
        monkeypatch.setattr(ThreadPoolCopyBackend, "check", lambda *a: None)
        job = load_job(3, [1, 2], [0, 99], 1, 1)
        engine_step(rig.loaders, meta(loads=[job]))
        out = drain(rig.loaders)
        assert out.failed == {3: {0}} and out.completed == {}
        assert out.finished_recving == {"r"}  # this rank is done with the request's load either way
        assert_zero_except(rig.dst, [])
    finally:
        rig.close()


def test_one_rank_failing_is_one_failure_report(monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_rig(world_size=2)
    try:
        target = backend_of(rig.storers[1])
        real_copy = ThreadPoolCopyBackend._copy

        def copy_or_fail(self: ThreadPoolCopyBackend, plan: JobPlan) -> None:
            if self is target:
                raise RuntimeError("simulated DMA error")
            real_copy(self, plan)

        monkeypatch.setattr(ThreadPoolCopyBackend, "_copy", copy_or_fail)
        job = store_job(1, [3, 4], [2], 2)
        engine_step(rig.storers, meta(stores=[job]))
        out = drain(rig.storers)
        assert out.completed == {1: {0}}
        assert out.failed == {1: {1}}
        job.ack(0)
        job.fail(1)
        assert job.current() is JobState.FAILED
    finally:
        rig.close()


def test_submit_failure_after_launch_is_reported_failed() -> None:
    rig = make_rig(world_size=1)
    try:
        backend_of(rig.storers[0]).shutdown()
        with pytest.raises(KvfsmError):
            backend_of(rig.storers[0]).submit(9, True, GPUBlockSpec((0,)), SlotSpec((0,)))
        job = store_job(1, [0], [0], 1)
        engine_step(rig.storers, meta(stores=[job]))
        assert job.current() is JobState.IN_FLIGHT
        out = drain(rig.storers)
        assert out.failed == {1: {0}} and out.completed == {}
        assert rig.storers[0].num_in_flight == 0
    finally:
        rig.close()


def test_poll_reports_each_job_once() -> None:
    rig = make_rig(world_size=1)
    try:
        engine_step(rig.storers, meta(stores=[store_job(1, [0, 1], [0], 1)]))
        assert drain(rig.storers).completed == {1: {0}}
        assert drain(rig.storers).is_empty()
    finally:
        rig.close()


# ---------------------------------------------------------------------------------------------- worker step


def test_terminal_jobs_are_skipped() -> None:
    rig = make_rig(world_size=2)
    try:
        stale = store_job(1, [0, 1], [0], 2)
        stale.discard()
        cancelled = store_job(2, [2, 3], [1], 2)
        cancelled.cancel()
        failed = load_job(3, [4], [2], 0, 2)
        failed.fail()
        terminal = (stale, cancelled, failed)
        states = [j.current() for j in terminal]
        worker, rec = recording_worker(rig, rank=0)
        m = meta(stores=[stale, cancelled], loads=[failed], flush=[1, 2])
        worker.before_forward(m)
        worker.after_forward(m)
        assert rec.submitted() == []
        assert [j.current() for j in terminal] == states
        assert all(j.launched_mask == 0 for j in terminal)
        assert worker.unlaunched_store_ids == ()
        assert worker.poll().is_empty()
    finally:
        rig.close()


def test_job_made_stale_in_flight_still_reports_its_outcome() -> None:
    rig = make_rig(world_size=1)
    try:
        job = store_job(1, [0], [0], 1)
        engine_step(rig.storers, meta(stores=[job]))
        job.discard()
        assert drain(rig.storers).completed == {1: {0}}  # the scheduler drops acks of stale jobs
    finally:
        rig.close()


def test_stores_wait_for_after_forward_loads_go_before() -> None:
    rig = make_rig(world_size=1)
    try:
        worker, rec = recording_worker(rig)
        st_job = store_job(1, [0, 1], [0], 1)
        ld_job = load_job(2, [5], [3], 0, 1)
        m = meta(stores=[st_job], loads=[ld_job])
        worker.before_forward(m)
        assert st_job.current() is JobState.SUBMITTED and st_job.launched_mask == 0
        assert ld_job.current() is JobState.IN_FLIGHT
        assert rec.submitted() == [2]
        assert list(worker.unlaunched_store_ids) == [1]
        worker.after_forward(m)
        assert st_job.current() is JobState.IN_FLIGHT
        assert rec.submitted() == [2, 1]
        worker.after_forward(m)  # the same metadata again is not a second launch
        assert rec.submitted() == [2, 1]
        assert not worker.unlaunched_store_ids
        worker.wait_all()
        out = worker.poll()
        assert out.completed == {1: {0}, 2: {0}}
    finally:
        rig.close()


def test_flush_launches_and_waits_before_loads() -> None:
    rig = make_rig(world_size=1, blocks_per_chunk=2)
    try:
        worker, rec = recording_worker(rig)
        st_job = store_job(1, [3, 8, 5], [4, 6], 1)
        other = store_job(2, [0, 1], [0], 1)
        ld_job = load_job(3, [9], [2], 0, 1)
        m = meta(stores=[st_job, other], loads=[ld_job], flush=[1])
        worker.before_forward(m)
        # The flushed store was launched and waited for before the load; the other store was not launched.
        assert rec.calls == [("submit", (1,)), ("wait", (1,)), ("submit", (3,))]
        assert other.current() is JobState.SUBMITTED
        # Right after the call returns the flushed data is in the pool (no poll, no wait).
        pool = rig.pools[0]
        for layer, flat in zip(rig.src, layer_rows(pool), strict=True):
            for b, row in zip([3, 8, 5], [8, 9, 12], strict=True):
                assert torch.equal(layer[b], flat[row])
        worker.after_forward(m)
        assert rec.submitted() == [1, 3, 2]
        worker.wait_all()
        assert worker.poll().completed == {1: {0}, 2: {0}, 3: {0}}
    finally:
        rig.close()


def test_flush_waits_for_stores_launched_in_earlier_steps() -> None:
    rig = make_rig(world_size=2)
    try:
        pairs = [recording_worker(rig, rank) for rank in range(2)]
        workers = [w for w, _ in pairs]
        job = store_job(1, [6, 7], [3], 2)
        engine_step(workers, meta(stores=[job]))  # launched in after_forward, not polled
        for w in workers:
            w.before_forward(meta(flush=[1, 42]))  # 42: not a job this worker launched
        for rank, (_, rec) in enumerate(pairs):
            assert rec.calls == [("submit", (1,)), ("wait", (1,))]
            shard = shard_kv_caches(rig.src, 2, rank)
            for layer, flat in zip(shard, layer_rows(rig.pools[rank]), strict=True):
                assert torch.equal(layer[6], flat[6]) and torch.equal(layer[7], flat[7])
        out = WorkerOutput()
        for w in workers:
            out.merge(w.poll())
        assert out.completed == {1: {0, 1}}
    finally:
        rig.close()


def test_flush_of_store_left_unlaunched_by_an_earlier_step() -> None:
    rig = make_rig(world_size=1)
    try:
        worker, rec = recording_worker(rig)
        job = store_job(1, [2], [1], 1)
        worker.before_forward(meta(stores=[job]))  # a step whose after_forward never came
        assert rec.submitted() == []
        worker.before_forward(meta(flush=[1]))
        assert rec.calls == [("submit", (1,)), ("wait", (1,))]
        assert torch.equal(rig.src[0][2], layer_rows(rig.pools[0])[0][2])
        assert worker.poll().completed == {1: {0}}
    finally:
        rig.close()


def test_launch_fires_the_job_machine_once_per_rank() -> None:
    rig = make_rig(world_size=2)
    try:
        job = store_job(1, [0, 1], [0], 2)
        rig.storers[0].after_forward(meta(stores=[job]))
        assert job.launched_mask == 0b01 and job.current() is JobState.IN_FLIGHT
        with pytest.raises(InvalidTransition):
            job.launch(0)
        rig.storers[1].after_forward(meta(stores=[job]))
        assert job.launched_mask == 0b11
        with pytest.raises(InvalidTransition):
            job.launch(1)
        assert drain(rig.storers).completed == {1: {0, 1}}
    finally:
        rig.close()


def test_shutdown_waits_for_outstanding_copies() -> None:
    rig = make_rig(world_size=1)
    try:
        engine_step(rig.storers, meta(stores=[store_job(1, list(range(8)), [0, 1, 2, 3], 1)]))
        rig.storers[0].shutdown()
        assert backend_of(rig.storers[0]).num_inflight == 1  # finished, not yet polled
        assert rig.storers[0].poll().completed == {1: {0}}
        for b in range(8):
            assert torch.equal(rig.src[0][b], layer_rows(rig.pools[0])[0][b])
    finally:
        rig.close()


# ---------------------------------------------------------------------------------------------- validation


def test_worker_validates_every_job_before_any_transition() -> None:
    rig = make_rig(world_size=1)
    try:
        worker, rec = recording_worker(rig)
        good = load_job(1, [0], [0], 0, 1)
        bad = load_job(2, [rig.spec.num_blocks], [0], 0, 1)
        with pytest.raises(ConfigError, match="expected ids in"):
            worker.before_forward(meta(loads=[good, bad]))
        assert good.current() is JobState.SUBMITTED and good.launched_mask == 0
        assert rec.calls == []
        wrong_kind = load_job(3, [0], [0], 0, 1)
        with pytest.raises(ConfigError, match="expected a store job"):
            worker.after_forward(meta(stores=[wrong_kind]))
        wrong_w = store_job(4, [0], [0], 2)
        with pytest.raises(ConfigError, match="world_size"):
            worker.after_forward(meta(stores=[wrong_w]))
        assert wrong_w.launched_mask == 0
    finally:
        rig.close()


@pytest.mark.parametrize(
    ("is_store", "gpu", "slots", "match"),
    [
        (True, GPUBlockSpec((0, 24)), SlotSpec((0,)), "expected ids in 0..23"),
        (True, GPUBlockSpec((-1,)), SlotSpec((0,)), "expected ids in 0..23"),
        (True, GPUBlockSpec((0, 1, 2)), SlotSpec((0,)), "expected 2"),
        (True, GPUBlockSpec((0, 1)), SlotSpec((0, 1)), "expected 1"),
        (False, GPUBlockSpec((0, 1), 1), SlotSpec((0,)), "expected 2"),
        (False, GPUBlockSpec((0,), 2), SlotSpec((0,)), "first_block_offset"),
        (True, GPUBlockSpec((0,)), SlotSpec((16,)), "expected ids in 0..15"),
        (True, GPUBlockSpec((0, 1, 2)), SlotSpec((3, 3)), "distinct slots"),
        (False, GPUBlockSpec((4, 4)), SlotSpec((3,)), "distinct blocks"),
        (True, GPUBlockSpec(()), SlotSpec((0,)), "expected 0"),
    ],
)
def test_submit_rejects_bad_specs(is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec, match: str) -> None:
    rig = make_rig(world_size=1, blocks_per_chunk=2, num_blocks=24, num_slots=16)
    try:
        backend = backend_of(rig.storers[0])
        with pytest.raises(ConfigError, match=match):
            backend.submit(1, is_store, gpu, slots)
        assert backend.num_inflight == 0
    finally:
        rig.close()


def test_duplicate_job_id_rejected() -> None:
    rig = make_rig(world_size=1)
    try:
        backend = backend_of(rig.storers[0])
        backend.submit(1, True, GPUBlockSpec((0,)), SlotSpec((0,)))
        with pytest.raises(ConfigError, match="already submitted"):
            backend.submit(1, True, GPUBlockSpec((1,)), SlotSpec((1,)))
    finally:
        rig.close()


def test_kv_cache_spec_and_layout_validation() -> None:
    spec = KVCacheSpec(2, 8, 4, 16, 8, dtype=torch.bfloat16, device="cpu")
    assert spec.layer_shape == (8, 2, 4, 16, 8)
    assert spec.bytes_per_block == 2 * 2 * 4 * 16 * 8 * 2
    kv = allocate_kv_caches(spec)
    validate_kv_caches(kv, spec)
    assert all(not layer.any() for layer in kv)
    with pytest.raises(ConfigError, match="num_layers=2"):
        validate_kv_caches(kv[:1], spec)
    with pytest.raises(ConfigError, match=r"expected \(8, 2, 4, 16, 8\)"):
        validate_kv_caches([kv[0], torch.zeros(8, 2, 4, 16, 4, dtype=torch.bfloat16)], spec)
    with pytest.raises(ConfigError, match=r"expected torch\.bfloat16"):
        validate_kv_caches([kv[0], kv[1].float()], spec)
    with pytest.raises(ConfigError, match="expected cuda"):
        validate_kv_caches(kv, KVCacheSpec(2, 8, 4, 16, 8, dtype=torch.bfloat16, device="cuda"))
    for bad in ({"num_layers": 0}, {"num_heads": -1}, {"head_dim": 2.0}, {"num_blocks": True}):
        args: dict[str, Any] = {"num_layers": 1, "num_blocks": 1, "num_heads": 1, "tokens_per_block": 1}
        args |= {"head_dim": 1, **bad}
        with pytest.raises(ConfigError, match="positive int"):
            KVCacheSpec(**args)
    with pytest.raises(ConfigError, match=r"torch\.dtype"):
        KVCacheSpec(1, 1, 1, 1, 1, dtype="float16")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="device"):
        KVCacheSpec(1, 1, 1, 1, 1, device="no-such-device")
    assert KVCacheSpec(1, 1, 1, 1, 1).torch_device == default_device()
    assert default_device().type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_head_sharding() -> None:
    assert head_shard(8, 4, 3) == slice(6, 8)
    assert head_shard(8, 1, 0) == slice(0, 8)
    with pytest.raises(ConfigError, match="not divisible"):
        head_shard(6, 4, 0)
    with pytest.raises(ConfigError, match="rank"):
        head_shard(8, 2, 2)
    spec = KVCacheSpec(2, 4, 4, 2, 2, dtype=torch.float32, device="cpu")
    kv = allocate_kv_caches(spec)
    fill_random(kv, 0)
    shards = [shard_kv_caches(kv, 2, r) for r in range(2)]
    for layer, s0, s1 in zip(kv, shards[0], shards[1], strict=True):
        assert s0.shape == (4, 2, 2, 2, 2)
        assert torch.equal(torch.cat([s0, s1], dim=2), layer)
        assert s0.untyped_storage().data_ptr() == layer.untyped_storage().data_ptr()  # views, not copies
    with pytest.raises(ConfigError, match="5 dims"):
        shard_kv_caches([torch.zeros(4, 4)], 1, 0)
    with pytest.raises(ConfigError, match="empty"):
        shard_kv_caches([], 1, 0)
    with pytest.raises(ConfigError, match="not divisible"):
        make_workers(kv, CPUSlotPool, 3, 1, 4)


def test_backend_rejects_mismatched_pool() -> None:
    kv = allocate_kv_caches(KVCacheSpec(2, 4, 2, 2, 2, dtype=torch.float16, device="cpu"))
    block = (2, 2, 2, 2)
    ok = CPUSlotPool(4, 2, block, 2, torch.float16, pin_memory=False)
    ThreadPoolCopyBackend(kv, ok, 2).shutdown()
    with pytest.raises(ConfigError, match=r"pool's torch\.float16"):
        ThreadPoolCopyBackend([t.float() for t in kv], ok, 2)
    with pytest.raises(ConfigError, match="block shape"):
        ThreadPoolCopyBackend(kv, CPUSlotPool(4, 2, (2, 2, 2, 3), 2, torch.float16, pin_memory=False), 2)
    with pytest.raises(ConfigError, match="2 layers"):
        ThreadPoolCopyBackend(kv[:1], ok, 2)
    with pytest.raises(ConfigError, match="pool's 2"):
        ThreadPoolCopyBackend(kv, ok, 3)
    with pytest.raises(ConfigError, match="max_workers"):
        ThreadPoolCopyBackend(kv, ok, 2, max_workers=0)
    with pytest.raises(ConfigError, match="empty"):
        ThreadPoolCopyBackend([], ok, 2)
    with pytest.raises(ConfigError, match="rank"):
        OffloadingWorker(2, 2, ThreadPoolCopyBackend(kv, ok, 2))


# ---------------------------------------------------------------------------------------------- the pool


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pool_slot_bytes_round_trip(dtype: torch.dtype) -> None:
    a = CPUSlotPool(3, 2, (2, 2, 4, 8), 3, dtype, pin_memory=False)
    b = CPUSlotPool(3, 2, (2, 2, 4, 8), 3, dtype, pin_memory=False)
    fill_random(a.layers, 7)
    elem = torch.empty((), dtype=dtype).element_size()
    assert a.nbytes_per_slot == 3 * 2 * (2 * 2 * 4 * 8) * elem
    assert a.nbytes == 3 * a.nbytes_per_slot
    data = a.read_slot(1)
    assert len(data) == a.nbytes_per_slot
    b.write_slot(2, data)
    b.write_slot(0, bytearray(a.read_slot(0)))
    for la, lb in zip(a.layers, b.layers, strict=True):
        assert torch.equal(la[1], lb[2])
        assert torch.equal(la[0], lb[0])
        assert not lb[1].any()
    # Layer 0's chunk comes first in the slot bytes.
    first = a.layers[0][1].reshape(-1).view(torch.uint8)
    assert data[: first.numel()] == bytes(first.numpy().tobytes())


def test_pool_validation_and_pinning() -> None:
    with pytest.raises(ConfigError, match="expected nbytes_per_slot"):
        CPUSlotPool(2, 1, (4,), 1, torch.float32, pin_memory=False).write_slot(0, b"\0" * 3)
    with pytest.raises(ConfigError, match=r"outside 0\.\.1"):
        CPUSlotPool(2, 1, (4,), 1, torch.float32, pin_memory=False).read_slot(2)
    with pytest.raises(ConfigError, match="num_slots"):
        CPUSlotPool(0, 1, (4,), 1, torch.float32)
    with pytest.raises(ConfigError, match="block_shape"):
        CPUSlotPool(1, 1, (), 1, torch.float32)
    with pytest.raises(ConfigError, match=r"block_shape\[1\]"):
        CPUSlotPool(1, 1, (4, 0), 1, torch.float32)
    with pytest.raises(ConfigError, match="dtype"):
        CPUSlotPool(1, 1, (4,), 1, "float32")  # type: ignore[arg-type]
    pool = CPUSlotPool(2, 2, (4,), 1, torch.float32)
    assert pool.layers[0].shape == (2, 2, 4) and pool.rows.shape == (4, 4)
    assert pool.pinned == torch.cuda.is_available()
    assert not CPUSlotPool(2, 2, (4,), 1, torch.float32, pin_memory=False).pinned
    if not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="pageable"):
            forced = CPUSlotPool(2, 2, (4,), 1, torch.float32, pin_memory=True)
        assert not forced.pinned and forced.layers[0].shape == (2, 2, 4)
