"""One conformance suite for every copy backend: ``cpu`` (ThreadPoolCopyBackend), ``cuda-emu`` (CudaCopyBackend
on CPU tensors through the EmulatedDevice: the real launch, ordering and completion logic, deferred streams) and
``cuda`` (CudaCopyBackend on a GPU; skipped without CUDA). Each runs with every copy path it has.

Round trips go GPU -> CPU -> GPU through the worker and the job machines, for random block sets, chunk sizes,
layer counts and groups, dtypes and KV layouts (one allocation, separate tensors, tensor-parallel shard views with
non-contiguous rows): every byte must come back. Completion fires the job machine exactly once; a launch that fails
(an id that slipped past validation) ends the job ``failed`` through the scheduler and is never reported complete.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
from typing_extensions import override

pytest.importorskip("torch")

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data import CPUSlotPool, OffloadingWorker, ThreadPoolCopyBackend
from kvfsm.data.calibration import CalibrationTable, Choice
from kvfsm.data.cuda import CudaCopyBackend, EmulatedDevice
from kvfsm.data.cuda.backend import _segments
from kvfsm.data.plan import Registration, contiguous_start, runs
from kvfsm.errors import ConfigError
from kvfsm.machines.names import JobKind, JobState
from kvfsm.testing.backend import CopyBackendStateMachine

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@dataclass(frozen=True)
class Kind:
    backend: str  # "cpu" | "cuda-emu" | "cuda"
    path: str

    @property
    def device(self) -> str:
        return "cuda" if self.backend == "cuda" else "cpu"

    @override
    def __str__(self) -> str:
        return f"{self.backend}-{self.path}"


KINDS = [
    pytest.param(Kind("cpu", "auto"), id="cpu-auto"),
    pytest.param(Kind("cpu", "staged"), id="cpu-staged"),
    pytest.param(Kind("cpu", "runs"), id="cpu-runs"),
    pytest.param(Kind("cuda-emu", "dma"), id="cuda-emu-dma"),
    pytest.param(Kind("cuda-emu", "runs"), id="cuda-emu-runs"),
    pytest.param(Kind("cuda-emu", "kernel"), id="cuda-emu-kernel"),
    pytest.param(Kind("cuda", "dma"), id="cuda-dma", marks=needs_cuda),
    pytest.param(Kind("cuda", "runs"), id="cuda-runs", marks=needs_cuda),
    pytest.param(Kind("cuda", "kernel"), id="cuda-kernel", marks=needs_cuda),
    pytest.param(Kind("cuda", "auto"), id="cuda-auto", marks=needs_cuda),
]
FAST_KINDS = [k for k in KINDS if "cuda-" not in str(k.id) or str(k.id).startswith("cuda-emu")]


def make_backend(
    kind: Kind,
    kv: Sequence[torch.Tensor],
    pool: CPUSlotPool,
    bpc: int,
    layers_per_group: int | None = None,
    staging_bytes: int = 1 << 12,
) -> CopyBackend:
    """The backend under test. A small staging buffer makes the dma path copy in several pieces."""
    if kind.backend == "cpu":
        return ThreadPoolCopyBackend(kv, pool, bpc, copy_path=kind.path, layers_per_group=layers_per_group)
    api = EmulatedDevice() if kind.backend == "cuda-emu" else None
    if kind.backend == "cuda" and kind.path == "kernel":
        try:
            return CudaCopyBackend(kv, pool, bpc, copy_path="kernel", layers_per_group=layers_per_group)
        except ConfigError as exc:
            pytest.skip(f"no zero-copy kernel path on this machine: {exc}")
    return CudaCopyBackend(
        kv,
        pool,
        bpc,
        copy_path=kind.path,
        layers_per_group=layers_per_group,
        staging_bytes=staging_bytes,
        device_api=api,
    )


def random_bytes(t: torch.Tensor, seed: int) -> None:
    """Every bit pattern (NaN payloads included), written through an integer view."""
    gen = torch.Generator().manual_seed(seed)
    host = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.copy_(host.view(t.dtype).view(t.shape).to(t.device))


def raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().view(torch.uint8)


def allocate(
    layout: str, layers: int, blocks: int, block: tuple[int, ...], dtype: torch.dtype, device: str
) -> list[torch.Tensor]:
    """KV layers: one allocation ("stacked"), one per layer ("separate"), or rank 1's head shard of 2 ("sharded",
    non-contiguous rows)."""
    if layout == "stacked":
        return list(torch.zeros((layers, blocks, *block), dtype=dtype, device=device).unbind(0))
    if layout == "separate":
        return [torch.zeros((blocks, *block), dtype=dtype, device=device) for _ in range(layers)]
    wide = (block[0], block[1] * 2, *block[2:])
    full = torch.zeros((layers, blocks, *wide), dtype=dtype, device=device)
    return [layer[:, :, block[1] :] for layer in full.unbind(0)]


# ---------------------------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    """KV cache ``src`` (random) stores into the pool; KV cache ``dst`` (zeros) loads from it."""

    kind: Kind
    layers: int = 2
    blocks: int = 24
    slots: int = 16
    bpc: int = 2
    block: tuple[int, ...] = (2, 2, 4, 8)
    dtype: torch.dtype = torch.float16
    layout: str = "stacked"
    layers_per_group: int | None = None
    src: list[torch.Tensor] = field(init=False)
    dst: list[torch.Tensor] = field(init=False)
    pool: CPUSlotPool = field(init=False)
    storer: OffloadingWorker = field(init=False)
    loader: OffloadingWorker = field(init=False)
    acks: dict[int, int] = field(default_factory=dict)
    fails: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = self.kind.device
        self.src = allocate(self.layout, self.layers, self.blocks, self.block, self.dtype, dev)
        for i, layer in enumerate(self.src):
            random_bytes(layer, 1000 + i)
        self.dst = allocate(self.layout, self.layers, self.blocks, self.block, self.dtype, dev)
        self.pool = CPUSlotPool(self.slots, self.bpc, self.block, self.layers, self.dtype, pin_memory=HAS_CUDA)
        lpg = self.layers_per_group
        self.storer = OffloadingWorker(0, 1, make_backend(self.kind, self.src, self.pool, self.bpc, lpg))
        self.loader = OffloadingWorker(0, 1, make_backend(self.kind, self.dst, self.pool, self.bpc, lpg))

    def close(self) -> None:
        self.storer.shutdown()
        self.loader.shutdown()
        self.pool.close()

    def step(self, worker: OffloadingWorker, jobs: Sequence[Job]) -> None:
        stores = [j for j in jobs if j.kind is JobKind.STORE]
        loads = [j for j in jobs if j.kind is JobKind.LOAD]
        meta = ConnectorMetadata({j.job_id: j for j in loads}, {j.job_id: j for j in stores})
        worker.before_forward(meta)
        worker.after_forward(meta)

    def finish(self, worker: OffloadingWorker, jobs: Sequence[Job]) -> WorkerOutput:
        """Poll until every job is reported, then apply the reports to the job machines as the scheduler does.
        (The blocking wait is only there to make the test deterministic.)"""
        out = WorkerOutput()
        worker.wait_all()
        out.merge(worker.poll())
        assert worker.poll().is_empty(), "a job was reported twice"
        for job in jobs:
            ok, bad = out.completed.get(job.job_id, set()), out.failed.get(job.job_id, set())
            self.acks[job.job_id] = self.acks.get(job.job_id, 0) + len(ok)
            self.fails[job.job_id] = self.fails.get(job.job_id, 0) + len(bad)
            for rank in sorted(bad):
                job.fail(rank)
            for rank in sorted(ok):
                job.ack(rank)
        return out


def store_job(job_id: int, blocks: Sequence[int], slots: Sequence[int]) -> Job:
    return Job(job_id, JobKind.STORE, "r", (), GPUBlockSpec(tuple(blocks)), SlotSpec(tuple(slots)), 1)


def load_job(job_id: int, blocks: Sequence[int], slots: Sequence[int], offset: int) -> Job:
    return Job(job_id, JobKind.LOAD, f"q{job_id}", (), GPUBlockSpec(tuple(blocks), offset), SlotSpec(tuple(slots)), 1)


def round_trip(rig: Rig, rng: random.Random, n_store: int, n_loads: int) -> None:
    """A random store, then random loads (some starting part-way into a chunk); every byte must match."""
    bpc = rig.bpc
    n_chunks = -(-n_store // bpc)
    blocks = rng.sample(range(rig.blocks), n_store)
    slots = rng.sample(range(rig.slots), n_chunks)
    st_job = store_job(1, blocks, slots)
    rig.step(rig.storer, [st_job])
    assert st_job.current() is JobState.IN_FLIGHT
    rig.finish(rig.storer, [st_job])
    assert st_job.current() is JobState.COMPLETE and rig.acks[1] == 1
    # The pool holds each block at its chunk row; rows past the job's last block keep their zeros.
    for i, b in enumerate(blocks):
        for layer in range(rig.layers):
            assert torch.equal(raw(rig.pool.data[slots[i // bpc], layer, i % bpc]), raw(rig.src[layer][b]))
    for sub in range(n_store - (n_chunks - 1) * bpc, bpc):
        assert not rig.pool.data[slots[-1], :, sub].any()

    free = list(range(rig.blocks))
    rng.shuffle(free)
    jobs: list[Job] = []
    wanted: list[tuple[int, int, list[int]]] = []
    for k in range(n_loads):
        start = rng.randrange(n_store) if k else min(n_store - 1, bpc + 1 if n_store > bpc + 1 else 0)
        length = rng.randint(1, min(n_store - start, len(free))) if free else 0
        if not length:
            break
        dst = [free.pop() for _ in range(length)]
        first, last = start // bpc, (start + length - 1) // bpc
        jobs.append(load_job(10 + k, dst, slots[first : last + 1], start % bpc))
        wanted.append((start, length, dst))
    rig.step(rig.loader, jobs)
    rig.finish(rig.loader, jobs)
    assert all(j.current() is JobState.COMPLETE and rig.acks[j.job_id] == 1 for j in jobs)
    loaded: set[int] = set()
    for start, length, dst in wanted:
        for k in range(length):
            for layer in range(rig.layers):
                assert torch.equal(raw(rig.dst[layer][dst[k]]), raw(rig.src[layer][blocks[start + k]])), (
                    f"layer {layer}: loaded block {dst[k]} != stored block {blocks[start + k]}"
                )
        loaded.update(dst)
    for kv_layer in rig.dst:
        for b in range(rig.blocks):
            if b not in loaded:
                assert not kv_layer[b].any(), f"block {b} was never loaded but changed"


# ---------------------------------------------------------------------------------------------- round trips


LAYOUTS = ["stacked", "separate", "sharded"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("bpc", [1, 3])
def test_round_trip_every_byte(kind: Kind, layout: str, bpc: int) -> None:
    rig = Rig(kind, layers=3, bpc=bpc, layout=layout, layers_per_group=2)
    try:
        round_trip(rig, random.Random(f"{kind}{layout}{bpc}"), n_store=11, n_loads=3)
    finally:
        rig.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_dtypes(kind: Kind, dtype: torch.dtype) -> None:
    rig = Rig(kind, layers=2, bpc=2, dtype=dtype)
    try:
        round_trip(rig, random.Random(str(dtype)), n_store=9, n_loads=2)
    finally:
        rig.close()


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_odd_row_bytes(kind: Kind) -> None:
    """3-byte rows: the copies fall back to 1-byte elements and still move every byte."""
    rig = Rig(kind, layers=2, bpc=2, block=(1, 1, 1, 3), dtype=torch.uint8, layout="separate")
    try:
        assert rig.storer.backend.registration.width == 1  # type: ignore[attr-defined]
        round_trip(rig, random.Random(3), n_store=7, n_loads=2)
    finally:
        rig.close()


@pytest.mark.parametrize("kind", FAST_KINDS)
@settings(
    max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(
    layers=st.integers(1, 4),
    group=st.sampled_from([None, 1, 2, 3]),
    bpc=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    layout=st.sampled_from(LAYOUTS),
    n_store=st.integers(1, 14),
    n_loads=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_round_trip_random(
    kind: Kind,
    layers: int,
    group: int | None,
    bpc: int,
    dtype: torch.dtype,
    layout: str,
    n_store: int,
    n_loads: int,
    seed: int,
) -> None:
    rig = Rig(kind, layers=layers, blocks=16, slots=14, bpc=bpc, dtype=dtype, layout=layout, layers_per_group=group)
    try:
        round_trip(rig, random.Random(seed), n_store, n_loads)
    finally:
        rig.close()


@needs_cuda
@pytest.mark.parametrize("kind", [k for k in KINDS if str(k.id).startswith("cuda-") and "emu" not in str(k.id)])
@pytest.mark.parametrize("seed", range(6))
def test_round_trip_random_cuda(kind: Kind, seed: int) -> None:
    rng = random.Random(seed)
    rig = Rig(
        kind,
        layers=rng.randint(1, 4),
        blocks=64,
        slots=48,
        bpc=rng.randint(1, 4),
        dtype=rng.choice(DTYPES),
        layout=rng.choice(LAYOUTS),
        layers_per_group=rng.choice([None, 1, 2]),
    )
    try:
        round_trip(rig, rng, rng.randint(1, 40), 3)
    finally:
        rig.close()


# ---------------------------------------------------------------------------------------------- completion


@pytest.mark.parametrize("kind", KINDS)
def test_completion_fires_the_job_machine_exactly_once(kind: Kind) -> None:
    rig = Rig(kind)
    try:
        jobs = [store_job(1, [0, 1, 2], [0, 1]), store_job(2, [5], [4]), store_job(3, [], [])]
        rig.step(rig.storer, jobs)
        seen: dict[int, int] = {}
        for _ in range(3):  # repeated polls, some before and some after the copies finished
            rig.storer.wait_all()
            out = rig.storer.poll()
            assert not out.failed
            for job_id, ranks in out.completed.items():
                assert ranks == {0}
                seen[job_id] = seen.get(job_id, 0) + len(ranks)
                rig.storer.backend  # noqa: B018  (the backend stays usable between polls)
                next(j for j in jobs if j.job_id == job_id).ack(0)
        assert seen == {1: 1, 2: 1, 3: 1}
        assert all(j.current() is JobState.COMPLETE for j in jobs)
        # A repeated metadata object is not a second launch, so no second report either.
        rig.step(rig.storer, jobs)
        rig.storer.wait_all()
        assert rig.storer.poll().is_empty()
    finally:
        rig.close()


def test_emulated_completion_is_polled_never_synchronized() -> None:
    """Submitting and polling never block: completion is seen through query(), only once the copy ran."""
    api = EmulatedDevice(auto_progress=False)
    kv = allocate("stacked", 2, 8, (4,), torch.float32, "cpu")
    for layer in kv:
        random_bytes(layer, 5)
    pool = CPUSlotPool(4, 2, (4,), 2, torch.float32, pin_memory=False)
    backend = CudaCopyBackend(kv, pool, 2, copy_path="dma", device_api=api)
    worker = OffloadingWorker(0, 1, backend)
    job = store_job(7, [3, 1, 6], [2, 0])
    meta = ConnectorMetadata(store_jobs={7: job})
    worker.before_forward(meta)
    worker.after_forward(meta)
    assert job.current() is JobState.IN_FLIGHT
    assert not pool.data.any(), "the copy must not run at submit"
    for _ in range(3):
        assert worker.poll().is_empty()
    assert api.synchronize_calls == 0 and api.query_calls >= 3
    api.run_all()  # the device gets to it
    assert worker.poll().completed == {7: {0}}
    assert worker.poll().is_empty()
    assert api.synchronize_calls == 0
    assert torch.equal(pool.data[2, :, 0], torch.stack([kv[0][3], kv[1][3]]))
    worker.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_failed_launch_is_failed_never_complete(kind: Kind, monkeypatch: pytest.MonkeyPatch) -> None:
    """An id that slipped past validation fails the launch; the job is reported failed and never complete."""
    rig = Rig(kind)
    try:
        monkeypatch.setattr(type(rig.storer.backend), "check", lambda *a: None)
        bad_block = store_job(1, [0, rig.blocks + 3], [0])
        bad_slot = load_job(2, [4, 5], [1, rig.slots + 9], 1)
        rig.step(rig.storer, [bad_block])
        rig.step(rig.loader, [bad_slot])
        assert bad_block.current() is JobState.IN_FLIGHT  # the worker never fails a job itself
        out_s = rig.finish(rig.storer, [bad_block])
        out_l = rig.finish(rig.loader, [bad_slot])
        assert out_s.failed == {1: {0}} and not out_s.completed
        assert out_l.failed == {2: {0}} and not out_l.completed and out_l.finished_recving == {"q2"}
        assert bad_block.current() is JobState.FAILED and bad_slot.current() is JobState.FAILED
        assert rig.acks == {1: 0, 2: 0}
        assert not rig.pool.data.any() and not any(layer.any() for layer in rig.dst)
        for worker in (rig.storer, rig.loader):
            rig.step(worker, [])
            worker.wait_all()
            assert worker.poll().is_empty()
    finally:
        rig.close()


@pytest.mark.parametrize("kind", KINDS)
def test_failed_launch_through_the_scheduler(kind: Kind, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: the scheduler plans a store, its block id is corrupted after validation would have passed,
    the launch fails, and the scheduler's failure report ends the job ``failed`` - nothing is committed."""
    tpb = 4
    rig = Rig(kind, layers=2, bpc=1, block=(2, 1, tpb, 8))
    try:
        manager = CPUOffloadingManager(8)
        sched = OffloadingScheduler(OffloadConfig(tpb, world_size=1), manager)

        class Req:
            req_id = "r"
            block_hashes = (b"h0" * 8, b"h1" * 8)
            num_tokens = 2 * tpb + 1
            num_prompt_tokens = 2 * tpb + 1
            num_computed_tokens = 0
            is_aborted = False

        req = Req()
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [3, 4], 0)
        meta = sched.build_connector_meta(
            SchedulerOutput(
                (ScheduledRequest("r", (3, 4), 2 * tpb + 1, admitted=True),), allocated_block_ids=frozenset((3, 4))
            )
        )
        for _ in range(3):
            if meta.store_jobs:
                break
            meta = sched.build_connector_meta(SchedulerOutput((ScheduledRequest("r", (), 1),)))
        assert meta.store_jobs, "the scheduler planned no store"
        (job,) = meta.store_jobs.values()
        job.gpu = GPUBlockSpec((job.gpu.block_ids[0], rig.blocks + 1, *job.gpu.block_ids[2:]), 0)
        monkeypatch.setattr(type(rig.storer.backend), "check", lambda *a: None)
        rig.storer.before_forward(meta)
        rig.storer.after_forward(meta)
        assert job.current() is JobState.IN_FLIGHT
        rig.storer.wait_all()
        out = rig.storer.poll()
        assert out.failed == {job.job_id: {0}} and not out.completed
        sched.update_connector_output(out)
        assert job.current() is JobState.FAILED
        assert sched.stats.failed_stores == 1 and sched.stats.committed_stores == 0
        assert not rig.pool.data.any()
    finally:
        rig.close()


