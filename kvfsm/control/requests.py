"""The one concrete request the scheduler half can read (its ``OffloadRequest`` protocol), torch-free.

:class:`TokenRequest` is a request's token ids (which only ever grow), their chained block hashes and the
counters the connector reads. The reference engine's :class:`~kvfsm.engine.requests.EngineRequest` extends
it with the engine's own bookkeeping; the model checker's replay and the tests use it as it is.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from typing_extensions import override

__all__ = ["TokenRequest", "chain_block_hashes"]


def _hash_block(parent: bytes, tokens: Sequence[int]) -> bytes:
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


class TokenRequest:
    """A request as the scheduler half reads it: token ids (appended to, never rewritten), the chained
    hash of every full block (computed as blocks fill), and the connector's counters."""

    __slots__ = (
        "_block_hashes",
        "is_aborted",
        "num_computed_tokens",
        "num_prompt_tokens",
        "req_id",
        "token_ids",
        "tokens_per_block",
    )

    def __init__(
        self,
        req_id: str,
        token_ids: Sequence[int],
        tokens_per_block: int,
        *,
        num_prompt_tokens: int | None = None,
        num_computed_tokens: int = 0,
    ) -> None:
        self.req_id = req_id
        self.token_ids = list(token_ids)
        self.tokens_per_block = tokens_per_block
        self.num_prompt_tokens = len(self.token_ids) if num_prompt_tokens is None else num_prompt_tokens
        self.num_computed_tokens = num_computed_tokens
        self.is_aborted = False
        self._block_hashes: list[bytes] = []

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        if len(self._block_hashes) < len(self.token_ids) // self.tokens_per_block:
            self._block_hashes = chain_block_hashes(self.token_ids, self.tokens_per_block, self._block_hashes)
        return self._block_hashes

    @override
    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.req_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens})"
