"""Side by side with vLLM 0.33: kvfsm's CPU manager against vLLM's own, same trace, same process.

Each round replays one seeded prefix-reuse trace (:mod:`kvfsm.bench.workload`) through three managers,
one after the other, in an order that alternates between rounds:

- ``vllm``: vLLM's ``CPUOffloadingManager`` (``lru`` or ``arc``);
- ``kvfsm``: kvfsm's ``CPUOffloadingManager`` with the request-scoped policy of the same name (vLLM's
  rules), called with kvfsm's own types;
- ``adapter``: the same kvfsm manager behind :class:`kvfsm.vllm.KvfsmCPUOffloadingManager`, called with
  vLLM's types, as vLLM's connector calls it.

Every manager operation is timed per call (``perf_counter_ns``); a round gives µs per call of each, and
the table shows the median over rounds and the ratio kvfsm / vLLM (below 1: kvfsm is faster). The
replay is the connector's: look up a request's prefix, load the hits, touch, store the rest, complete
the loads and stores ``in_flight`` requests later, then finish the request. Positions are recorded for
every key as vLLM's scheduler records them. Runs only where vLLM is installed (``kvfsm[vllm]``).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.types import OffloadKey, ReqContext

__all__ = ["MANAGER_OPS", "SideBySide", "run_side_by_side", "vllm_available"]

MANAGER_OPS: tuple[str, ...] = ("lookup", "prepare_load", "touch", "prepare_store", "complete_load", "complete_store")
SIDES: tuple[str, ...] = ("vllm", "kvfsm", "adapter")


def vllm_available() -> bool:
    try:
        import kvfsm.vllm.manager
        import kvfsm.vllm.native  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class SideBySide:
    policy: str
    capacity: float
    num_slots: int
    rounds: int
    #: side -> op -> median µs per call
    us: dict[str, dict[str, float]]
    #: side -> median replay wall seconds (timing included)
    wall_s: dict[str, float]
    #: side -> hit blocks of the replay (the same trace: a difference is a policy difference)
    hits: dict[str, int]

    def ratio(self, side: str, op: str) -> float:
        return self.us[side][op] / self.us["vllm"][op]


_Ctx = Callable[[int, Sequence[OffloadKey]], Any]


def _replay(
    manager: Any, make_ctx: _Ctx, requests: Sequence[Sequence[OffloadKey]], in_flight: int
) -> tuple[dict[str, float], int]:
    clock = time.perf_counter_ns
    ns = dict.fromkeys(MANAGER_OPS, 0)
    calls = dict.fromkeys(MANAGER_OPS, 0)
    lookup, prepare_load, touch = manager.lookup, manager.prepare_load, manager.touch
    prepare_store, complete_load, complete_store = manager.prepare_store, manager.complete_load, manager.complete_store
    finish = manager.on_request_finished
    pending: deque[tuple[Any, list[OffloadKey], list[OffloadKey]]] = deque()
    hit_blocks = 0

    def retire() -> None:
        ctx, loaded, stored = pending.popleft()
        if loaded:
            t = clock()
            complete_load(loaded, ctx)
            ns["complete_load"] += clock() - t
            calls["complete_load"] += 1
        if stored:
            t = clock()
            complete_store(stored, ctx)
            ns["complete_store"] += clock() - t
            calls["complete_store"] += 1
        finish(ctx)

    for i, keys in enumerate(requests):
        ctx = make_ctx(i, keys)
        hits = 0
        for key in keys:
            t = clock()
            r = lookup(key, ctx)
            ns["lookup"] += clock() - t
            calls["lookup"] += 1
            if r.name != "HIT":
                break
            hits += 1
        hit_blocks += hits
        loaded = list(keys[:hits])
        if hits:
            t = clock()
            prepare_load(loaded, ctx)
            ns["prepare_load"] += clock() - t
            calls["prepare_load"] += 1
        t = clock()
        touch(keys, ctx)
        ns["touch"] += clock() - t
        calls["touch"] += 1
        t = clock()
        out = prepare_store(keys[hits:], ctx)
        ns["prepare_store"] += clock() - t
        calls["prepare_store"] += 1
        pending.append((ctx, loaded, list(out.keys_to_store) if out is not None else []))
        if len(pending) > in_flight:
            retire()
    while pending:
        retire()
    return {op: ns[op] / 1000 / max(1, calls[op]) for op in MANAGER_OPS}, hit_blocks


def run_side_by_side(
    requests: Sequence[Sequence[OffloadKey]],
    *,
    policy: str = "lru",
    capacity: float = 0.25,
    rounds: int = 3,
    in_flight: int = 8,
    tokens_per_block: int = 16,
) -> SideBySide:
    """Alternated rounds of the three sides on ``requests``; medians per side and operation."""
    from kvfsm.vllm.manager import KvfsmCPUOffloadingManager
    from kvfsm.vllm.native import native_cpu_manager, vllm_request_context

    distinct = len({k for keys in requests for k in keys})
    num_slots = max(1, round(distinct * capacity))

    def positions(keys: Sequence[OffloadKey]) -> dict[OffloadKey, int]:
        return {key: (j + 1) * tokens_per_block for j, key in enumerate(keys)}

    def vllm_ctx(i: int, keys: Sequence[OffloadKey]) -> Any:
        return vllm_request_context(f"r{i}", positions(keys))

    def build(side: str) -> tuple[Any, _Ctx]:
        if side == "vllm":
            return native_cpu_manager(num_slots, policy), vllm_ctx
        if side == "adapter":
            return KvfsmCPUOffloadingManager(num_slots, policy), vllm_ctx
        manager = CPUOffloadingManager(num_slots, f"request-{policy}", enable_events=False)

        def kvfsm_ctx(i: int, keys: Sequence[OffloadKey]) -> ReqContext:
            ctx = ReqContext(f"r{i}")
            manager.on_new_request(ctx, key_position=positions(keys).get)
            return ctx

        return manager, kvfsm_ctx

    per_round: dict[str, list[dict[str, float]]] = {s: [] for s in SIDES}
    walls: dict[str, list[float]] = {s: [] for s in SIDES}
    hits: dict[str, int] = {}
    for r in range(rounds):
        order = SIDES if r % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            manager, make_ctx = build(side)
            t0 = time.perf_counter()
            us, hit_blocks = _replay(manager, make_ctx, requests, in_flight)
            walls[side].append(time.perf_counter() - t0)
            per_round[side].append(us)
            hits[side] = hit_blocks
    us_median = {s: {op: statistics.median(rnd[op] for rnd in per_round[s]) for op in MANAGER_OPS} for s in SIDES}
    wall_median = {s: statistics.median(walls[s]) for s in SIDES}
    return SideBySide(policy, capacity, num_slots, rounds, us_median, wall_median, hits)
