"""kvfsm.control.seam: the boundary invariant ``job_copies_engine_block`` and its checker.

The engine side here is a plain block table and hash list, as an engine holds them; the jobs come from
kvfsm's real scheduler, fed a scheduler output the way a translation would (right, and with the bug
vLLM 0.32 exposed: a new request's whole table read as blocks to append).
"""

from __future__ import annotations

import pytest

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.seam import BOUNDARY_CHECKERS, engine_blocks_of_job, job_seam_violation
from kvfsm.control.types import make_offload_key, make_offload_keys
from kvfsm.machines.loader import load_boundary_invariants

TPB = 4  # tokens per block


def _hashes(n: int, tag: bytes = b"r") -> list[bytes]:
    return [tag + i.to_bytes(15, "big") for i in range(n)]


def test_checker_names_equal_spec_names() -> None:
    specs = load_boundary_invariants()
    assert {s.name for s in specs} == set(BOUNDARY_CHECKERS)
    assert all(s.boundary == "scheduler/worker" and s.prose for s in specs)


def test_engine_blocks_follow_chunk_positions() -> None:
    hashes = _hashes(6)
    table = [10, 11, 12, 13, 14, 15]
    # Two blocks per chunk: chunk c is keyed by hash 2c+1.
    keys = make_offload_keys([hashes[3], hashes[5]])
    assert engine_blocks_of_job(keys, hashes, table, 2, 0) == (12, 13, 14, 15)
    # A load whose first chunk's head the engine already computed starts one block in.
    assert engine_blocks_of_job(keys, hashes, table, 2, 1) == (13, 14, 15)


@pytest.mark.parametrize(
    ("keys", "table", "reason"),
    [
        ([make_offload_key(b"x" * 16)], [1, 2, 3], "not the key of any chunk"),
        ([make_offload_key(_hashes(3)[2])], [1, 2], "past the engine's 2-block table"),
    ],
)
def test_unknown_key_or_short_table_is_a_violation(keys: list[bytes], table: list[int], reason: str) -> None:
    v = job_seam_violation(7, "store", "a", keys, [1], 0, _hashes(3), table, 1)  # type: ignore[arg-type]
    assert v is not None and reason in v.reason and v.engine_blocks is None


def test_missing_engine_table_is_a_violation() -> None:
    v = job_seam_violation(1, "load", "a", make_offload_keys(_hashes(1)), [3], 0, None, None, 1)
    assert v is not None and "no block table" in v.describe()


def test_matching_job_passes_and_a_swapped_block_fails() -> None:
    hashes, table = _hashes(3), [7, 8, 9]
    keys = make_offload_keys(hashes)
    assert job_seam_violation(1, "store", "a", keys, [7, 8, 9], 0, hashes, table, 1) is None
    v = job_seam_violation(1, "store", "a", keys, [7, 9, 8], 0, hashes, table, 1)
    assert v is not None and v.engine_blocks == (7, 8, 9) and v.job_blocks == (7, 9, 8)


class _Req:
    def __init__(self, req_id: str, hashes: list[bytes]) -> None:
        self.req_id = req_id
        self.block_hashes = hashes
        self.num_tokens = len(hashes) * TPB + 1
        self.num_prompt_tokens = self.num_tokens
        self.num_computed_tokens = 0
        self.is_aborted = False


def _store_jobs_of_two_steps(first_step_admitted: bool) -> list[tuple[OffloadingScheduler, int]]:
    """A new request prefilled in two chunks of 2 blocks; the engine's table is [20..23]. The first step's
    output carries the request's whole table (a new request) with the flag the translation chose."""
    sched = OffloadingScheduler(OffloadConfig(TPB), CPUOffloadingManager(16))
    req = _Req("a", _hashes(4))
    sched.get_num_new_matched_tokens(req, 0)
    sched.update_state_after_alloc(req, [20, 21], 0)
    out = []
    meta = sched.build_connector_meta(
        SchedulerOutput((ScheduledRequest("a", (20, 21), 2 * TPB, admitted=first_step_admitted),))
    )
    out += [(sched, j) for j in meta.store_jobs]
    req.num_computed_tokens = 2 * TPB
    meta = sched.build_connector_meta(SchedulerOutput((ScheduledRequest("a", (22, 23), 2 * TPB + 1),)))
    out += [(sched, j) for j in meta.store_jobs]
    return out


def _violations(first_step_admitted: bool) -> list[str]:
    hashes, table = _hashes(4), [20, 21, 22, 23]
    found = []
    for sched, job_id in _store_jobs_of_two_steps(first_step_admitted):
        job = sched.job(job_id)
        assert job is not None
        v = job_seam_violation(
            job_id, "store", "a", job.keys, job.gpu.block_ids, job.gpu.first_block_offset, hashes, table, 1
        )
        if v is not None:
            found.append(v.describe())
    return found


def test_right_translation_stores_the_engines_blocks() -> None:
    assert _violations(first_step_admitted=True) == []


def test_new_request_table_appended_is_caught() -> None:
    """The vLLM 0.32 bug: the whole table of a new request appended to the blocks the connector already
    held from update_state_after_alloc, so the second chunk's store reads blocks 20, 21 again."""
    found = _violations(first_step_admitted=False)
    assert found and "the engine's block table holds [22, 23]" in found[0]
