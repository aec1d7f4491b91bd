"""``kvfsm bench``: side-by-side ratios measured in one run, printed as tables and written as JSON.

Sections (``--only`` picks some):

1. ``drain`` - drain responsiveness (the headline): a request finishes leaving D bytes of stores in
   flight and a new one arrives at once; time and steps until it is first scheduled, non-blocking drain
   against the blocking-flush baseline, D from 1 MiB to 1 GiB (:mod:`kvfsm.bench.drain`); and the CPU
   per drained job (and steps per drained job) of a drain through a file-system tier, the engine's
   busy polling against its readiness wait (``EngineConfig.poll``).
2. ``control`` - control-plane cost: a seeded prefix-reuse trace (or a JSONL one) replayed through the
   CPU tier manager at 25% and 100% capacity, and the scheduler's per-step cost for N = 16, 64, 256
   running requests (:mod:`kvfsm.bench.control`, :mod:`kvfsm.bench.workload`).
3. ``lifecycle`` - µs per job on the compiled path and in transitions-checked mode, and the cost of
   ``has_pending_push_work()`` with 10 and 100k jobs in flight.
4. ``transfers`` - the data plane's table (:mod:`kvfsm.bench.transfers`, when it is installed).
5. ``verification`` - model-checker states/s and Hypothesis stateful steps/s (:mod:`kvfsm.bench.verify`).
6. ``redis`` - the Redis tier on a local redis-server it starts (:mod:`kvfsm.bench.redis`): write and read
   GB/s against ``redis-benchmark`` for the same value size, pipelined against one chunk per round trip
   and against the file-system tier, promotion latency percentiles, and the cross-instance hit rate of
   two engine processes sharing a prefix workload. Skipped (reported) without redis-server or redis-py.
7. ``vllm`` - side by side with vLLM 0.33's own CPU manager, LRU and ARC, per manager operation
   (:mod:`kvfsm.bench.vllm_side`; only where vLLM is installed, else reported as not available).
8. ``vllm-scheduler`` - optional, where vLLM is installed: the scheduler-side step cost of ``KvfsmConnector`` against
   vLLM's native ``OffloadingConnector`` inside vLLM's own Scheduler (:mod:`kvfsm.bench.vllm_scheduler`).
9. ``e2e`` - opt-in (``--only e2e``), where a vLLM that computes tokens is installed: time to first token
   recomputed against a hit from each kvfsm tier, decode step cost and bytes per second, on a serving vLLM
   engine (:mod:`kvfsm.bench.e2e`).
10. ``vllm-tiers`` - opt-in (``--only vllm-tiers``), where vLLM with its tiering spec, redis-py and redis-server
   are installed: kvfsm's Redis tier as a secondary tier of vLLM's own ``TieringOffloadingManager``, store and
   promote MB/s against ``redis-benchmark`` on the same local server, every promoted chunk compared
   (:mod:`kvfsm.vllm.tier_bench`).

Both sides of every comparison run in the same process, one after the other: machines here are noisy,
so compare the ratios, not absolute numbers across runs. Goals are marked met or not met at the end.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from kvfsm.bench.sections import OPT_IN_SECTIONS, SECTIONS
from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.errors import ConfigError
from kvfsm.machines import job_machine
from kvfsm.machines.names import JobKind
from kvfsm.observe.progress import Progress
from kvfsm.validation import is_int, require_output_file

__all__ = [
    "SECTIONS",
    "BenchReport",
    "BenchRequest",
    "Goal",
    "job_machine_us",
    "lifecycle_us",
    "pending_check_ns",
    "run_bench",
]


#: vLLM 0.33 on a 2-core machine (issue 6): trace replay at 25% capacity, scheduler step at N = 256.
VLLM_REPLAY_25_S = 3.2
VLLM_STEP_DECODE_MS = 1.3
VLLM_STEP_PREFILL_MS = 6.6


# ---------------------------------------------------------------------------- lifecycle (section 3)


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
            sched.update_connector_output(WorkerOutput(completed={job.job_id: set(range(world_size))}))
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
        for rank in range(world_size):
            job.ack(rank)
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


# ---------------------------------------------------------------------------- report


@dataclass(frozen=True, slots=True)
class Goal:
    section: str
    name: str
    target: str
    measured: str
    #: None: not evaluated in this run (e.g. a custom workload).
    met: bool | None

    @property
    def verdict(self) -> str:
        return "n/a" if self.met is None else ("met" if self.met else "NOT MET")

    def as_dict(self) -> dict[str, object]:
        return {
            "section": self.section,
            "goal": self.name,
            "target": self.target,
            "measured": self.measured,
            "met": self.met,
        }


@dataclass(slots=True)
class BenchReport:
    meta: dict[str, object] = field(default_factory=dict)
    results: dict[str, object] = field(default_factory=dict)
    goals: list[Goal] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return {"meta": self.meta, **self.results, "goals": [g.as_dict() for g in self.goals]}


def format_table(
    headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ", align: str | None = None
) -> str:
    """A plain text table; ``align`` has one letter per column, "l" or "r" (default: the first column
    left-aligned, the others right-aligned)."""
    cells = [[str(h) for h in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    how = align or "l" + "r" * (len(headers) - 1)
    if len(how) != len(headers) or set(how) - {"l", "r"}:
        raise ConfigError(f"align={align!r}; expected one 'l' or 'r' per column ({len(headers)})")

    def line(r: list[str]) -> str:
        parts = [c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, how, strict=True)]
        return (indent + "  ".join(parts)).rstrip()

    rule = indent + "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule, *(line(r) for r in cells[1:])])


def _ms(x: float) -> str:
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


# ---------------------------------------------------------------------------- sections


@dataclass(slots=True)
class _Options:
    quick: bool
    jobs: int
    repeats: int
    workload: Path | None
    show_progress: bool
    #: the ``workload`` file's requests, read (and validated) before any section runs
    trace: list[list[int]] | None = None


def _in_flight(results: Sequence[Any]) -> str:
    """Rounds whose stores were in flight at B's arrival, and still in flight when B was scheduled."""
    n = len(results)
    arrived = sum(1 for r in results if r.a_jobs_in_flight_at_arrival)
    scheduled = sum(1 for r in results if r.a_jobs_in_flight_when_scheduled)
    return f"{arrived}/{n}, {scheduled}/{n}"


