"""The data plane: KV-cache layout, the CPU slot pool, the copy backends (CPU and CUDA) and the worker half.

Needs the ``torch`` extra. Nothing in :mod:`kvfsm.control` imports this package.
"""

from __future__ import annotations

from kvfsm.control.worker import CopyBackend, OffloadingWorker
from kvfsm.data.backend import CopyStats, ThreadPoolCopyBackend, chunk_rows
from kvfsm.data.calibration import CalibrationTable
from kvfsm.data.cuda import CudaCopyBackend, EmulatedDevice
from kvfsm.data.layout import (
    KVCacheSpec,
    allocate_kv_caches,
    default_device,
    head_shard,
    same_device,
    shard_kv_caches,
    validate_kv_caches,
)
from kvfsm.data.plan import Registration
from kvfsm.data.pool import CPUSlotPool
from kvfsm.data.worker import BackendFactory, PoolFactory, default_backend, make_workers

__all__ = [
    "BackendFactory",
    "CPUSlotPool",
    "CalibrationTable",
    "CopyBackend",
    "CopyStats",
    "CudaCopyBackend",
    "EmulatedDevice",
    "KVCacheSpec",
    "OffloadingWorker",
    "PoolFactory",
    "Registration",
    "ThreadPoolCopyBackend",
    "allocate_kv_caches",
    "chunk_rows",
    "default_backend",
    "default_device",
    "head_shard",
    "make_workers",
    "same_device",
    "shard_kv_caches",
    "validate_kv_caches",
]
