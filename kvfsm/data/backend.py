"""Copy backends: move a job's blocks between one worker's KV-cache shard and its CPU slot pool.

A job names GPU blocks in logical order (``GPUBlockSpec``) and the CPU chunk slots that hold them
(``SlotSpec``). Logical block ``i`` of the job sits at position ``p = first_block_offset + i`` of the
job's chunk run: chunk ``slot_ids[p // blocks_per_chunk]``, sub-block ``p % blocks_per_chunk``. A store
copies GPU -> slots, a load copies slots -> GPU.

:class:`ThreadPoolCopyBackend` batches every copy: per layer one gather (``index_select``) and one scatter
(``index_copy_``), whatever the number of blocks. The copies run on a thread pool (torch releases the GIL);
on CUDA each pool thread has its own stream, which first waits for the work queued on the submitting
thread's current stream (the forward that wrote the blocks, or that zeroes re-allocated ones).

There is no ordering between jobs, not even in one direction: the scheduler's flush rules must (and do)
order any two jobs that touch the same memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Protocol

import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data.layout import is_int
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError, KvfsmError

__all__ = ["CopyBackend", "CopyStats", "ThreadPoolCopyBackend", "chunk_rows"]

logger = logging.getLogger(__name__)


class CopyBackend(Protocol):
    """What a worker needs from a copy engine: asynchronous batched copies with completion polling."""

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        """Raise ConfigError if the job cannot be copied; never changes anything."""
        ...

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        """Start the copy of one job; its outcome is reported once by :meth:`poll`."""
        ...

    def poll(self) -> list[tuple[int, bool]]:
        """``(job_id, success)`` for every submitted job that finished since the last poll, each once."""
        ...

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs (those submitted and not yet polled) have finished."""
        ...

    def shutdown(self) -> None:
        """Finish everything outstanding and release the copy threads."""
        ...


@dataclass(frozen=True, slots=True)
class CopyStats:
    """Totals of the copies that succeeded, per direction, and the number that failed."""

    bytes_stored: int
    bytes_loaded: int
    jobs_stored: int
    jobs_loaded: int
    jobs_failed: int


