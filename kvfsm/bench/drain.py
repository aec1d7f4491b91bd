"""Drain responsiveness: how long a new request waits behind the last stores of a finished one.

Request A is prefilled in one step and finishes at once, leaving D bytes of store jobs in flight (real
copies on the copy threads). Request B arrives during the very next step. We measure the wall time and
the number of steps from B's arrival until B is first scheduled, in the non-blocking drain (vLLM
#45595: the engine keeps stepping, nothing waits) and in the blocking-flush baseline (vLLM #42611: the
step with no live request left flushes every job and waits for it).

The stand-in forward of the reference engine computes a deterministic pattern per (block, layer); with
thousands of blocks that is seconds of set-up per run, so the benchmark engine writes one precomputed
pattern per layer instead (:class:`_BenchEngine`). Nothing else changes: the same scheduler, workers,
copy backend and engine machine, and the measured window does not include the forward of A.

The CPU cost of a drain (:func:`measure_drain_cpu`): 8 requests finish in one step leaving their stores
in flight, and the engine (a CPU primary in front of a file-system tier) steps until idle with nothing
else to do: the copies, then the cascades to disk. Per drained (committed) store job: the process's CPU
time (``time.process_time``: the engine thread and the copy threads), the engine thread's alone
(``time.thread_time``) and the steps taken, for ``PollMode.BUSY`` (every polling step returns at once,
the behaviour before issue 13) against ``PollMode.WAIT`` (a polling step waits on the readiness signal).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from typing_extensions import override

from kvfsm.control.config import DrainMode
from kvfsm.engine.core import EngineConfig, PollMode, ReferenceEngine
from kvfsm.errors import ConfigError
from kvfsm.machines.names import EngineState

__all__ = [
    "CPU_DRAIN_BLOCKS",
    "CPU_DRAIN_REQUESTS",
    "FULL_SIZES_MIB",
    "PROMOTION_BLOCKS",
    "QUICK_SIZES_MIB",
    "DrainCpuPoint",
    "DrainCpuResult",
    "DrainPoint",
    "DrainResult",
    "block_bytes",
    "compress_timeline",
    "drain_cpu_point",
    "drain_sweep",
    "measure_drain",
    "measure_drain_cpu",
    "measure_drain_rounds",
    "promotion_cpu_point",
]

FULL_SIZES_MIB: tuple[int, ...] = (1, 4, 16, 64, 256, 1024)
QUICK_SIZES_MIB: tuple[int, ...] = (1, 8, 64)

_HEADS, _HEAD_DIM, _LAYERS, _TPB = 8, 64, 8, 16


def block_bytes() -> int:
    """Bytes of one block over all layers in the benchmark engine (K and V, fp16): 256 KiB."""
    return 2 * _HEADS * _TPB * _HEAD_DIM * _LAYERS * 2


def compress_timeline(states: Sequence[EngineState]) -> str:
    """``running x12 -> finishing -> draining x3 -> idle``"""
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


class _BenchEngine(ReferenceEngine):
    """The reference engine with a cheap stand-in forward: one cached pattern per layer."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._patterns: dict[int, torch.Tensor] = {}

    @override
    def expected_block(self, key: bytes, layer: int) -> torch.Tensor:
        pattern = self._patterns.get(layer)
        if pattern is None:
            pattern = self._patterns[layer] = super().expected_block(b"bench-block", layer)
        return pattern


@dataclass(frozen=True, slots=True)
class DrainResult:
    """One round: A leaves ``store_bytes`` of stores in flight, B arrives during the next step."""

    mode: DrainMode
    store_bytes: int
    steps_waited: int
    ms_waited: float
    #: A's store jobs uncommitted when B arrived (0: the copies were already done within A's last step).
    a_jobs_in_flight_at_arrival: int
    #: A's store jobs still uncommitted when B was scheduled (0: B waited for all of them, or they were done).
    a_jobs_in_flight_when_scheduled: int
    blocking_waits: int
    timeline: str


def _config(mode: DrainMode, blocks: int, poll: PollMode = PollMode.WAIT) -> EngineConfig:
    return EngineConfig(
        poll=poll,
        num_layers=_LAYERS,
        num_heads=_HEADS,
        head_dim=_HEAD_DIM,
        tokens_per_block=_TPB,
        num_gpu_blocks=blocks + 16,
        num_cpu_slots=blocks + 16,
        dtype=torch.float16,
        drain=mode,
        max_num_batched_tokens=(blocks + 2) * _TPB,
    )


