"""kvfsm as an out-of-tree ``OffloadingSpec`` for vLLM 0.33's native ``OffloadingConnector``.

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
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from typing_extensions import override
from vllm.v1.kv_offload.base import OffloadingSpec, OffloadingWorker, TransferResult
from vllm.v1.kv_offload.cpu.common import CPUOffloadingInfo
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import OffloadingManager as KvfsmManager
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError, ConfigKeyError
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.vllm.config import SpecConfig, parse_extra_config
from kvfsm.vllm.manager import KvfsmOffloadingManager

__all__ = ["KvfsmOffloadingSpec", "KvfsmOffloadingWorker"]

# The fs tier moves slot bytes in the scheduler process; with vLLM's in-process executor the worker's pool
# is in the same process, so the worker binds it to the tier its scheduler built (per engine id).
_FS_TIERS: weakref.WeakValueDictionary[str, FileSystemTier] = weakref.WeakValueDictionary()
_FS_LOCK = threading.Lock()


class KvfsmOffloadingWorker(OffloadingWorker):
    """vLLM's worker interface over one kvfsm :class:`~kvfsm.control.worker.CopyBackend`."""

    def __init__(self, backend: CopyBackend) -> None:
        self.backend = backend

    @staticmethod
    def _gpu(spec: Any) -> GPUBlockSpec:
        sizes = list(spec.group_sizes)
        if len(sizes) != 1:
            raise ConfigError(f"kvfsm's worker copies one KV-cache group per job; got group sizes {sizes}")
        return GPUBlockSpec(tuple(int(b) for b in spec.block_ids), int(spec.block_indices[0]))

    @staticmethod
    def _slots(spec: Any) -> SlotSpec:
        return SlotSpec(tuple(int(c) for c in spec.block_ids))

    @override
    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        gpu, slots = self._gpu(src_spec), self._slots(dst_spec)
        self.backend.check(True, gpu, slots)
        self.backend.submit(job_id, True, gpu, slots)
        return True

    @override
    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        gpu, slots = self._gpu(dst_spec), self._slots(src_spec)
        self.backend.check(False, gpu, slots)
        self.backend.submit(job_id, False, gpu, slots)
        return True

    @override
    def get_finished(self) -> list[Any]:
        return [TransferResult(job_id=job_id, success=ok) for job_id, ok in self.backend.poll()]

    @override
    def wait(self, job_ids: Iterable[int]) -> None:
        self.backend.wait(job_ids)

    @override
    def shutdown(self) -> None:
        self.backend.shutdown()


class KvfsmOffloadingSpec(OffloadingSpec):
    """kvfsm's managers and copy backend, configured from ``kv_connector_extra_config``."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
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
        self.cpu_info = CPUOffloadingInfo.from_config(config, self.num_chunks, self.kv_bytes_per_chunk)
        self._manager: KvfsmOffloadingManager | None = None
        self._worker: KvfsmOffloadingWorker | None = None

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The metrics of vLLM's CPU spec: kvfsm's manager reports the same gauges, histogram and counter."""
        return dict(CPUOffloadingSpec.build_metric_definitions(extra_config))

    @classmethod
    @override
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        return tuple(CPUOffloadingInfo.config_info_keys())

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
        assert cfg.fs_path is not None  # parse_extra_config requires it with the fs tier
        tier = FileSystemTier(cfg.fs_path, capacity_bytes=cfg.fs_capacity_bytes)
        with _FS_LOCK:
            _FS_TIERS[str(self.config.engine_id)] = tier
        return TieringManager(primary, [tier], checked=cfg.checked)

    @override
    def get_manager(self) -> Any:
        if self._manager is None:
            self._manager = KvfsmOffloadingManager(self._build_manager(), self.cpu_info)
        return self._manager

    @override
    def get_worker(self, kv_caches: Any) -> Any:
        if self._worker is None:
            self._worker = KvfsmOffloadingWorker(self._build_backend(kv_caches))
        return self._worker

    def _build_backend(self, kv_caches: Any) -> CopyBackend:
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
        if self.kvfsm_config.tier == "fs":
            with _FS_LOCK:
                tier = _FS_TIERS.get(str(self.config.engine_id))
            if tier is None:
                raise ConfigKeyError(
                    "kvfsm_tier", "the fs tier needs its scheduler in this process (vLLM's uniproc executor)"
                )
            tier.slot_io = pool
        if on_gpu:
            # kvfsm's CUDA backend: batched copies on its own streams, ordered after the forward's writes.
            from kvfsm.data.cuda.backend import CudaCopyBackend

            return CudaCopyBackend(tensors, pool, int(self.blocks_per_chunk))
        return ThreadPoolCopyBackend(
            tensors, pool, int(self.blocks_per_chunk), max_workers=self.kvfsm_config.copy_threads, copy_path="runs"
        )
