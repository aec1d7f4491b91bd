"""``kvfsm bench``: the lifecycle cost of a job, compiled tables against transitions-checked mode.

Both paths run in the same process and the table prints their medians side by side with the ratio,
because machines here are noisy: compare ratios, not absolute numbers across runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.machines import job_machine
from kvfsm.states import JobKind

__all__ = ["BenchRequest", "lifecycle_us", "pending_check_ns", "run_bench"]


@dataclass(slots=True)
class BenchRequest:
    req_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    is_aborted: bool = False


def _requests(n: int, tokens_per_block: int, tag: str) -> list[BenchRequest]:
    out = []
    for i in range(n):
        h = hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest()
        out.append(BenchRequest(f"{tag}{i}", [h], tokens_per_block + 1, tokens_per_block + 1))
    return out


def lifecycle_us(checked: bool, jobs: int, world_size: int = 2) -> float:
    """µs per request through lookup -> plan -> launch on W workers -> W acks -> commit -> finish."""
    tpb = 16
    manager = CPUOffloadingManager(jobs + 1, checked=checked)
    sched = OffloadingScheduler(OffloadConfig(tpb, world_size=world_size), manager, checked=checked)
    reqs = _requests(jobs, tpb, f"c{int(checked)}-")
    empty = SchedulerOutput()
    t0 = time.perf_counter()
    for i, r in enumerate(reqs):
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, [i], 0)
        meta = sched.build_connector_meta(
            SchedulerOutput(
                (ScheduledRequest(r.req_id, (i,), tpb + 1, admitted=True),),
                allocated_block_ids=frozenset((i,)),
            )
        )
        for job in meta.store_jobs.values():
            for rank in range(world_size):
                job.launch(rank)
            sched.update_connector_output(WorkerOutput(completed={job.job_id: world_size}))
        r.num_computed_tokens = tpb + 1
        sched.request_finished(r)
        sched.build_connector_meta(empty)
    elapsed = time.perf_counter() - t0
    if sched.stats.committed_stores != jobs or sched.has_pending_push_work():
        raise AssertionError(f"benchmark lifecycle did not commit every job: {sched.stats}")
    return elapsed / jobs * 1e6


def job_machine_us(checked: bool, jobs: int, world_size: int = 2) -> float:
    """µs per bare job: construct, W launches, W acks (the job machine alone)."""
    machine = job_machine(checked)
    gpu, slots = GPUBlockSpec((0,)), SlotSpec((0,))
    t0 = time.perf_counter()
    for i in range(jobs):
        job = Job(i, JobKind.STORE, "r", (), gpu, slots, world_size, machine)
        for rank in range(world_size):
            job.launch(rank)
        for _ in range(world_size):
            job.ack(1)
    return (time.perf_counter() - t0) / jobs * 1e6


def pending_check_ns(num_jobs: int, calls: int = 100_000) -> float:
    """ns per has_pending_push_work() call with ``num_jobs`` jobs in flight."""
    tpb = 16
    manager = CPUOffloadingManager(num_jobs + 1)
    sched = OffloadingScheduler(OffloadConfig(tpb), manager)
    reqs = _requests(num_jobs, tpb, f"p{num_jobs}-")
    scheduled = []
    for i, r in enumerate(reqs):
        sched.get_num_new_matched_tokens(r, 0)
        sched.update_state_after_alloc(r, [i], 0)
        scheduled.append(ScheduledRequest(r.req_id, (i,), tpb + 1, admitted=True))
    meta = sched.build_connector_meta(SchedulerOutput(tuple(scheduled)))
    if len(meta.store_jobs) != num_jobs:
        raise AssertionError(f"expected {num_jobs} jobs in flight, planned {len(meta.store_jobs)}")
    check = sched.has_pending_push_work
    t0 = time.perf_counter()
    for _ in range(calls):
        check()
    return (time.perf_counter() - t0) / calls * 1e9


def _median(fn: Callable[[], float], repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def run_bench(jobs: int = 2000, repeats: int = 5, as_json: bool = False) -> int:
    rows: list[tuple[str, float, float]] = []
    benches: tuple[tuple[str, Callable[[bool, int], float]], ...] = (
        ("request lifecycle, W=2 (µs/job)", lifecycle_us),
        ("job machine alone, W=2 (µs/job)", job_machine_us),
    )
    for label, fn in benches:
        compiled = _median(functools.partial(fn, False, jobs), repeats)
        checked = _median(functools.partial(fn, True, max(jobs // 4, 50)), repeats)
        rows.append((label, compiled, checked))
    small = _median(lambda: pending_check_ns(10), repeats)
    large = _median(lambda: pending_check_ns(100_000), max(1, repeats // 2))
    if as_json:
        print(
            json.dumps(
                {
                    "lifecycle": [{"what": w, "compiled_us": c, "checked_us": k, "ratio": k / c} for w, c, k in rows],
                    "has_pending_push_work_ns": {
                        "10_jobs": small,
                        "100k_jobs": large,
                        "ratio": large / small,
                    },
                },
                indent=2,
            )
        )
        return 0
    print(f"kvfsm bench: median of {repeats} runs, {jobs} jobs per run (checked mode runs a quarter)\n")
    print(f"{'':36} {'compiled':>10} {'checked':>10} {'checked/compiled':>17}")
    for what, c, k in rows:
        print(f"{what:36} {c:>10.2f} {k:>10.2f} {k / c:>16.1f}x")
    print(
        f"\nhas_pending_push_work(): {small:.0f} ns with 10 jobs in flight, {large:.0f} ns with 100k "
        f"({large / small:.2f}x)"
    )
    return 0