def _section_drain(opts: _Options, report: BenchReport) -> str:
    from kvfsm.bench.drain import (
        FULL_SIZES_MIB,
        PROMOTION_BLOCKS,
        QUICK_SIZES_MIB,
        DrainPoint,
        drain_cpu_point,
        drain_sweep,
        promotion_cpu_point,
    )

    sizes = QUICK_SIZES_MIB if opts.quick else FULL_SIZES_MIB
    repeats = 5 if opts.quick else 7
    with Progress(len(sizes), "drain", enabled=opts.show_progress) as bar:

        def done(p: DrainPoint) -> None:
            bar.advance(f"{p.store_bytes / 2**20:.0f} MiB: {p.ratio:.0f}x")

        points = drain_sweep(sizes, repeats, on_point=done)
    cpu = drain_cpu_point(repeats=3 if opts.quick else 5)
    promo = promotion_cpu_point(repeats=3 if opts.quick else 5)
    rows = [
        (
            f"{p.store_bytes / 2**20:.0f}",
            p.nonblocking_steps,
            _ms(p.nonblocking_ms),
            p.blocking_steps,
            _ms(p.blocking_ms),
            f"{p.ratio:.1f}x",
            _in_flight(p.nonblocking),
        )
        for p in points
    ]
    report.results["drain"] = {
        "repeats": repeats,
        "points": [p.as_dict() for p in points],
        "cpu": cpu.as_dict(),
        "promotion_cpu": promo.as_dict(),
    }
    nb = [p.nonblocking_ms for p in points]
    bl = [p.blocking_ms for p in points]
    max_steps = max(p.nonblocking_steps for p in points)
    flat = max(nb) / min(nb) if min(nb) > 0 else float("inf")
    growth = bl[-1] / bl[0] if bl[0] > 0 else float("inf")
    report.goals += [
        Goal(
            "drain",
            "non-blocking: new request scheduled within one step at every D",
            "<= 1 step",
            f"max {max_steps} step(s)",
            max_steps <= 1,
        ),
        Goal(
            "drain",
            "non-blocking wait flat from smallest to largest D",
            "max/min <= 2x",
            f"{flat:.2f}x ({_ms(min(nb))}..{_ms(max(nb))} ms)",
            flat <= 2.0,
        ),
        Goal(
            "drain",
            "blocking baseline grows with D",
            "largest/smallest D >= 4x",
            f"{growth:.0f}x ({_ms(bl[0])} -> {_ms(bl[-1])} ms)",
            growth >= 4.0,
        ),
        Goal(
            "drain",
            "waiting engine: less engine CPU per drained job than busy polling",
            "busy/wait >= 1.5x",
            f"{cpu.ratio('engine_cpu_ms_per_job'):.1f}x",
            cpu.ratio("engine_cpu_ms_per_job") >= 1.5,
        ),
    ]
    head = (
        "(1) drain responsiveness: A finishes leaving D of stores in flight, B arrives during the next step\n"
        f"    median of {repeats} rounds per D; time = B's arrival to B first scheduled; "
        "small stores may finish within A's last step\n"
    )
    table = format_table(
        (
            "D (MiB)",
            "non-blocking steps",
            "ms",
            "blocking steps",
            "ms",
            "blocking/non-blocking",
            "A's stores in flight (at B's arrival, at B's scheduling)",
        ),
        rows,
    )
    cpu_rows = [
        (
            label,
            f"{cpu.median(cpu.busy, what):.{digits}f}",
            f"{cpu.median(cpu.wait, what):.{digits}f}",
            f"{cpu.ratio(what):.1f}x",
        )
        for label, what, digits in (
            ("engine thread CPU ms / job", "engine_cpu_ms_per_job", 3),
            ("process CPU ms / job (copies, tier I/O too)", "cpu_ms_per_job", 3),
            ("steps / job", "steps_per_job", 1),
            ("drain wall s", "wall_s", 4),
        )
    ]
    cpu_rows += [
        (
            f"{PROMOTION_BLOCKS}-block fs promotion: {label}",
            f"{promo.median(promo.busy, what):.{digits}f}",
            f"{promo.median(promo.wait, what):.{digits}f}",
            f"{promo.ratio(what):.1f}x",
        )
        for label, what, digits in (
            ("engine thread CPU ms", "engine_cpu_ms_per_job", 3),
            ("process CPU ms", "cpu_ms_per_job", 3),
            ("steps", "steps", 0),
            ("wall s", "wall_s", 4),
        )
    ]
    jobs = cpu.busy[0].jobs
    cpu_head = (
        f"\n\n    CPU per drained job: {jobs} requests finish in one step, each leaving a 2 MiB store that also\n"
        f"    cascades to a file-system tier; the engine steps until idle (median of {len(cpu.busy)} drains);\n"
    )
    cpu_head += (
        f"    and a fresh engine promoting and loading a prompt's {PROMOTION_BLOCKS} blocks from that tier (one run)\n"
    )
    cpu_table = format_table(("per drained job", "poll=busy", "poll=wait", "busy/wait"), cpu_rows)
    return head + table + cpu_head + cpu_table


