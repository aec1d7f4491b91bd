"""The reference engine: the engine loop (:class:`kvfsm.engine.loop.EngineLoop`) over real KV tensors,
real CPU slot pools and real copy backends. Needs the ``torch`` extra.

Wiring: ``ReferenceEngine(config, tiers=[...], backend_factory=...)`` puts secondary tiers (for example a
:class:`~kvfsm.tiers.fs.FileSystemTier`) behind the CPU primary and builds each rank's copy backend with
``backend_factory``; the engine binds every tier's ``slot_io`` to its own CPU pools (all ranks' shards of a
slot, as :class:`~kvfsm.tiers.slotio.CompositeSlotIO` lays them out), which only exist once the engine
has built them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from kvfsm.control.config import DrainMode, OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Clock, Deadlines
from kvfsm.control.manager import OffloadingManager, SecondaryTier
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.tiering import BackpressureConfig, TieringManager
from kvfsm.control.worker import OffloadingWorker
from kvfsm.data.layout import KVCacheSpec, allocate_kv_caches
from kvfsm.data.pool import CPUSlotPool
from kvfsm.data.worker import BackendFactory, default_backend, make_workers
from kvfsm.engine.loop import EngineLoop, IntegrityStats, PollMode, StepRecord
from kvfsm.engine.tensor_memory import TensorMemory
from kvfsm.errors import ConfigError
from kvfsm.validation import require_positive_int

__all__ = [
    "BackendFactory",
    "EngineConfig",
    "IntegrityStats",
    "PollMode",
    "PoolsSlotIO",
    "ReferenceEngine",
    "StepRecord",
]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The reference engine's geometry and behaviour, validated at construction (``ConfigError``).

    Sizes count blocks of ``tokens_per_block`` tokens; a CPU slot holds one chunk of ``blocks_per_chunk``
    blocks. Every field has a default, so ``EngineConfig()`` is a small working engine.
    """

    #: Transformer layers, each with its own KV cache tensor. Default 2. vLLM: the model's
    #: ``num_hidden_layers``.
    num_layers: int = 2
    #: KV heads over all ranks (each of the ``world_size`` ranks holds ``num_heads / world_size``). Default 4.
    #: vLLM: the model's ``num_key_value_heads``.
    num_heads: int = 4
    #: Elements per head. Default 8. vLLM: the model's ``head_dim``.
    head_dim: int = 8
    #: Tokens per GPU KV block. Default 16. vLLM: ``--block-size`` (``CacheConfig.block_size``).
    tokens_per_block: int = 16
    #: GPU blocks per offloaded chunk (one CPU slot, one store or load unit). Default 1. vLLM: the
    #: OffloadingConnector's ``kv_connector_extra_config["block_size"]`` divided by ``--block-size``.
    blocks_per_chunk: int = 1
    #: Blocks in the GPU KV cache. Default 64. vLLM: ``--num-gpu-blocks-override`` (else profiled).
    num_gpu_blocks: int = 64
    #: CPU slots (chunks) in each rank's pinned pool and in the CPU primary tier. Default 64. vLLM: the
    #: OffloadingConnector's ``kv_connector_extra_config["num_cpu_blocks"]`` (in chunks), or its
    #: ``cpu_bytes_to_use`` divided by the bytes of a chunk.
    num_cpu_slots: int = 64
    #: Tensor-parallel ranks, one worker (and one pool shard) each. Default 1. vLLM:
    #: ``--tensor-parallel-size``.
    world_size: int = 1
    #: Element type of the KV cache and of the CPU pools. Default ``torch.float16``. vLLM: ``--dtype`` (or
    #: ``--kv-cache-dtype`` when set).
    dtype: torch.dtype = torch.float16
    #: Token budget of one step (prefill chunks plus decodes). Default 512. vLLM:
    #: ``--max-num-batched-tokens``.
    max_num_batched_tokens: int = 512
    #: How a request's last stores drain: ``NONBLOCKING`` (default) keeps stepping while they finish, as vLLM
    #: does since #45595; ``BLOCKING`` is the old flush-and-wait baseline (#42611). No vLLM option.
    drain: DrainMode = DrainMode.NONBLOCKING
    #: Eviction policy of the CPU primary: ``"lru"`` (default, what vLLM's CPU offloading uses) or ``"arc"``.
    policy: str = "lru"
    #: True: offload only prompt tokens, as vLLM does; False (default): generated tokens too.
    offload_prompt_only: bool = False
    #: Copy threads per rank of the thread-pool copy backend (CPU KV caches only). Default 2. No vLLM option.
    copy_threads: int = 2
    #: ``"cuda"``, ``"cpu"`` or another torch device for the KV cache; None (default): CUDA when available.
    #: vLLM: ``--device``.
    device: str | None = None
    #: Also run every machine transition through the ``transitions`` library (slow; a cross-check).
    #: None (default): the ``KVFSM_CHECKED`` environment variable decides. No vLLM option.
    checked: bool | None = None
    #: How a step that only polls transfers ends: ``PollMode.WAIT`` (default) waits on the engine's
    #: readiness signal for at most 50 us to 1 ms (growing while nothing happens; a new request ends it at
    #: once); ``PollMode.BUSY`` returns at once (busy polling, the measured baseline). A string
    #: (``"wait"``, ``"busy"``) is accepted. No vLLM option (vLLM's engine core polls its queues).
    poll: PollMode = PollMode.WAIT

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_heads",
            "head_dim",
            "tokens_per_block",
            "blocks_per_chunk",
            "num_gpu_blocks",
            "num_cpu_slots",
            "world_size",
            "max_num_batched_tokens",
            "copy_threads",
        ):
            require_positive_int(name, getattr(self, name))
        if self.num_heads % self.world_size:
            raise ConfigError(
                f"num_heads={self.num_heads} is not divisible by world_size={self.world_size}; "
                "each worker holds an equal share of the heads"
            )
        if self.num_gpu_blocks < self.blocks_per_chunk:
            raise ConfigError(
                f"num_gpu_blocks={self.num_gpu_blocks} cannot hold one chunk of {self.blocks_per_chunk} blocks"
            )
        poll: object = self.poll
        if not isinstance(poll, PollMode):
            try:
                poll = PollMode(poll)
            except ValueError:
                raise ConfigError(f"poll={self.poll!r}; expected one of {[m.value for m in PollMode]}") from None
            object.__setattr__(self, "poll", poll)


