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
    tokens_per_block: int
    blocks_per_chunk: int = 1
    world_size: int = 1
    drain: DrainMode = DrainMode.NONBLOCKING
    #: Offload only prompt tokens (vLLM's default); False also offloads generated tokens.
    offload_prompt_only: bool = False

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "blocks_per_chunk", "world_size"):
            require_positive_int(name, getattr(self, name))
        if not isinstance(self.drain, DrainMode):
            raise ConfigError(f"drain must be one of {[m.value for m in DrainMode]}, got {self.drain!r}")

    @property
    def tokens_per_chunk(self) -> int:
        return self.tokens_per_block * self.blocks_per_chunk
