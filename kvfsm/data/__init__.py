"""The data plane: KV-cache layout, the CPU slot pool, batched copy backends and the worker half.

Needs the ``torch`` extra. Nothing in :mod:`kvfsm.control` imports this package.
"""

from __future__ import annotations

from kvfsm.data.backend import CopyBackend, CopyStats, ThreadPoolCopyBackend, chunk_rows
from kvfsm.data.layout import (
    KVCacheSpec,
    allocate_kv_caches,
    default_device,
    head_shard,
    same_device,
    shard_kv_caches,
    validate_kv_caches,
)
from kvfsm.data.pool import CPUSlotPool
from kvfsm.data.worker import OffloadingWorker, PoolFactory, make_workers

__all__ = [
    "CPUSlotPool",
    "CopyBackend",
    "CopyStats",
    "KVCacheSpec",
    "OffloadingWorker",
    "PoolFactory",
    "ThreadPoolCopyBackend",
    "allocate_kv_caches",
    "chunk_rows",
    "default_device",
    "head_shard",
    "make_workers",
    "same_device",
    "shard_kv_caches",
    "validate_kv_caches",
]
