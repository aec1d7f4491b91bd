"""``kvfsm demo``: a multi-turn workload with prefix reuse through the reference engine, real copies.

Part 1 runs conversations whose turns share a system prompt and their own history, on a GPU pool too
small to keep it all, so later turns load their prefix back from the CPU tier. Every loaded block is
checked byte for byte against the value the stand-in forward pass wrote, and every spec invariant is
checked after every step.

Part 2 shows the drain: a request finishes with its stores in flight and a new request arrives during
the next step. In both modes it is scheduled in the step after it arrives; non-blocking, that step
runs at once while the stores continue (the engine is draining), under the blocking baseline (vLLM
#42611) it first waits for a flush of every transfer. The table shows the wait in ms and the blocking
waits, then each step of both rounds.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from kvfsm.bench.drain import (
    DrainResult,
    _BenchEngine,
    _blocks_for,
    _config,
    _round,
    compress_timeline,
    measure_drain,
)
from kvfsm.check.invariants import SystemView, check_all
from kvfsm.control.config import DrainMode
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.engine.core import EngineConfig, ReferenceEngine, StepRecord
from kvfsm.machines.names import EngineState
from kvfsm.validation import require_output_file

if TYPE_CHECKING:
    from kvfsm.observe.trace import TraceRecorder

__all__ = [
    "DrainResult",
    "compress_timeline",
    "describe_drain_steps",
    "measure_drain",
    "run_demo",
    "run_shared_demo",
    "run_workload",
]


def _check(engine: ReferenceEngine) -> None:
    violations = check_all(SystemView(engine.scheduler, engine.state))
    if violations:
        raise AssertionError("invariant violated: " + "; ".join(map(str, violations)))


def run_workload(
    config: EngineConfig, users: int = 4, turns: int = 3, seed: int = 0
) -> tuple[ReferenceEngine, list[EngineState]]:
    """Conversations sharing a system prompt; each turn's prompt is the whole history plus new text."""
    rng = random.Random(seed)
    engine = ReferenceEngine(config)
    tpb = config.tokens_per_block
    system = [rng.randrange(1, 30000) for _ in range(4 * tpb)]
    history = {u: list(system) for u in range(users)}
    states: list[EngineState] = []
    for turn in range(turns):
        reqs = {}
        for u in range(users):
            history[u] += [rng.randrange(1, 30000) for _ in range(rng.randrange(tpb, 3 * tpb))]
            req = engine.make_request(f"u{u}-t{turn}", history[u], max_tokens=rng.randrange(tpb // 2, 2 * tpb))
            engine.add_request(req)
            reqs[u] = req
        while engine.step() is not None:
            states.append(engine.state)
            _check(engine)
        for u, req in reqs.items():
            history[u] = req.all_token_ids  # the next turn continues the whole conversation
        engine.reset_prefix_cache()  # as if the GPU cache had been reused by other traffic meanwhile
    engine.shutdown()
    return engine, states


def run_demo(quick: bool = False, trace: str | Path | None = None, plot: str | Path | None = None) -> int:
    """The demo; ``trace`` records every transition as NDJSON (then verifies it), ``plot`` draws the
    workload's engine-state timeline (needs matplotlib).

    Both paths, and matplotlib for ``plot``, are checked before anything runs: ConfigError (or
    PlotUnavailable) instead of a failure after the demo.
    """
    if trace is not None:
        require_output_file("trace file", trace)
    if plot is not None:
        require_output_file("plot file", plot)
        from kvfsm.observe.timeline import require_matplotlib

        require_matplotlib()
    with ExitStack() as stack:
        recorder = None
        if trace is not None:
            from kvfsm.data.events import copy_events_to
            from kvfsm.observe.trace import TraceRecorder

            # The data plane's copy events too (submitted / finished, with checksums): trace format 3.
            recorder = stack.enter_context(TraceRecorder(trace, data_plane=True))
            stack.enter_context(copy_events_to(recorder.copy_event))
        ok = _run_demo(quick, recorder, plot)
    if recorder is not None and trace is not None:
        from kvfsm.observe.trace import verify_trace_file

        report = verify_trace_file(trace)
        print(f"\ntrace: {recorder.records} transitions written to {trace}")
        print(f"  kvfsm check --trace: {report.summary()}")
        ok = ok and report.ok
    print("\nresult:", "OK" if ok else "FAILED")
    return 0 if ok else 1


def _turn_markers(records: list[StepRecord]) -> list[tuple[int, str]]:
    """The first step of each turn: the step after the engine went idle (and the very first step)."""
    marks: list[tuple[int, str]] = []
    prev: StepRecord | None = None
    for rec in records:
        if prev is None or prev.state is EngineState.IDLE:
            marks.append((rec.step, f"turn {len(marks) + 1}"))
        prev = rec
    return marks


#: The demo's engine: W=2, chunks of two blocks, a CPU tier small enough to show evictions.
DEMO_CONFIG = EngineConfig(
    num_layers=4,
    num_heads=4,
    head_dim=16,
    tokens_per_block=16,
    blocks_per_chunk=2,
    num_gpu_blocks=40,
    num_cpu_slots=16,
    world_size=2,
)


def _run_demo(quick: bool, recorder: TraceRecorder | None, plot: str | Path | None) -> bool:
    print("kvfsm demo: multi-turn prefix reuse through the reference engine (real torch copies)\n")
    if recorder is not None:
        recorder.scope("workload")
    cfg = DEMO_CONFIG
    t0 = time.perf_counter()
    engine, states = run_workload(cfg, users=3 if quick else 4, turns=2 if quick else 3)
    elapsed = time.perf_counter() - t0
    s = engine.scheduler.stats
    assert isinstance(engine.manager, CPUOffloadingManager)
    m = engine.manager.stats()
    print(f"engine timeline ({len(states)} steps): {compress_timeline(states)}\n")
    print(
        f"  store jobs {s.store_jobs} (committed {s.committed_stores}), load jobs {s.load_jobs} "
        f"(committed {s.committed_loads}), fence flushes {s.fence_flushes}, "
        f"allocation failures {s.allocation_failures}"
    )
    print(
        f"  CPU tier: lookups {m.lookups}, hits {m.hits}, misses {m.misses}, "
        f"hit_pending {m.hit_pending}, retries {m.lookup_retries}, evictions {m.evictions}"
    )
    integ = engine.integrity
    print(
        f"  integrity: {integ.blocks_verified} loaded block-layers verified byte for byte, "
        f"{integ.mismatches} mismatches, {integ.loads_completed} loads"
    )
    print(f"  all spec invariants held after every step; {elapsed:.2f} s\n")
    print("drain: request A finishes with its stores in flight; request B arrives during the next step")
    mib = 32 if quick else 128
    rounds: list[tuple[DrainResult, list[StepRecord]]] = []
    for mode in (DrainMode.NONBLOCKING, DrainMode.BLOCKING):
        if recorder is not None:
            recorder.scope(f"drain-{mode.value}")
        rounds.append(_drain_round(mode, mib))
    head = "A's stores in flight when B was scheduled"
    print(f"  {'mode':<12} {'stores':>7} {'B waited':>10} {'blocking waits':>15}  {head}")
    for r, _ in rounds:
        print(
            f"  {r.mode.value:<12} {r.store_bytes / 2**20:>4.0f}MiB {r.ms_waited:>7.2f} ms {r.blocking_waits:>15}  "
            f"{r.a_jobs_in_flight_when_scheduled:>{len(head)}}"
        )
    print("  per step (state after the step; what happened in it):")
    for r, records in rounds:
        print(f"  {r.mode.value}: {describe_drain_steps(records)}")
    (nb, _), (bl, _) = rounds
    ratio = bl.ms_waited / nb.ms_waited if nb.ms_waited > 0 else float("inf")
    print(
        f"  B is scheduled in the step after it arrives in both modes; the blocking step first waits for every copy: "
        f"B waited {ratio:.1f}x longer"
    )
    if plot is not None:
        from kvfsm.observe.timeline import plot_timeline

        records = list(engine.timeline)
        markers = _turn_markers(records)
        # The non-blocking drain round, appended after the workload: where the picture shows draining.
        offset = records[-1].step if records else 0
        markers.append((offset + 1, "drain"))
        records += [dataclasses.replace(rec, step=rec.step + offset) for rec in rounds[0][1]]
        path = plot_timeline(
            records,
            plot,
            title="kvfsm demo: engine state over steps (multi-turn prefix reuse, then the non-blocking drain; W=2)",
            markers=markers,
            zoom=(offset + 1, records[-1].step),
            zoom_title="zoom: the non-blocking drain",
        )
        print(f"\nengine timeline picture: {path}")
    return integ.mismatches == 0 and integ.blocks_verified > 0


def _drain_round(mode: DrainMode, mib: float) -> tuple[DrainResult, list[StepRecord]]:
    """:func:`measure_drain`, keeping the engine's step records for the per-step timeline."""
    blocks = _blocks_for(mib)
    engine = _BenchEngine(_config(mode, blocks))
    try:
        result = _round(engine, blocks, random.Random(0), "0")
        return result, list(engine.timeline)
    finally:
        engine.shutdown()


def describe_drain_steps(records: Sequence[StepRecord]) -> str:
    """``1 finishing (A ran; 1 job in flight) -> 2 draining (B arrived; 1 job in flight) -> ...``: one drain
    round read step by step. B arrives during the step after A's finishing step."""
    finishing = next((r.step for r in records if r.state is EngineState.FINISHING), None)
    parts = []
    for rec in records:
        what = []
        if finishing is not None and rec.step == finishing + 1:
            what.append("B arrived")
        if rec.flushed:
            what.append(f"blocked until {rec.flushed} job{'s' * (rec.flushed != 1)} finished")
        what.extend(f"{req_id[0]} ran" for req_id in rec.scheduled)
        what.append(f"{rec.jobs_in_flight} job{'s' * (rec.jobs_in_flight != 1)} in flight")
        parts.append(f"{rec.step} {rec.state.value} ({', '.join(what)})")
    return " -> ".join(parts)


def run_shared_demo(url: str, *, cluster: bool = False) -> int:
    """``kvfsm demo --shared URL``: engine A, then engine B, in two processes of their own, configured
    alike, on one Redis server (or cluster). B finds A's prefixes on the server, loads them (verified
    byte for byte) and computes none of them. Prints what B reused."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        from kvfsm.errors import ConfigError

        raise ConfigError(f"--shared {url!r}; expected a redis://host:port URL")
    from kvfsm.bench.redis import SHARED_CONFIG, ping, run_shared

    ping(url, cluster=cluster)  # one line and exit 2, not two failed engine runs, when nothing answers
    print(f"kvfsm demo --shared: two engine processes, one Redis server at {url}\n")
    result = run_shared(url, cluster=cluster)
    a, b = result.a, result.b
    bpc = SHARED_CONFIG.blocks_per_chunk
    for r in (a, b):
        print(
            f"  engine {r.role.upper()} (pid {r.pid}): computed {r.prefix_blocks_computed}/{r.prefix_blocks} "
            f"shared-prefix blocks, wrote {r.chunks_written_to_server * bpc} blocks "
            f"({r.bytes_written_to_server:,} bytes) to the server, loaded {r.chunks_loaded_from_server * bpc} "
            f"blocks ({r.bytes_loaded_from_server:,} bytes); {r.blocks_verified} loaded parts verified, "
            f"{r.mismatches} mismatches; idle at the end: {r.idle}"
        )
    same = sorted(set(a.chunk_digests) & set(b.chunk_digests))
    identical = sum(a.chunk_digests[k] == b.chunk_digests[k] for k in same)
    print(
        f"\nblocks reused across instances: {result.blocks_reused} ({b.bytes_loaded_from_server:,} bytes); "
        f"B's shared-prefix hit rate {result.hit_rate:.0%}; {identical}/{len(same)} chunks held by both "
        "byte-identical"
    )
    ok = (
        b.prefix_blocks_computed == 0
        and result.blocks_reused > 0
        and a.mismatches == 0
        and b.mismatches == 0
        and identical == len(same)
        and a.idle
        and b.idle
    )
    print("\nresult:", "OK" if ok else "FAILED")
    return 0 if ok else 1