class _SlotIO(Protocol):
    def read_slot(self, slot_id: int) -> bytes: ...

    def write_slot(self, slot_id: int, data: bytes) -> None: ...


@runtime_checkable
class _SlotBoundTier(Protocol):
    """A tier that moves slot bytes through a ``slot_io`` attribute the engine can bind (the tiers'
    ``SlotIO`` protocol, :mod:`kvfsm.tiers.slotio`; the engine layer does not import the tiers)."""

    slot_io: _SlotIO | None


class PoolsSlotIO:
    """The slots of W ranks' pools as one tier-facing slot: rank 0's shard of slot ``s``, then rank 1's..."""

    __slots__ = ("_sizes", "pools")

    def __init__(self, pools: Sequence[CPUSlotPool]) -> None:
        if not pools:
            raise ConfigError("PoolsSlotIO needs at least one rank's pool; got none")
        self.pools = tuple(pools)
        self._sizes = tuple(p.nbytes_per_slot for p in self.pools)

    @property
    def nbytes_per_slot(self) -> int:
        return sum(self._sizes)

    def read_slot(self, slot_id: int) -> bytes:
        return b"".join(pool.read_slot(slot_id) for pool in self.pools)

    def write_slot(self, slot_id: int, data: bytes) -> None:
        if len(data) != self.nbytes_per_slot:
            raise ConfigError(
                f"slot data has {len(data)} bytes; expected {self.nbytes_per_slot} "
                f"(the shards of {len(self.pools)} ranks)"
            )
        view = memoryview(data)
        offset = 0
        for pool, n in zip(self.pools, self._sizes, strict=True):
            pool.write_slot(slot_id, view[offset : offset + n])
            offset += n


