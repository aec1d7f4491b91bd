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
from dataclasses import dataclass

import torch

from kvfsm.control.config import DrainMode
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.engine.core import EngineConfig, ReferenceEngine
from kvfsm.invariants import SystemView, check_all
from kvfsm.states import EngineState

__all__ = ["DrainResult", "compress_timeline", "measure_drain", "run_demo", "run_workload"]


def compress_timeline(states: list[EngineState]) -> str:
    """running x12 -> finishing -> draining x3 -> idle"""
    parts: list[str] = []
    prev: EngineState | None = None
    count = 0
    for s in [*states, None]:
        if s == prev:
            count += 1
            continue
        if prev is not None:
            parts.append(prev.value + (f" x{count}" if count > 1 else ""))
        prev, count = s, 1
    return " -> ".join(parts)


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


@dataclass(frozen=True, slots=True)
class DrainResult:
    mode: DrainMode
    store_bytes: int
    steps_waited: int
    ms_waited: float
    #: A's store jobs still uncommitted when B was scheduled (0 means B waited for all of them).
    a_jobs_in_flight_when_scheduled: int
    blocking_waits: int
    timeline: str


def measure_drain(mode: DrainMode, store_mib: int = 64, seed: int = 0) -> DrainResult:
    """Request A leaves ~store_mib MiB of stores; B arrives during the very next step."""
    heads, head_dim, layers, tpb = 8, 64, 8, 16
    block_bytes = 2 * heads * tpb * head_dim * layers * 2  # K and V, fp16, all layers
    blocks = max(2, store_mib * 2**20 // block_bytes)
    cfg = EngineConfig(
        num_layers=layers,
        num_heads=heads,
        head_dim=head_dim,
        tokens_per_block=tpb,
        num_gpu_blocks=blocks + 16,
        num_cpu_slots=blocks + 16,
        dtype=torch.float16,
        drain=mode,
        max_num_batched_tokens=(blocks + 2) * tpb,
    )
    engine = ReferenceEngine(cfg)
    rng = random.Random(seed)
    a = engine.make_request("A", [rng.randrange(1, 30000) for _ in range(blocks * tpb + 1)], max_tokens=1)
    engine.add_request(a)
    while engine.state is not EngineState.FINISHING:
        engine.step()
    b = engine.make_request("B", [rng.randrange(1, 30000) for _ in range(2 * tpb)], max_tokens=1)
    engine.add_request_during_next_step(b)
    arrival_step = engine.step_count + 1
    in_flight = 0
    while b.first_scheduled_step is None:
        engine.step()
        in_flight = len(engine.scheduler.request_jobs("A"))
    assert b.first_scheduled_time is not None
    waited_ms = (b.first_scheduled_time - b.arrival_time) * 1e3
    steps = b.first_scheduled_step - arrival_step
    engine.run_until_idle()
    engine.shutdown()
    timeline = compress_timeline([rec.state for rec in engine.timeline])
    return DrainResult(mode, blocks * block_bytes, steps, waited_ms, in_flight, engine.blocking_waits, timeline)


def run_demo(quick: bool = False) -> int:
    print("kvfsm demo: multi-turn prefix reuse through the reference engine (real torch copies)\n")
    cfg = EngineConfig(
        num_layers=4,
        num_heads=4,
        head_dim=16,
        tokens_per_block=16,
        blocks_per_chunk=2,
        num_gpu_blocks=40,
        num_cpu_slots=48,
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
        f"  CPU tier: lookups {m['lookups']}, hits {m['hits']}, misses {m['misses']}, "
        f"hit_pending {m['hit_pending']}, evictions {m['evictions']}"
    )
    integ = engine.integrity
    print(
        f"  integrity: {integ.blocks_verified} loaded block-layers verified byte for byte, "
        f"{integ.mismatches} mismatches, {integ.loads_completed} loads"
    )
    print(f"  all spec invariants held after every step; {elapsed:.2f} s\n")
    print("drain: request A finishes with its stores in flight; request B arrives during the next step")
    mib = 32 if quick else 128
    results = [measure_drain(mode, mib) for mode in (DrainMode.NONBLOCKING, DrainMode.BLOCKING)]
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
    ok = integ.mismatches == 0 and integ.blocks_verified > 0
    print("\nresult:", "OK" if ok else "FAILED")
    return 0 if ok else 1