def chunk_rows(gpu: GPUBlockSpec, slots: SlotSpec, blocks_per_chunk: int) -> list[int]:
    """The pool row (``slot * blocks_per_chunk + sub_block``) of each of the job's blocks, in order."""
    off = gpu.first_block_offset
    return [
        slots.slot_ids[p // blocks_per_chunk] * blocks_per_chunk + p % blocks_per_chunk
        for p in range(off, off + len(gpu.block_ids))
    ]


class ThreadPoolCopyBackend:
    """Batched copies between one KV-cache shard and one :class:`CPUSlotPool`, on a thread pool."""

    __slots__ = (
        "_bytes_per_block",
        "_closed",
        "_executor",
        "_inflight",
        "_local",
        "_lock",
        "_stats",
        "blocks_per_chunk",
        "device",
        "kv_caches",
        "num_blocks",
        "pool",
    )

    def __init__(
        self,
        kv_caches: list[torch.Tensor],
        pool: CPUSlotPool,
        blocks_per_chunk: int,
        max_workers: int = 2,
    ) -> None:
        if not kv_caches:
            raise ConfigError("kv_caches is empty; expected one tensor per layer")
        if len(kv_caches) != pool.num_layers:
            raise ConfigError(f"got {len(kv_caches)} KV-cache layers; the pool has {pool.num_layers} layers")
        if blocks_per_chunk != pool.blocks_per_chunk:
            raise ConfigError(f"blocks_per_chunk={blocks_per_chunk!r}; expected the pool's {pool.blocks_per_chunk}")
        if not is_int(max_workers) or max_workers < 1:
            raise ConfigError(f"max_workers must be a positive int, got {max_workers!r}")
        first = kv_caches[0]
        for i, layer in enumerate(kv_caches):
            if not isinstance(layer, torch.Tensor):
                raise ConfigError(f"layer {i} is a {type(layer).__name__}; expected a torch.Tensor")
            if layer.dim() < 1 or tuple(layer.shape[1:]) != pool.block_shape:
                raise ConfigError(
                    f"layer {i} has shape {tuple(layer.shape)}; expected (num_blocks, *{pool.block_shape}) "
                    f"to match the pool's block shape"
                )
            if layer.shape[0] != first.shape[0]:
                raise ConfigError(f"layer {i} has {layer.shape[0]} blocks; expected {first.shape[0]} like layer 0")
            if layer.dtype != pool.dtype:
                raise ConfigError(f"layer {i} has dtype {layer.dtype}; expected the pool's {pool.dtype}")
            if layer.device != first.device:
                raise ConfigError(f"layer {i} is on {layer.device}; expected {first.device} like layer 0")
        self.kv_caches = list(kv_caches)
        self.pool = pool
        self.blocks_per_chunk = blocks_per_chunk
        self.num_blocks = int(first.shape[0])
        self.device = first.device
        self._bytes_per_block = pool.nbytes_per_slot // blocks_per_chunk
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvfsm-copy")
        self._inflight: dict[int, Future[None]] = {}
        self._local = threading.local()
        self._lock = threading.Lock()
        # bytes_stored, bytes_loaded, jobs_stored, jobs_loaded, jobs_failed
        self._stats = [0, 0, 0, 0, 0]
        self._closed = False

    # ------------------------------------------------------------------ validation

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        bpc = self.blocks_per_chunk
        block_ids = gpu.block_ids
        slot_ids = slots.slot_ids
        off = gpu.first_block_offset
        if not is_int(off) or not 0 <= off < bpc:
            raise ConfigError(f"first_block_offset={off!r}; expected an int in 0..{bpc - 1}")
        if not all(is_int(b) for b in block_ids):
            raise ConfigError(f"GPU block ids {block_ids!r}; expected ints")
        if not all(is_int(s) for s in slot_ids):
            raise ConfigError(f"slot ids {slot_ids!r}; expected ints")
        n = len(block_ids)
        expected_slots = (off + n + bpc - 1) // bpc if n else 0
        if len(slot_ids) != expected_slots:
            raise ConfigError(
                f"{len(slot_ids)} slots for {n} blocks at first_block_offset={off} with "
                f"blocks_per_chunk={bpc}; expected {expected_slots}"
            )
        if n == 0:
            return
        if min(block_ids) < 0 or max(block_ids) >= self.num_blocks:
            raise ConfigError(f"GPU block ids {block_ids!r}; expected ids in 0..{self.num_blocks - 1}")
        if min(slot_ids) < 0 or max(slot_ids) >= self.pool.num_slots:
            raise ConfigError(f"slot ids {slot_ids!r}; expected ids in 0..{self.pool.num_slots - 1}")
        # A destination written twice in one scatter has an undefined result.
        if is_store and len(set(slot_ids)) != len(slot_ids):
            raise ConfigError(f"store slot ids {slot_ids!r}; expected distinct slots")
        if not is_store and len(set(block_ids)) != n:
            raise ConfigError(f"load GPU block ids {block_ids!r}; expected distinct blocks")

    # ------------------------------------------------------------------ submission and completion

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if self._closed:
            raise KvfsmError(f"job {job_id}: the copy backend is shut down; expected no submissions")
        if job_id in self._inflight:
            raise ConfigError(f"job {job_id} is already submitted and not yet polled; expected a new job id")
        self.check(is_store, gpu, slots)
        gpu_idx = torch.tensor(gpu.block_ids, dtype=torch.int64)
        cpu_rows = torch.tensor(chunk_rows(gpu, slots, self.blocks_per_chunk), dtype=torch.int64)
        ready: torch.cuda.Event | None = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        future = self._executor.submit(self._run, is_store, gpu_idx, cpu_rows, ready)
        self._inflight[job_id] = future
        return future

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

    @property
    def num_inflight(self) -> int:
        """Jobs submitted and not yet reported by :meth:`poll`."""
        return len(self._inflight)

    def stats(self) -> CopyStats:
        with self._lock:
            return CopyStats(*self._stats)

    @property
    def bytes_stored(self) -> int:
        return self.stats().bytes_stored

    @property
    def bytes_loaded(self) -> int:
        return self.stats().bytes_loaded

    # ------------------------------------------------------------------ the copies (pool threads)

    def _run(
        self,
        is_store: bool,
        gpu_idx: torch.Tensor,
        cpu_rows: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        try:
            if gpu_idx.numel():
                if self.device.type == "cuda":
                    self._copy_cuda(is_store, gpu_idx, cpu_rows, ready)
                else:
                    self._copy_generic(is_store, gpu_idx, cpu_rows)
        except BaseException:
            with self._lock:
                self._stats[4] += 1
            raise
        nbytes = gpu_idx.numel() * self._bytes_per_block
        with self._lock:
            if is_store:
                self._stats[0] += nbytes
                self._stats[2] += 1
            else:
                self._stats[1] += nbytes
                self._stats[3] += 1

    def _copy_generic(self, is_store: bool, gpu_idx: torch.Tensor, cpu_rows: torch.Tensor) -> None:
        """CPU-resident (or non-CUDA) KV caches: synchronous gather + scatter per layer."""
        on_cpu = self.device.type == "cpu"
        gidx = gpu_idx if on_cpu else gpu_idx.to(self.device)
        for kv, flat in zip(self.kv_caches, self.pool.flat_layers, strict=True):
            if is_store:
                flat.index_copy_(0, cpu_rows, kv.index_select(0, gidx).to("cpu"))
            else:
                kv.index_copy_(0, gidx, flat.index_select(0, cpu_rows).to(self.device))

    def _stream(self) -> torch.cuda.Stream:
        stream: torch.cuda.Stream | None = getattr(self._local, "stream", None)
        if stream is None:
            stream = torch.cuda.Stream(device=self.device)
            self._local.stream = stream
        return stream

    def _copy_cuda(
        self,
        is_store: bool,
        gpu_idx: torch.Tensor,
        cpu_rows: torch.Tensor,
        ready: torch.cuda.Event | None,
    ) -> None:
        """CUDA KV caches: gather on the device, one async DMA per layer through pinned staging."""
        stream = self._stream()
        if ready is not None:
            stream.wait_event(ready)
        staged: list[torch.Tensor] = []
        with torch.cuda.stream(stream):
            gidx = gpu_idx.to(self.device, non_blocking=True)
            if is_store:
                # D2H with non_blocking lands in pinned memory; scatter it once the stream is done.
                staged = [kv.index_select(0, gidx).to("cpu", non_blocking=True) for kv in self.kv_caches]
                stream.synchronize()
                for flat, host in zip(self.pool.flat_layers, staged, strict=True):
                    flat.index_copy_(0, cpu_rows, host)
            else:
                n = int(cpu_rows.numel())
                for kv, flat in zip(self.kv_caches, self.pool.flat_layers, strict=True):
                    host = torch.empty((n, *self.pool.block_shape), dtype=flat.dtype, pin_memory=self.pool.pinned)
                    torch.index_select(flat, 0, cpu_rows, out=host)
                    kv.index_copy_(0, gidx, host.to(self.device, non_blocking=True))
                    staged.append(host)  # alive until the DMA has read it
                stream.synchronize()
