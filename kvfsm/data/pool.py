"""The CPU primary tier's memory: ``num_slots`` chunk slots, one tensor per layer.

Slot ``s`` of layer ``l`` is ``layers[l][s]``, of shape ``(blocks_per_chunk, *block_shape)``; sub-block
``b`` of slot ``s`` is row ``s * blocks_per_chunk + b`` of ``flat_layers[l]``, the
``(num_slots * blocks_per_chunk, *block_shape)`` view the copy backend gathers from and scatters into.
The tensors are pinned when CUDA is available, so host<->device copies can be asynchronous DMA; if pinning
fails the pool warns and falls back to pageable memory.
"""

from __future__ import annotations

import math
import warnings

import torch

from kvfsm.data.layout import is_int
from kvfsm.errors import ConfigError
from kvfsm.validation import require_positive_int

__all__ = ["CPUSlotPool"]


_positive = require_positive_int


class CPUSlotPool:
    """Host memory for the CPU primary tier of one worker (one tensor-parallel shard)."""

    __slots__ = (
        "block_shape",
        "blocks_per_chunk",
        "dtype",
        "flat_layers",
        "layers",
        "nbytes_per_slot",
        "num_layers",
        "num_slots",
        "pinned",
    )

    def __init__(
        self,
        num_slots: int,
        blocks_per_chunk: int,
        block_shape: tuple[int, ...],
        num_layers: int,
        dtype: torch.dtype,
        pin_memory: bool | None = None,
    ) -> None:
        self.num_slots = _positive("num_slots", num_slots)
        self.blocks_per_chunk = _positive("blocks_per_chunk", blocks_per_chunk)
        self.num_layers = _positive("num_layers", num_layers)
        shape = tuple(block_shape)
        if not shape:
            raise ConfigError("block_shape is empty; expected the shape of one KV block, e.g. (2, H, T, D)")
        for i, dim in enumerate(shape):
            _positive(f"block_shape[{i}]", dim)
        self.block_shape: tuple[int, ...] = shape
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        want_pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        full_shape = (self.num_slots, self.blocks_per_chunk, *shape)
        self.layers: list[torch.Tensor] = []
        self.pinned = False
        if want_pin:
            try:
                self.layers = [
                    torch.zeros(full_shape, dtype=dtype, device="cpu", pin_memory=True) for _ in range(self.num_layers)
                ]
                self.pinned = True
            except RuntimeError as exc:
                warnings.warn(
                    f"could not pin {self._total_bytes(full_shape)} bytes of CPU slot memory ({exc}); "
                    f"falling back to pageable memory, so host<->device copies will be synchronous",
                    RuntimeWarning,
                    stacklevel=2,
                )
                self.layers = []
        if not self.layers:
            self.layers = [torch.zeros(full_shape, dtype=dtype, device="cpu") for _ in range(self.num_layers)]
        rows = self.num_slots * self.blocks_per_chunk
        self.flat_layers: list[torch.Tensor] = [layer.view(rows, *shape) for layer in self.layers]
        self.nbytes_per_slot: int = sum(layer[0].numel() * layer.element_size() for layer in self.layers)

    def _total_bytes(self, full_shape: tuple[int, ...]) -> int:
        return math.prod(full_shape) * torch.empty((), dtype=self.dtype).element_size() * self.num_layers

    def __repr__(self) -> str:
        return (
            f"CPUSlotPool(num_slots={self.num_slots}, blocks_per_chunk={self.blocks_per_chunk}, "
            f"block_shape={self.block_shape}, num_layers={self.num_layers}, dtype={self.dtype}, "
            f"pinned={self.pinned})"
        )

    @property
    def nbytes(self) -> int:
        """Bytes of the whole pool over all layers."""
        return self.nbytes_per_slot * self.num_slots

    def _check_slot(self, slot_id: int) -> None:
        if not is_int(slot_id) or not 0 <= slot_id < self.num_slots:
            raise ConfigError(f"slot id {slot_id!r} is outside 0..{self.num_slots - 1}")

    def _slot_bytes_views(self, slot_id: int) -> list[torch.Tensor]:
        # A slot of one layer is contiguous, so it can be reinterpreted as raw bytes (bfloat16 included).
        return [layer[slot_id].reshape(-1).view(torch.uint8) for layer in self.layers]

    def read_slot(self, slot_id: int) -> bytes:
        """The raw bytes of slot ``slot_id``: layer 0's chunk, then layer 1's, and so on."""
        self._check_slot(slot_id)
        return bytes(torch.cat(self._slot_bytes_views(slot_id)).numpy().tobytes())

    def write_slot(self, slot_id: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite slot ``slot_id`` with bytes produced by :meth:`read_slot` (of a same-shaped pool)."""
        self._check_slot(slot_id)
        raw = bytes(data) if isinstance(data, memoryview) else data
        if len(raw) != self.nbytes_per_slot:
            raise ConfigError(f"slot data has {len(raw)} bytes; expected nbytes_per_slot={self.nbytes_per_slot}")
        src = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        offset = 0
        for dst in self._slot_bytes_views(slot_id):
            n = dst.numel()
            dst.copy_(src[offset : offset + n])
            offset += n
