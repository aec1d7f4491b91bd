"""The CPU primary tier's memory: ``num_slots`` chunk slots in one slot-major host buffer.

Layout: ``data`` has shape ``(num_slots, num_layers, blocks_per_chunk, *block_shape)`` and is contiguous, so

- one slot (every layer of one chunk) is one contiguous byte range: ``read_slot``/``write_slot`` and a
  secondary tier see layer 0's chunk, then layer 1's, and so on;
- the chunks of consecutive slots are adjacent, so a run of slots is one host<->device DMA;
- ``rows`` is the ``(num_slots * num_layers * blocks_per_chunk, *block_shape)`` view the copy backends index:
  sub-block ``b`` of layer ``l`` in slot ``s`` is row ``(s * num_layers + l) * blocks_per_chunk + b``
  (:meth:`row_index`).

``layers[l]`` is the ``(num_slots, blocks_per_chunk, *block_shape)`` view of layer ``l`` (strided across
slots, contiguous within one slot).

When CUDA is available the buffer is page-locked with ``cudaHostRegister`` in chunks of whole slots of at most
``pin_chunk_bytes`` (one registration of hundreds of GiB fails, vLLM #51080), so host<->device copies are
asynchronous DMA. If pinning fails, the registered chunks are rolled back and the pool warns and stays pageable
(copies stay correct but block the launching thread). :attr:`pinned_ranges` lists the registered slot ranges:
a DMA never crosses one of their boundaries.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref

import torch
from typing_extensions import override

from kvfsm.data.hostmem import host_buffer
from kvfsm.data.layout import is_int
from kvfsm.errors import ConfigError
from kvfsm.validation import require_positive_int

__all__ = ["DEFAULT_PIN_CHUNK_BYTES", "CPUSlotPool"]


_positive = require_positive_int

#: Largest single host registration (whole slots). vLLM registers in <= 64 GiB chunks; smaller ones cost nothing.
DEFAULT_PIN_CHUNK_BYTES = 1 << 30

_PAGE = 4096
# cudaHostRegisterPortable | cudaHostRegisterMapped: usable from every device, and mapped into the device
# address space (the zero-copy kernel path of the CUDA backend reads and writes it from the GPU).
_REGISTER_FLAGS = 0x01 | 0x02


def _cuda_register(ptr: int, nbytes: int) -> None:
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(ptr, nbytes, _REGISTER_FLAGS)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister({nbytes} bytes) failed with CUDA error {int(err)}")


def _cuda_unregister(ptrs: list[int]) -> None:
    if not ptrs:
        return
    try:
        cudart = torch.cuda.cudart()
        for ptr in ptrs:
            cudart.cudaHostUnregister(ptr)
    except Exception as exc:  # e.g. at interpreter exit, with the CUDA runtime already gone
        warnings.warn(f"could not unpin CPU slot memory: {exc!r}", RuntimeWarning, stacklevel=2)


def _release(ptrs: list[int], keep_alive: object) -> None:
    """Finalizer: unregister before the buffer (held alive by this closure until now) can be freed."""
    _cuda_unregister(ptrs)
    del keep_alive


class CPUSlotPool:
    """Host memory for the CPU primary tier of one worker (one tensor-parallel shard)."""

    __slots__ = (
        "__weakref__",
        "_buffer",
        "_finalizer",
        "_lock",
        "_registered",
        "block_shape",
        "blocks_per_chunk",
        "data",
        "dtype",
        "layers",
        "nbytes_per_slot",
        "num_layers",
        "num_slots",
        "pinned",
        "pinned_ranges",
        "rows",
    )

    def __init__(
        self,
        num_slots: int,
        blocks_per_chunk: int,
        block_shape: tuple[int, ...],
        num_layers: int,
        dtype: torch.dtype,
        pin_memory: bool | None = None,
        pin_chunk_bytes: int = DEFAULT_PIN_CHUNK_BYTES,
    ) -> None:
        self.num_slots = _positive("num_slots", num_slots)
        self.blocks_per_chunk = _positive("blocks_per_chunk", blocks_per_chunk)
        self.num_layers = _positive("num_layers", num_layers)
        _positive("pin_chunk_bytes", pin_chunk_bytes)
        shape = tuple(block_shape)
        if not shape:
            raise ConfigError("block_shape is empty; expected the shape of one KV block, e.g. (2, H, T, D)")
        for i, dim in enumerate(shape):
            _positive(f"block_shape[{i}]", dim)
        self.block_shape: tuple[int, ...] = shape
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"dtype must be a torch.dtype, got {dtype!r}")
        self.dtype = dtype
        elem = torch.empty((), dtype=dtype).element_size()
        full_shape = (self.num_slots, self.num_layers, self.blocks_per_chunk, *shape)
        self.nbytes_per_slot: int = math.prod(full_shape[1:]) * elem
        total = self.nbytes_per_slot * self.num_slots
        # Aligned (registration chunks that start on a page boundary never share a page) and on huge pages
        # where the OS allows (scattered block copies then miss the TLB far less).
        self._buffer = host_buffer(total)
        self.data: torch.Tensor = self._buffer.view(dtype).view(full_shape)
        self.data.zero_()
        rows = self.num_slots * self.num_layers * self.blocks_per_chunk
        self.rows: torch.Tensor = self.data.view(rows, *shape)
        self.layers: list[torch.Tensor] = [self.data[:, layer] for layer in range(self.num_layers)]
        self._lock = threading.Lock()
        self._registered: list[int] = []
        self.pinned = False
        self.pinned_ranges: tuple[tuple[int, int], ...] = ()
        want_pin = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        if want_pin:
            self._pin(pin_chunk_bytes)
        self._finalizer = weakref.finalize(self, _release, self._registered, self._buffer)

    # ------------------------------------------------------------------ pinning

    def _pin(self, pin_chunk_bytes: int) -> None:
        slot = self.nbytes_per_slot
        # Whole slots per chunk, and a multiple of the page size (so chunks start on page boundaries).
        align = _PAGE // math.gcd(slot, _PAGE)
        per_chunk = max(align, (pin_chunk_bytes // slot) // align * align)
        ranges: list[tuple[int, int]] = []
        base = self.data.data_ptr()
        try:
            if not torch.cuda.is_available():
                raise RuntimeError("CUDA is not available")
            for lo in range(0, self.num_slots, per_chunk):
                hi = min(self.num_slots, lo + per_chunk)
                _cuda_register(base + lo * slot, (hi - lo) * slot)
                self._registered.append(base + lo * slot)
                ranges.append((lo, hi))
        except RuntimeError as exc:
            _cuda_unregister(self._registered)
            self._registered.clear()
            warnings.warn(
                f"could not pin {self.nbytes} bytes of CPU slot memory ({exc}); falling back to pageable "
                f"memory, so host<->device copies will be synchronous",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        self.pinned = True
        self.pinned_ranges = tuple(ranges)

    def close(self) -> None:
        """Unpin the buffer (idempotent). The pool stays usable as pageable memory."""
        with self._lock:
            _cuda_unregister(self._registered)
            self._registered.clear()
            self.pinned = False
            self.pinned_ranges = ()

    # ------------------------------------------------------------------ addressing

    @override
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

    @property
    def nbytes_per_block(self) -> int:
        """Bytes of one block of one layer (one row of :attr:`rows`)."""
        return self.nbytes_per_slot // (self.num_layers * self.blocks_per_chunk)

    def row_index(self, slot_id: int, layer: int, sub_block: int) -> int:
        """The row of :attr:`rows` holding sub-block ``sub_block`` of layer ``layer`` in slot ``slot_id``."""
        return (slot_id * self.num_layers + layer) * self.blocks_per_chunk + sub_block

    def block(self, layer: int, chunk_row: int) -> torch.Tensor:
        """Layer ``layer``'s block at chunk row ``chunk_row`` (= ``slot * blocks_per_chunk + sub_block``)."""
        bpc = self.blocks_per_chunk
        return self.data[chunk_row // bpc, layer, chunk_row % bpc]

    @property
    def flat_layers(self) -> list[torch.Tensor]:
        """Per layer, its blocks by chunk row: ``(num_slots * blocks_per_chunk, *block_shape)``.

        Read-only use: with one layer these are views of the pool, with several they are snapshots (copies),
        because a layer's chunks are not adjacent in the slot-major buffer. Write through :attr:`data`,
        :attr:`layers`, :attr:`rows` or :meth:`block`.
        """
        return [layer.reshape(-1, *self.block_shape) for layer in self.layers]

    def _check_slot(self, slot_id: int) -> None:
        if not is_int(slot_id) or not 0 <= slot_id < self.num_slots:
            raise ConfigError(f"slot id {slot_id!r} is outside 0..{self.num_slots - 1}")

    def _slot_bytes(self, slot_id: int) -> torch.Tensor:
        return self.data[slot_id].reshape(-1).view(torch.uint8)

    def read_slot(self, slot_id: int) -> bytes:
        """The raw bytes of slot ``slot_id``: layer 0's chunk, then layer 1's, and so on."""
        self._check_slot(slot_id)
        return bytes(self._slot_bytes(slot_id).numpy().tobytes())

    def write_slot(self, slot_id: int, data: bytes | bytearray | memoryview) -> None:
        """Overwrite slot ``slot_id`` with bytes produced by :meth:`read_slot` (of a same-shaped pool)."""
        self._check_slot(slot_id)
        raw = bytes(data) if isinstance(data, memoryview) else data
        if len(raw) != self.nbytes_per_slot:
            raise ConfigError(f"slot data has {len(raw)} bytes; expected nbytes_per_slot={self.nbytes_per_slot}")
        self._slot_bytes(slot_id).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
