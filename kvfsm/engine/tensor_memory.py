"""The engine loop's KV memory over real torch tensors: the forward writes :func:`block_pattern` values,
a loaded block is verified byte for byte, layer by layer."""

from __future__ import annotations

import torch

from kvfsm.engine.kv_values import block_pattern

__all__ = ["TensorMemory"]


class TensorMemory:
    """The KVMemory of :class:`kvfsm.engine.loop.EngineLoop` over ``kv_caches`` (one tensor per layer,
    ``[num_blocks, ...block shape]``)."""

    __slots__ = ("dtype", "kv_caches")

    def __init__(self, kv_caches: list[torch.Tensor], dtype: torch.dtype) -> None:
        self.kv_caches = kv_caches
        self.dtype = dtype

    def expected_block(self, key: bytes, layer: int) -> torch.Tensor:
        """The value (on the CPU) the forward writes in ``layer`` for a block of content ``key``."""
        return block_pattern(key, layer, self.kv_caches[layer].shape[1:], self.dtype)

    def write(self, block_id: int, key: bytes) -> None:
        for layer, kv in enumerate(self.kv_caches):
            kv[block_id].copy_(self.expected_block(key, layer).to(kv.device))

    def verify(self, block_id: int, block_hash: bytes) -> tuple[int, int]:
        """(layers that hold the expected bytes, layers that do not)."""
        good = sum(
            1
            for layer, kv in enumerate(self.kv_caches)
            if torch.equal(kv[block_id].cpu(), self.expected_block(block_hash, layer))
        )
        return good, len(self.kv_caches) - good