def _blocks_for(store_mib: float) -> int:
    if store_mib <= 0:
        raise ConfigError(f"store size must be > 0 MiB, got {store_mib!r}")
    return max(2, int(store_mib * 2**20) // block_bytes())


def _round(engine: ReferenceEngine, blocks: int, rng: random.Random, tag: str) -> DrainResult:
    waits_before = engine.blocking_waits
    first_step = len(engine.timeline)
    a = engine.make_request(f"A{tag}", [rng.randrange(1, 30000) for _ in range(blocks * _TPB + 1)], max_tokens=1)
    engine.add_request(a)
    while engine.state is not EngineState.FINISHING:
        if engine.step() is None:
            raise AssertionError("engine went idle before request A finished")
    # Small stores may already be done (and acked by this step's poll): that is measured, not assumed.
    at_arrival = len(engine.scheduler.request_jobs(a.req_id))
    b = engine.make_request(f"B{tag}", [rng.randrange(1, 30000) for _ in range(2 * _TPB)], max_tokens=1)
    engine.add_request_during_next_step(b)
    arrival_step = engine.step_count + 1
    in_flight = 0
    while b.first_scheduled_step is None:
        engine.step()
        in_flight = len(engine.scheduler.request_jobs(a.req_id))
    assert b.first_scheduled_time is not None
    waited_ms = (b.first_scheduled_time - b.arrival_time) * 1e3
    steps = b.first_scheduled_step - arrival_step
    # The measurement is over. Let the copies finish before draining: on a CPU-only machine an engine
    # stepping back to back holds the GIL and starves the copy threads (thousands of empty steps).
    engine.wait_for_transfers()
    engine.run_until_idle()
    timeline = compress_timeline([rec.state for rec in engine.timeline[first_step:]])
    return DrainResult(
        engine.config.drain,
        blocks * block_bytes(),
        steps,
        waited_ms,
        at_arrival,
        in_flight,
        engine.blocking_waits - waits_before,
        timeline,
    )


def measure_drain_rounds(mode: DrainMode, store_mib: float, seed: int = 0, repeats: int = 1) -> list[DrainResult]:
    """``repeats`` rounds on one engine (the first one also faults in its memory)."""
    blocks = _blocks_for(store_mib)
    engine = _BenchEngine(_config(mode, blocks))
    rng = random.Random(seed)
    try:
        return [_round(engine, blocks, rng, str(i)) for i in range(repeats)]
    finally:
        engine.shutdown()


def measure_drain(mode: DrainMode, store_mib: float = 64, seed: int = 0) -> DrainResult:
    """One round on a fresh engine: A leaves ~``store_mib`` MiB of stores, B arrives during the next step."""
    return measure_drain_rounds(mode, store_mib, seed, 1)[0]


@dataclass(frozen=True, slots=True)
class DrainPoint:
    """Both modes at one store size: medians over the rounds."""

    store_bytes: int
    nonblocking: list[DrainResult]
    blocking: list[DrainResult]

    @staticmethod
    def _ms(results: list[DrainResult]) -> float:
        return statistics.median(r.ms_waited for r in results)

    @staticmethod
    def _steps(results: list[DrainResult]) -> int:
        return max(r.steps_waited for r in results)

    @property
    def nonblocking_ms(self) -> float:
        return self._ms(self.nonblocking)

    @property
    def blocking_ms(self) -> float:
        return self._ms(self.blocking)

    @property
    def nonblocking_steps(self) -> int:
        return self._steps(self.nonblocking)

    @property
    def blocking_steps(self) -> int:
        return self._steps(self.blocking)

    @property
    def ratio(self) -> float:
        nb = self.nonblocking_ms
        return self.blocking_ms / nb if nb > 0 else float("inf")

    def as_dict(self) -> dict[str, object]:
        def side(results: list[DrainResult]) -> dict[str, object]:
            return {
                "steps": self._steps(results),
                "ms_median": self._ms(results),
                "ms": [r.ms_waited for r in results],
                "a_jobs_in_flight_at_arrival": [r.a_jobs_in_flight_at_arrival for r in results],
                "a_jobs_in_flight_when_scheduled": [r.a_jobs_in_flight_when_scheduled for r in results],
                "blocking_waits": sum(r.blocking_waits for r in results),
                "timeline": results[0].timeline,
            }

        return {
            "store_mib": self.store_bytes / 2**20,
            "nonblocking": side(self.nonblocking),
            "blocking": side(self.blocking),
            "ratio_blocking_over_nonblocking": self.ratio,
        }


def drain_sweep(
    sizes_mib: Sequence[float],
    repeats: int = 3,
    seed: int = 0,
    on_point: Callable[[DrainPoint], None] | None = None,
) -> list[DrainPoint]:
    """Both modes at every size; ``on_point`` is called after each size (progress)."""
    points: list[DrainPoint] = []
    for i, mib in enumerate(sizes_mib):
        nb = measure_drain_rounds(DrainMode.NONBLOCKING, mib, seed + i, repeats)
        bl = measure_drain_rounds(DrainMode.BLOCKING, mib, seed + i, repeats)
        point = DrainPoint(nb[0].store_bytes, nb, bl)
        points.append(point)
        if on_point is not None:
            on_point(point)
    return points


# ---------------------------------------------------------------------------------------------- CPU


#: The CPU-per-drained-job rounds: this many requests finish in one step, each leaving one store job of
#: this many blocks (256 KiB each: 8 x 2 MiB), which then also cascade to a file-system tier.
CPU_DRAIN_REQUESTS = 8
CPU_DRAIN_BLOCKS = 8


class _BenchTierEngine(_BenchEngine):
    """The benchmark engine with a file-system tier behind its CPU primary."""

    def __init__(self, config: EngineConfig, root: str) -> None:
        from kvfsm.tiers.fs import FileSystemTier

        ReferenceEngine.__init__(self, config, tiers=[FileSystemTier(root, scan=False)])
        self._patterns = {}


@dataclass(frozen=True, slots=True)
class DrainCpuResult:
    """One drain: the requests finished; ``jobs`` store jobs committed while the engine stepped ``steps``
    times (until idle: their cascades to the file-system tier done too)."""

    poll: PollMode
    jobs: int
    steps: int
    #: CPU seconds of the whole process (engine thread, copy threads, tier I/O threads) during the drain.
    cpu_s: float
    #: CPU seconds of the engine thread alone.
    engine_cpu_s: float
    wall_s: float

    @property
    def cpu_ms_per_job(self) -> float:
        return self.cpu_s * 1e3 / self.jobs

    @property
    def engine_cpu_ms_per_job(self) -> float:
        return self.engine_cpu_s * 1e3 / self.jobs

    @property
    def steps_per_job(self) -> float:
        return self.steps / self.jobs


def _cpu_round(engine: ReferenceEngine, rng: random.Random, tag: str) -> DrainCpuResult:
    for i in range(CPU_DRAIN_REQUESTS):
        prompt = [rng.randrange(1, 30000) for _ in range(CPU_DRAIN_BLOCKS * _TPB + 1)]
        engine.add_request(engine.make_request(f"A{tag}-{i}", prompt, max_tokens=1))
    while engine.state is not EngineState.FINISHING:
        if engine.step() is None:
            raise AssertionError("engine went idle before the requests finished")
    committed = engine.scheduler.stats.committed_stores
    cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
    steps = engine.run_until_idle(max_steps=10_000_000)
    wall = time.perf_counter() - wall0
    cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
    jobs = engine.scheduler.stats.committed_stores - committed
    if jobs <= 0:
        raise AssertionError("the requests left no stores to drain")
    return DrainCpuResult(engine.config.poll, jobs, steps, cpu, thread, wall)


def measure_drain_cpu(poll: PollMode, seed: int = 0, repeats: int = 3) -> list[DrainCpuResult]:
    """``repeats`` drains on one engine (CPU primary and a file-system tier) polling in ``poll`` mode."""
    import tempfile

    blocks = CPU_DRAIN_REQUESTS * (CPU_DRAIN_BLOCKS + 1)
    config = EngineConfig(
        poll=poll,
        num_layers=_LAYERS,
        num_heads=_HEADS,
        head_dim=_HEAD_DIM,
        tokens_per_block=_TPB,
        num_gpu_blocks=blocks + 16,
        num_cpu_slots=blocks * (repeats + 2),  # no eviction: every round drains the same work
        dtype=torch.float16,
        max_num_batched_tokens=(blocks + 2) * _TPB,
    )
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="kvfsm-bench-") as root:
        engine = _BenchTierEngine(config, root)
        try:
            _cpu_round(engine, rng, "warm")  # faults the pools and the KV cache in
            return [_cpu_round(engine, rng, str(i)) for i in range(repeats)]
        finally:
            engine.shutdown()


