"""The paged KV-cache layout the data plane copies, and its tensor-parallel sharding by heads.

Each layer holds one tensor of shape ``(num_blocks, 2, num_heads, tokens_per_block, head_dim)``: the GPU
block id is the index on dim 0, so a block of every layer is one contiguous row and a batch of blocks is a
single ``index_select`` / ``index_copy_`` on dim 0. Dim 1 holds K and V. Tensor parallelism splits dim 2
(heads): rank ``r`` of ``W`` owns heads ``r*H/W .. (r+1)*H/W - 1`` of every block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch

from kvfsm.data.hostmem import host_buffer
from kvfsm.errors import ConfigError
from kvfsm.validation import is_int, require_positive_int

__all__ = [
    "KVCacheSpec",
    "allocate_kv_caches",
    "default_device",
    "head_shard",
    "is_int",
    "same_device",
    "shard_kv_caches",
    "validate_kv_caches",
]


def default_device() -> torch.device:
    """CUDA when a GPU is visible, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def same_device(actual: torch.device, expected: torch.device) -> bool:
    """True when ``actual`` is ``expected``; an index-less ``expected`` (``cuda``) matches any index."""
    index = cast("int | None", expected.index)  # the stubs say int; an index-less device has None
    return actual.type == expected.type and (index is None or actual.index == index)


_check_positive = require_positive_int


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape, dtype and device of a paged KV cache with ``num_layers`` layers."""

    num_layers: int
    num_blocks: int
    num_heads: int
    tokens_per_block: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    device: torch.device | str = field(default_factory=default_device)

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "num_heads", "tokens_per_block", "head_dim"):
            _check_positive(name, getattr(self, name))
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {self.dtype!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ConfigError(
                f"device must be a torch.device or a device string such as 'cpu' or 'cuda:0', got {self.device!r}"
            ) from exc

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block of one layer: ``(2, num_heads, tokens_per_block, head_dim)``."""
        return (2, self.num_heads, self.tokens_per_block, self.head_dim)

    @property
    def layer_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one layer's tensor: ``(num_blocks, 2, num_heads, tokens_per_block, head_dim)``."""
        return (self.num_blocks, *self.block_shape)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * self.num_heads * self.tokens_per_block * self.head_dim * elem


def allocate_kv_caches(spec: KVCacheSpec) -> list[torch.Tensor]:
    """One zero-filled tensor per layer, each of shape ``spec.layer_shape``.

    The layers are views of one allocation, equally spaced, so the copy backends can gather or scatter a block
    of every layer with one index kernel (see :mod:`kvfsm.data.plan`); each is still its own tensor.
    """
    shape = (spec.num_layers, *spec.layer_shape)
    if spec.torch_device.type == "cpu":
        # Host-resident caches (the CPU engine): aligned and on huge pages, like the slot pool.
        elem = torch.empty((), dtype=spec.dtype).element_size()
        stacked = host_buffer(math.prod(shape) * elem).view(spec.dtype).view(shape)
        stacked.zero_()
    else:
        stacked = torch.zeros(shape, dtype=spec.dtype, device=spec.torch_device)
    return list(stacked.unbind(0))


def head_shard(num_heads: int, world_size: int, rank: int) -> slice:
    """The heads rank ``rank`` of ``world_size`` owns: an equal, contiguous share of ``num_heads``."""
    _check_positive("num_heads", num_heads)
    _check_positive("world_size", world_size)
    if not is_int(rank) or not 0 <= rank < world_size:
        raise ConfigError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
    if num_heads % world_size:
        raise ConfigError(
            f"num_heads={num_heads} is not divisible by world_size={world_size}; "
            f"expected a world size that divides the head count"
        )
    per_rank = num_heads // world_size
    return slice(rank * per_rank, (rank + 1) * per_rank)


def shard_kv_caches(kv_caches: list[torch.Tensor], world_size: int, rank: int) -> list[torch.Tensor]:
    """Views of ``kv_caches`` holding only rank ``rank``'s heads (dim 2); they share storage."""
    if not kv_caches:
        raise ConfigError("kv_caches is empty; expected one tensor per layer")
    shards: list[torch.Tensor] = []
    for i, layer in enumerate(kv_caches):
        if layer.dim() != 5:
            raise ConfigError(
                f"layer {i} has shape {tuple(layer.shape)}; expected 5 dims "
                f"(num_blocks, 2, num_heads, tokens_per_block, head_dim)"
            )
        shards.append(layer[:, :, head_shard(layer.shape[2], world_size, rank)])
    return shards


def validate_kv_caches(kv_caches: list[torch.Tensor], spec: KVCacheSpec) -> None:
    """Raise ConfigError unless ``kv_caches`` has ``spec``'s layer count, shape, dtype and device."""
    if len(kv_caches) != spec.num_layers:
        raise ConfigError(f"got {len(kv_caches)} KV-cache layers; expected num_layers={spec.num_layers}")
    expected_device = spec.torch_device
    for i, layer in enumerate(kv_caches):
        if not isinstance(layer, torch.Tensor):
            raise ConfigError(f"layer {i} is a {type(layer).__name__}; expected a torch.Tensor")
        if tuple(layer.shape) != spec.layer_shape:
            raise ConfigError(
                f"layer {i} has shape {tuple(layer.shape)}; expected {spec.layer_shape} "
                f"(num_blocks, 2, num_heads, tokens_per_block, head_dim)"
            )
        if layer.dtype != spec.dtype:
            raise ConfigError(f"layer {i} has dtype {layer.dtype}; expected {spec.dtype}")
        if not same_device(layer.device, expected_device):
            raise ConfigError(f"layer {i} is on device {layer.device}; expected {expected_device}")