# ---------------------------------------------------------------------------------------------- registration


@pytest.mark.parametrize("kind", KINDS)
def test_registration_rejects_mismatches(kind: Kind) -> None:
    dev = kind.device
    block = (2, 2, 2, 2)
    pool = CPUSlotPool(4, 2, block, 2, torch.float16, pin_memory=False)
    kv = allocate("stacked", 2, 4, block, torch.float16, dev)

    def build(kv_: Sequence[Any], pool_: Any = pool, bpc: int = 2, **kw: Any) -> None:
        make_backend(kind, kv_, pool_, bpc, **kw).shutdown()

    build(kv)
    cases: list[tuple[Callable[[], None], str]] = [
        (lambda: build([]), "empty"),
        (lambda: build(kv[:1]), "2 layers"),
        (lambda: build([t.float() for t in kv]), r"pool's torch\.float16"),
        (lambda: build([kv[0], torch.zeros(4, 2, 2, 2, 3, dtype=torch.float16, device=dev)]), "block shape"),
        (lambda: build([kv[0], torch.zeros(5, *block, dtype=torch.float16, device=dev)]), "5 blocks"),
        (lambda: build([kv[0], "layer"]), "expected a torch.Tensor"),
        (lambda: build(kv, bpc=3), "pool's 2"),
        (lambda: build(kv, layers_per_group=0), "layers_per_group"),
        (lambda: build(kv, pool_=object()), "CPUSlotPool"),
        (lambda: build([kv[0], torch.zeros(4, *block, dtype=torch.float16, device="meta")]), "on meta"),
    ]
    for fn, match in cases:
        with pytest.raises(ConfigError, match=match):
            fn()