def _primary_slots(manager: OffloadingManager) -> int | None:
    primary = manager.primary
    return None if primary is None else primary.num_slots


def _pools_of(workers: Sequence[OffloadingWorker]) -> list[CPUSlotPool]:
    """The CPU slot pools that given workers' backends expose as ``pool`` (the kvfsm backends do; the
    ``CopyBackend`` protocol does not require it), in rank order; ranks without one are left out."""
    pools: list[CPUSlotPool] = []
    for w in workers:
        pool = getattr(w.backend, "pool", None)
        if isinstance(pool, CPUSlotPool):
            pools.append(pool)
    return pools


def _check_workers(cfg: EngineConfig, workers: Sequence[OffloadingWorker], manager_slots: int | None) -> None:
    """The geometry of given workers against the config and the manager; raises before anything is built."""
    if len(workers) != cfg.world_size:
        raise ConfigError(f"got {len(workers)} workers; expected world_size={cfg.world_size}")
    for i, w in enumerate(workers):
        if w.rank != i or w.world_size != cfg.world_size:
            raise ConfigError(
                f"worker {i} has rank={w.rank}, world_size={w.world_size}; "
                f"expected rank={i}, world_size={cfg.world_size}"
            )
        pool = getattr(w.backend, "pool", None)
        if not isinstance(pool, CPUSlotPool):
            continue  # a backend without a CPU slot pool of ours: nothing to compare
        if manager_slots is not None and pool.num_slots < manager_slots:
            raise ConfigError(
                f"rank {i}'s CPU pool has {pool.num_slots} slots but the manager's CPU primary has "
                f"{manager_slots}; expected a pool of at least {manager_slots} slots"
            )
        if pool.blocks_per_chunk != cfg.blocks_per_chunk:
            raise ConfigError(
                f"rank {i}'s CPU pool holds {pool.blocks_per_chunk} blocks per slot; "
                f"expected blocks_per_chunk={cfg.blocks_per_chunk}"
            )


