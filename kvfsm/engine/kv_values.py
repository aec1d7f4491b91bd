"""The stand-in forward pass: a deterministic KV value per (block content, layer)."""

from __future__ import annotations

import torch

__all__ = ["block_pattern"]


def block_pattern(key: bytes, layer: int, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The KV a forward pass writes for a block whose content hashes to ``key``, in ``layer``.

    Distinct keys and layers give distinct tensors, so a block loaded back can be checked byte for byte.
    Values stay small integers so that every float dtype represents them exactly.
    """
    seed = int.from_bytes(key[:8], "little") ^ (layer * 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF)
    n = 1
    for d in shape:
        n *= d
    base = torch.arange(n, dtype=torch.int64)
    mixed = (base * ((seed | 1) & 0xFFFF) + (seed >> 16)) % 251
    return (mixed - 125).to(dtype).reshape(shape)