def test_cuda_backend_needs_cuda_tensors_or_an_emulator() -> None:
    kv = allocate("stacked", 1, 4, (4,), torch.float32, "cpu")
    pool = CPUSlotPool(2, 1, (4,), 1, torch.float32, pin_memory=False)
    with pytest.raises(ConfigError, match="expected CUDA tensors"):
        CudaCopyBackend(kv, pool, 1)
    with pytest.raises(ConfigError, match="copy_path"):
        CudaCopyBackend(kv, pool, 1, copy_path="turbo", device_api=EmulatedDevice())
    with pytest.raises(ConfigError, match="staging_bytes"):
        CudaCopyBackend(kv, pool, 1, staging_bytes=0, device_api=EmulatedDevice())
    with pytest.raises(ConfigError, match="copy_path"):
        ThreadPoolCopyBackend(kv, pool, 1, copy_path="dma")


def test_registration_views() -> None:
    """Row widths, flat rows and stacking are detected from the layout."""
    pool = CPUSlotPool(4, 2, (2, 2, 4, 8), 3, torch.float16, pin_memory=False)
    stacked = Registration(allocate("stacked", 3, 6, (2, 2, 4, 8), torch.float16, "cpu"), pool, 2, 2)
    assert stacked.flat and stacked.width == 16 and stacked.row_shape == (16,)
    assert [g.size for g in stacked.groups] == [2, 1]
    assert all(g.stacked is not None for g in stacked.groups)
    separate = Registration(allocate("separate", 3, 6, (2, 2, 4, 8), torch.float16, "cpu"), pool, 2)
    assert separate.groups[0].stacked is None
    sharded = Registration(allocate("sharded", 3, 6, (2, 2, 4, 8), torch.float16, "cpu"), pool, 2)
    assert not sharded.flat and sharded.row_shape == (2, 2, 4, 1)
    assert sharded.groups[0].stacked is not None and sharded.groups[0].spacing == 6


