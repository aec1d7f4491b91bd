"""The CUDA copy backend: asynchronous, ordered, batched GPU <-> pinned-host copies driven by the job machines.

The worker fires a job's ``launch`` (the job enters ``in_flight``) and calls :meth:`CudaCopyBackend.submit`,
which enqueues the whole copy and one CUDA event, and returns at once. :meth:`~CudaCopyBackend.poll` reports a job
when ``event.query()`` says its copy is done - never by a blocking synchronize. Only :meth:`~CudaCopyBackend.wait`
(fence and preemption flushes) and :meth:`~CudaCopyBackend.shutdown` block, because memory safety requires it.

Ordering, the source of silent corruption in peers (vLLM #31210, #45704, #47282):

- one dedicated stream per direction, so each direction executes in submission order;
- every job's stream first waits for the compute stream (``wait_stream``): a store never reads KV the forward
  has not finished writing, and a load never writes a block whose previous contents the compute stream may still
  read or be zeroing;
- across directions, per GPU block and per slot the backend remembers the last job of each direction that touched
  it; a job first waits (``wait_event``) for the latest unfinished job of the *other* direction on any of its
  blocks or slots - so a load into a re-allocated block waits for the store still reading it.

Copy paths, chosen per job and layer group from a :class:`~kvfsm.data.calibration.CalibrationTable` measured at
start-up on this device (never on the engine path):

- ``dma``: device-side gather (one ``index_select`` per group when its layers are one allocation, else per
  layer) into a device staging buffer laid out like the destination pool rows, then one ``cudaMemcpyAsync`` per
  contiguous run of pool rows (slot-major pool: a run of slots of all layers is one DMA); loads the reverse.
- ``runs``: one ``cudaMemcpyAsync`` per run of rows contiguous on both sides, straight between the KV cache and
  the pool (no staging, no index kernel): best when blocks and slots come in long runs.
- ``kernel`` (opt-in, ``enable_kernel_path`` or ``KVFSM_CUDA_KERNEL_COPY=1``): the pinned pool is mapped into the
  device address space and index kernels read or write it directly over the bus - no per-run DMA setup, which is
  what small scattered blocks need. It is verified byte-for-byte by the calibration before it can be chosen.

``dma`` and ``runs`` issue ``cudaMemcpyAsync`` through ctypes on the runtime torch loaded (verified once by a
self-test; ``KVFSM_CUDA_CTYPES_MEMCPY=0`` uses ``Tensor.copy_``), a fraction of the cost of a tensor slice and
``copy_`` per run - what many small runs are bound by.

Everything device-specific goes through a :class:`DeviceAPI`. :class:`CudaDevice` is the real one;
:class:`EmulatedDevice` runs the same backend on CPU tensors with deferred, event-ordered streams, so the launch,
ordering and completion logic is exercised (and race-tested) without a GPU.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from typing_extensions import override

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data import events
from kvfsm.data.backend import CopyStatsMixin, CopyTally, job_side_bytes
from kvfsm.data.calibration import CalibrationTable, Choice, Measure, cached_table, calibrate, grid
from kvfsm.data.cuda.device import (
    CUDA_COPY_PATHS,
    DEFAULT_STAGING_BYTES,
    KERNEL_PATH_ENV,
    CudaDevice,
    DeviceAPI,
    Runs,
)
from kvfsm.data.plan import IndexArray, JobPlan, LayerGroup, Registration
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.validation import is_int

logger = logging.getLogger(__name__)


class _Indexes:
    """Every index array of one job, uploaded with one host->device copy, then handed out as slices."""

    def __init__(self) -> None:
        self._parts: list[IndexArray] = []
        self._offsets: list[int] = []
        self._size = 0
        self._device: torch.Tensor | None = None

    def add(self, a: IndexArray) -> int:
        self._parts.append(np.ascontiguousarray(a, dtype=np.int64).reshape(-1))
        self._offsets.append(self._size)
        self._size += int(a.size)
        return len(self._parts) - 1

    def upload(self, api: DeviceAPI) -> None:
        if self._parts:
            self._device = api.upload(np.concatenate(self._parts))

    def __getitem__(self, key: int) -> torch.Tensor:
        assert self._device is not None
        lo = self._offsets[key]
        return self._device[lo : lo + int(self._parts[key].size)]


@dataclass(frozen=True, slots=True)
class _Piece:
    """A slice of a group's pairs in pool-row order, small enough for the staging buffer."""

    lo: int
    hi: int
    segments: Runs  #: (pool rows, staging rows, counts) of the contiguous runs of pool rows


