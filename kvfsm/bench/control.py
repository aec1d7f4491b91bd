"""Control-plane cost: trace replay through the CPU tier manager, and the scheduler's per-step cost.

Replay follows vLLM's call order per request: ``lookup`` key by key until the first non-HIT, then
``prepare_load`` (the hit prefix), ``touch`` (every key of the request), ``prepare_store`` (the keys
after the hit prefix). At most ``in_flight`` requests are in flight: when one more arrives, the oldest
gets ``complete_load``, ``complete_store`` and ``on_request_finished``. The remaining ones finish at
the end of the trace.

Two passes per capacity, in the same process: one with a timer around every call (µs per call per
operation) and one without (the wall time of the whole replay, the headline number).
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.errors import ConfigError

__all__ = [
    "OPERATIONS",
    "ReplayResult",
    "StepCost",
    "replay",
    "replay_wall_s",
    "scheduler_step_cost",
]

OPERATIONS: tuple[str, ...] = (
    "lookup",
    "prepare_load",
    "touch",
    "prepare_store",
    "complete_load",
    "complete_store",
    "finish",
)


@dataclass(slots=True)
class ReplayResult:
    capacity: float  #: CPU slots as a fraction of the trace's distinct blocks
    num_slots: int
    requests: int
    wall_s: float  #: untimed pass (best of the repeats)
    timed_wall_s: float  #: the pass with a timer around every call
    #: CPU time of the untimed pass (best of the repeats): its wall time on an idle machine, since the
    #: replay is single-threaded; on a shared machine the wall time also counts waiting for a core.
    cpu_s: float = 0.0
    calls: dict[str, int] = field(default_factory=dict)
    total_ns: dict[str, int] = field(default_factory=dict)
    hit_blocks: int = 0
    looked_up_blocks: int = 0
    stored_blocks: int = 0
    store_refusals: int = 0  #: prepare_store returned None (everything evictable was pinned)
    evictions: int = 0

    def us_per_call(self, op: str) -> float:
        n = self.calls.get(op, 0)
        return self.total_ns.get(op, 0) / n / 1e3 if n else 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.looked_up_blocks if self.looked_up_blocks else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "capacity": self.capacity,
            "num_slots": self.num_slots,
            "requests": self.requests,
            "wall_s": self.wall_s,
            "cpu_s": self.cpu_s,
            "timed_wall_s": self.timed_wall_s,
            "us_per_call": {op: self.us_per_call(op) for op in OPERATIONS},
            "calls": dict(self.calls),
            "hit_rate": self.hit_rate,
            "stored_blocks": self.stored_blocks,
            "store_refusals": self.store_refusals,
            "evictions": self.evictions,
        }


_Inflight = tuple[ReqContext, Sequence[OffloadKey], Sequence[OffloadKey]]


def _replay_untimed(manager: CPUOffloadingManager, requests: Sequence[Sequence[OffloadKey]], in_flight: int) -> None:
    lookup, prepare_load, touch = manager.lookup, manager.prepare_load, manager.touch
    prepare_store, complete_load, complete_store = manager.prepare_store, manager.complete_load, manager.complete_store
    finish = manager.on_request_finished
    hit = LookupResult.HIT
    pending: deque[_Inflight] = deque()

    def retire() -> None:
        ctx, loaded, stored = pending.popleft()
        if loaded:
            complete_load(loaded, ctx)
        if stored:
            complete_store(stored, ctx)
        finish(ctx)

    for i, keys in enumerate(requests):
        ctx = ReqContext(f"r{i}")
        hits = 0
        for key in keys:
            if lookup(key, ctx) is not hit:
                break
            hits += 1
        loaded = keys[:hits]
        if hits:
            prepare_load(loaded, ctx)
        touch(keys, ctx)
        out = prepare_store(keys[hits:], ctx)
        pending.append((ctx, loaded, out.keys_to_store if out is not None else ()))
        if len(pending) > in_flight:
            retire()
    while pending:
        retire()


def _replay_timed(
    manager: CPUOffloadingManager, requests: Sequence[Sequence[OffloadKey]], in_flight: int, result: ReplayResult
) -> None:
    clock = time.perf_counter_ns
    ns = dict.fromkeys(OPERATIONS, 0)
    calls = dict.fromkeys(OPERATIONS, 0)
    hit = LookupResult.HIT
    pending: deque[_Inflight] = deque()

    def retire() -> None:
        ctx, loaded, stored = pending.popleft()
        if loaded:
            t = clock()
            manager.complete_load(loaded, ctx)
            ns["complete_load"] += clock() - t
            calls["complete_load"] += 1
        if stored:
            t = clock()
            manager.complete_store(stored, ctx)
            ns["complete_store"] += clock() - t
            calls["complete_store"] += 1
        t = clock()
        manager.on_request_finished(ctx)
        ns["finish"] += clock() - t
        calls["finish"] += 1

    for i, keys in enumerate(requests):
        ctx = ReqContext(f"r{i}")
        hits = 0
        for key in keys:
            t = clock()
            r = manager.lookup(key, ctx)
            ns["lookup"] += clock() - t
            calls["lookup"] += 1
            if r is not hit:
                break
            hits += 1
        result.looked_up_blocks += len(keys)
        result.hit_blocks += hits
        loaded = keys[:hits]
        if hits:
            t = clock()
            manager.prepare_load(loaded, ctx)
            ns["prepare_load"] += clock() - t
            calls["prepare_load"] += 1
        t = clock()
        manager.touch(keys, ctx)
        ns["touch"] += clock() - t
        calls["touch"] += 1
        t = clock()
        out = manager.prepare_store(keys[hits:], ctx)
        ns["prepare_store"] += clock() - t
        calls["prepare_store"] += 1
        if out is None:
            result.store_refusals += 1
            stored: Sequence[OffloadKey] = ()
        else:
            stored = out.keys_to_store
            result.stored_blocks += len(stored)
        pending.append((ctx, loaded, stored))
        if len(pending) > in_flight:
            retire()
    while pending:
        retire()
    result.total_ns, result.calls = ns, calls


def _num_slots(requests: Sequence[Sequence[OffloadKey]], capacity: float) -> int:
    if not capacity > 0:
        raise ConfigError(f"capacity must be > 0 (a fraction of the distinct blocks), got {capacity!r}")
    distinct = len({k for keys in requests for k in keys})
    return max(1, round(distinct * capacity))


def replay_wall_s(
    requests: Sequence[Sequence[OffloadKey]], capacity: float, in_flight: int = 8, policy: str = "lru"
) -> tuple[float, float]:
    """(wall, CPU) seconds of one untimed replay on a fresh manager (events off, as a harness would)."""
    manager = CPUOffloadingManager(_num_slots(requests, capacity), policy, enable_events=False)
    c0, t0 = time.process_time(), time.perf_counter()
    _replay_untimed(manager, requests, in_flight)
    return time.perf_counter() - t0, time.process_time() - c0


def replay(
    requests: Sequence[Sequence[OffloadKey]],
    capacity: float,
    *,
    in_flight: int = 8,
    policy: str = "lru",
    repeats: int = 1,
) -> ReplayResult:
    """Replay ``requests`` (keys per request) at ``capacity``: a timed pass, then ``repeats`` untimed ones
    (``wall_s`` is the best of them)."""
    if in_flight < 1:
        raise ConfigError(f"in_flight must be >= 1, got {in_flight!r}")
    num_slots = _num_slots(requests, capacity)
    manager = CPUOffloadingManager(num_slots, policy, enable_events=False)
    result = ReplayResult(capacity, num_slots, len(requests), 0.0, 0.0)
    t0 = time.perf_counter()
    _replay_timed(manager, requests, in_flight, result)
    result.timed_wall_s = time.perf_counter() - t0
    result.evictions = manager.stats().evictions
    if manager.num_writing or manager.num_reading:
        raise AssertionError(f"replay left slots pinned: {manager.stats()}")
    # Best of the untimed passes, as timeit does: other load on the machine only ever adds time.
    passes = [replay_wall_s(requests, capacity, in_flight, policy) for _ in range(max(1, repeats))]
    result.wall_s = min(w for w, _ in passes)
    result.cpu_s = min(c for _, c in passes)
    return result


# ---------------------------------------------------------------------------- scheduler per-step cost


@dataclass(slots=True)
class _Req:
    """A running request as the scheduler half reads it (the OffloadRequest protocol)."""

    req_id: str
    block_hashes: list[bytes]
    num_tokens: int
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    is_aborted: bool = False


@dataclass(frozen=True, slots=True)
class StepCost:
    kind: str  #: "decode" or "prefill"
    num_requests: int
    us_per_step: float  #: median over the measured steps: build_connector_meta + update_connector_output
    build_us: float
    update_us: float
    jobs_per_step: float
    #: median thread CPU time per step (excludes time spent waiting for a core on a shared machine)
    cpu_us_per_step: float = 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "num_requests": self.num_requests,
            "us_per_step": self.us_per_step,
            "build_us": self.build_us,
            "update_us": self.update_us,
            "jobs_per_step": self.jobs_per_step,
            "cpu_us_per_step": self.cpu_us_per_step,
        }


def _hashes(tag: str, n: int) -> list[bytes]:
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=16).digest() for i in range(n)]


def _launch_all(jobs: Iterable[Job], world_size: int) -> None:
    for job in jobs:
        for rank in range(world_size):
            job.launch(rank)


def scheduler_step_cost(
    num_requests: int,
    kind: str,
    *,
    steps: int = 64,
    warmup: int = 8,
    rounds: int = 1,
    tokens_per_block: int = 16,
    prompt_blocks: int = 64,
    world_size: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> StepCost:
    """Per-step cost of the scheduler half with ``num_requests`` running requests: the median step of
    the best of ``rounds`` independent rounds (each on a fresh scheduler; other load only adds time).

    decode: every request gets one token per step; the config offloads prompts only (vLLM's default),
    so decode steps plan no job. prefill: every request is chunk-prefilled one block per step, so every
    step plans one store job per request, and the workers ack each job in the next step's output.
    """
    if rounds < 1:
        raise ConfigError(f"rounds must be >= 1, got {rounds!r}")
    results = [
        _step_cost_round(num_requests, kind, steps, warmup, tokens_per_block, prompt_blocks, world_size, clock)
        for _ in range(rounds)
    ]
    return min(results, key=lambda c: c.cpu_us_per_step)


def _step_cost_round(
    num_requests: int,
    kind: str,
    steps: int,
    warmup: int,
    tokens_per_block: int,
    prompt_blocks: int,
    world_size: int,
    clock: Callable[[], float],
) -> StepCost:
    """One round of :func:`scheduler_step_cost`."""
    if kind not in ("decode", "prefill"):
        raise ConfigError(f"kind must be 'decode' or 'prefill', got {kind!r}")
    tpb = tokens_per_block
    total_steps = warmup + steps
    prefill = kind == "prefill"
    blocks = prompt_blocks + total_steps + 2 if prefill else prompt_blocks
    cfg = OffloadConfig(tpb, world_size=world_size, offload_prompt_only=True)
    manager = CPUOffloadingManager(num_requests * (blocks + 2), enable_events=False)
    sched = OffloadingScheduler(cfg, manager)
    reqs: list[_Req] = []
    admitted: list[ScheduledRequest] = []
    for r in range(num_requests):
        prompt = blocks * tpb
        req = _Req(f"{kind}{r}", _hashes(f"{kind}{r}", blocks), prompt, prompt)
        block_ids = tuple(range(r * blocks, r * blocks + blocks))
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, block_ids, 0)
        reqs.append(req)
        # Decode: the whole prompt is computed (and stored) by this admission step, which is not measured.
        admitted.append(ScheduledRequest(req.req_id, block_ids, 0 if prefill else prompt, admitted=True))
    _launch_all(sched.build_connector_meta(SchedulerOutput(tuple(admitted))).store_jobs.values(), world_size)
    if not prefill:
        for q in reqs:
            q.num_computed_tokens = q.num_prompt_tokens
        sched.update_connector_output(WorkerOutput(completed={jid: set(range(world_size)) for jid in sched.jobs()}))
    step_tokens = tpb if prefill else 1
    pending = WorkerOutput()
    build_times: list[float] = []
    update_times: list[float] = []
    cpu_times: list[float] = []
    cpu_clock = time.thread_time
    jobs = 0
    for step in range(total_steps):
        out = SchedulerOutput(tuple(ScheduledRequest(q.req_id, (), step_tokens) for q in reqs))
        c0, t0 = cpu_clock(), clock()
        meta = sched.build_connector_meta(out)
        t1 = clock()
        sched.update_connector_output(pending)
        t2, c2 = clock(), cpu_clock()
        for q in reqs:
            q.num_computed_tokens += step_tokens
            if not prefill:
                q.num_tokens += 1
        # The workers' side, not measured: launch every job on every rank, ack it in the next output.
        _launch_all(meta.store_jobs.values(), world_size)
        pending = WorkerOutput(completed={jid: set(range(world_size)) for jid in meta.store_jobs})
        if step >= warmup:
            build_times.append(t1 - t0)
            update_times.append(t2 - t1)
            cpu_times.append(c2 - c0)
            jobs += len(meta.store_jobs)
    sched.update_connector_output(pending)
    if sched.num_jobs:
        raise AssertionError(f"{sched.num_jobs} jobs left unacked after the measured steps")
    if prefill and jobs != steps * num_requests:
        raise AssertionError(f"prefill planned {jobs} store jobs; expected one per request per step")
    if not prefill and jobs:
        raise AssertionError(f"decode planned {jobs} store jobs; expected none")
    totals = [b + u for b, u in zip(build_times, update_times, strict=True)]
    return StepCost(
        kind,
        num_requests,
        statistics.median(totals) * 1e6,
        statistics.median(build_times) * 1e6,
        statistics.median(update_times) * 1e6,
        jobs / steps,
        statistics.median(cpu_times) * 1e6,
    )