def test_index_helpers() -> None:
    a = np.array([5, 6, 7], dtype=np.int64)
    assert contiguous_start(a) == 5
    assert contiguous_start(np.array([5, 7], dtype=np.int64)) is None
    assert contiguous_start(np.zeros(0, dtype=np.int64)) is None
    s, d, n = runs(np.array([10, 11, 3, 4, 5], dtype=np.int64), np.array([0, 1, 7, 8, 9], dtype=np.int64))
    assert s.tolist() == [10, 3] and d.tolist() == [0, 7] and n.tolist() == [2, 3]
    # Sorted pool rows -> runs, cut at pinned-range starts (row 8) and into pieces of <= 4 staging rows.
    pieces = _segments(np.array([1, 2, 3, 4, 5, 7, 8, 9], dtype=np.int64), np.array([8], dtype=np.int64), 4)
    assert [(p.lo, p.hi) for p in pieces] == [(0, 4), (4, 8)]
    assert pieces[0].segments == ([1], [0], [4])  # (pool rows, staging rows, counts)
    assert pieces[1].segments == ([5, 7, 8], [0, 1, 2], [1, 1, 2])


@settings(max_examples=200, deadline=None)
@given(
    rows=st.sets(st.integers(0, 60), min_size=1, max_size=40),
    breaks=st.sets(st.integers(0, 60), max_size=4),
    stage=st.integers(1, 9),
)
def test_segments_match_a_reference(rows: set[int], breaks: set[int], stage: int) -> None:
    """Pieces of <= ``stage`` sorted rows, each cut into runs of consecutive rows that never cross a break."""
    prows = np.array(sorted(rows), dtype=np.int64)
    pieces = _segments(prows, np.array(sorted(breaks), dtype=np.int64), stage)
    expected: list[tuple[int, int, list[tuple[int, int, int]]]] = []
    for lo in range(0, len(prows), stage):
        chunk = prows[lo : lo + stage].tolist()
        segs: list[tuple[int, int, int]] = []
        for i, r in enumerate(chunk):
            if segs and r == segs[-1][0] + segs[-1][2] and r not in breaks:
                segs[-1] = (segs[-1][0], segs[-1][1], segs[-1][2] + 1)
            else:
                segs.append((r, i, 1))
        expected.append((lo, lo + len(chunk), segs))
    got = [(p.lo, p.hi, list(zip(*p.segments, strict=True))) for p in pieces]
    assert got == expected