@dataclass(frozen=True, slots=True)
class DrainCpuPoint:
    """Both poll modes on the same drains: medians over the rounds."""

    busy: list[DrainCpuResult]
    wait: list[DrainCpuResult]

    @staticmethod
    def median(results: list[DrainCpuResult], what: str) -> float:
        return statistics.median(float(getattr(r, what)) for r in results)

    def ratio(self, what: str) -> float:
        """busy / wait of the median of ``what`` (a DrainCpuResult property)."""
        w = self.median(self.wait, what)
        return self.median(self.busy, what) / w if w > 0 else float("inf")

    def as_dict(self) -> dict[str, object]:
        metrics = ("cpu_ms_per_job", "engine_cpu_ms_per_job", "steps_per_job", "wall_s")

        def side(results: list[DrainCpuResult]) -> dict[str, object]:
            out: dict[str, object] = {f"{m}_median": self.median(results, m) for m in metrics}
            out["jobs"] = [r.jobs for r in results]
            out["steps"] = [r.steps for r in results]
            out["cpu_s"] = [r.cpu_s for r in results]
            out["engine_cpu_s"] = [r.engine_cpu_s for r in results]
            out["wall_s"] = [r.wall_s for r in results]
            return out

        return {
            "busy": side(self.busy),
            "wait": side(self.wait),
            **{f"ratio_busy_over_wait_{m}": self.ratio(m) for m in metrics},
        }


