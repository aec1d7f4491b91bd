"""The rule of the seam between kvfsm and the engine it serves: a job copies the blocks that the engine's
block table holds for its keys (spec/invariants.toml, ``job_copies_engine_block``).

Pure and sans-IO: the engine's side (its block table and block hashes for a request) comes in as plain
sequences, read by the caller from the engine itself (``kvfsm.vllm.seam`` reads vLLM's scheduler), never
from kvfsm's own bookkeeping, which is what the rule checks. A key is a block hash plus its group suffix
(:func:`~kvfsm.control.types.make_offload_key`); a chunk of ``blocks_per_chunk`` blocks is keyed by the
hash of its last block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvfsm.control.types import OffloadKey

__all__ = ["BOUNDARY_CHECKERS", "SeamViolation", "engine_blocks_of_job", "job_seam_violation"]

#: Bytes of the group suffix at the end of every key.
_GROUP_SUFFIX = 4


@dataclass(frozen=True, slots=True)
class SeamViolation:
    """One job whose GPU blocks differ from the engine's block table at its keys' chunk positions."""

    job_id: int
    kind: str
    req_id: str
    #: What the engine's block table holds for the job's keys (None: the engine does not know a key).
    engine_blocks: tuple[int, ...] | None
    job_blocks: tuple[int, ...]
    reason: str

    def describe(self) -> str:
        return (
            f"{self.kind} job {self.job_id} of request {self.req_id!r} copies GPU blocks {list(self.job_blocks)}; "
            f"the engine's block table holds "
            f"{'nothing' if self.engine_blocks is None else list(self.engine_blocks)} for its keys ({self.reason})"
        )


def engine_blocks_of_job(
    keys: Sequence[OffloadKey],
    block_hashes: Sequence[bytes],
    block_table: Sequence[int],
    blocks_per_chunk: int,
    first_block_offset: int,
) -> tuple[int, ...] | str:
    """The engine's GPU blocks for ``keys``, in key order: chunk ``c`` (the chunk whose last block's hash is
    the key's) covers table positions ``c*k .. c*k+k-1``, the first chunk starting ``first_block_offset``
    blocks in (a load of a chunk whose head the engine already computed). A reason string instead when a
    key is no chunk of the request's or its positions lie past the table. O(request's blocks)."""
    k = blocks_per_chunk
    chunk_of: dict[bytes, int] = {}
    for c in range(len(block_hashes) // k):
        chunk_of.setdefault(bytes(block_hashes[c * k + k - 1]), c)
    out: list[int] = []
    for j, key in enumerate(keys):
        found = chunk_of.get(bytes(key[:-_GROUP_SUFFIX]))
        if found is None:
            return f"key #{j} is not the key of any chunk of the request's {len(block_hashes)} block hashes"
        c = found
        start = c * k + (first_block_offset if j == 0 else 0)
        stop = (c + 1) * k
        if stop > len(block_table):
            return f"key #{j} is chunk {c}, past the engine's {len(block_table)}-block table"
        out.extend(int(b) for b in block_table[start:stop])
    return tuple(out)


def job_seam_violation(
    job_id: int,
    kind: str,
    req_id: str,
    keys: Sequence[OffloadKey],
    job_blocks: Sequence[int],
    first_block_offset: int,
    block_hashes: Sequence[bytes] | None,
    block_table: Sequence[int] | None,
    blocks_per_chunk: int,
) -> SeamViolation | None:
    """None when the job's GPU blocks are the engine's for its keys, else the violation."""
    got = tuple(int(b) for b in job_blocks)
    if block_hashes is None or block_table is None:
        return SeamViolation(job_id, kind, req_id, None, got, "the engine has no block table for the request")
    expected = engine_blocks_of_job(keys, block_hashes, block_table, blocks_per_chunk, first_block_offset)
    if isinstance(expected, str):
        return SeamViolation(job_id, kind, req_id, None, got, expected)
    if expected != got:
        return SeamViolation(job_id, kind, req_id, expected, got, "different blocks")
    return None


#: Each boundary invariant of spec/invariants.toml and its checker (tests/test_invariants.py checks the names
#: both ways).
BOUNDARY_CHECKERS = {"job_copies_engine_block": job_seam_violation}