# ---------------------------------------------------------------------------------------------- calibration


def test_calibration_table_choice_and_json(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.data import calibration as cal

    table = CalibrationTable(
        "test",
        {
            "a/store": {(4096, 64): 1e9, (65536, 64): 10e9},
            "b/store": {(4096, 64): 5e9, (65536, 64): 6e9},
        },
    )
    small, large = Choice(1 << 20, 4096, 256), Choice(1 << 20, 65536, 16)
    assert table.choose({"a/store": small, "b/store": small}, "a/store") == "b/store"
    assert table.choose({"a/store": large, "b/store": large}, "a/store") == "a/store"
    assert table.choose({"c/store": large}, "a/store") == "a/store"  # never measured: the default
    assert table.rate("a/store", 30000, 1) == 10e9  # nearest measured unit size
    again = CalibrationTable.from_json(table.to_json())
    assert again == table
    with pytest.raises(ConfigError, match="malformed"):
        CalibrationTable.from_json({"context": "x"})

    # Measured once per process and context, and persisted in the calibration file.
    cal.clear_cache()
    monkeypatch.setenv(cal.CALIBRATION_FILE_ENV, str(tmp_path / "cal.json"))
    calls: list[int] = []

    def build() -> CalibrationTable:
        calls.append(1)
        return cal.calibrate("ctx", {"p/store": lambda u, c: float(u * c), "bad/store": _raise}, [(4096, 8)])

    first = cal.cached_table("ctx", build)
    assert first.paths() == ("p/store",)  # the failing path is dropped, never chosen
    assert cal.cached_table("ctx", build) is first and calls == [1]
    cal.clear_cache()
    from_file = cal.cached_table("ctx", build)
    assert calls == [1] and from_file.rates == first.rates
    cal.clear_cache()


def _raise(unit: int, count: int) -> float:
    raise RuntimeError("this path does not work here")


def test_cpu_backend_auto_path_uses_the_calibration() -> None:
    """Jobs of 1 MiB and more take the path the table predicts fastest; smaller ones the staged path."""
    table = CalibrationTable("forced", {"runs/store": {(1 << 19, 8): 1e12}, "staged/store": {(1 << 19, 8): 1.0}})
    kv = allocate("stacked", 1, 8, (1 << 17,), torch.float32, "cpu")  # 512 KiB blocks
    pool = CPUSlotPool(8, 1, (1 << 17,), 1, torch.float32, pin_memory=False)
    backend = ThreadPoolCopyBackend(kv, pool, 1, calibration=table)
    backend.submit(1, True, GPUBlockSpec((3, 1, 2)), SlotSpec((7, 0, 4)))  # 1.5 MiB
    backend.submit(2, True, GPUBlockSpec((5,)), SlotSpec((6,)))  # 512 KiB
    backend.wait([1, 2])
    assert sorted(backend.poll()) == [(1, True), (2, True)]
    assert backend.path_counts == {("store", "runs"): 1, ("store", "staged"): 1}
    backend.shutdown()


def test_cuda_backend_auto_path_uses_the_calibration() -> None:
    kv = allocate("stacked", 2, 8, (16,), torch.float32, "cpu")
    pool = CPUSlotPool(8, 1, (16,), 2, torch.float32, pin_memory=False)
    fast_kernel = CalibrationTable("t", {"dma/load": {(128, 8): 1e6}, "kernel/load": {(64, 8): 1e12}})
    backend = CudaCopyBackend(
        kv, pool, 1, enable_kernel_path=True, calibration=fast_kernel, device_api=EmulatedDevice()
    )
    assert backend.paths == ("dma", "runs", "kernel")
    backend.submit(1, False, GPUBlockSpec((3, 1)), SlotSpec((7, 0)))
    backend.wait([1])
    assert backend.poll() == [(1, True)]
    assert backend.path_counts == {("load", "kernel"): 1}
    backend.shutdown()


# ---------------------------------------------------------------------------------------------- the pool


def test_pool_layout_and_slot_bytes() -> None:
    pool = CPUSlotPool(3, 2, (4,), 2, torch.float32, pin_memory=False)
    assert pool.data.shape == (3, 2, 2, 4) and pool.data.is_contiguous()
    assert pool.rows.shape == (12, 4) and pool.nbytes_per_block == 16
    assert pool.row_index(2, 1, 1) == 11
    pool.block(1, 5).fill_(7.0)  # layer 1, slot 2, sub-block 1
    assert pool.rows[pool.row_index(2, 1, 1)].eq(7.0).all()
    assert pool.layers[1][2, 1].eq(7.0).all() and pool.data.ne(0).sum() == 4
    assert pool.data.data_ptr() % 4096 == 0
    data = pool.read_slot(2)
    assert data[-16:] == bytes(pool.block(1, 5).numpy().tobytes())


def test_pool_pins_in_whole_slot_chunks_and_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvfsm.data import pool as pool_mod

    registered: list[tuple[int, int]] = []
    unregistered: list[int] = []
    fail_at: list[int] = [-1]

    def register(ptr: int, nbytes: int) -> None:
        if len(registered) == fail_at[0]:
            raise RuntimeError("out of pinnable memory")
        registered.append((ptr, nbytes))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pool_mod, "_cuda_register", register)
    monkeypatch.setattr(pool_mod, "_cuda_unregister", lambda ptrs: unregistered.extend(ptrs))
    # 24 KiB slots (6 pages); at most 100 KiB per registration -> 4 slots (96 KiB, page multiple) per chunk.
    pool = CPUSlotPool(10, 2, (1536,), 2, torch.float32, pin_chunk_bytes=100 << 10)
    assert pool.pinned
    assert list(pool.pinned_ranges) == [(0, 4), (4, 8), (8, 10)]
    base = pool.data.data_ptr()
    assert registered == [(base, 4 * 24576), (base + 4 * 24576, 4 * 24576), (base + 8 * 24576, 2 * 24576)]
    assert all(ptr % 4096 == 0 for ptr, _ in registered)
    pool.close()
    assert unregistered == [p for p, _ in registered] and not pool.pinned_ranges
    pool.close()  # idempotent
    assert len(unregistered) == 3

    registered.clear()
    unregistered.clear()
    fail_at[0] = 2
    with pytest.warns(RuntimeWarning, match="pageable"):
        failed = CPUSlotPool(10, 2, (1536,), 2, torch.float32, pin_chunk_bytes=100 << 10)
    assert not failed.pinned and failed.pinned_ranges == ()
    assert unregistered == [p for p, _ in registered]  # rolled back


