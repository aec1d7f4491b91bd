"""What both copy backends share: KV-cache registration (validated once) and per-job address lists.

Registration (:class:`Registration`) checks the KV layers against the pool - shapes, dtypes, devices -
with typed :class:`~kvfsm.errors.ConfigError`, then prepares the views every copy indexes:

- the copy *width*: each row is reinterpreted as the widest integer-like dtype that divides every row, stride
  and address (16 bytes where possible), so index kernels move 16 bytes per element whatever the KV dtype
  (bit-exact: no arithmetic is done on the values);
- per layer, a ``(num_blocks, *inner)`` row view; when every block row is contiguous ``inner`` is one flat
  dim, otherwise (tensor-parallel head shards are views with gaps) it keeps the block's shape;
- the pool's ``(num_slots * num_layers * blocks_per_chunk, *inner)`` row view;
- layer groups of ``layers_per_group`` consecutive layers; a group whose layers are equally spaced views of one
  allocation (``allocate_kv_caches`` makes them so) also gets one *stacked* row view, so a whole group is
  gathered or scattered by one index kernel.

A job's address lists (:class:`JobPlan`) are built once, with numpy, when the job is launched: every GPU block
of the job and, per layer group, the pool row and stacked-view row of each (block, layer) pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError
from kvfsm.validation import is_int

__all__ = [
    "IndexArray",
    "JobPlan",
    "LayerGroup",
    "Registration",
    "check_job",
    "chunk_rows",
    "contiguous_start",
    "runs",
    "width_dtype",
]

IndexArray = npt.NDArray[np.int64]

_WIDTHS = (16, 8, 4, 2, 1)
_WIDTH_DTYPES = {16: torch.complex128, 8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def width_dtype(width: int) -> torch.dtype:
    """The dtype used to move ``width``-byte elements (a bit carrier: values are copied, never computed on)."""
    return _WIDTH_DTYPES[width]


def chunk_rows(gpu: GPUBlockSpec, slots: SlotSpec, blocks_per_chunk: int) -> list[int]:
    """The chunk row (``slot * blocks_per_chunk + sub_block``) of each of the job's blocks, in order."""
    off = gpu.first_block_offset
    return [
        slots.slot_ids[p // blocks_per_chunk] * blocks_per_chunk + p % blocks_per_chunk
        for p in range(off, off + len(gpu.block_ids))
    ]


def _all_ints(values: Sequence[object]) -> bool:
    types = set(map(type, values))  # C speed for the common case: every id a plain int
    return types <= {int} or all(is_int(v) for v in values)


def check_job(
    is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec, blocks_per_chunk: int, num_blocks: int, num_slots: int
) -> None:
    """Raise ConfigError if the job cannot be copied; never changes anything."""
    bpc = blocks_per_chunk
    block_ids = gpu.block_ids
    slot_ids = slots.slot_ids
    off = gpu.first_block_offset
    if not is_int(off) or not 0 <= off < bpc:
        raise ConfigError(f"first_block_offset={off!r}; expected an int in 0..{bpc - 1}")
    if not _all_ints(block_ids):
        raise ConfigError(f"GPU block ids {block_ids!r}; expected ints")
    if not _all_ints(slot_ids):
        raise ConfigError(f"slot ids {slot_ids!r}; expected ints")
    n = len(block_ids)
    expected_slots = (off + n + bpc - 1) // bpc if n else 0
    if len(slot_ids) != expected_slots:
        raise ConfigError(
            f"{len(slot_ids)} slots for {n} blocks at first_block_offset={off} with "
            f"blocks_per_chunk={bpc}; expected {expected_slots}"
        )
    if n == 0:
        return
    blocks = np.fromiter(block_ids, dtype=np.int64, count=n)
    if int(blocks.min()) < 0 or int(blocks.max()) >= num_blocks:
        raise ConfigError(f"GPU block ids {block_ids!r}; expected ids in 0..{num_blocks - 1}")
    slot_arr = np.fromiter(slot_ids, dtype=np.int64, count=len(slot_ids))
    if int(slot_arr.min()) < 0 or int(slot_arr.max()) >= num_slots:
        raise ConfigError(f"slot ids {slot_ids!r}; expected ids in 0..{num_slots - 1}")
    # A destination written twice in one scatter has an undefined result.
    if is_store and len(set(slot_ids)) != len(slot_ids):
        raise ConfigError(f"store slot ids {slot_ids!r}; expected distinct slots")
    if not is_store and len(set(block_ids)) != n:
        raise ConfigError(f"load GPU block ids {block_ids!r}; expected distinct blocks")


def contiguous_start(idx: IndexArray) -> int | None:
    """``idx[0]`` when ``idx`` is ``idx[0], idx[0] + 1, ...`` (so it can be a slice), else None."""
    n = idx.shape[0]
    if n == 0:
        return None
    first = int(idx[0])
    if n == 1 or (int(idx[-1]) - first == n - 1 and bool(np.all(np.diff(idx) == 1))):
        return first
    return None


def runs(src: IndexArray, dst: IndexArray) -> tuple[IndexArray, IndexArray, IndexArray]:
    """Coalesce row pairs into maximal runs contiguous on both sides: ``(src_starts, dst_starts, lengths)``.

    The pairs are taken in destination order, so a run is as long as both sides allow.
    """
    if src.shape[0] == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    order = np.argsort(dst, kind="stable")
    s = src[order]
    d = dst[order]
    brk = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate((np.zeros(1, dtype=np.int64), brk))
    ends = np.concatenate((brk, np.array([d.shape[0]], dtype=np.int64)))
    return s[starts], d[starts], (ends - starts).astype(np.int64)


def _max_width(t: torch.Tensor, flat: bool) -> int:
    """The widest element (bytes) that ``t``'s row view can be reinterpreted as (at least its own)."""
    elem = t.element_size()
    if flat:
        inner_bytes = int(t[0].numel()) * elem
        strides = [t.stride(0) * elem]
    else:
        if t.stride(-1) != 1:
            return elem
        inner_bytes = int(t.shape[-1]) * elem
        strides = [s * elem for s in t.stride()[:-1]]
    for w in _WIDTHS:
        if w <= elem:
            break
        if t.data_ptr() % w == 0 and inner_bytes % w == 0 and all(s % w == 0 for s in strides):
            return w
    return elem


def _row_view(t: torch.Tensor, width: int, flat: bool) -> torch.Tensor:
    """``t`` (rows on dim 0) as rows of ``width``-byte elements: ``(rows, row_bytes / width)`` when ``flat``."""
    if flat:
        t = torch.as_strided(t, (t.shape[0], int(t[0].numel())), (t.stride(0), 1), t.storage_offset())
    return t.view(width_dtype(width))


def _stack(views: Sequence[torch.Tensor]) -> tuple[torch.Tensor, int] | None:
    """One row view over equally spaced layer views of one allocation: row ``j * spacing + block``."""
    first = views[0]
    if len(views) == 1:
        return first, int(first.shape[0])
    storage = first.untyped_storage().data_ptr()
    for v in views[1:]:
        if v.untyped_storage().data_ptr() != storage or v.stride() != first.stride() or v.shape != first.shape:
            return None
    step = views[1].storage_offset() - first.storage_offset()
    row_stride = first.stride(0)
    if step <= 0 or row_stride <= 0 or step % row_stride:
        return None
    spacing = step // row_stride
    if spacing < first.shape[0]:
        return None
    if any(v.storage_offset() - first.storage_offset() != j * step for j, v in enumerate(views)):
        return None
    rows = (len(views) - 1) * spacing + int(first.shape[0])
    return torch.as_strided(first, (rows, *first.shape[1:]), first.stride(), first.storage_offset()), spacing


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Consecutive layers ``first_layer ..`` copied together."""

    first_layer: int
    layers: tuple[torch.Tensor, ...]  #: per layer, its row view
    stacked: torch.Tensor | None  #: one row view of all the group's layers (row ``j * spacing + block``), or None
    spacing: int  #: rows between layer j and j + 1 in ``stacked``

    @property
    def size(self) -> int:
        return len(self.layers)


class Registration:
    """A validated KV-cache shard and pool, with the row views and layer groups the copies index."""

    __slots__ = (
        "blocks_per_chunk",
        "device",
        "dtype",
        "flat",
        "groups",
        "kv_caches",
        "num_blocks",
        "pool",
        "pool_rows",
        "row_bytes",
        "row_shape",
        "width",
    )

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        pool: CPUSlotPool,
        blocks_per_chunk: int,
        layers_per_group: int | None = None,
    ) -> None:
        if len(kv_caches) == 0:
            raise ConfigError("kv_caches is empty; expected one tensor per layer")
        if not isinstance(pool, CPUSlotPool):
            raise ConfigError(f"pool is a {type(pool).__name__}; expected a CPUSlotPool")
        if len(kv_caches) != pool.num_layers:
            raise ConfigError(f"got {len(kv_caches)} KV-cache layers; the pool has {pool.num_layers} layers")
        if not is_int(blocks_per_chunk) or blocks_per_chunk != pool.blocks_per_chunk:
            raise ConfigError(f"blocks_per_chunk={blocks_per_chunk!r}; expected the pool's {pool.blocks_per_chunk}")
        num_layers = len(kv_caches)
        if layers_per_group is None:
            layers_per_group = num_layers
        if not is_int(layers_per_group) or layers_per_group < 1:
            raise ConfigError(f"layers_per_group must be a positive int or None, got {layers_per_group!r}")
        first = kv_caches[0]
        for i, layer in enumerate(kv_caches):
            if not isinstance(layer, torch.Tensor):
                raise ConfigError(f"layer {i} is a {type(layer).__name__}; expected a torch.Tensor")
            if layer.dim() < 2 or tuple(layer.shape[1:]) != pool.block_shape:
                raise ConfigError(
                    f"layer {i} has shape {tuple(layer.shape)}; expected (num_blocks, *{pool.block_shape}) "
                    f"to match the pool's block shape"
                )
            if layer.shape[0] != first.shape[0]:
                raise ConfigError(f"layer {i} has {layer.shape[0]} blocks; expected {first.shape[0]} like layer 0")
            if layer.shape[0] < 1:
                raise ConfigError(f"layer {i} has no blocks; expected num_blocks >= 1")
            if layer.dtype != pool.dtype:
                raise ConfigError(f"layer {i} has dtype {layer.dtype}; expected the pool's {pool.dtype}")
            if layer.device != first.device:
                raise ConfigError(f"layer {i} is on {layer.device}; expected {first.device} like layer 0")
            if layer.device.type not in ("cpu", "cuda"):
                raise ConfigError(f"layer {i} is on {layer.device}; expected a CPU or CUDA tensor")
            if any(s < 0 for s in layer.stride()) or layer.stride(0) == 0:
                raise ConfigError(f"layer {i} has strides {layer.stride()}; expected distinct, non-negative rows")
        self.kv_caches = list(kv_caches)
        self.pool = pool
        self.blocks_per_chunk = int(blocks_per_chunk)
        self.num_blocks = int(first.shape[0])
        self.device = first.device
        self.dtype = first.dtype
        self.row_bytes = pool.nbytes_per_block
        self.flat = all(layer[0].is_contiguous() for layer in self.kv_caches)
        self.width = min(_max_width(t, self.flat) for t in (*self.kv_caches, pool.rows))
        views = [_row_view(layer, self.width, self.flat) for layer in self.kv_caches]
        self.pool_rows = _row_view(pool.rows, self.width, self.flat)
        self.row_shape: tuple[int, ...] = tuple(self.pool_rows.shape[1:])
        groups: list[LayerGroup] = []
        for lo in range(0, num_layers, layers_per_group):
            members = views[lo : lo + layers_per_group]
            stacked = _stack(members)
            groups.append(
                LayerGroup(
                    lo,
                    tuple(members),
                    None if stacked is None else stacked[0],
                    int(first.shape[0]) if stacked is None else stacked[1],
                )
            )
        self.groups: tuple[LayerGroup, ...] = tuple(groups)

    @property
    def num_layers(self) -> int:
        return len(self.kv_caches)

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        check_job(is_store, gpu, slots, self.blocks_per_chunk, self.num_blocks, self.pool.num_slots)

    def plan(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> JobPlan:
        return JobPlan.build(self, is_store, gpu, slots)


@dataclass(frozen=True, slots=True)
class JobPlan:
    """A job's address lists, built once at launch.

    ``gpu_ids[i]`` is the job's i-th GPU block and ``slot_of[i]`` / ``sub[i]`` its slot and sub-block.
    ``pool_rows[g]`` and ``kv_rows[g]`` are ``(n, group size)`` arrays: for block i and the group's layer j,
    the row in the pool's row view and in the group's stacked row view.
    """

    is_store: bool
    gpu_ids: IndexArray
    slot_of: IndexArray
    sub: IndexArray
    slot_ids: IndexArray
    pool_rows: tuple[IndexArray, ...]
    kv_rows: tuple[IndexArray, ...]

    @property
    def num_blocks(self) -> int:
        return int(self.gpu_ids.shape[0])

    @staticmethod
    def build(reg: Registration, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> JobPlan:
        """Every address the copy needs. Bounds are checked here too (launch-time, before any copy starts), so
        an id that slipped past :meth:`Registration.check` fails the job instead of faulting a kernel."""
        bpc = reg.blocks_per_chunk
        gpu_ids = np.fromiter(gpu.block_ids, dtype=np.int64, count=len(gpu.block_ids))
        slot_ids = np.fromiter(slots.slot_ids, dtype=np.int64, count=len(slots.slot_ids))
        n = gpu_ids.shape[0]
        off = int(gpu.first_block_offset)
        pos = off + np.arange(n, dtype=np.int64)
        chunk = pos // bpc
        if n and (off < 0 or int(chunk[-1]) >= slot_ids.shape[0]):
            raise ConfigError(f"{slot_ids.shape[0]} slots cannot hold {n} blocks at first_block_offset={off}")
        if n and (int(gpu_ids.min()) < 0 or int(gpu_ids.max()) >= reg.num_blocks):
            raise ConfigError(f"GPU block ids {gpu.block_ids!r}; expected ids in 0..{reg.num_blocks - 1}")
        num_slots = reg.pool.num_slots
        if slot_ids.shape[0] and (int(slot_ids.min()) < 0 or int(slot_ids.max()) >= num_slots):
            raise ConfigError(f"slot ids {slots.slot_ids!r}; expected ids in 0..{num_slots - 1}")
        slot_of = slot_ids[chunk] if n else np.zeros(0, dtype=np.int64)
        sub = pos % bpc
        num_layers = reg.num_layers
        pool_rows: list[IndexArray] = []
        kv_rows: list[IndexArray] = []
        for group in reg.groups:
            j = np.arange(group.size, dtype=np.int64)[None, :]
            pool_rows.append((slot_of[:, None] * num_layers + group.first_layer + j) * bpc + sub[:, None])
            kv_rows.append(j * group.spacing + gpu_ids[:, None])
        return JobPlan(is_store, gpu_ids, slot_of, sub, slot_ids, tuple(pool_rows), tuple(kv_rows))
