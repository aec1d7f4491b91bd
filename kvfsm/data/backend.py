"""Copy backends: move a job's blocks between one worker's KV-cache shard and its CPU slot pool.

A job names GPU blocks in logical order (``GPUBlockSpec``) and the CPU chunk slots that hold them
(``SlotSpec``). Logical block ``i`` of the job sits at position ``p = first_block_offset + i`` of the
job's chunk run: chunk ``slot_ids[p // blocks_per_chunk]``, sub-block ``p % blocks_per_chunk``. A store
copies GPU -> slots, a load copies slots -> GPU. Both backends share the registration and the per-job address
lists of :mod:`kvfsm.data.plan`; :mod:`kvfsm.data.cuda` has the CUDA backend.

:class:`ThreadPoolCopyBackend` is the backend for KV caches in host memory (the CPU engine, tests, and the
CPU rows of the transfer benchmark). Each job runs on a thread of a small pool (torch and memmove release the
GIL). It has two copy paths, picked per job and layer group from a :class:`~kvfsm.data.calibration.CalibrationTable`
measured on this machine:

- ``staged``: batched index kernels, a fixed number per batch of blocks (2 MiB) whatever the block count. The
  blocks are taken in destination order; when one side of a batch is one contiguous row range the copy is a single
  pass (``index_select(out=)`` straight into the destination, or ``index_put_`` straight from the source),
  otherwise rows are gathered into a staging buffer that stays in cache and scattered from it.
- ``runs``: the job's (source, destination) rows coalesced into runs contiguous on both sides, one ``memmove``
  per run, in source order (optionally split over threads: ``split_threads``).

Copy threads run torch ops single-threaded (:func:`serial_torch_thread`): an OpenMP team per op only adds
fork/join latency to copies that are bound by memory, not by cores. Host buffers are on huge pages where the OS
allows (:mod:`kvfsm.data.hostmem`): scattered blocks then cost far fewer TLB misses.

There is no ordering between jobs, not even in one direction: the scheduler's flush rules must (and do)
order any two jobs that touch the same memory.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data import events
from kvfsm.data.calibration import CalibrationTable, Choice, cached_table
from kvfsm.data.gate import CopyGate
from kvfsm.data.hostmem import host_buffer
from kvfsm.data.layout import is_int
from kvfsm.data.plan import IndexArray, JobPlan, LayerGroup, Registration, chunk_rows, contiguous_start
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError, KvfsmError

__all__ = [
    "COPY_PATHS",
    "CopyStats",
    "CopyStatsMixin",
    "CopyTally",
    "CpuCopier",
    "ThreadPoolCopyBackend",
    "chunk_rows",
    "cpu_calibration",
    "job_side_bytes",
]

logger = logging.getLogger(__name__)

#: Copy paths of the CPU backend; "auto" picks one per job from the calibration table.
COPY_PATHS = ("staged", "runs")

#: Rows per batch of the staged path, in bytes: also the per-thread staging buffer (well inside L3).
DEFAULT_STAGE_BYTES = 2 << 20
#: Smaller jobs use the staged path without consulting the calibration (it would not change their time).
CALIBRATE_MIN_BYTES = 1 << 20
#: Jobs of the runs path at least this large are split over the helper threads.
_SPLIT_BYTES = 4 << 20


@dataclass(frozen=True, slots=True)
class CopyStats:
    """Totals of the copies that succeeded, per direction, and the number that failed."""

    bytes_stored: int
    bytes_loaded: int
    jobs_stored: int
    jobs_loaded: int
    jobs_failed: int


class CopyTally:
    """The thread-safe running totals behind :class:`CopyStats`, updated as each copy ends (on copy threads)."""

    __slots__ = ("_counts", "_lock")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # bytes_stored, bytes_loaded, jobs_stored, jobs_loaded, jobs_failed
        self._counts = [0, 0, 0, 0, 0]

    def succeeded(self, is_store: bool, nbytes: int) -> None:
        with self._lock:
            self._counts[0 if is_store else 1] += nbytes
            self._counts[2 if is_store else 3] += 1

    def failed(self) -> None:
        with self._lock:
            self._counts[4] += 1

    def snapshot(self) -> CopyStats:
        with self._lock:
            return CopyStats(*self._counts)


class CopyStatsMixin:
    """``stats()``, ``bytes_stored`` and ``bytes_loaded`` of a copy backend, read from its ``_tally``."""

    __slots__ = ()
    _tally: CopyTally

    def stats(self) -> CopyStats:
        return self._tally.snapshot()

    @property
    def bytes_stored(self) -> int:
        return self._tally.snapshot().bytes_stored

    @property
    def bytes_loaded(self) -> int:
        return self._tally.snapshot().bytes_loaded


def job_side_bytes(
    kv_caches: Sequence[torch.Tensor],
    pool: CPUSlotPool,
    is_store: bool,
    gpu: GPUBlockSpec,
    slots: SlotSpec,
    *,
    source: bool,
) -> list[bytes]:
    """The raw bytes of one side of a job, layer by layer, block by block in the job's order: its GPU blocks
    (a store's source, a load's destination) or its CPU slot rows (the other side). For the data-plane events
    (:mod:`kvfsm.data.events`); reading device memory synchronizes with the current stream."""
    if is_store == source:
        idx = torch.tensor(list(gpu.block_ids), dtype=torch.long, device=kv_caches[0].device)
        return [_raw(layer.index_select(0, idx)) for layer in kv_caches]
    rows = torch.tensor(chunk_rows(gpu, slots, pool.blocks_per_chunk), dtype=torch.long)
    return [_raw(layer.index_select(0, rows)) for layer in pool.flat_layers]


def _raw(t: torch.Tensor) -> bytes:
    """A tensor's bytes (any dtype, any device), in row-major order."""
    return bytes(t.contiguous().cpu().view(torch.uint8).numpy().tobytes())


