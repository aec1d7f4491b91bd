"""Requests of the reference engine: token ids, chained block hashes and a deterministic sampler."""

from __future__ import annotations

import hashlib
from enum import Enum

__all__ = ["EngineRequest", "RequestStatus", "chain_block_hashes"]


def _hash_block(parent: bytes, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=16)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.digest()


def chain_block_hashes(token_ids: list[int], tokens_per_block: int, prefix: list[bytes] | None = None) -> list[bytes]:
    """Hash every full block, each hash covering its whole prefix (as vLLM's prefix caching does)."""
    hashes = list(prefix or [])
    parent = hashes[-1] if hashes else b"kvfsm-root"
    for start in range(len(hashes) * tokens_per_block, len(token_ids) - tokens_per_block + 1, tokens_per_block):
        parent = _hash_block(parent, token_ids[start : start + tokens_per_block])
        hashes.append(parent)
    return hashes


class RequestStatus(Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class EngineRequest:
    """A generation request. Output tokens are a deterministic function of the sequence so far."""

    __slots__ = (
        "_block_hashes",
        "aborted",
        "arrival_step",
        "arrival_time",
        "block_ids",
        "first_scheduled_step",
        "first_scheduled_time",
        "max_tokens",
        "num_computed_tokens",
        "output_token_ids",
        "prompt_token_ids",
        "req_id",
        "status",
        "tokens_per_block",
        "vocab_size",
    )

    def __init__(
        self,
        req_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        tokens_per_block: int,
        vocab_size: int = 32000,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {req_id!r}: the prompt must have at least one token")
        if max_tokens < 1:
            raise ValueError(f"request {req_id!r}: max_tokens must be >= 1, got {max_tokens}")
        self.req_id = req_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.max_tokens = max_tokens
        self.tokens_per_block = tokens_per_block
        self.vocab_size = vocab_size
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.aborted = False
        self.block_ids: list[int] = []
        self.arrival_step = -1
        self.arrival_time = 0.0
        self.first_scheduled_time: float | None = None
        self.first_scheduled_step: int | None = None
        self._block_hashes: list[bytes] = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_aborted(self) -> bool:
        return self.aborted

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def block_hashes(self) -> list[bytes]:
        if len(self._block_hashes) < self.num_tokens // self.tokens_per_block:
            self._block_hashes = chain_block_hashes(self.all_token_ids, self.tokens_per_block, self._block_hashes)
        return self._block_hashes

    def sample_next(self) -> int:
        """A deterministic 'sampled' token: the same sequence always continues the same way."""
        seed = self.block_hashes[-1] if self.block_hashes else b""
        digest = hashlib.blake2b(seed + self.num_tokens.to_bytes(4, "little"), digest_size=4).digest()
        return int.from_bytes(digest, "little") % self.vocab_size

    def __repr__(self) -> str:
        return f"EngineRequest({self.req_id!r}, {self.status.value}, tokens={self.num_tokens})"
