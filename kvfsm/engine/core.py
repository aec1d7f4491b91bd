"""The reference engine: the engine loop (:class:`kvfsm.engine.loop.EngineLoop`) over real KV tensors,
real CPU slot pools and real copy backends. Needs the ``torch`` extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvfsm.control.config import DrainMode, OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Clock, Deadlines
from kvfsm.control.manager import OffloadingManager
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.data.layout import KVCacheSpec, allocate_kv_caches
from kvfsm.data.pool import CPUSlotPool
from kvfsm.data.worker import OffloadingWorker, make_workers
from kvfsm.engine.loop import EngineLoop, IntegrityStats, StepRecord
from kvfsm.engine.tensor_memory import TensorMemory
from kvfsm.errors import ConfigError
from kvfsm.validation import require_positive_int

__all__ = ["EngineConfig", "IntegrityStats", "ReferenceEngine", "StepRecord"]


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 8
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 64
    num_cpu_slots: int = 64
    world_size: int = 1
    dtype: torch.dtype = torch.float16
    max_num_batched_tokens: int = 512
    drain: DrainMode = DrainMode.NONBLOCKING
    policy: str = "lru"
    offload_prompt_only: bool = False
    copy_threads: int = 2
    device: str | None = None
    checked: bool | None = None

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


class ReferenceEngine(EngineLoop):
    """A small vLLM-like engine over real KV tensors, the connector's scheduler half and W workers."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        manager: OffloadingManager | None = None,
        workers: list[OffloadingWorker] | None = None,
        deadlines: Deadlines | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``deadlines`` and ``clock`` go to the connector's scheduler half (see kvfsm.control.deadlines)."""
        self.config = cfg = config or EngineConfig()
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
        if manager is None:
            manager = CPUOffloadingManager(cfg.num_cpu_slots, cfg.policy, checked=cfg.checked)
        offload = OffloadConfig(
            cfg.tokens_per_block, cfg.blocks_per_chunk, cfg.world_size, cfg.drain, cfg.offload_prompt_only
        )
        scheduler = OffloadingScheduler(offload, manager, checked=cfg.checked, deadlines=deadlines, clock=clock)
        if workers is None:
            workers = make_workers(
                self.kv_caches,
                CPUSlotPool,
                cfg.world_size,
                cfg.blocks_per_chunk,
                cfg.num_cpu_slots,
                cfg.copy_threads,
            )
        if len(workers) != cfg.world_size:
            raise ConfigError(f"got {len(workers)} workers; expected world_size={cfg.world_size}")
        super().__init__(
            cfg,
            memory=self.tensor_memory,
            scheduler=scheduler,
            workers=workers,
        )

    def expected_block(self, key: bytes, layer: int) -> torch.Tensor:
        """The value (on the CPU) the forward writes in ``layer`` for a block of content ``key``."""
        return self.tensor_memory.expected_block(key, layer)