def _section_control(opts: _Options, report: BenchReport) -> str:
    from kvfsm.bench.control import OPERATIONS, replay, scheduler_step_cost
    from kvfsm.bench.workload import WorkloadConfig, generate_trace, read_jsonl, to_keys, trace_stats

    source = str(opts.workload) if opts.workload else "generated (seed 0)"
    if opts.trace is not None:
        trace = opts.trace
    else:
        trace = read_jsonl(opts.workload) if opts.workload else generate_trace(WorkloadConfig())
    stats = trace_stats(trace)
    requests = to_keys(trace)
    capacities = (0.25, 1.0)
    kinds_ns = ((kind, n) for kind in ("decode", "prefill") for n in (16, 64, 256))
    step_plan = list(kinds_ns)
    replay_repeats = 1 if opts.quick else 3
    results = []
    costs = []
    with Progress(len(capacities) + len(step_plan), "control plane", enabled=opts.show_progress) as bar:
        for cap in capacities:
            r = replay(requests, cap, repeats=replay_repeats)
            results.append(r)
            bar.advance(f"replay {cap:.0%}: {r.cpu_s:.2f} s")
        for kind, n in step_plan:
            c = scheduler_step_cost(n, kind, steps=16 if opts.quick else 64, rounds=1 if opts.quick else 3)
            costs.append(c)
            bar.advance(f"{kind} N={n}: {c.cpu_us_per_step:.0f} µs")
    report.results["control"] = {
        "workload": {
            "source": source,
            "requests": stats.requests,
            "blocks": stats.blocks,
            "distinct_blocks": stats.distinct_blocks,
            "continuations": stats.continuations,
            "in_flight": 8,
        },
        "replay": [r.as_dict() for r in results],
        "scheduler_step": [c.as_dict() for c in costs],
    }
    lines = [
        "(2) control-plane cost (CPU time is the wall time on an idle machine: both are single-threaded)",
        f"    trace: {source}, {stats.requests} requests, {stats.blocks} blocks, {stats.distinct_blocks} distinct, "
        f"{stats.continuations / max(1, stats.requests):.0%} continue an earlier request, 8 in flight",
    ]
    rows: list[list[object]] = [[op, *(f"{r.us_per_call(op):.2f}" for r in results)] for op in OPERATIONS]
    rows.append(["calls (lookup)", *(r.calls.get("lookup", 0) for r in results)])
    rows.append(["block hit rate", *(f"{r.hit_rate:.1%}" for r in results)])
    rows.append(["evictions", *(r.evictions for r in results)])
    rows.append(["store refusals", *(r.store_refusals for r in results)])
    rows.append(["wall time, timed pass (s)", *(f"{r.timed_wall_s:.3f}" for r in results)])
    rows.append([f"wall time (s, best of {replay_repeats})", *(f"{r.wall_s:.3f}" for r in results)])
    rows.append([f"CPU time (s, best of {replay_repeats})", *(f"{r.cpu_s:.3f}" for r in results)])
    lines.append(
        format_table(("µs per call", *(f"{r.capacity:.0%} capacity ({r.num_slots} slots)" for r in results)), rows)
    )
    lines.append("")
    rounds = "" if opts.quick else ", best of 3 rounds"
    lines.append(f"    scheduler per step: build_connector_meta + update_connector_output (median step{rounds})")
    step_rows = [
        (
            c.kind,
            c.num_requests,
            f"{c.jobs_per_step:.0f}",
            f"{c.build_us:.0f}",
            f"{c.update_us:.0f}",
            f"{c.us_per_step / 1e3:.3f}",
            f"{c.cpu_us_per_step / 1e3:.3f}",
        )
        for c in costs
    ]
    lines.append(format_table(("step", "N", "jobs/step", "build µs", "update µs", "ms/step", "CPU ms/step"), step_rows))
    generated = opts.workload is None
    r25 = results[0]
    report.goals.append(
        Goal(
            "control",
            "trace replay at 25% capacity (vLLM: ~3.2 s)",
            "< 1.6 s",
            f"{r25.cpu_s:.3f} s CPU, {r25.wall_s:.3f} s wall ({VLLM_REPLAY_25_S / r25.cpu_s:.1f}x faster than vLLM)",
            r25.cpu_s < VLLM_REPLAY_25_S / 2 if generated else None,
        )
    )
    by = {(c.kind, c.num_requests): c for c in costs}
    for kind, vllm_ms in (("decode", VLLM_STEP_DECODE_MS), ("prefill", VLLM_STEP_PREFILL_MS)):
        cost = by[(kind, 256)]
        cpu_ms, wall_ms = cost.cpu_us_per_step / 1e3, cost.us_per_step / 1e3
        report.goals.append(
            Goal(
                "control",
                f"scheduler {kind} step at N=256 (vLLM: ~{vllm_ms} ms)",
                f"< {vllm_ms / 2:.2g} ms",
                f"{cpu_ms:.3f} ms CPU, {wall_ms:.3f} ms wall",
                cpu_ms < vllm_ms / 2,
            )
        )
    return "\n".join(lines)