@pytest.mark.parametrize("path", ["dma", "runs"])
@pytest.mark.parametrize("is_store", [True, False])
def test_host_copies_never_cross_a_pinned_registration(
    path: str, is_store: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool pinned in chunks of 4 slots: a job over slots 1..8 is copied in runs that each stay inside one
    registration (a DMA across two is not guaranteed to be a pinned DMA), and still moves every byte."""
    from kvfsm.data import pool as pool_mod

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pool_mod, "_cuda_register", lambda ptr, n: None)
    monkeypatch.setattr(pool_mod, "_cuda_unregister", lambda ptrs: None)
    block = (1024,)  # 4 KiB rows; slot = 2 layers x 2 sub-blocks = 16 KiB; 4 slots = 64 KiB per registration
    pool = CPUSlotPool(10, 2, block, 2, torch.float32, pin_chunk_bytes=64 << 10)
    assert pool.pinned and list(pool.pinned_ranges) == [(0, 4), (4, 8), (8, 10)]
    kv = allocate("stacked", 2, 32, block, torch.float32, "cpu")
    for i, layer in enumerate(kv):
        random_bytes(layer, i)
    random_bytes(pool.data, 9)
    api = EmulatedDevice()
    copies: list[tuple[int, int, int]] = []
    real = api.copy_rows

    def recording(dst: torch.Tensor, src: torch.Tensor, runs: tuple[list[int], list[int], list[int]]) -> None:
        host_rows = runs[0] if dst.data_ptr() == pool.rows.data_ptr() else runs[1]
        copies.extend(zip(host_rows, runs[2], runs[2], strict=True))
        real(dst, src, runs)

    monkeypatch.setattr(api, "copy_rows", recording)
    backend = CudaCopyBackend(kv, pool, 2, copy_path=path, device_api=api)
    blocks = list(range(4, 20))  # 16 consecutive blocks -> 8 consecutive slots
    slots = list(range(1, 9))
    before = pool.data.clone()
    backend.submit(1, is_store, GPUBlockSpec(tuple(blocks)), SlotSpec(tuple(slots)))
    backend.wait([1])
    assert backend.poll() == [(1, True)]
    rows_per_slot = 4
    for first, count, _ in copies:
        last = first + count - 1
        assert first // (4 * rows_per_slot) == last // (4 * rows_per_slot), f"rows {first}..{last} cross a boundary"
    assert len(copies) >= 3  # slots 1-3, 4-7, 8 at least
    for i, b in enumerate(blocks):
        for j in range(2):
            if is_store:
                assert torch.equal(raw(pool.data[slots[i // 2], j, i % 2]), raw(kv[j][b]))
            else:
                assert torch.equal(raw(kv[j][b]), raw(before[slots[i // 2], j, i % 2]))
    backend.shutdown()
    pool.close()  # while registration is still faked


# ---------------------------------------------------------------------------------------------- state machine


class _SettledCpuBackend(ThreadPoolCopyBackend):
    """The CPU backend with each copy finished before ``submit`` returns: the state machine's rules then see the
    same polls on every replay (thread timing would make Hypothesis's replays diverge)."""

    @override
    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        future = super().submit(job_id, is_store, gpu, slots)
        future.exception()  # waits; the outcome is still reported by poll
        return future


class _CpuMachine(CopyBackendStateMachine):
    device = "cpu"

    @override
    def make_backend(self, kv_caches: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int) -> CopyBackend:
        return _SettledCpuBackend(kv_caches, pool, blocks_per_chunk, copy_path="runs")


class _EmulatedCudaMachine(CopyBackendStateMachine):
    device = "cpu"

    @override
    def make_backend(self, kv_caches: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int) -> CopyBackend:
        return CudaCopyBackend(
            kv_caches, pool, blocks_per_chunk, copy_path="dma", staging_bytes=64, device_api=EmulatedDevice()
        )


class _SettledCudaBackend(CudaCopyBackend):
    """The CUDA backend with each copy finished before ``submit`` returns (deterministic polls, as above)."""

    @override
    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        future = super().submit(job_id, is_store, gpu, slots)
        self.wait([job_id])
        return future


class _CudaMachine(CopyBackendStateMachine):
    device = "cuda"

    @override
    def make_backend(self, kv_caches: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int) -> CopyBackend:
        return _SettledCudaBackend(kv_caches, pool, blocks_per_chunk, copy_path="dma")


_MACHINE_SETTINGS = settings(max_examples=20, stateful_step_count=15, deadline=None)
TestCpuBackendMachine = _CpuMachine.TestCase
TestCpuBackendMachine.settings = _MACHINE_SETTINGS
TestEmulatedCudaBackendMachine = _EmulatedCudaMachine.TestCase
TestEmulatedCudaBackendMachine.settings = _MACHINE_SETTINGS
TestCudaBackendMachine = needs_cuda(_CudaMachine.TestCase)
TestCudaBackendMachine.settings = _MACHINE_SETTINGS


# ---------------------------------------------------------------------------------------------- benchmark


def test_transfer_bench_smoke() -> None:
    from kvfsm.bench.transfers import format_table, run_transfer_bench

    rows = run_transfer_bench(True, backends=["cpu"], sizes=(16 << 10, 64 << 10), repeats=1, total_bytes=1 << 19)
    assert [(r["direction"], r["block_bytes"]) for r in rows] == [
        ("store", 16 << 10),
        ("load", 16 << 10),
        ("store", 64 << 10),
        ("load", 64 << 10),
    ]
    for r in rows:
        assert r["backend"] == "cpu" and r["blocks"] == (1 << 19) // int(r["block_bytes"])  # type: ignore[call-overload]
        assert float(r["gbps"]) > 0 and float(r["ratio"]) > 0  # type: ignore[arg-type]
        assert r["goal"] in (">= 0.5x", ">= 0.8x") and isinstance(r["met"], bool)
    table = format_table(rows)
    assert "contig GB/s" in table and len(table.splitlines()) == 2 + len(rows)