def _segments(prows: IndexArray, breaks: IndexArray, stage_rows: int) -> list[_Piece]:
    """Cut sorted pool rows into pieces of at most ``stage_rows`` rows, and each piece into runs of contiguous
    rows (also cut at ``breaks``: pinned-range starts). Vectorised: a job of many small runs is the common case."""
    n = int(prows.shape[0])
    if n == 0:
        return []
    pos = np.arange(1, n, dtype=np.int64)
    cut = (np.diff(prows) != 1) | np.isin(prows[1:], breaks) | (pos % stage_rows == 0)
    starts = np.concatenate((np.zeros(1, dtype=np.int64), pos[cut]))
    sizes = np.diff(np.concatenate((starts, np.array([n], dtype=np.int64))))
    first_rows = prows[starts]
    piece_of = starts // stage_rows
    bounds = np.searchsorted(piece_of, np.arange(0, (n - 1) // stage_rows + 2, dtype=np.int64)).tolist()
    pieces: list[_Piece] = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        lo = k * stage_rows
        segs = (first_rows[a:b].tolist(), (starts[a:b] - lo).tolist(), sizes[a:b].tolist())
        pieces.append(_Piece(lo, min(n, lo + stage_rows), segs))
    return pieces


@dataclass(slots=True)
class _Job:
    job_id: int
    is_store: bool
    future: Future[None]
    nbytes: int
    seq: int = -1
    event: Any = None
    error: BaseException | None = None
    done: bool = False
    #: The job's blocks and slots while the data-plane events are listened to (its bytes are read at the end).
    sides: tuple[GPUBlockSpec, SlotSpec] | None = None


class CudaCopyBackend(CopyStatsMixin):
    """Asynchronous batched copies between one CUDA KV-cache shard and one pinned :class:`CPUSlotPool`.

    ``copy_path``: ``"auto"`` (calibrated at construction), ``"dma"`` or ``"kernel"``. ``device_api`` defaults to
    :class:`CudaDevice` for the KV caches' device; tests pass an :class:`EmulatedDevice` with CPU tensors.
    ``compute_stream``: the stream copies wait for (default: the device's current stream at each submit).
    """

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        pool: CPUSlotPool,
        blocks_per_chunk: int,
        *,
        layers_per_group: int | None = None,
        copy_path: str = "auto",
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        enable_kernel_path: bool | None = None,
        calibration: CalibrationTable | None = None,
        device_api: DeviceAPI | None = None,
        compute_stream: Any = None,
    ) -> None:
        if copy_path not in ("auto", *CUDA_COPY_PATHS):
            raise ConfigError(f"copy_path={copy_path!r}; expected 'auto' or one of {CUDA_COPY_PATHS}")
        if not is_int(staging_bytes) or staging_bytes < 1:
            raise ConfigError(f"staging_bytes must be a positive int, got {staging_bytes!r}")
        reg = Registration(kv_caches, pool, blocks_per_chunk, layers_per_group)
        if device_api is None:
            if reg.device.type != "cuda":
                raise ConfigError(
                    f"KV caches on {reg.device}: CudaCopyBackend copies CUDA caches; expected CUDA tensors "
                    f"(use ThreadPoolCopyBackend for host-resident caches)"
                )
            device_api = CudaDevice(reg.device)
        elif reg.device != device_api.device:
            raise ConfigError(f"KV caches on {reg.device}; expected the device API's {device_api.device}")
        self.api: DeviceAPI = device_api
        self.registration = reg
        self.kv_caches = reg.kv_caches
        self.pool = pool
        #: This backend's number in the data-plane events (:mod:`kvfsm.data.events`).
        self.copy_source = events.next_source()
        self.blocks_per_chunk = reg.blocks_per_chunk
        self.num_blocks = reg.num_blocks
        self.device = reg.device
        if isinstance(device_api, CudaDevice) and not pool.pinned:
            warnings.warn(
                "the CPU slot pool is not pinned: host<->device copies are synchronous and block the engine",
                RuntimeWarning,
                stacklevel=2,
            )
        kernel = enable_kernel_path
        if kernel is None:
            kernel = copy_path == "kernel" or os.environ.get(KERNEL_PATH_ENV, "") == "1"
        self._pool_alias: torch.Tensor | None = None
        if kernel and (pool.pinned or not isinstance(device_api, CudaDevice)):
            self._pool_alias = device_api.host_alias(reg.pool_rows)
        if copy_path == "kernel" and self._pool_alias is None:
            raise ConfigError("copy_path='kernel' needs a pinned pool mapped into the device address space")
        self.paths: tuple[str, ...] = ("dma", "runs", "kernel") if self._pool_alias is not None else ("dma", "runs")
        self._forced = None if copy_path == "auto" else copy_path
        max_group = max(g.size for g in reg.groups)
        self.stage_rows = max(max_group, staging_bytes // reg.row_bytes)
        carrier = reg.pool_rows.dtype
        self._streams = {True: device_api.new_stream(), False: device_api.new_stream()}
        self._stage = {d: device_api.empty((self.stage_rows, *reg.row_shape), carrier) for d in (True, False)}
        self._compute_stream = compute_stream
        # Pool rows at which a pinned registration starts: a DMA never crosses one.
        rows_per_slot = pool.num_layers * pool.blocks_per_chunk
        self._pin_breaks = np.array([lo * rows_per_slot for lo, _ in pool.pinned_ranges[1:]], dtype=np.int64)
        # Hazard tracking: per direction, the seq of the last job touching each GPU block / slot.
        self._seq = 0
        self._block_seq = {d: np.full(reg.num_blocks, -1, dtype=np.int64) for d in (True, False)}
        self._slot_seq = {d: np.full(pool.num_slots, -1, dtype=np.int64) for d in (True, False)}
        self._seq_events: dict[int, Any] = {}
        self._inflight: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._tally = CopyTally()
        #: (direction, path) -> layer-group copies done that way
        self.path_counts: Counter[tuple[str, str]] = Counter()
        self._closed = False
        self._calibration = calibration
        for d, stage in self._stage.items():
            device_api.record_stream(stage, self._streams[d])  # freed only after the copies that use it
        if self._forced is None and calibration is None and isinstance(device_api, CudaDevice):
            self._calibration = cuda_calibration(device_api, kernel="kernel" in self.paths)

    @override
    def __repr__(self) -> str:
        return (
            f"CudaCopyBackend(device={self.device}, layers={self.registration.num_layers}, "
            f"groups={len(self.registration.groups)}, paths={self.paths}, in_flight={len(self._inflight)})"
        )

    # ------------------------------------------------------------------ the CopyBackend protocol

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.registration.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        """Enqueue the job's copy and its completion event; returns at once.

        The returned future resolves when :meth:`poll` or :meth:`wait` observes the job finished. A launch that
        fails (e.g. an id that slipped past :meth:`check`) does not raise: the job is reported failed by
        :meth:`poll` - after whatever part of it was already queued has run, so its memory is free again.
        """
        if self._closed:
            raise KvfsmError(f"job {job_id}: the copy backend is shut down; expected no submissions")
        if job_id in self._inflight:
            raise ConfigError(f"job {job_id} is already submitted and not yet polled; expected a new job id")
        self.check(is_store, gpu, slots)
        future: Future[None] = Future()
        job = _Job(job_id, is_store, future, len(gpu.block_ids) * self.pool.nbytes_per_slot // self.blocks_per_chunk)
        if events.listening():
            # The source bytes as the copy is queued (tracing only; reading the device waits for its stream).
            job.sides = (gpu, slots)
            digest = events.checksum(job_side_bytes(self.kv_caches, self.pool, is_store, gpu, slots, source=True))
            events.emit_copy("submitted", job_id, is_store, self.copy_source, digest, None)
        self._inflight[job_id] = job
        try:
            plan = self.registration.plan(is_store, gpu, slots)
        except Exception as exc:  # nothing was queued: the job fails at the next poll
            job.error = exc
            return future
        if plan.num_blocks == 0:
            return future
        self._launch(job, plan)
        return future

    def poll(self) -> list[tuple[int, bool]]:
        finished: list[tuple[int, bool]] = []
        for job_id, job in list(self._inflight.items()):
            if not job.done and job.event is not None and not self.api.query(job.event):
                continue
            del self._inflight[job_id]
            self._finish(job)
            finished.append((job_id, job.error is None))
        return finished

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs' copies are done (fence/preemption flushes and shutdown only)."""
        for job_id in job_ids:
            job = self._inflight.get(job_id)
            if job is not None and job.event is not None and not job.done:
                self.api.synchronize(job.event)
                self._finish(job)

    def wait_all(self) -> None:
        self.wait(list(self._inflight))

    def shutdown(self) -> None:
        self.wait_all()
        self._closed = True

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def stream(self, is_store: bool) -> Any:
        """The dedicated stream of one direction (stores or loads): every copy of that direction runs on it."""
        return self._streams[is_store]

    @property
    def calibration(self) -> CalibrationTable | None:
        return self._calibration

    # ------------------------------------------------------------------ completion

    def _finish(self, job: _Job) -> None:
        if job.done:
            return
        job.done = True
        self._seq_events.pop(job.seq, None)
        if job.sides is not None and events.listening():
            # Observed finished (its event done, or synchronized): the destination bytes, before any report.
            gpu, slots = job.sides
            digest = None
            if job.error is None:
                digest = events.checksum(
                    job_side_bytes(self.kv_caches, self.pool, job.is_store, gpu, slots, source=False)
                )
            events.emit_copy("finished", job.job_id, job.is_store, self.copy_source, digest, job.error is None)
        if job.error is not None:
            self._tally.failed()
        else:
            self._tally.succeeded(job.is_store, job.nbytes)
        if job.error is not None:
            logger.warning("copy of job %d failed: %r", job.job_id, job.error)
            job.future.set_exception(job.error)
        else:
            job.future.set_result(None)

    # ------------------------------------------------------------------ launching

    def _launch(self, job: _Job, plan: JobPlan) -> None:
        api = self.api
        stream = self._streams[job.is_store]
        other = not job.is_store
        self._seq += 1
        seq = self._seq
        # The latest unfinished job of the other direction on any of our blocks or slots (its stream is FIFO,
        # so waiting for the latest one covers the earlier ones).
        dep = max(int(self._block_seq[other][plan.gpu_ids].max()), int(self._slot_seq[other][plan.slot_ids].max()))
        dep_event = self._seq_events.get(dep) if dep >= 0 else None
        try:
            paths = [self._choose(plan, g) for g in range(len(self.registration.groups))]
            work = self._prepare(plan, paths)
        except Exception as exc:  # nothing was queued yet
            job.error = exc
            return
        queued = False
        try:
            api.wait_stream(stream, self._compute_stream if self._compute_stream is not None else api.current_stream())
            if dep_event is not None and not api.query(dep_event):
                api.wait_event(stream, dep_event)
            queued = True
            api.launch(stream, work)
        except Exception as exc:
            job.error = exc
            if not queued:
                return
        event = api.new_event()
        try:
            api.record(event, stream)
        except Exception as exc:  # the device is unusable; report at once
            job.error = job.error or exc
            return
        job.seq = seq
        job.event = event
        self._seq_events[seq] = event
        self._block_seq[job.is_store][plan.gpu_ids] = seq
        self._slot_seq[job.is_store][plan.slot_ids] = seq
        direction = "store" if job.is_store else "load"
        with self._lock:
            for p in paths:
                self.path_counts[(direction, p)] += 1

    def _choose(self, plan: JobPlan, g: int) -> str:
        if self._forced is not None:
            return self._forced
        if self._calibration is None:
            return "dma"
        reg = self.registration
        n = plan.num_blocks * reg.groups[g].size
        nbytes = n * reg.row_bytes
        prows = plan.pool_rows[g].reshape(-1)
        host_runs = 1 + int(np.count_nonzero(np.diff(np.sort(prows)) != 1)) if n else 1
        both_runs = max(1, int(self._runs(plan, g)[3].shape[0]))
        d = "store" if plan.is_store else "load"
        work = {
            "dma": Choice(nbytes, nbytes // host_runs, host_runs),
            "runs": Choice(nbytes, nbytes // both_runs, both_runs),
            "kernel": Choice(nbytes, reg.row_bytes, max(1, n)),
        }
        options = {f"{p}/{d}": work[p] for p in self.paths}
        return self._calibration.choose(options, default=f"dma/{d}").split("/")[0]

    def _runs(self, plan: JobPlan, g: int) -> tuple[IndexArray, IndexArray, IndexArray, IndexArray]:
        """Group ``g``'s rows as copies contiguous on both sides: arrays ``(layer, kv row, pool row, rows)`` in
        pool-row order, never across a pinned-range start; ``layer`` is -1 for the stacked view."""
        group = self.registration.groups[g]
        prows = plan.pool_rows[g].reshape(-1)
        width = self.num_blocks + 1  # per-layer row spaces with a gap, so runs never cross from one to the next
        if group.stacked is not None:
            krows = plan.kv_rows[g].reshape(-1)
        else:
            j = np.tile(np.arange(group.size, dtype=np.int64), plan.num_blocks)
            krows = j * width + np.repeat(plan.gpu_ids, group.size)
        order = np.argsort(prows, kind="stable")
        k, p = krows[order], prows[order]
        brk = (np.diff(k) != 1) | (np.diff(p) != 1) | np.isin(p[1:], self._pin_breaks)
        starts = np.concatenate((np.zeros(1, dtype=np.int64), np.flatnonzero(brk) + 1))
        ends = np.concatenate((starts[1:], np.array([k.shape[0]], dtype=np.int64)))
        sizes: IndexArray = (ends - starts).astype(np.int64)
        k0 = k[starts]
        if group.stacked is not None:
            return np.zeros_like(starts) - 1, k0, p[starts], sizes
        return k0 // width, k0 % width, p[starts], sizes

    def _prepare(self, plan: JobPlan, paths: list[str]) -> Callable[[], None]:
        """Build every address list on the host, then return the function that queues the device work."""
        idx = _Indexes()
        steps: list[Callable[[], None]] = []
        for g, path in enumerate(paths):
            group = self.registration.groups[g]
            if path == "kernel":
                steps.extend(self._kernel_steps(plan, g, group, idx))
            elif path == "runs":
                steps.append(self._runs_step(plan, g, group))
            else:
                steps.extend(self._dma_steps(plan, g, group, idx))
        api = self.api

        def work() -> None:
            idx.upload(api)
            for step in steps:
                step()

        return work

    def _dma_steps(self, plan: JobPlan, g: int, group: LayerGroup, idx: _Indexes) -> list[Callable[[], None]]:
        reg = self.registration
        prows = plan.pool_rows[g].reshape(-1)
        krows = plan.kv_rows[g].reshape(-1)
        order = np.argsort(prows, kind="stable")
        prows_s, krows_s = prows[order], krows[order]
        layer_s = np.tile(np.arange(group.size, dtype=np.int64), plan.num_blocks)[order]
        pool = reg.pool_rows
        stage = self._stage[plan.is_store]
        store = plan.is_store
        api = self.api
        steps: list[Callable[[], None]] = []
        for piece in _segments(prows_s, self._pin_breaks, self.stage_rows):
            m = piece.hi - piece.lo
            k = krows_s[piece.lo : piece.hi]
            if group.stacked is not None:
                kv_moves: list[tuple[torch.Tensor, int, int | None]] = [(group.stacked, idx.add(k), None)]
            else:
                lay = layer_s[piece.lo : piece.hi]
                kv_moves = []
                for j, layer in enumerate(group.layers):
                    pos = np.flatnonzero(lay == j)
                    if pos.size:
                        kv_moves.append((layer, idx.add(k[pos] - j * group.spacing), idx.add(pos)))
            segs = piece.segments

            def step(
                m: int = m,
                kv_moves: list[tuple[torch.Tensor, int, int | None]] = kv_moves,
                segs: Runs = segs,
            ) -> None:
                buf = stage[:m]
                if store:
                    for src, rows, pos in kv_moves:
                        if pos is None:
                            torch.index_select(src, 0, idx[rows], out=buf)
                        else:
                            buf.index_copy_(0, idx[pos], src.index_select(0, idx[rows]))
                    api.copy_rows(pool, buf, segs)
                else:
                    api.copy_rows(buf, pool, (segs[1], segs[0], segs[2]))
                    for dst, rows, pos in kv_moves:
                        if pos is None:
                            dst.index_copy_(0, idx[rows], buf)
                        else:
                            dst.index_copy_(0, idx[rows], buf.index_select(0, idx[pos]))

            steps.append(step)
        return steps

    def _runs_step(self, plan: JobPlan, g: int, group: LayerGroup) -> Callable[[], None]:
        """One direct ``cudaMemcpyAsync`` per run contiguous on both sides (no staging, no index kernel)."""
        pool = self.registration.pool_rows
        stacked = group.stacked
        layer, k0, p0, sizes = self._runs(plan, g)
        moves: list[tuple[torch.Tensor, list[int], list[int], list[int]]] = []
        for j in np.unique(layer).tolist():
            sel = layer == j
            kv = stacked if stacked is not None else group.layers[j]
            moves.append((kv, k0[sel].tolist(), p0[sel].tolist(), sizes[sel].tolist()))
        store = plan.is_store
        api = self.api

        def step() -> None:
            for kv, kr, pr, n in moves:
                if store:
                    api.copy_rows(pool, kv, (pr, kr, n))
                else:
                    api.copy_rows(kv, pool, (kr, pr, n))

        return step

    def _kernel_steps(self, plan: JobPlan, g: int, group: LayerGroup, idx: _Indexes) -> list[Callable[[], None]]:
        alias = self._pool_alias
        if alias is None:
            raise ConfigError("the kernel copy path needs the pool mapped into the device address space")
        prows = plan.pool_rows[g]
        krows = plan.kv_rows[g]
        store = plan.is_store
        nb = max(1, self.stage_rows // group.size)
        steps: list[Callable[[], None]] = []
        for b0 in range(0, plan.num_blocks, nb):
            b1 = min(plan.num_blocks, b0 + nb)
            if group.stacked is not None:
                moves = [(group.stacked, idx.add(krows[b0:b1].reshape(-1)), idx.add(prows[b0:b1].reshape(-1)))]
            else:
                gidx = idx.add(plan.gpu_ids[b0:b1])
                moves = [(layer, gidx, idx.add(prows[b0:b1, j])) for j, layer in enumerate(group.layers)]

            def step(moves: list[tuple[torch.Tensor, int, int]] = moves) -> None:
                for kv, rows, pos in moves:
                    if store:
                        alias.index_copy_(0, idx[pos], kv.index_select(0, idx[rows]))
                    else:
                        kv.index_copy_(0, idx[rows], alias.index_select(0, idx[pos]))

            steps.append(step)
        return steps


# ---------------------------------------------------------------------------------------------- calibration

_CAL_UNITS = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20)
_CAL_COUNTS = (8, 64, 512, 4096)
_CAL_MAX_BYTES = 64 << 20


def _cuda_measure(api: CudaDevice, path: str, is_store: bool) -> Measure:
    cache: dict[int, tuple[torch.Tensor, CPUSlotPool, CudaCopyBackend]] = {}

    def rig(unit: int) -> tuple[torch.Tensor, CPUSlotPool, CudaCopyBackend]:
        if unit not in cache:
            for old in cache.values():
                old[2].shutdown()
                old[1].close()
            cache.clear()
            count = max(1, _CAL_MAX_BYTES // unit)
            kv = torch.randint(0, 256, (count, unit), dtype=torch.uint8, device=api.device)
            pool = CPUSlotPool(count, 1, (unit,), 1, torch.uint8, pin_memory=True)
            if not pool.pinned:
                raise KvfsmError("calibration needs pinned host memory")
            pool.rows.copy_(torch.randint(0, 256, (count, unit), dtype=torch.uint8))
            backend = CudaCopyBackend(
                [kv], pool, 1, copy_path=path, enable_kernel_path=path == "kernel", device_api=api
            )
            cache[unit] = (kv, pool, backend)
        return cache[unit]

    counter = iter(range(1 << 62))

    def measure(unit: int, count: int) -> float:
        kv, pool, backend = rig(unit)
        gen = torch.Generator().manual_seed(unit * 7919 + count)
        blocks = tuple(torch.randperm(kv.shape[0], generator=gen)[:count].tolist())
        slots = tuple(torch.randperm(pool.num_slots, generator=gen)[:count].tolist())
        times = []
        for _ in range(4):
            job = next(counter)
            torch.cuda.synchronize(api.device)
            t0 = time.perf_counter()
            backend.submit(job, is_store, GPUBlockSpec(blocks), SlotSpec(slots))
            backend.wait([job])
            times.append(time.perf_counter() - t0)
            if backend.poll() != [(job, True)]:
                raise KvfsmError(f"calibration job of path {path!r} failed")
        b, s = torch.tensor(blocks), torch.tensor(slots)
        if not torch.equal(kv[b.to(api.device)].cpu(), pool.rows[s]):
            raise KvfsmError(f"calibration copy of path {path!r} moved the wrong bytes")
        return unit * count / sorted(times[1:])[1]

    return measure


def cuda_calibration(api: CudaDevice, kernel: bool) -> CalibrationTable:
    """This device's table (measured once per process, a few seconds, or read from the calibration file)."""
    name = torch.cuda.get_device_name(api.device)
    paths = CUDA_COPY_PATHS if kernel else ("dma", "runs")
    context = f"cuda/{name}/{'+'.join(paths)}"

    def build() -> CalibrationTable:
        measures = {f"{p}/{d}": _cuda_measure(api, p, d == "store") for p in paths for d in ("store", "load")}
        return calibrate(context, measures, grid(_CAL_UNITS, _CAL_COUNTS, _CAL_MAX_BYTES))

    return cached_table(context, build)