class ReferenceEngine(EngineLoop):
    """A small vLLM-like engine over real KV tensors, the connector's scheduler half and W workers.

    Parts, all optional (keyword arguments):

    - ``tiers``: secondary tiers behind the CPU primary, fastest first (a
      :class:`~kvfsm.control.tiering.TieringManager` over them is built, with ``backpressure``). A tier with
      a ``slot_io`` of None gets the engine's CPU pools as its slot I/O.
    - ``backend_factory``: builds each rank's copy backend, ``(kv shard, pool, blocks_per_chunk,
      copy_threads)`` (default :func:`~kvfsm.data.worker.default_backend`).
    - ``manager``: a manager of your own instead (not with ``tiers``); its CPU primary may not have more
      slots than the engine's pools (``num_cpu_slots``).
    - ``workers``: W workers of your own instead (not with ``backend_factory``), checked against the config
      and the manager (rank order, world size, and the slots and chunk size of the CPU pool each backend
      exposes as ``pool``, if any; tiers need every rank's).
    - ``deadlines`` and ``clock`` go to the connector's scheduler half and the tiering manager (see
      :mod:`kvfsm.control.deadlines`).

    Every check runs before the KV caches are allocated: a ``ConfigError`` leaves nothing built.
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        manager: OffloadingManager | None = None,
        workers: list[OffloadingWorker] | None = None,
        deadlines: Deadlines | None = None,
        clock: Clock | None = None,
        tiers: Sequence[SecondaryTier] = (),
        backend_factory: BackendFactory | None = None,
        backpressure: BackpressureConfig | None = None,
    ) -> None:
        self.config = cfg = config or EngineConfig()
        tiers = list(tiers)
        if tiers and manager is not None:
            raise ConfigError("got both tiers and a manager; expected one: the engine builds the manager for tiers")
        if backpressure is not None and not tiers:
            raise ConfigError("got backpressure without tiers; expected tiers for it to act on")
        if workers is not None and backend_factory is not None:
            raise ConfigError("got both workers and a backend_factory; expected one of them")
        if len({id(t) for t in tiers}) != len(tiers):
            raise ConfigError("the same tier object is given twice; expected distinct tiers")
        for i, tier in enumerate(tiers):
            if not isinstance(tier, SecondaryTier):
                raise ConfigError(f"tiers[{i}] is a {type(tier).__name__}; expected a SecondaryTier")
        # The CPU primary's slot count: the given manager's, or the one the engine builds (num_cpu_slots).
        manager_slots = cfg.num_cpu_slots if manager is None else _primary_slots(manager)
        if workers is None:
            if manager_slots is not None and manager_slots > cfg.num_cpu_slots:
                raise ConfigError(
                    f"the manager's CPU primary has {manager_slots} slots but the engine's CPU pools have "
                    f"num_cpu_slots={cfg.num_cpu_slots}; expected at most {cfg.num_cpu_slots} slots"
                )
        else:
            _check_workers(cfg, workers, manager_slots)

        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.kv_spec = KVCacheSpec(
            cfg.num_layers,
            cfg.num_gpu_blocks,
            cfg.num_heads,
            cfg.tokens_per_block,
            cfg.head_dim,
            cfg.dtype,
            device,
        )
        self.kv_caches = allocate_kv_caches(self.kv_spec)
        self.tensor_memory = TensorMemory(self.kv_caches, self.kv_spec.dtype)
        pools: list[CPUSlotPool] = []

        def pool_factory(*args: Any) -> CPUSlotPool:
            pools.append(CPUSlotPool(*args))
            return pools[-1]

        if workers is None:
            workers = make_workers(
                self.kv_caches,
                pool_factory,
                cfg.world_size,
                cfg.blocks_per_chunk,
                cfg.num_cpu_slots,
                cfg.copy_threads,
                backend_factory or default_backend,
            )
        else:
            pools = _pools_of(workers)
        #: Each rank's CPU slot pool (rank order); for given workers, those their backends expose as ``pool``.
        self.pools: tuple[CPUSlotPool, ...] = tuple(pools)
        #: The secondary tiers the engine wired (empty with a manager of your own).
        self.tiers: tuple[SecondaryTier, ...] = tuple(tiers)
        if manager is None:
            primary = CPUOffloadingManager(cfg.num_cpu_slots, cfg.policy, checked=cfg.checked)
            if tiers:
                self._bind_slot_io(tiers, self.pools, len(workers))
                manager = TieringManager(
                    primary, tiers, checked=cfg.checked, deadlines=deadlines, clock=clock, backpressure=backpressure
                )
            else:
                manager = primary
        offload = OffloadConfig(
            cfg.tokens_per_block, cfg.blocks_per_chunk, cfg.world_size, cfg.drain, cfg.offload_prompt_only
        )
        scheduler = OffloadingScheduler(offload, manager, checked=cfg.checked, deadlines=deadlines, clock=clock)
        super().__init__(cfg, memory=self.tensor_memory, scheduler=scheduler, workers=workers, poll=cfg.poll)

    @staticmethod
    def _bind_slot_io(tiers: Sequence[SecondaryTier], pools: Sequence[CPUSlotPool], world_size: int) -> None:
        """Give every tier without a ``slot_io`` the slots of all ranks' pools (rank 0's shard first)."""
        unbound = [t for t in tiers if isinstance(t, _SlotBoundTier) and t.slot_io is None]
        if not unbound:
            return
        if len(pools) != world_size:
            raise ConfigError(
                f"found the CPU slot pools of {len(pools)} of {world_size} ranks; expected every given worker's "
                "backend to expose its pool (a `pool` attribute holding a CPUSlotPool) so tiers can move slots"
            )
        io = PoolsSlotIO(pools)
        for tier in unbound:
            tier.slot_io = io

    def expected_block(self, key: bytes, layer: int) -> torch.Tensor:
        """The value (on the CPU) the forward writes in ``layer`` for a block of content ``key``."""
        return self.tensor_memory.expected_block(key, layer)
