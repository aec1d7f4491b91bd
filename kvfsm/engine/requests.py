"""Requests of the reference engine: token ids, chained block hashes and a deterministic sampler."""

from __future__ import annotations

import hashlib
from enum import Enum

from typing_extensions import override

from kvfsm.control.requests import TokenRequest

__all__ = ["EngineRequest", "RequestStatus"]


class RequestStatus(Enum):
    """A request's status in the reference engine's own queues (vLLM's ``RequestStatus``)."""

    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class EngineRequest(TokenRequest):
    """A generation request. Output tokens are a deterministic function of the sequence so far."""

    __slots__ = (
        "arrival_step",
        "arrival_time",
        "block_ids",
        "first_scheduled_step",
        "first_scheduled_time",
        "max_tokens",
        "status",
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
        super().__init__(req_id, prompt_token_ids, tokens_per_block)
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        self.status = RequestStatus.WAITING
        self.block_ids: list[int] = []
        self.arrival_step = -1
        self.arrival_time = 0.0
        self.first_scheduled_time: float | None = None
        self.first_scheduled_step: int | None = None

    @property
    def aborted(self) -> bool:
        """The engine aborted the request (the connector reads it as ``is_aborted``)."""
        return self.is_aborted

    @aborted.setter
    def aborted(self, value: bool) -> None:
        self.is_aborted = value

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The tokens generated so far (a copy: :meth:`append_output` adds one)."""
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_output(self, token: int) -> None:
        self.token_ids.append(token)

    def sample_next(self) -> int:
        """A deterministic 'sampled' token: the same sequence always continues the same way."""
        seed = self.block_hashes[-1] if self.block_hashes else b""
        digest = hashlib.blake2b(seed + self.num_tokens.to_bytes(4, "little"), digest_size=4).digest()
        return int.from_bytes(digest, "little") % self.vocab_size

    @override
    def __repr__(self) -> str:
        return f"EngineRequest({self.req_id!r}, {self.status.value}, tokens={self.num_tokens})"
