"""Configuration of the scheduler half, validated at construction."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kvfsm.errors import ConfigError
from kvfsm.validation import require_positive_int

__all__ = ["DrainMode", "OffloadConfig"]


class DrainMode(StrEnum):
    """How the engine finishes the last transfers once no request is left (spec/README.md, "the drain")."""

    #: has_pending_push_work() keeps the engine stepping; nothing blocks (vLLM #45595).
    NONBLOCKING = "nonblocking"
    #: The old behaviour (vLLM #42611): once no live request remains, flush every job with a blocking
    #: wait inside that step. Kept only as the benchmark baseline.
    BLOCKING = "blocking"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    """The connector's scheduler half: the geometry of what it offloads and how the engine drains.

    Validated at construction (``ConfigError`` naming the field and what was expected).
    """

    #: Tokens per GPU KV block (required, >= 1). vLLM: ``--block-size`` (``CacheConfig.block_size``).
    tokens_per_block: int
    #: GPU blocks per offloaded chunk, the unit of every lookup, store and load and one CPU slot
    #: (default 1, >= 1). vLLM: the offloading connector's ``kv_connector_extra_config["block_size"]``
    #: (in tokens) divided by ``--block-size``.
    blocks_per_chunk: int = 1
    #: Workers (tensor-parallel ranks) that copy every job; a job commits when all of them acked it
    #: (default 1, >= 1). vLLM: ``--tensor-parallel-size``.
    world_size: int = 1
    #: How the engine finishes the last transfers once no request is left (default non-blocking, as vLLM
    #: since #45595; ``BLOCKING`` is the pre-#45595 flush, kept as a benchmark baseline). vLLM: no flag.
    drain: DrainMode = DrainMode.NONBLOCKING
    #: True offloads only prompt tokens (as vLLM's offloading connector does); False (the default) also
    #: offloads generated tokens once they fill a chunk. vLLM: no such flag.
    offload_prompt_only: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "blocks_per_chunk", "world_size"):
            require_positive_int(name, getattr(self, name))
        if not isinstance(self.drain, DrainMode):
            raise ConfigError(f"drain must be one of {[m.value for m in DrainMode]}, got {self.drain!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk
