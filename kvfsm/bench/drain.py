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
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from typing_extensions import override

from kvfsm.control.config import DrainMode
from kvfsm.engine.core import EngineConfig, ReferenceEngine
from kvfsm.errors import ConfigError
from kvfsm.machines.names import EngineState

__all__ = [
    "FULL_SIZES_MIB",
    "QUICK_SIZES_MIB",
    "DrainPoint",
    "DrainResult",
    "block_bytes",
    "compress_timeline",
    "drain_sweep",
    "measure_drain",
    "measure_drain_rounds",
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


def _config(mode: DrainMode, blocks: int) -> EngineConfig:
    return EngineConfig(
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
