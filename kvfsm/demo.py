"""``kvfsm demo``: a multi-turn workload with prefix reuse through the reference engine, real copies.

Part 1 runs conversations whose turns share a system prompt and their own history, on a GPU pool too
small to keep it all, so later turns load their prefix back from the CPU tier. Every loaded block is
checked byte for byte against the value the stand-in forward pass wrote, and every spec invariant is
checked after every step.

Part 2 shows the drain: a request finishes with its stores in flight and a new request arrives during
the next step. Non-blocking, it is scheduled at once while the stores continue; under the blocking
baseline (vLLM #42611) it waits behind a flush of every transfer.
"""

from __future__ import annotations

import random
import time
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING

from kvfsm.bench_drain import DrainResult, compress_timeline, measure_drain
from kvfsm.control.config import DrainMode
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.engine.core import EngineConfig, ReferenceEngine, StepRecord
from kvfsm.invariants import SystemView, check_all
from kvfsm.states import EngineState

if TYPE_CHECKING:
    from kvfsm.trace import TraceRecorder

__all__ = ["DrainResult", "compress_timeline", "measure_drain", "run_demo", "run_workload"]


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
    workload's engine-state timeline (needs matplotlib)."""
    with ExitStack() as stack:
        recorder = None
        if trace is not None:
            from kvfsm.trace import TraceRecorder

            recorder = stack.enter_context(TraceRecorder(trace))
        ok = _run_demo(quick, recorder, plot)
    if recorder is not None and trace is not None:
        from kvfsm.trace import verify_trace_file

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


def _run_demo(quick: bool, recorder: TraceRecorder | None, plot: str | Path | None) -> bool:
    print("kvfsm demo: multi-turn prefix reuse through the reference engine (real torch copies)\n")
    if recorder is not None:
        recorder.scope("workload")
    cfg = EngineConfig(
        num_layers=4,
        num_heads=4,
        head_dim=16,
        tokens_per_block=16,
        blocks_per_chunk=2,
        num_gpu_blocks=40,
        num_cpu_slots=16,
        world_size=2,
    )
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
        f"hit_pending {m.hit_pending}, evictions {m.evictions}"
    )
    integ = engine.integrity
    print(
        f"  integrity: {integ.blocks_verified} loaded block-layers verified byte for byte, "
        f"{integ.mismatches} mismatches, {integ.loads_completed} loads"
    )
    print(f"  all spec invariants held after every step; {elapsed:.2f} s\n")
    if plot is not None:
        from kvfsm.timeline import plot_timeline

        records = list(engine.timeline)
        path = plot_timeline(
            records,
            plot,
            title="kvfsm demo: engine state over steps (multi-turn prefix reuse, W=2)",
            markers=_turn_markers(records),
        )
        print(f"engine timeline picture: {path}\n")
    print("drain: request A finishes with its stores in flight; request B arrives during the next step")
    mib = 32 if quick else 128
    results: list[DrainResult] = []
    for mode in (DrainMode.NONBLOCKING, DrainMode.BLOCKING):
        if recorder is not None:
            recorder.scope(f"drain-{mode.value}")
        results.append(measure_drain(mode, mib))
    print(f"  {'mode':<12} {'stores':>8} {'B waited':>10} {'ms':>9} {'A jobs left':>15} {'blocking waits':>15}")
    for r in results:
        print(
            f"  {r.mode.value:<12} {r.store_bytes / 2**20:>6.0f}MiB {r.steps_waited:>7} step "
            f"{r.ms_waited:>9.2f} {r.a_jobs_in_flight_when_scheduled:>15} {r.blocking_waits:>15}"
        )
    for r in results:
        print(f"  {r.mode.value} timeline: {r.timeline}")
    nb, bl = results
    ratio = bl.ms_waited / nb.ms_waited if nb.ms_waited > 0 else float("inf")
    print(f"  blocking / non-blocking wait: {ratio:.1f}x")
    return integ.mismatches == 0 and integ.blocks_verified > 0
