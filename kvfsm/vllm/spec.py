"""kvfsm as an out-of-tree ``OffloadingSpec`` for vLLM's native ``OffloadingConnector`` (vLLM 0.32-0.34).

vLLM loads it with::

    kv_transfer_config = {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": "KvfsmOffloadingSpec",
            "spec_module_path": "kvfsm.vllm",
            "cpu_bytes_to_use": 8 << 30,
        },
    }

The scheduler side gets kvfsm's manager (:mod:`kvfsm.vllm.manager`): the CPU manager with kvfsm's
request-scoped LRU or ARC, or kvfsm's tiering manager with the file-system tier below it. The worker side
gets :class:`KvfsmOffloadingWorker`, vLLM's worker interface over kvfsm's copy backend (the CUDA backend
for CUDA KV caches, else the thread-pool one) and a kvfsm slot pool. The keys are parsed by :mod:`kvfsm.vllm.config`.

Importing this module on a vLLM outside 0.32-0.34 raises :class:`kvfsm.vllm.compat.UnsupportedVllmError`
(one message naming the supported range); the differences between the supported versions are detected by
:mod:`kvfsm.vllm.compat` (0.34's workers take device pointers, 0.32 has no ``CPUOffloadingInfo``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.manager import OffloadingManager as KvfsmManager
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError, ConfigKeyError, KvfsmError
from kvfsm.vllm.compat import (
    connector_handles_failed_jobs,
    has_offloading_info,
    require_supported_vllm,
    vllm_version,
    worker_takes_device_pointers,
)
from kvfsm.vllm.config import SpecConfig, parse_extra_config
from kvfsm.vllm.connector_tiers import bind_worker_pool, build_tiers, register_tiers

# Before any vLLM import: an unsupported vLLM gets one error naming the supported range, not an ImportError
# of whichever name it happens to lack first.
require_supported_vllm()

from vllm.v1.kv_offload.base import OffloadingSpec, OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu import common as vllm_cpu_common  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec  # noqa: E402

from kvfsm.vllm.manager import KvfsmOffloadingManager  # noqa: E402

if TYPE_CHECKING:
    from kvfsm.tiers.redis_codec import Namespace

__all__ = ["KvfsmOffloadingSpec", "KvfsmOffloadingWorker"]


def _builds_meta(owner: Any) -> bool:
    """``owner`` is a vLLM offloading connector scheduler (it builds the connector metadata for the workers)."""
    return callable(getattr(owner, "build_connector_meta", None)) and callable(getattr(owner, "request_finished", None))


class KvfsmOffloadingWorker(OffloadingWorker):
    """vLLM's worker interface over one kvfsm :class:`~kvfsm.control.worker.CopyBackend`.

    The GPU side of a job arrives as a ``GPULoadStoreSpec`` (vLLM 0.32, 0.33) or as ``DevicePointers``
    (0.34: the blocks' resolved addresses, one per layer and block), which the worker maps back to block ids
    of its registered tensors. Each finished job reports its transfer size (blocks copied times the bytes
    of one block over all layers) and its time (wall seconds from submit until the copy finished, as seen
    here), which vLLM's connector sums into its ``kv_offload_*_bytes`` and ``*_time`` metrics. A failed job
    reports neither: vLLM counts only the bytes that moved. Where vLLM's connector cannot take a failed job
    (0.32, 0.33) a failure raises :class:`~kvfsm.errors.KvfsmError` instead of being reported.
    """

    def __init__(
        self,
        backend: CopyBackend,
        kv_caches: Any = None,
        bytes_per_block: int = 0,
        *,
        blocks_per_chunk: int = 1,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        """``kv_caches``: vLLM's ``CanonicalKVCaches`` the backend copies (needed to read 0.34's device
        pointers); ``bytes_per_block``: the bytes of one block over all layers (0: report no sizes);
        ``blocks_per_chunk``: the spec's, to place a job's first block inside its chunk."""
        self.backend = backend
        self._blocks_per_chunk = blocks_per_chunk
        self._kv_caches = kv_caches
        self._bytes_per_block = bytes_per_block
        self._clock = clock
        #: job id -> (submit time, bytes the job copies), until get_finished reports it.
        self._submitted: dict[int, tuple[float, int]] = {}
        #: job id -> the time its copy finished (written by the backend's completion callback).
        self._finished_at: dict[int, float] = {}

    def _offset(self, block_index: Any) -> int:
        """vLLM's ``block_indices`` hold the logical index of a job's first block in its request; kvfsm wants
        its offset inside its chunk (vLLM's own workers skip ``block_index % blocks_per_chunk`` sub-blocks)."""
        return int(block_index) % self._blocks_per_chunk

    def _gpu(self, spec: Any) -> GPUBlockSpec:
        sizes = list(spec.group_sizes)
        if len(sizes) != 1:
            raise ConfigError(f"kvfsm's worker copies one KV-cache group per job; got group sizes {sizes}")
        return GPUBlockSpec(tuple(int(b) for b in spec.block_ids), self._offset(spec.block_indices[0]))

    def _gpu_from_pointers(self, device_ptrs: Any) -> GPUBlockSpec:
        """The block ids behind vLLM 0.34's ``DevicePointers``: vLLM resolves block ``b`` of a data ref's
        tensor ``t`` to ``t.data_ptr() + b * t.stride(0)``; this inverts that and checks every layer agrees."""
        counts = list(device_ptrs.group_block_counts)
        if len(counts) != 1:
            raise ConfigError(f"kvfsm's worker copies one KV-cache group per job; got group block counts {counts}")
        if self._kv_caches is None:
            raise ConfigError("device pointers need the worker's registered KV caches; got a worker without them")
        n = counts[0]
        refs = self._kv_caches.group_data_refs[0]
        ptrs = np.asarray(device_ptrs.ptrs, dtype=np.uint64)
        if len(ptrs) != n * len(refs):
            raise ConfigError(f"got {len(ptrs)} device pointers; expected {n} blocks x {len(refs)} data refs")
        block_ids: np.ndarray[Any, np.dtype[np.int64]] | None = None
        for j, ref in enumerate(refs):
            tensor = self._kv_caches.tensors[ref.tensor_idx].tensor
            offsets = ptrs[j * n : (j + 1) * n].astype(np.int64) - np.int64(tensor.data_ptr())
            stride = int(tensor.stride(0))
            ids = offsets // stride
            if n and ((offsets % stride).any() or ids.min() < 0 or ids.max() >= tensor.shape[0]):
                raise ConfigError(
                    f"device pointers of data ref {j} are not block starts of its tensor ({tensor.shape[0]} blocks)"
                )
            if block_ids is None:
                block_ids = ids
            elif not np.array_equal(block_ids, ids):
                raise ConfigError(f"device pointers of data ref {j} name other blocks than data ref 0")
        blocks = tuple(int(b) for b in block_ids) if block_ids is not None else ()
        return GPUBlockSpec(blocks, self._offset(device_ptrs.block_indices[0]))

    def _device_side(self, spec: Any) -> GPUBlockSpec:
        return self._gpu_from_pointers(spec) if worker_takes_device_pointers() else self._gpu(spec)

    @staticmethod
    def _slots(spec: Any) -> SlotSpec:
        return SlotSpec(tuple(int(c) for c in spec.block_ids))

    def _submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> bool:
        self.backend.check(is_store, gpu, slots)
        self._submitted[job_id] = (self._clock(), len(gpu.block_ids) * self._bytes_per_block)
        try:
            future: Future[None] = self.backend.submit(job_id, is_store, gpu, slots)
        except BaseException:
            del self._submitted[job_id]
            raise
        # Stamped when the copy finishes (on the copy thread, or when a backend observes its device event
        # done), not when get_finished next looks: vLLM's transfer time is the copy's, not the step's.
        future.add_done_callback(partial(self._stamp_finished, job_id))
        return True

    def _stamp_finished(self, job_id: int, _future: Future[None]) -> None:
        self._finished_at[job_id] = self._clock()  # one dict store: atomic under the GIL, from any thread

    @override
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """``src_spec``: a ``GPULoadStoreSpec`` (vLLM 0.32, 0.33) or ``DevicePointers`` (0.34)."""
        return self._submit(job_id, True, self._device_side(src_spec), self._slots(dst_spec))

    @override
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """``dst_spec``: a ``GPULoadStoreSpec`` (vLLM 0.32, 0.33) or ``DevicePointers`` (0.34). An expedited
        load (0.34's synchronous loads) is copied like any other: vLLM waits on it within the step."""
        return self._submit(job_id, False, self._device_side(dst_spec), self._slots(src_spec))

    @override
    def get_finished(self) -> list[Any]:
        results: list[Any] = []
        for job_id, ok in self.backend.poll():
            submitted = self._submitted.pop(job_id, None)
            finished = self._finished_at.pop(job_id, None)
            if not ok and not connector_handles_failed_jobs():
                # vLLM 0.32/0.33 assume every transfer succeeds; reporting success would publish (store) or
                # compute on (load) bytes that never arrived, so the engine stops here, saying why.
                raise KvfsmError(
                    f"the copy of offloading job {job_id} failed, and this vLLM ({vllm_version()}) cannot take a "
                    "failed transfer (vLLM 0.34 can); stopping rather than using KV bytes that never arrived"
                )
            if not ok or submitted is None:
                results.append(TransferResult(job_id=job_id, success=ok))
                continue
            start, nbytes = submitted
            seconds = (finished if finished is not None else self._clock()) - start
            results.append(TransferResult(job_id=job_id, success=True, transfer_size=nbytes, transfer_time=seconds))
        return results

    @override
    def wait(self, job_ids: Iterable[int]) -> None:
        self.backend.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self.backend.shutdown()


class KvfsmOffloadingSpec(CPUOffloadingSpec):
    """kvfsm's managers and copy backend, configured from ``kv_connector_extra_config``.

    A ``CPUOffloadingSpec`` by class, because vLLM reports its transfer counters under the older names too
    (``vllm:kv_offload_total_bytes``, ``..._total_time``, ``..._size`` per direction) only for a subclass of its
    CPU spec, and kvfsm's spec is a CPU tier with the same sizing. Nothing else is inherited: the manager,
    the worker and the sizing are kvfsm's, and vLLM's CPU-spec constructor is skipped (it would size a shared
    mmap region and a replicated layout kvfsm's pool does not use).
    """

    def __init__(self, config: Any) -> None:
        require_supported_vllm()  # cached; the module's import ran it first
        OffloadingSpec.__init__(self, config)  # not CPUOffloadingSpec's (see the class docstring)
        self.replicated_layout = False  # one copy per rank: kvfsm's pool holds each rank's blocks
        self.kvfsm_config: SpecConfig = parse_extra_config(dict(self.extra_config))
        world = int(config.parallel.world_size)
        self.num_chunks = 0
        self.kv_bytes_per_chunk = 0
        if config.worker_kv_bytes_per_block > 0 and world > 0:
            # The same arithmetic as vLLM's CPU spec, so either spec holds as many chunks for the same bytes.
            per_chunk = int(config.worker_kv_bytes_per_block) * world * int(self.blocks_per_chunk)
            align = int(SharedOffloadRegion.BLOCK_SIZE_ALIGNMENT)
            aligned = -(-per_chunk // align) * align
            self.num_chunks = self.kvfsm_config.cpu_bytes_to_use // aligned
            self.kv_bytes_per_chunk = aligned
        # vLLM 0.33 on: the facts of the kv_offload_config_info metric (0.32 has no such metric).
        self.cpu_info: Any = (
            vllm_cpu_common.CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
            if has_offloading_info()
            else None
        )
        self._manager: KvfsmOffloadingManager | None = None
        self._worker: KvfsmOffloadingWorker | None = None
        # The tier registry holds entries weakly: the spec and its manager (which vLLM's connector scheduler
        # keeps after dropping the spec) keep their engine's entry alive.
        self._tier_entry: Any = None
        self._tier_binding: Any = None

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The metrics of vLLM's CPU spec: kvfsm's manager reports the same gauges, histogram and counter."""
        return dict(CPUOffloadingSpec.build_metric_definitions(extra_config))

    @classmethod
    @override
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        if not has_offloading_info():
            return ()
        return tuple(vllm_cpu_common.CPUOffloadingInfo.config_info_keys())

    def _build_manager(self) -> KvfsmManager:
        cfg = self.kvfsm_config
        primary = CPUOffloadingManager(
            self.num_chunks,
            cfg.policy,
            enable_events=bool(self.kv_events_config.enable_kv_cache_events),
            store_threshold=cfg.store_threshold,
            max_tracker_size=cfg.max_tracker_size,
            checked=cfg.checked,
        )
        if cfg.tier == "none":
            return primary
        tiers = build_tiers(cfg.tier_settings, Deadlines(), self._redis_namespace() if cfg.tier == "redis" else None)
        # Tiers move slot bytes in this (the scheduler's) process; the worker's pool joins them by engine id,
        # whichever of the two is built first (kvfsm/vllm/connector_tiers.py).
        self._tier_entry = register_tiers(str(self.config.engine_id), tiers, 1)
        return TieringManager(primary, tiers, checked=cfg.checked)

    def _redis_namespace(self) -> Namespace:
        """The Redis namespace: the model, the KV bytes of one block on every rank, the chunk geometry."""
        from kvfsm.tiers.redis_codec import Namespace

        model = getattr(self.config, "model", None)
        return Namespace(
            model=str(getattr(model, "name", "") or "unknown"),
            num_layers=1,
            num_heads=int(self.config.parallel.world_size),
            head_dim=max(1, int(self.config.worker_kv_bytes_per_block)),
            tokens_per_block=max(1, int(getattr(self.config.cache, "tokens_per_hash", 1))),
            blocks_per_chunk=int(self.blocks_per_chunk),
            dtype=str(getattr(model, "dtype", "unknown")),
            world_size=int(self.config.parallel.world_size),
            prefix=self.kvfsm_config.tier_settings.redis_prefix,
        )

    @override
    def get_manager(self) -> Any:
        if self._manager is None:
            core = self._build_manager()  # registers the tiers (self._tier_entry) when there are any
            self._manager = KvfsmOffloadingManager(core, self.cpu_info, keepalive=self._tier_entry)
            if self.kvfsm_config.checked:
                self._install_seam_check(self._manager)
        return self._manager

    def _install_seam_check(self, manager: KvfsmOffloadingManager) -> None:
        """Checked mode: every job vLLM's connector scheduler builds is checked against vLLM's block table
        (:func:`kvfsm.vllm.seam.install_offloading_check`). vLLM calls ``get_manager`` from its connector
        scheduler's constructor, which is found on the call stack; a spec used without one (a test driving
        the manager directly) has no metadata to check."""
        from kvfsm.vllm.seam import SeamChecker, find_caller, install_offloading_check

        connector_scheduler = find_caller(_builds_meta)
        if connector_scheduler is None:
            return
        manager.track_slot_keys()
        install_offloading_check(connector_scheduler, SeamChecker(int(self.blocks_per_chunk)), manager.slot_key)

    @override
    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            backend, bytes_per_block = self._build_backend(kv_caches)
            self._worker = KvfsmOffloadingWorker(
                backend, kv_caches, bytes_per_block, blocks_per_chunk=int(self.blocks_per_chunk)
            )
        return self._worker

    def _build_backend(self, kv_caches: Any) -> tuple[CopyBackend, int]:
        """The copy backend over ``kv_caches``, and the bytes of one block over all its tensors."""
        tensors: list[torch.Tensor] = [t.tensor for t in kv_caches.tensors]
        if not tensors:
            raise ConfigError("vLLM registered no KV-cache tensors; expected at least one")
        rows = [tuple(int(d) for d in t.shape[1:]) for t in tensors]
        if len(set(rows)) != 1 or len({t.dtype for t in tensors}) != 1:
            raise ConfigError(f"kvfsm's copy backend needs one block shape and dtype for all tensors; got {rows}")
        if self.num_chunks < 1:
            raise ConfigKeyError("cpu_bytes_to_use", "too small for one chunk; expected room for at least one")
        on_gpu = tensors[0].device.type == "cuda"
        pool = CPUSlotPool(
            self.num_chunks, int(self.blocks_per_chunk), rows[0], len(tensors), tensors[0].dtype, pin_memory=on_gpu
        )
        if self.kvfsm_config.tier != "none":
            self._tier_binding = bind_worker_pool(
                str(self.config.engine_id), 0, 1, pool, self.kvfsm_config.tier_settings.tiers
            )
        bytes_per_block = pool.nbytes_per_slot // int(self.blocks_per_chunk)
        if on_gpu:
            # kvfsm's CUDA backend: batched copies on its own streams, ordered after the forward's writes.
            from kvfsm.data.cuda.backend import CudaCopyBackend

            return CudaCopyBackend(tensors, pool, int(self.blocks_per_chunk)), bytes_per_block
        backend = ThreadPoolCopyBackend(
            tensors, pool, int(self.blocks_per_chunk), max_workers=self.kvfsm_config.copy_threads, copy_path="runs"
        )
        return backend, bytes_per_block