def _section_lifecycle(opts: _Options, report: BenchReport) -> str:
    benches: tuple[tuple[str, Callable[[bool, int], float]], ...] = (
        ("request lifecycle, W=2 (µs/job)", lifecycle_us),
        ("job machine alone, W=2 (µs/job)", job_machine_us),
    )
    jobs, repeats = opts.jobs, opts.repeats
    rows: list[tuple[str, float, float]] = []
    with Progress(len(benches) + 2, "lifecycle", enabled=opts.show_progress) as bar:
        for label, fn in benches:
            compiled = _median(functools.partial(fn, False, jobs), repeats)
            checked = _median(functools.partial(fn, True, max(jobs // 4, 50)), repeats)
            rows.append((label, compiled, checked))
            bar.advance(label.split(",")[0])
        small = _median(lambda: pending_check_ns(10), repeats)
        bar.advance("has_pending_push_work, 10 jobs")
        large = _median(lambda: pending_check_ns(100_000), max(1, repeats // 2))
        bar.advance("has_pending_push_work, 100k jobs")
    report.results["lifecycle"] = {
        "jobs": jobs,
        "repeats": repeats,
        "rows": [{"what": w, "compiled_us": c, "checked_us": k, "ratio": k / c} for w, c, k in rows],
        "has_pending_push_work_ns": {"10_jobs": small, "100k_jobs": large, "ratio": large / small},
    }
    report.goals.append(
        Goal(
            "lifecycle",
            "has_pending_push_work() costs the same at 10 and 100k jobs",
            "100k/10 <= 2x",
            f"{small:.0f} ns vs {large:.0f} ns ({large / small:.2f}x)",
            large / small <= 2.0,
        )
    )
    head = f"(3) lifecycle overhead: median of {repeats} runs, {jobs} jobs per run (checked mode runs a quarter)\n"
    table = format_table(
        ("", "compiled", "checked", "checked/compiled"),
        [(w, f"{c:.2f}", f"{k:.2f}", f"{k / c:.1f}x") for w, c, k in rows],
    )
    tail = (
        f"\n  has_pending_push_work(): {small:.0f} ns with 10 jobs in flight, {large:.0f} ns with 100k "
        f"({large / small:.2f}x)"
    )
    return head + table + tail


def _generic_table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "  (no rows)"
    headers = list(rows[0])

    def cell(v: object) -> str:
        return f"{v:.3g}" if isinstance(v, float) else str(v)

    return format_table(headers, [[cell(r.get(h, "")) for h in headers] for r in rows])


def _section_transfers(opts: _Options, report: BenchReport) -> str:
    head = "(4) transfers: the data plane's copy benchmark\n"
    try:
        module = importlib.import_module("kvfsm.bench.transfers")
    except ImportError as exc:
        report.results["transfers"] = {"available": False, "detail": f"not available ({exc})"}
        return head + "  not available (kvfsm.bench.transfers is not installed, or torch is missing)"
    run: Callable[..., list[dict[str, Any]]] = module.run_transfer_bench
    with Progress(1, "transfers", enabled=opts.show_progress) as bar:
        try:
            rows = run(quick=opts.quick)
        except Exception as exc:  # the data plane's own failure is reported, not a bench crash
            report.results["transfers"] = {"available": False, "detail": f"failed: {type(exc).__name__}: {exc}"}
            return head + f"  failed: {type(exc).__name__}: {exc}"
        bar.advance(f"{len(rows)} rows")
    report.results["transfers"] = {"available": True, "rows": rows}
    for name in ("format_transfer_table", "format_table", "transfer_table"):
        formatter = getattr(module, name, None)
        if callable(formatter):
            text = formatter(rows)
            if isinstance(text, str):
                return head + text
    return head + _generic_table(rows)


def _section_verification(opts: _Options, report: BenchReport) -> str:
    from kvfsm.bench.verify import checker_throughput, hypothesis_throughput

    with Progress(2, "verification", enabled=opts.show_progress) as bar:
        checker = checker_throughput(opts.quick)
        bar.advance("model checker")
        hyp = hypothesis_throughput(opts.quick)
        bar.advance("hypothesis")
    report.results["verification"] = [r.as_dict() for r in (*checker, *hyp)]
    rows: list[tuple[object, ...]] = []
    for r in (*checker, *hyp):
        if r.available:
            rows.append((r.tool, r.target, r.units, r.unit_name, f"{r.seconds:.2f}", f"{r.per_second:,.0f}", ""))
        else:
            note = r.detail if len(r.detail) <= 90 else r.detail[:87] + "..."
            rows.append((r.tool, r.target, "-", "-", "-", "-", note))
    table = format_table(("tool", "target", "count", "unit", "s", "per second", "note"), rows, align="llrlrrl")
    for r in checker:
        cpu = r.extra.get("cpu_seconds")
        if r.available and isinstance(cpu, float) and cpu > 0:
            rate = r.units / cpu
            report.goals.append(
                Goal(
                    "verification",
                    f"kvfsm check states/s by CPU time, {r.target}",
                    ">= 100k states/s",
                    f"{rate:,.0f} states/s ({r.units:,} states in {cpu:.2f} s CPU)",
                    rate >= 100_000,
                )
            )
    return "(5) verification throughput\n" + table


def _section_redis(opts: _Options, report: BenchReport) -> str:
    head = "(6) redis: the Redis tier on a local redis-server\n"
    try:
        from kvfsm.bench.redis import bench_redis, format_redis
    except ImportError as exc:
        report.results["redis"] = {"available": False, "detail": f"not available ({exc})"}
        return head + f"  not available ({exc}; pip install 'kvfsm[redis]')"
    with Progress(1, "redis", enabled=opts.show_progress) as bar:
        try:
            numbers = bench_redis(quick=opts.quick)
        except (ConfigError, OSError) as exc:  # no redis-server here: reported, not a bench crash
            report.results["redis"] = {"available": False, "detail": str(exc)}
            return head + f"  not available: {exc}"
        bar.advance("redis")
    report.results["redis"] = {"available": True, **numbers}
    return head + format_redis(numbers)


def _section_vllm(opts: _Options, report: BenchReport) -> str:
    from kvfsm.bench.vllm_side import MANAGER_OPS, run_side_by_side, vllm_available
    from kvfsm.bench.workload import WorkloadConfig, generate_trace, to_keys

    head = "(7) vllm: kvfsm's CPU manager side by side with vLLM 0.33's (µs per call, medians; ratio kvfsm/vLLM)\n"
    if not vllm_available():
        report.results["vllm"] = {"available": False, "detail": "vLLM is not installed (pip install 'kvfsm[vllm]')"}
        return head + "  not available (vLLM is not installed: pip install 'kvfsm[vllm]')"
    requests = to_keys(generate_trace(WorkloadConfig(distinct_blocks=20_000 if opts.quick else 100_000)))
    rounds = 3 if opts.quick else 5
    plan = [(policy, cap) for policy in ("lru", "arc") for cap in (0.25, 1.0)]
    rows: list[list[object]] = []
    results: list[dict[str, object]] = []
    with Progress(len(plan), "vllm side by side", enabled=opts.show_progress) as bar:
        for policy, cap in plan:
            r = run_side_by_side(requests, policy=policy, capacity=cap, rounds=rounds)
            bar.advance(f"{policy} {cap:.0%}")
            results.append({"policy": policy, "capacity": cap, "us": r.us, "wall_s": r.wall_s, "hits": r.hits})
            for op in MANAGER_OPS:
                rows.append(
                    [
                        f"{policy} {cap:.0%} {op}",
                        f"{r.us['vllm'][op]:.2f}",
                        f"{r.us['kvfsm'][op]:.2f}",
                        f"{r.ratio('kvfsm', op):.2f}",
                        f"{r.us['adapter'][op]:.2f}",
                        f"{r.ratio('adapter', op):.2f}",
                    ]
                )
            worst = max(MANAGER_OPS, key=lambda op: r.ratio("kvfsm", op))
            report.goals.append(
                Goal(
                    "vllm",
                    f"every manager op <= 0.5x vLLM ({policy}, {cap:.0%})",
                    "<= 0.5",
                    f"worst {worst} {r.ratio('kvfsm', worst):.2f}",
                    r.ratio("kvfsm", worst) <= 0.5,
                )
            )
    report.results["vllm"] = {"available": True, "rounds": rounds, "results": results}
    headers = ["policy, capacity, op", "vLLM", "kvfsm", "ratio", "adapter", "ratio"]
    return head + format_table(headers, rows)


def _section_vllm_scheduler(opts: _Options, report: BenchReport) -> str:
    """Optional: runs only where vLLM is installed (kvfsm[vllm]); see kvfsm/bench/vllm_scheduler.py."""
    from kvfsm.bench import vllm_scheduler

    head = "(8) scheduler step inside vLLM 0.33's Scheduler: KvfsmConnector against vLLM's OffloadingConnector\n"
    missing = vllm_scheduler.available()
    if missing is not None:
        report.results["vllm-scheduler"] = {"available": False, "detail": missing}
        return head + f"  not available (vLLM is not installed: {missing})"
    ns = (16,) if opts.quick else (16, 64, 256)
    with Progress(1, "vllm scheduler", enabled=opts.show_progress) as bar:
        rows = vllm_scheduler.run_side_by_side(ns, repeats=1 if opts.quick else opts.repeats)
        bar.advance(f"{len(rows)} rows")
    report.results["vllm-scheduler"] = {"available": True, "rows": rows}
    for r in rows:
        report.goals.append(
            Goal(
                "vllm-scheduler",
                f"{r['step']} step N={r['n']} vs vLLM",
                "<= 0.5x",
                f"{r['ratio']:.2f}x",
                r["ratio"] <= 0.5,
            )
        )
    table = format_table(
        ("N", "step", "vLLM µs", "kvfsm µs", "kvfsm / vLLM"),
        [(r["n"], r["step"], f"{r['vllm_us']:.0f}", f"{r['kvfsm_us']:.0f}", f"{r['ratio']:.2f}") for r in rows],
        align="rlrrr",
    )
    return head + table


def _section_e2e(opts: _Options, report: BenchReport) -> str:
    """Opt-in: a serving vLLM engine per setup (kvfsm/bench/e2e.py)."""
    from kvfsm.bench import e2e

    head = (
        "(9) e2e: a serving vLLM engine, 8-layer model, 2,048-token prompt: time to first token recomputed vs a "
        "hit from kvfsm (CPU ms, medians, alternating on each engine)\n"
    )
    missing = e2e.available()
    if missing is not None:
        report.results["e2e"] = {"available": False, "detail": missing}
        return head + f"  not available ({missing})"
    with Progress(1, "e2e", enabled=opts.show_progress) as bar:
        rows = e2e.run_e2e(quick=opts.quick, repeats=opts.repeats)
        bar.advance(f"{len(rows)} engines")
    report.results["e2e"] = {"available": True, "rows": rows}
    for r in rows[1:]:
        report.goals.append(
            Goal(
                "e2e",
                f"TTFT hit / recompute, {r['engine']}",
                "< 1",
                f"{r['hit_over_miss']:.2f}x",
                r["hit_over_miss"] < 1,
            )
        )
    return head + format_table(
        (
            "engine",
            "recompute ms",
            "hit ms",
            "hit/recompute",
            "decode step ms",
            "step ratio",
            "hit GB/s",
            "tokens equal",
        ),
        [
            (
                r["engine"],
                f"{r['ttft_miss_ms']:.1f}",
                f"{r['ttft_hit_ms']:.1f}",
                f"{r['hit_over_miss']:.2f}",
                f"{r['decode_step_ms']:.2f}",
                f"{r['decode_step_ratio']:.2f}",
                f"{r['hit_bytes_per_s'] / 1e9:.2f}",
                "yes" if r["tokens_equal"] else "NO",
            )
            for r in rows
        ],
    )


def _section_vllm_tiers(opts: _Options, report: BenchReport) -> str:
    """Opt-in: kvfsm's Redis tier through vLLM's tiering manager against redis-benchmark (kvfsm/vllm/tier_bench.py)."""
    head = (
        "(10) vllm-tiers: KvfsmRedisTier as a secondary tier of vLLM's TieringOffloadingManager, store and promote "
        "MB/s against redis-benchmark on the same local server\n"
    )
    try:
        from kvfsm.bench.redis import local_redis
        from kvfsm.vllm.tier_bench import bench_vllm_redis_tier, format_vllm_redis_tier

        with Progress(1, "vllm-tiers", enabled=opts.show_progress) as bar, local_redis() as url:
            result = bench_vllm_redis_tier(url, chunks=64 if opts.quick else 256)
            bar.advance(f"{result.chunks} chunks")
    except (ConfigError, ImportError, OSError) as exc:
        report.results["vllm-tiers"] = {"available": False, "detail": str(exc)}
        return head + f"  not available ({exc})"
    report.results["vllm-tiers"] = {
        "available": True,
        **dataclasses.asdict(result),
        "store_vs_redis_benchmark": result.store_vs_redis_benchmark,
        "promote_vs_redis_benchmark": result.promote_vs_redis_benchmark,
    }
    report.goals.append(
        Goal(
            "vllm-tiers",
            "promoted chunks that differ from what was stored",
            "0",
            str(result.wrong_chunks),
            result.wrong_chunks == 0,
        )
    )
    return head + format_vllm_redis_tier(result)


_RUNNERS: dict[str, Callable[[_Options, BenchReport], str]] = {
    "e2e": _section_e2e,
    "vllm-tiers": _section_vllm_tiers,
    "drain": _section_drain,
    "control": _section_control,
    "lifecycle": _section_lifecycle,
    "transfers": _section_transfers,
    "verification": _section_verification,
    "redis": _section_redis,
    "vllm-scheduler": _section_vllm_scheduler,
    "vllm": _section_vllm,
}


def _meta(opts: _Options, sections: Sequence[str]) -> dict[str, object]:
    meta: dict[str, object] = {
        "quick": opts.quick,
        "sections": list(sections),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "load_average": _load_average(),
    }
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["torch_threads"] = torch.get_num_threads()
        meta["cuda"] = torch.cuda.is_available()
    except ImportError:
        meta["torch"] = None
    return meta


def _load_average() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return None


def format_goals(goals: Sequence[Goal]) -> str:
    return "goals\n" + format_table(
        ("section", "goal", "target", "measured", "verdict"),
        [(g.section, g.name, g.target, g.measured, g.verdict) for g in goals],
    )


def run_bench(
    *,
    quick: bool = False,
    quiet: bool = False,
    as_json: bool = False,
    out: str | Path | None = None,
    jobs: int | None = None,
    repeats: int | None = None,
    workload: str | Path | None = None,
    sections: Sequence[str] | None = None,
    stream: TextIO | None = None,
) -> int:
    """Run the benchmark sections; print tables (or JSON with ``as_json``); write JSON to ``out``.

    Returns 0 when every section ran (goals missed are reported, not an error). Every input (sections,
    jobs, repeats, the workload file, the ``out`` path) is checked before the first section runs:
    ConfigError or WorkloadError, and no work done.
    """
    chosen = list(sections) if sections else list(SECTIONS)
    unknown = [s for s in chosen if s not in SECTIONS + OPT_IN_SECTIONS]
    if unknown:
        raise ConfigError(f"unknown bench section(s) {unknown}; expected some of {list(SECTIONS + OPT_IN_SECTIONS)}")
    stream = stream if stream is not None else sys.stdout
    opts = _Options(
        quick=quick,
        jobs=jobs if jobs is not None else (500 if quick else 2000),
        repeats=repeats if repeats is not None else (3 if quick else 5),
        workload=Path(workload) if workload is not None else None,
        show_progress=not (quiet or as_json),
    )
    # Every input is checked before the first section runs: a bad one must not cost a whole run.
    if not is_int(opts.jobs) or not is_int(opts.repeats) or opts.jobs < 1 or opts.repeats < 1:
        raise ConfigError(f"jobs and repeats must be >= 1, got jobs={opts.jobs}, repeats={opts.repeats}")
    if opts.workload is not None:
        if "control" not in chosen:
            raise ConfigError(
                f"--workload applies only to the control section, which this run skips (sections {chosen}); "
                "expected --only control or no --only"
            )
        from kvfsm.bench.workload import read_jsonl

        opts.trace = read_jsonl(opts.workload)
    out_path = require_output_file("output file", out) if out is not None else None
    report = BenchReport(meta=_meta(opts, chosen))
    t0 = time.perf_counter()
    if not as_json:
        mode = "quick" if quick else "full"
        load = report.meta["load_average"]
        busy = isinstance(load, float) and load > 0.75 * (os.cpu_count() or 1)
        print(
            f"kvfsm bench ({mode}): {', '.join(chosen)}; {os.cpu_count()} CPUs, Python {platform.python_version()}"
            + (f", load average {load:.2f}" if isinstance(load, float) else "")
            + (" (busy machine: timings are inflated)" if busy else ""),
            file=stream,
        )
    for name in chosen:
        text = _RUNNERS[name](opts, report)
        if not as_json:
            print("\n" + text, file=stream, flush=True)
    report.meta["seconds"] = time.perf_counter() - t0
    if not as_json:
        print("\n" + format_goals(report.goals), file=stream)
        print(f"\nbench finished in {report.meta['seconds']:.1f} s", file=stream)
    payload = json.dumps(report.as_dict(), indent=2, default=str)
    if as_json:
        print(payload, file=stream)
    if out_path is not None:
        try:
            out_path.write_text(payload + "\n", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write the results to {out_path}: {exc.strerror or exc}") from exc
    return 0