def _idx(a: IndexArray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


@dataclass(frozen=True, slots=True)
class _Runs:
    """A group's rows as memmove runs contiguous on both sides: byte addresses and sizes, in source order."""

    src: list[int]
    dst: list[int]
    sizes: list[int]
    nbytes: int


def _coalesce(src: IndexArray, dst: IndexArray, unit: int) -> _Runs:
    """Byte-address pairs of ``unit``-byte rows merged into runs contiguous on both sides, in source order
    (reading memory in ascending order lets the prefetcher run ahead across blocks)."""
    n = int(src.shape[0])
    if n == 0:
        return _Runs([], [], [], 0)
    order = np.argsort(src, kind="stable")
    src, dst = src[order], dst[order]
    brk = np.flatnonzero((np.diff(dst) != unit) | (np.diff(src) != unit)) + 1
    if brk.size == 0:
        return _Runs([int(src[0])], [int(dst[0])], [n * unit], n * unit)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    sizes = np.diff(np.concatenate((starts, np.array([n], dtype=np.int64)))) * unit
    return _Runs(src[starts].tolist(), dst[starts].tolist(), sizes.tolist(), n * unit)


def _memmove_all(dst: list[int], src: list[int], sizes: list[int]) -> None:
    move = ctypes.memmove
    for d, s, n in zip(dst, src, sizes, strict=True):
        move(d, s, n)


def serial_torch_thread() -> None:
    """Make torch ops on the calling thread single-threaded (a ThreadPoolExecutor initializer).

    The copy paths split large jobs over their own threads; an OpenMP team inside each op on top of that only
    adds fork/join latency (milliseconds per op on a busy 2-vCPU VM). ``torch.set_num_threads`` sets this
    thread's OpenMP thread count and also the process-wide default used by threads created later; a short-lived
    thread restores that default, so no other thread is affected.
    """
    default = torch.get_num_threads()
    torch.set_num_threads(1)
    if default != 1:
        restore = threading.Thread(target=torch.set_num_threads, args=(default,), name="kvfsm-threads-restore")
        restore.start()
        restore.join()


def copy_executor(threads: int, name: str) -> ThreadPoolExecutor:
    """A thread pool whose threads run torch ops single-threaded (see :func:`serial_torch_thread`)."""
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name, initializer=serial_torch_thread)