def drain_cpu_point(repeats: int = 3, seed: int = 0) -> DrainCpuPoint:
    """The same drains polled busily and with the readiness wait, one after the other."""
    busy = measure_drain_cpu(PollMode.BUSY, seed, repeats)
    wait = measure_drain_cpu(PollMode.WAIT, seed, repeats)
    return DrainCpuPoint(busy, wait)


#: Blocks of the prompt whose KV a second engine promotes from the file-system tier (issue 13: about
#: 1,229 busy engine steps for 4 blocks).
PROMOTION_BLOCKS = 4


def _promotion_round(poll: PollMode, root: str, rng: random.Random) -> DrainCpuResult:
    """A cold engine stores a prompt's KV down to disk; a fresh engine over the same directory runs it
    again: its lookup promotes the chunks from disk and loads them. Measured: that second run."""
    from kvfsm.tiers.fs import FileSystemTier

    config = EngineConfig(poll=poll, device="cpu", tokens_per_block=_TPB, num_cpu_slots=16)
    prompt = [rng.randrange(1, 30000) for _ in range(PROMOTION_BLOCKS * _TPB + 1)]
    result: DrainCpuResult | None = None
    for run in ("cold", "warm"):
        tier = FileSystemTier(root)
        if not tier.wait_scan(60.0):
            raise AssertionError("the file-system tier's scan never finished")
        engine = ReferenceEngine(config, tiers=[tier])
        try:
            engine.add_request(engine.make_request(run, prompt, max_tokens=1))
            cpu0, thread0, wall0 = time.process_time(), time.thread_time(), time.perf_counter()
            steps = engine.run_until_idle(max_steps=10_000_000)
            wall = time.perf_counter() - wall0
            cpu, thread = time.process_time() - cpu0, time.thread_time() - thread0
        finally:
            engine.shutdown()
        if run == "warm":
            if engine.integrity.loads_completed != 1 or engine.integrity.mismatches:
                raise AssertionError(f"the warm run did not load its prefix from disk: {engine.integrity}")
            result = DrainCpuResult(poll, 1, steps, cpu, thread, wall)
    assert result is not None
    return result


def promotion_cpu_point(repeats: int = 3, seed: int = 0) -> DrainCpuPoint:
    """A 4-block promotion from a file-system tier, busy polling against the readiness wait (per
    promoted request: ``jobs`` is 1)."""
    import tempfile

    rng = random.Random(seed)
    sides: dict[PollMode, list[DrainCpuResult]] = {PollMode.BUSY: [], PollMode.WAIT: []}
    for _ in range(repeats):
        for poll, results in sides.items():
            with tempfile.TemporaryDirectory(prefix="kvfsm-bench-") as root:
                results.append(_promotion_round(poll, root, rng))
    return DrainCpuPoint(sides[PollMode.BUSY], sides[PollMode.WAIT])
