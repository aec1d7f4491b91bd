"""Records shared by the control plane, the worker and the engine (vLLM's vocabulary)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from typing import NewType, cast

__all__ = [
    "GPUBlockSpec",
    "LookupResult",
    "OffloadKey",
    "OffloadingEvent",
    "PrepareStoreOutput",
    "ReqContext",
    "SlotSpec",
    "make_offload_key",
    "make_offload_keys",
]

#: A chunk's identity in every tier: the block hash of its last hash-block plus the group index.
OffloadKey = NewType("OffloadKey", bytes)


def make_offload_key(block_hash: bytes, group_idx: int = 0) -> OffloadKey:
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big"))


def make_offload_keys(block_hashes: Iterable[bytes], group_idx: int = 0) -> list[OffloadKey]:
    """:func:`make_offload_key` of each hash, in order: the group's suffix made once (a request's keys, every
    lookup and store plan)."""
    suffix = group_idx.to_bytes(4, "big")
    # cast, not OffloadKey() per key: NewType's call is a Python call each, and the bytes are the key.
    return cast("list[OffloadKey]", [h + suffix for h in block_hashes])


class LookupResult(Enum):
    """What a tier answers for one key (vLLM's lookup outcome, plus HIT_PENDING and RETRY)."""

    MISS = "miss"  #: not offloaded
    HIT = "hit"  #: offloaded and readable
    HIT_PENDING = "hit_pending"  #: present, but its store (or promotion) is still in flight
    RETRY = "retry"  #: location not known yet (async lookup or promotion under way): ask again


@dataclass(frozen=True, slots=True)
class ReqContext:
    req_id: str


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """CPU primary slots, one per chunk, in key order."""

    slot_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class GPUBlockSpec:
    """GPU blocks of one job, in logical order.

    ``first_block_offset`` is the logical index of ``block_ids[0]`` inside its chunk: a load may start
    part-way into a chunk (its first chunk's leading sub-blocks are skipped); stores always start at 0.
    """

    block_ids: tuple[int, ...]
    first_block_offset: int = 0


@dataclass(frozen=True, slots=True)
class PrepareStoreOutput:
    keys_to_store: tuple[OffloadKey, ...]
    store_spec: SlotSpec
    evicted_keys: tuple[OffloadKey, ...]


@dataclass(frozen=True, slots=True)
class OffloadingEvent:
    keys: tuple[OffloadKey, ...]
    medium: str
    removed: bool
    #: A removal that only releases bookkeeping (a failed store's keys, never announced as stored).
    metadata_only: bool = False
