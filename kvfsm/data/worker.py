"""The worker half's torch factories: one :class:`OffloadingWorker` per rank over a torch copy backend.

The launch protocol itself is sans IO, in :mod:`kvfsm.control.worker` (re-exported here): this module only
builds each rank's CPU slot pool and copy backend (:class:`~kvfsm.data.cuda.CudaCopyBackend` for CUDA
caches, else :class:`~kvfsm.data.backend.ThreadPoolCopyBackend`) over its head shard of the KV caches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvfsm.control.worker import CopyBackend, OffloadingWorker
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.cuda import CudaCopyBackend
from kvfsm.data.layout import shard_kv_caches
from kvfsm.data.pool import CPUSlotPool

__all__ = ["BackendFactory", "PoolFactory", "default_backend", "make_workers"]

#: Builds one rank's pool: ``(num_slots, blocks_per_chunk, block_shape, num_layers, dtype)``;
#: :class:`CPUSlotPool` itself is one.
PoolFactory = Callable[[int, int, tuple[int, ...], int, torch.dtype], CPUSlotPool]

#: Builds one rank's copy backend: ``(kv shard, pool, blocks_per_chunk, max_workers)``.
BackendFactory = Callable[[list[torch.Tensor], CPUSlotPool, int, int], CopyBackend]


def default_backend(
    shard: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int, max_workers: int
) -> CopyBackend:
    """:class:`CudaCopyBackend` for CUDA caches, else :class:`ThreadPoolCopyBackend`."""
    if shard and shard[0].device.type == "cuda":
        return CudaCopyBackend(shard, pool, blocks_per_chunk)
    return ThreadPoolCopyBackend(shard, pool, blocks_per_chunk, max_workers=max_workers)


def make_workers(
    kv_caches: list[torch.Tensor],
    pool_factory: PoolFactory,
    world_size: int,
    blocks_per_chunk: int,
    num_slots: int,
    max_workers: int = 2,
    backend_factory: BackendFactory = default_backend,
) -> list[OffloadingWorker]:
    """One worker per rank: its head shard of ``kv_caches``, its own pool shard and copy backend."""
    workers: list[OffloadingWorker] = []
    for rank in range(world_size):
        shard = shard_kv_caches(kv_caches, world_size, rank)
        block_shape = tuple(int(d) for d in shard[0].shape[1:])
        pool = pool_factory(num_slots, blocks_per_chunk, block_shape, len(shard), shard[0].dtype)
        backend = backend_factory(shard, pool, blocks_per_chunk, max_workers)
        workers.append(OffloadingWorker(rank, world_size, backend))
    return workers