def _split(n: int, parts: int) -> list[tuple[int, int]]:
    parts = max(1, min(parts, n))
    step = -(-n // parts)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)]


class CpuCopier:
    """The copy paths between host-resident KV layers and the pool, for one :class:`Registration`.

    Thread-safe: each calling thread has its own staging buffer.
    """

    def __init__(
        self,
        reg: Registration,
        stage_bytes: int = DEFAULT_STAGE_BYTES,
        helpers: ThreadPoolExecutor | None = None,
        parts: int = 1,
    ) -> None:
        if reg.device.type != "cpu":
            raise ConfigError(f"the CPU copier needs host-resident KV caches; got {reg.device}")
        if not is_int(parts) or parts < 1:
            raise ConfigError(f"parts must be a positive int, got {parts!r}")
        self.reg = reg
        self.stage_rows = max(1, stage_bytes // reg.row_bytes)
        #: Jobs of at least _SPLIT_BYTES are split into this many parts: one on the calling thread, the rest
        #: on ``helpers``.
        self.helpers = helpers
        self.parts = parts if helpers is not None else 1
        self._local = threading.local()

    def _parallel(self, n: int, nbytes: int, work: Callable[[int, int], None]) -> None:
        """``work(lo, hi)`` over ``0..n``: split over the helpers when the job is large enough."""
        spans = _split(n, self.parts if nbytes >= _SPLIT_BYTES else 1)
        helpers = self.helpers
        if len(spans) == 1 or helpers is None:
            work(0, n)
            return
        futures = [helpers.submit(work, lo, hi) for lo, hi in spans[1:]]
        work(*spans[0])
        for f in futures:
            f.result()

    @property
    def paths(self) -> tuple[str, ...]:
        """The paths this registration supports (``runs`` needs contiguous block rows)."""
        return COPY_PATHS if self.reg.flat else ("staged",)

    def _stage(self, rows: int) -> torch.Tensor:
        stage: torch.Tensor | None = getattr(self._local, "stage", None)
        if stage is None or stage.shape[0] < rows:
            reg = self.reg
            stage = torch.empty((max(rows, self.stage_rows), *reg.row_shape), dtype=reg.pool_rows.dtype)
            self._local.stage = stage
        return stage

    # ------------------------------------------------------------------ path choice

    def runs(self, plan: JobPlan, g: int) -> _Runs:
        """Group ``g``'s rows as memmove runs (the runs path; needs contiguous block rows)."""
        src, dst = self._addresses(plan, g)
        return _coalesce(src, dst, self.reg.row_bytes)

    def choose(
        self, plan: JobPlan, group: int, table: CalibrationTable | None, forced: str | None
    ) -> tuple[str, _Runs | None]:
        """The path for one group, and its runs when they were computed to decide."""
        paths = self.paths
        if forced is not None:
            return (forced if forced in paths else "staged"), None
        if table is None or len(paths) == 1:
            return "staged", None
        direction = "store" if plan.is_store else "load"
        rows = plan.num_blocks * self.reg.groups[group].size
        nbytes = rows * self.reg.row_bytes
        runs = self.runs(plan, group)
        count = max(1, len(runs.sizes))
        options = {
            f"runs/{direction}": Choice(nbytes, nbytes // count, count),
            f"staged/{direction}": Choice(nbytes, self.reg.row_bytes, max(1, rows)),
        }
        return table.choose(options, default=f"staged/{direction}").split("/")[0], runs

    # ------------------------------------------------------------------ copying

    def copy(self, plan: JobPlan, table: CalibrationTable | None = None, forced: str | None = None) -> list[str]:
        """Copy every layer group of ``plan`` (synchronously, on the calling thread); the path of each group."""
        used: list[str] = []
        if plan.num_blocks == 0:
            return used
        for g in range(len(self.reg.groups)):
            path, runs = self.choose(plan, g, table, forced)
            used.append(path)
            if path == "runs":
                self.copy_runs(plan, g, runs)
            else:
                self.copy_staged(plan, g)
        return used

    def _addresses(self, plan: JobPlan, g: int) -> tuple[IndexArray, IndexArray]:
        """Byte addresses of each (block, layer) row of group ``g``: (source, destination), (i, j) order."""
        reg = self.reg
        group = reg.groups[g]
        w = reg.width
        pool = reg.pool_rows
        pool_addr = pool.data_ptr() + plan.pool_rows[g].reshape(-1) * (pool.stride(0) * w)
        if group.stacked is not None:
            st = group.stacked
            kv_addr = st.data_ptr() + plan.kv_rows[g].reshape(-1) * (st.stride(0) * w)
        else:
            base = np.array([layer.data_ptr() for layer in group.layers], dtype=np.int64)
            stride = np.array([layer.stride(0) * w for layer in group.layers], dtype=np.int64)
            kv_addr = (base[None, :] + plan.gpu_ids[:, None] * stride[None, :]).reshape(-1)
        return (kv_addr, pool_addr) if plan.is_store else (pool_addr, kv_addr)

    def copy_runs(self, plan: JobPlan, g: int, runs: _Runs | None = None) -> None:
        """One memmove per run of rows contiguous on both sides."""
        if not self.reg.flat:
            raise ConfigError("the runs copy path needs contiguous block rows; use the staged path")
        r = runs if runs is not None else self.runs(plan, g)
        self._parallel(len(r.sizes), r.nbytes, lambda lo, hi: _memmove_all(r.dst[lo:hi], r.src[lo:hi], r.sizes[lo:hi]))

    def copy_staged(self, plan: JobPlan, g: int) -> None:
        """Batched index kernels; single pass when one side of a batch is contiguous, else through staging."""
        group = self.reg.groups[g]
        nb = max(1, self.stage_rows // group.size)
        n = plan.num_blocks
        batch = self._store_batch if plan.is_store else self._load_batch
        starts = list(range(0, n, nb))
        # Blocks in destination order: a job into a range of slots (or blocks) gets batches whose destination
        # is one contiguous range, gathered in a single pass by index_select's memcpy loop.
        order = np.argsort(plan.pool_rows[g][:, 0] if plan.is_store else plan.gpu_ids, kind="stable")
        gpu_ids, pool_rows, kv_rows = plan.gpu_ids[order], plan.pool_rows[g][order], plan.kv_rows[g][order]

        def work(lo: int, hi: int) -> None:
            for b0 in starts[lo:hi]:
                b1 = min(n, b0 + nb)
                batch(group, gpu_ids[b0:b1], pool_rows[b0:b1], kv_rows[b0:b1])

        self._parallel(len(starts), n * group.size * self.reg.row_bytes, work)

    def _store_batch(self, group: LayerGroup, gpu: IndexArray, prows: IndexArray, krows: IndexArray) -> None:
        pool = self.reg.pool_rows
        nb, size = prows.shape
        m = nb * size
        flat_prows = prows.reshape(-1)
        g0 = contiguous_start(gpu)
        p0 = contiguous_start(flat_prows)
        if p0 is None and g0 is not None:
            # Contiguous source: scatter straight from each layer's block range.
            for j, layer in enumerate(group.layers):
                pool.index_put_((_idx(prows[:, j]),), layer[g0 : g0 + nb])
            return
        target = pool[p0 : p0 + m] if p0 is not None else self._stage(m)[:m]
        if group.stacked is not None:
            torch.index_select(group.stacked, 0, _idx(krows.reshape(-1)), out=target)
        else:
            per_layer = target.view(nb, size, *target.shape[1:])
            gidx = _idx(gpu)
            for j, layer in enumerate(group.layers):
                torch.index_select(layer, 0, gidx, out=per_layer[:, j])
        if p0 is None:
            pool.index_put_((_idx(flat_prows),), target)

    def _load_batch(self, group: LayerGroup, gpu: IndexArray, prows: IndexArray, krows: IndexArray) -> None:
        pool = self.reg.pool_rows
        nb, size = prows.shape
        m = nb * size
        flat_prows = prows.reshape(-1)
        g0 = contiguous_start(gpu)
        p0 = contiguous_start(flat_prows)
        if p0 is None and g0 is not None:
            # Contiguous destination: gather straight into each layer's block range.
            for j, layer in enumerate(group.layers):
                torch.index_select(pool, 0, _idx(prows[:, j]), out=layer[g0 : g0 + nb])
            return
        if p0 is not None:
            source = pool[p0 : p0 + m]
        else:
            source = self._stage(m)[:m]
            torch.index_select(pool, 0, _idx(flat_prows), out=source)
        if group.stacked is not None:
            group.stacked.index_put_((_idx(krows.reshape(-1)),), source)
            return
        per_layer = source.view(nb, size, *source.shape[1:])
        gidx = _idx(gpu)
        for j, layer in enumerate(group.layers):
            layer.index_put_((gidx,), per_layer[:, j])


# ---------------------------------------------------------------------------------------------- calibration

#: Fully scattered jobs of 64 MiB (twice a large L3, so memory-bound like real jobs) at each unit size.
_CAL_UNITS = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 2 << 20)
_CAL_BYTES = 64 << 20
_CAL_REPEATS = 5


class _CalibrationRig:
    """Scratch memory for one unit size: a one-layer KV cache of ``count`` blocks and a pool of ``count``
    one-block slots, with a store and a load plan over random permutations (fully scattered). A load is the
    store's inverse, so after any sequence of them block ``blocks[i]`` and slot ``slots[i]`` hold equal bytes."""

    def __init__(self, unit: int, count: int, helpers: ThreadPoolExecutor | None, parts: int) -> None:
        self.kv = host_buffer(unit * count).view(count, unit)
        words = self.kv.view(torch.int32).view(-1)
        words.copy_(torch.arange(words.numel(), dtype=torch.int32))
        self.pool = CPUSlotPool(count, 1, (unit,), 1, torch.uint8, pin_memory=False)
        reg = Registration([self.kv], self.pool, 1)
        self.copier = CpuCopier(reg, helpers=helpers, parts=parts)
        gen = torch.Generator().manual_seed(unit * 7919 + count)
        self.blocks = torch.randperm(count, generator=gen)
        self.slots = torch.randperm(count, generator=gen)
        spec = GPUBlockSpec(tuple(self.blocks.tolist())), SlotSpec(tuple(self.slots.tolist()))
        self.plans = {True: reg.plan(True, *spec), False: reg.plan(False, *spec)}
        self.nbytes = unit * count

    def seconds(self, path: str, is_store: bool) -> float:
        run = self.copier.copy_runs if path == "runs" else self.copier.copy_staged
        plan = self.plans[is_store]
        t0 = time.perf_counter()
        run(plan, 0)
        return time.perf_counter() - t0

    def verify(self) -> None:
        if not torch.equal(self.pool.rows[self.slots], self.kv[self.blocks]):
            raise KvfsmError("a calibration copy moved the wrong bytes")


def _cpu_calibrate(context: str, parts: int) -> CalibrationTable:
    """Every path and direction timed alternately at each unit size (drift on a shared machine hits them
    alike); the first round, a store first, is the warm-up. A path that fails or moves wrong bytes is dropped."""
    t0 = time.perf_counter()
    helpers = copy_executor(parts - 1, "kvfsm-calibrate-helper") if parts > 1 else None
    combos = [(p, d) for d in (True, False) for p in COPY_PATHS]
    rates: dict[str, dict[tuple[int, int], float]] = {}
    dropped: set[str] = set()
    try:
        for unit in _CAL_UNITS:
            count = _CAL_BYTES // unit
            rig = _CalibrationRig(unit, count, helpers, parts)
            samples: dict[tuple[str, bool], list[float]] = {c: [] for c in combos}
            for rep in range(_CAL_REPEATS + 1):
                for path, is_store in combos:
                    if path in dropped:
                        continue
                    try:
                        t = rig.seconds(path, is_store)
                    except Exception as exc:
                        logger.warning("calibration of copy path %r failed (%r); the path is disabled", path, exc)
                        dropped.add(path)
                        continue
                    if rep:
                        samples[(path, is_store)].append(t)
            try:
                rig.verify()
            except KvfsmError as exc:
                logger.warning("%s; the CPU copy paths stay uncalibrated", exc)
                return CalibrationTable(context)
            for (path, is_store), ts in samples.items():
                if ts and path not in dropped:
                    key = f"{path}/{'store' if is_store else 'load'}"
                    rates.setdefault(key, {})[(unit, count)] = rig.nbytes / statistics.median(ts)
            del rig
    finally:
        if helpers is not None:
            helpers.shutdown(wait=True)
    table = CalibrationTable(context, {k: v for k, v in rates.items() if k.split("/")[0] not in dropped})
    table.seconds = time.perf_counter() - t0
    return table


def cpu_calibration(parts: int = 1) -> CalibrationTable:
    """The CPU backend's table for this process (measured once, a few seconds, on a copy thread like the real
    jobs; see :mod:`kvfsm.data.calibration`)."""
    context = f"cpu/parts={parts}"

    def build_on_copy_thread() -> CalibrationTable:
        with copy_executor(1, "kvfsm-calibrate") as ex:
            return ex.submit(_cpu_calibrate, context, parts).result()

    return cached_table(context, build_on_copy_thread)


# ---------------------------------------------------------------------------------------------- the backend


class ThreadPoolCopyBackend(CopyStatsMixin):
    """Batched copies between one host-resident KV-cache shard and one :class:`CPUSlotPool`, on a thread pool.

    ``max_workers``: jobs copied at once (one copy thread each). ``split_threads``: threads one large job is
    split over (default 1: on a small shared machine splitting only adds contention; raise it on a host with
    memory bandwidth to spare). ``copy_path``: ``"auto"`` (calibrated; the calibration runs once per process,
    on the first job, on a copy thread), ``"staged"`` or ``"runs"``. ``layers_per_group``: layers batched
    together (default: all).

    ``gate``: a :class:`~kvfsm.data.gate.CopyGate` each copy thread passes through before and after moving a
    job's bytes (tests: completion decided by the test, inside the real copy path); None (the default) costs
    nothing. :meth:`unfinished_job_ids` and :meth:`unreported_job_ids` say, from the futures, which copies are
    still running or not yet reported.

    KV caches on a CUDA device are accepted too, with a simple synchronous fallback on the copy threads
    (:meth:`_copy_device`); :class:`kvfsm.data.cuda.CudaCopyBackend` is the CUDA backend proper.
    """

    __slots__ = (
        "_bytes_per_block",
        "_calibration",
        "_closed",
        "_executor",
        "_forced",
        "_gate",
        "_helpers",
        "_inflight",
        "_local",
        "_lock",
        "_parts",
        "_tally",
        "blocks_per_chunk",
        "copier",
        "copy_source",
        "device",
        "kv_caches",
        "num_blocks",
        "path_counts",
        "pool",
        "registration",
    )

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        pool: CPUSlotPool,
        blocks_per_chunk: int,
        max_workers: int = 2,
        *,
        copy_path: str = "auto",
        layers_per_group: int | None = None,
        calibration: CalibrationTable | None = None,
        split_threads: int = 1,
        gate: CopyGate | None = None,
    ) -> None:
        if not is_int(max_workers) or max_workers < 1:
            raise ConfigError(f"max_workers must be a positive int, got {max_workers!r}")
        if not is_int(split_threads) or split_threads < 1:
            raise ConfigError(f"split_threads must be a positive int, got {split_threads!r}")
        if copy_path not in ("auto", *COPY_PATHS):
            raise ConfigError(f"copy_path={copy_path!r}; expected 'auto' or one of {COPY_PATHS}")
        reg = Registration(kv_caches, pool, blocks_per_chunk, layers_per_group)
        self.registration = reg
        self.kv_caches = reg.kv_caches
        self.pool = pool
        self.blocks_per_chunk = reg.blocks_per_chunk
        self.num_blocks = reg.num_blocks
        self.device = reg.device
        self._bytes_per_block = pool.nbytes_per_slot // blocks_per_chunk
        self._executor = copy_executor(max_workers, "kvfsm-copy")
        self._helpers = copy_executor(split_threads - 1, "kvfsm-copy-helper") if split_threads > 1 else None
        self.copier = CpuCopier(reg, helpers=self._helpers, parts=split_threads) if reg.device.type == "cpu" else None
        self._local = threading.local()
        self._parts = split_threads
        self._forced = None if copy_path == "auto" else copy_path
        self._calibration = calibration
        self._inflight: dict[int, Future[None]] = {}
        self._lock = threading.Lock()
        self._tally = CopyTally()
        #: (direction, path) -> layer-group copies done that way
        self.path_counts: Counter[tuple[str, str]] = Counter()
        self._closed = False
        self._gate = gate
        #: This backend's number in the data-plane events (:mod:`kvfsm.data.events`).
        self.copy_source = events.next_source()

    # ------------------------------------------------------------------ validation

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.registration.check(is_store, gpu, slots)

    # ------------------------------------------------------------------ submission and completion

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if self._closed:
            raise KvfsmError(f"job {job_id}: the copy backend is shut down; expected no submissions")
        if job_id in self._inflight:
            raise ConfigError(f"job {job_id} is already submitted and not yet polled; expected a new job id")
        self.check(is_store, gpu, slots)
        ready: torch.cuda.Event | None = None
        if self.device.type == "cuda":
            # The copy thread's stream waits for the work queued so far on the submitting thread's stream (the
            # forward that wrote the blocks, or that may still read or zero re-allocated ones).
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if events.listening():
            # The source bytes as they are now, when the copy is handed to its thread (tracing only).
            digest = events.checksum(self.job_bytes(is_store, gpu, slots, source=True))
            events.emit_copy("submitted", job_id, is_store, self.copy_source, digest, None)
        future = self._executor.submit(self._run, job_id, is_store, gpu, slots, ready)
        self._inflight[job_id] = future
        return future

    def job_bytes(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec, *, source: bool) -> list[bytes]:
        """The raw bytes of one side of a job (see :func:`job_side_bytes`)."""
        return job_side_bytes(self.kv_caches, self.pool, is_store, gpu, slots, source=source)

    def poll(self) -> list[tuple[int, bool]]:
        finished: list[tuple[int, bool]] = []
        for job_id, future in list(self._inflight.items()):
            if not future.done():
                continue
            del self._inflight[job_id]
            if future.cancelled():
                logger.warning("copy of job %d was cancelled", job_id)
                finished.append((job_id, False))
                continue
            exc = future.exception()
            if exc is not None:
                logger.warning("copy of job %d failed: %r", job_id, exc)
            finished.append((job_id, exc is None))
        return finished

    def wait(self, job_ids: Iterable[int]) -> None:
        futures = [self._inflight[j] for j in job_ids if j in self._inflight]
        if futures:
            wait_futures(futures)

    def wait_all(self) -> None:
        if self._inflight:
            wait_futures(list(self._inflight.values()))

    def shutdown(self) -> None:
        self._closed = True
        self._executor.shutdown(wait=True)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def unfinished_job_ids(self) -> list[int]:
        """Jobs submitted whose copy has not finished (queued, running, or held at the gate), sorted."""
        return sorted(j for j, f in list(self._inflight.items()) if not f.done())

    def unreported_job_ids(self) -> list[int]:
        """Jobs submitted and not yet reported by :meth:`poll` (finished or not), sorted."""
        return sorted(self._inflight)

    @property
    def gate(self) -> CopyGate | None:
        return self._gate

    @property
    def num_inflight(self) -> int:
        """Jobs submitted and not yet reported by :meth:`poll`."""
        return len(self._inflight)

    @property
    def calibration(self) -> CalibrationTable | None:
        return self._calibration

    # ------------------------------------------------------------------ the copies (pool threads)

    def _table(self) -> CalibrationTable | None:
        if self._forced is not None or self.copier is None or len(self.copier.paths) == 1:
            return None
        if self._calibration is None:
            self._calibration = cpu_calibration(self._parts)
        return self._calibration

    def _run(
        self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec, ready: torch.cuda.Event | None
    ) -> None:
        gate = self._gate
        try:
            if gate is not None:
                gate.enter(job_id)
            plan = self.registration.plan(is_store, gpu, slots)
            if plan.num_blocks:
                if self.copier is None:
                    self._copy_device(plan, ready)
                else:
                    self._copy(plan)
        except BaseException:
            self._tally.failed()
            if events.listening():
                events.emit_copy("finished", job_id, is_store, self.copy_source, None, False)
            raise
        finally:
            if gate is not None:
                gate.leave(job_id)
        self._tally.succeeded(is_store, len(gpu.block_ids) * self._bytes_per_block)
        if events.listening():
            # On the copy thread, before the future completes: before any poll can report the job.
            digest = events.checksum(self.job_bytes(is_store, gpu, slots, source=False))
            events.emit_copy("finished", job_id, is_store, self.copy_source, digest, True)

    def _copy(self, plan: JobPlan) -> None:
        assert self.copier is not None
        # A job of a few blocks takes microseconds whichever way: only larger ones consult (and, the first time,
        # build) the calibration table.
        big = plan.num_blocks * self._bytes_per_block >= CALIBRATE_MIN_BYTES
        used = self.copier.copy(plan, self._table() if big else None, self._forced)
        direction = "store" if plan.is_store else "load"
        with self._lock:
            for path in used:
                self.path_counts[(direction, path)] += 1

    def _copy_device(self, plan: JobPlan, ready: torch.cuda.Event | None) -> None:
        """KV caches on a device (CUDA): synchronous on this copy thread, on its own stream.

        A simple fallback (gather on the device, one blocking copy per layer group, scatter on the host); the
        CUDA backend proper is :class:`kvfsm.data.cuda.CudaCopyBackend`.
        """
        reg = self.registration
        stream: torch.cuda.Stream | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(device=self.device)
            self._local.stream = stream
        if ready is not None:
            stream.wait_event(ready)
        pool = reg.pool_rows
        with torch.cuda.stream(stream):
            for g, group in enumerate(reg.groups):
                prows = torch.from_numpy(np.ascontiguousarray(plan.pool_rows[g].reshape(-1)))
                gidx = torch.from_numpy(plan.gpu_ids).to(self.device)
                if plan.is_store:
                    dev = torch.stack([layer.index_select(0, gidx) for layer in group.layers], dim=1)
                    pool.index_put_((prows,), dev.flatten(0, 1).to("cpu"))
                else:
                    host = pool.index_select(0, prows).to(self.device)
                    per_layer = host.view(plan.num_blocks, group.size, *host.shape[1:])
                    for j, layer in enumerate(group.layers):
                        layer.index_copy_(0, gidx, per_layer[:, j])
            stream.synchronize()
        direction = "store" if plan.is_store else "load"
        with self._lock:
            self.path_counts[(direction, "device-sync")] += len(reg.groups)
