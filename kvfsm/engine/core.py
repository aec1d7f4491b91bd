"""The reference engine loop. ``step()`` follows the engine machine and never blocks on a transfer.

One step: admit arrivals; schedule (running requests first, then waiting ones through the GPU prefix
cache and the connector's lookup); build the connector metadata; workers flush and launch loads; the
stand-in forward writes KV; workers launch stores; poll; the connector commits what finished. Then the
engine machine settles: running, finishing, draining (nothing to run but has_pending_push_work()) or idle.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from kvfsm.control.config import DrainMode, OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import OffloadingManager
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.data.layout import KVCacheSpec, allocate_kv_caches
from kvfsm.data.pool import CPUSlotPool
from kvfsm.data.worker import OffloadingWorker, make_workers
from kvfsm.deadlines import Clock, Deadlines, ShutdownReport, run_bounded_all
from kvfsm.engine.block_pool import BlockPool
from kvfsm.engine.kv_values import block_pattern
from kvfsm.engine.requests import EngineRequest, RequestStatus
from kvfsm.errors import ConfigError, DuplicateRequestError, KvfsmError, UnknownRequestError
from kvfsm.machines import engine_machine
from kvfsm.states import EngineEvent, EngineState
from kvfsm.validation import require_positive_int

__all__ = ["EngineConfig", "IntegrityStats", "ReferenceEngine", "StepRecord"]

logger = logging.getLogger(__name__)

#: Time a bounded shutdown still gives each phase once its deadline has passed (the "small margin").
_SHUTDOWN_GRACE_S = 0.05


@dataclass(frozen=True, slots=True)
class EngineConfig:
    num_layers: int = 2
    num_heads: int = 4
    head_dim: int = 8
    tokens_per_block: int = 16
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 64
    num_cpu_slots: int = 64
    world_size: int = 1
    dtype: torch.dtype = torch.float16
    max_num_batched_tokens: int = 512
    drain: DrainMode = DrainMode.NONBLOCKING
    policy: str = "lru"
    offload_prompt_only: bool = False
    copy_threads: int = 2
    device: str | None = None
    checked: bool | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "num_heads",
            "head_dim",
            "tokens_per_block",
            "blocks_per_chunk",
            "num_gpu_blocks",
            "num_cpu_slots",
            "world_size",
            "max_num_batched_tokens",
            "copy_threads",
        ):
            require_positive_int(name, getattr(self, name))
        if self.num_heads % self.world_size:
            raise ConfigError(
                f"num_heads={self.num_heads} is not divisible by world_size={self.world_size}; "
                "each worker holds an equal share of the heads"
            )
        if self.num_gpu_blocks < self.blocks_per_chunk:
            raise ConfigError(
                f"num_gpu_blocks={self.num_gpu_blocks} cannot hold one chunk of {self.blocks_per_chunk} blocks"
            )


@dataclass(slots=True)
class IntegrityStats:
    blocks_verified: int = 0
    mismatches: int = 0
    loads_completed: int = 0
    loads_failed: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    state: EngineState
    scheduled: tuple[str, ...]
    jobs_in_flight: int
    flushed: int
    pending_push_work: bool


@dataclass(slots=True)
class _StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    tokens: dict[str, int] = field(default_factory=dict)
    preempted: set[str] = field(default_factory=set)
    allocated: set[int] = field(default_factory=set)


class ReferenceEngine:
    """A small vLLM-like engine over real KV tensors, the connector's scheduler half and W workers."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        manager: OffloadingManager | None = None,
        workers: list[OffloadingWorker] | None = None,
        deadlines: Deadlines | None = None,
        clock: Clock | None = None,
    ) -> None:
        """``deadlines`` and ``clock`` go to the connector's scheduler half (see kvfsm.deadlines)."""
        self.config = cfg = config or EngineConfig()
        device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.kv_spec = KVCacheSpec(
            cfg.num_layers,
            cfg.num_gpu_blocks,
            cfg.num_heads,
            cfg.tokens_per_block,
            cfg.head_dim,
            cfg.dtype,
            device,
        )
        self.kv_caches = allocate_kv_caches(self.kv_spec)
        self.block_pool = BlockPool(cfg.num_gpu_blocks)
        self.manager = (
            manager if manager is not None else CPUOffloadingManager(cfg.num_cpu_slots, cfg.policy, checked=cfg.checked)
        )
        offload = OffloadConfig(
            cfg.tokens_per_block, cfg.blocks_per_chunk, cfg.world_size, cfg.drain, cfg.offload_prompt_only
        )
        self.scheduler = OffloadingScheduler(
            offload, self.manager, checked=cfg.checked, deadlines=deadlines, clock=clock
        )
        self.workers = (
            workers
            if workers is not None
            else make_workers(
                self.kv_caches,
                CPUSlotPool,
                cfg.world_size,
                cfg.blocks_per_chunk,
                cfg.num_cpu_slots,
                cfg.copy_threads,
            )
        )
        if len(self.workers) != cfg.world_size:
            raise ConfigError(f"got {len(self.workers)} workers; expected world_size={cfg.world_size}")
        self.state = EngineState.IDLE
        self._machine = engine_machine()
        self._inbox: deque[EngineRequest] = deque()
        self._inbox_lock = threading.Lock()
        self._late_arrivals: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.loading: dict[str, tuple[EngineRequest, int, int]] = {}  # req -> (req, load job id, tokens)
        self.finished: list[EngineRequest] = []
        self.step_count = 0
        self.timeline: list[StepRecord] = []
        self.integrity = IntegrityStats()
        self.blocking_waits = 0
        # Destination blocks of timed-out loads whose copies may still be writing them, per job id: kept
        # out of the pool until the scheduler says every launched copy has reported.
        self._quarantined_blocks: dict[int, list[int]] = {}
        self._pending_preempts: set[str] = set()  # requests re-queued after a timed-out load

    # ------------------------------------------------------------------ engine machine model

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def current_state(self) -> EngineState:
        return self.state

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # ------------------------------------------------------------------ input

    def make_request(self, req_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
        return EngineRequest(req_id, prompt, max_tokens, self.config.tokens_per_block)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; thread-safe. It is admitted at the start of the next step."""
        with self._inbox_lock:
            if request.req_id in self.requests or any(r.req_id == request.req_id for r in self._inbox):
                raise DuplicateRequestError(f"request id {request.req_id!r} is already in use; expected a new id")
            request.arrival_time = time.perf_counter()
            self._inbox.append(request)

    def add_request_during_next_step(self, request: EngineRequest) -> None:
        """Queue a request that arrives while the next step runs (after its admission phase).

        Models a request reaching the engine-core input queue mid-step: it is admitted one step later,
        after whatever that step blocks on.
        """
        self._late_arrivals.append(request)

    def wait_for_transfers(self) -> None:
        """Block until every launched copy finished (tests and shutdown only: makes completion explicit)."""
        for w in self.workers:
            w.wait_all()

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            raise UnknownRequestError(f"request {req_id!r} is not live; expected a waiting or running request")
        req.aborted = True
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Its blocks are the load's destination: free them only once the load is done.
            req.status = RequestStatus.FINISHED
            self.scheduler.request_finished(req)
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req)

    # ------------------------------------------------------------------ the step

    def step(self) -> StepRecord | None:
        """One engine iteration. Returns None when idle with nothing to do."""
        if self.state is EngineState.IDLE:
            self._admit_late()  # an idle engine has no step for them to arrive during
        self._admit()
        if self.state is EngineState.IDLE:
            return None
        self.step_count += 1
        self._admit_late()
        plan = self._schedule()
        meta = self.scheduler.build_connector_meta(
            SchedulerOutput(tuple(plan.scheduled), frozenset(plan.preempted), frozenset(plan.allocated))
        )
        if meta.jobs_to_flush:
            self.blocking_waits += 1
        if not plan.scheduled and self.state is EngineState.DRAINING:
            # A pure polling step: let the CPU copy threads take the GIL (a yield, not a wait; GPU copies
            # don't need it). Not in the finishing step, which plans the final stores.
            time.sleep(0)
        for w in self.workers:
            w.before_forward(meta)
        self._forward(plan)
        for w in self.workers:
            w.after_forward(meta)
        out = WorkerOutput()
        for w in self.workers:
            out.merge(w.poll())
        self.scheduler.update_connector_output(out)
        self._finish_loads()
        self._settle()
        rec = StepRecord(
            self.step_count,
            self.state,
            tuple(s.req_id for s in plan.scheduled),
            self.scheduler.num_jobs,
            len(meta.jobs_to_flush),
            self.has_pending_push_work(),
        )
        self.timeline.append(rec)
        return rec

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step until the engine is idle; returns the number of steps taken."""
        taken = 0
        while self.step() is not None:
            taken += 1
            if taken >= max_steps:
                raise RuntimeError(f"engine still {self.state.value} after {max_steps} steps")
        return taken

    def _admit_late(self) -> None:
        for late in self._late_arrivals:
            self.add_request(late)
        self._late_arrivals.clear()

    def _admit(self) -> None:
        with self._inbox_lock:
            arrivals = list(self._inbox)
            self._inbox.clear()
        for req in arrivals:
            req.arrival_step = self.step_count
            self.requests[req.req_id] = req
            self.scheduler.on_new_request(req)
            self.waiting.append(req)
        if arrivals:
            self._machine.fire(self, EngineEvent.ADMIT)

    def _settle(self) -> None:
        if self.has_unfinished_requests():
            if self.state is not EngineState.RUNNING:
                self._machine.fire(self, EngineEvent.ADMIT)
        elif self.state is EngineState.RUNNING:
            self._machine.fire(self, EngineEvent.ALL_FINISHED)
        elif self.state in (EngineState.FINISHING, EngineState.DRAINING):
            self._machine.fire(self, EngineEvent.SETTLE)

    # ------------------------------------------------------------------ scheduling

    def _blocks_needed(self, req: EngineRequest, num_tokens: int) -> int:
        tpb = self.config.tokens_per_block
        return max(0, -(-num_tokens // tpb) - len(req.block_ids))

    def _schedule(self) -> _StepPlan:
        plan = _StepPlan()
        # Requests re-queued after a timed-out load: the connector sees them preempted this step.
        plan.preempted |= {r for r in self._pending_preempts if not self.requests[r].is_finished}
        self._pending_preempts.clear()
        budget = self.config.max_num_batched_tokens
        # Running requests first, oldest first; preempt the newest when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = self._allocate(req, req.num_computed_tokens + n)
            while new is None and len(self.running) > i + 1:
                self._preempt(self.running.pop(), plan)
                new = self._allocate(req, req.num_computed_tokens + n)
            if new is None:
                self.running.pop(i)
                self._preempt(req, plan)
                continue
            plan.allocated.update(new)
            plan.scheduled.append(ScheduledRequest(req.req_id, tuple(new), n))
            plan.tokens[req.req_id] = n
            budget -= n
            i += 1
        if plan.preempted:
            return plan  # vLLM admits nothing in a step that preempted
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0:
            req = self.waiting.popleft()
            if not self._admit_waiting(req, plan, budget):
                skipped.append(req)
                if self.block_pool.num_free == 0:
                    break
                continue
            budget -= plan.tokens.get(req.req_id, 0)
        self.waiting.extendleft(reversed(skipped))
        return plan

    def _admit_waiting(self, req: EngineRequest, plan: _StepPlan, budget: int) -> bool:
        tpb = self.config.tokens_per_block
        hashes = req.block_hashes
        # The last token is always computed, so a cached prefix may cover at most num_tokens - 1.
        cached = self.block_pool.cached_prefix(hashes[: (req.num_tokens - 1) // tpb])
        num_local = len(cached) * tpb
        external, _async = self.scheduler.get_num_new_matched_tokens(req, num_local)
        if external is None:
            return False  # deferred: ask again next step
        computed = num_local + external
        n = 0 if external else min(req.num_tokens - computed, budget)
        self.block_pool.acquire(cached)
        need = -(-(computed + n) // tpb) - len(cached)
        new = self.block_pool.allocate(need)
        if new is None:
            self.block_pool.free(cached)
            return False
        req.block_ids = cached + new
        req.num_computed_tokens = num_local
        self.scheduler.update_state_after_alloc(req, req.block_ids, external)
        plan.allocated.update(new)
        if req.first_scheduled_step is None:
            req.first_scheduled_step = self.step_count
            req.first_scheduled_time = time.perf_counter()
        if external:
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            job_ids = self.scheduler.request_jobs(req.req_id)
            self.loading[req.req_id] = (req, min(job_ids), external)
            return True
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        plan.scheduled.append(ScheduledRequest(req.req_id, tuple(req.block_ids), n, admitted=True))
        plan.tokens[req.req_id] = n
        return True

    def _allocate(self, req: EngineRequest, num_tokens: int) -> list[int] | None:
        need = self._blocks_needed(req, num_tokens)
        new = self.block_pool.allocate(need)
        if new is not None:
            req.block_ids.extend(new)
        return new

    def _preempt(self, req: EngineRequest, plan: _StepPlan) -> None:
        self.block_pool.free(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        plan.preempted.add(req.req_id)
        plan.scheduled = [s for s in plan.scheduled if s.req_id != req.req_id]
        plan.tokens.pop(req.req_id, None)

    # ------------------------------------------------------------------ forward and completion

    def expected_block(self, key: bytes, layer: int) -> torch.Tensor:
        shape = self.kv_caches[layer].shape[1:]
        return block_pattern(key, layer, shape, self.kv_spec.dtype)

    def _forward(self, plan: _StepPlan) -> None:
        tpb = self.config.tokens_per_block
        for req_id, n in plan.tokens.items():
            req = self.requests[req_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            hashes = req.block_hashes
            for b in range(start // tpb, -(-end // tpb)):
                full = (b + 1) * tpb <= end
                # A partly written block gets a value of its own; it is never offloaded.
                key = hashes[b] if full else b"partial" + (hashes[b - 1] if b else b"") + end.to_bytes(4, "little")
                block_id = req.block_ids[b]
                for layer, kv in enumerate(self.kv_caches):
                    kv[block_id].copy_(self.expected_block(key, layer).to(kv.device))
                if full:
                    self.block_pool.cache(block_id, hashes[b])
            req.num_computed_tokens = end
            if end == req.num_tokens:
                req.output_token_ids.append(req.sample_next())
                if len(req.output_token_ids) >= req.max_tokens:
                    self.running.remove(req)
                    self._finish(req)

    def _finish(self, req: EngineRequest) -> None:
        req.status = RequestStatus.FINISHED
        self.scheduler.request_finished(req)
        self.block_pool.free(req.block_ids)
        self.finished.append(req)

    def _finish_loads(self) -> None:
        errors = self.scheduler.take_load_errors()
        for job_id in self.scheduler.take_released_quarantine():
            blocks = self._quarantined_blocks.pop(job_id, None)
            if blocks:
                self.block_pool.free(blocks)
        for req_id, (req, job_id, external) in list(self.loading.items()):
            if self.scheduler.job(job_id) is not None:
                continue  # still awaiting acks
            del self.loading[req_id]
            if self.scheduler.is_quarantined(job_id):
                self._quarantine_load(req, job_id, external)
                continue
            if req.aborted:
                self.block_pool.free(req.block_ids)
                self.finished.append(req)
                continue
            if req_id in errors:
                self.integrity.loads_failed += 1  # recompute from the local prefix
            else:
                self._verify_loaded(req, req.num_computed_tokens, external)
                self._cache_loaded(req, req.num_computed_tokens, external)
                req.num_computed_tokens += external
                self.integrity.loads_completed += 1
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def _quarantine_load(self, req: EngineRequest, job_id: int, external: int) -> None:
        """The load timed out but its copy may still write its destination blocks: keep those out of the
        pool until it reports, free the rest, and re-queue the request to start over with fresh blocks."""
        tpb = self.config.tokens_per_block
        first = req.num_computed_tokens // tpb
        dest = req.block_ids[first : first + external // tpb]
        self._quarantined_blocks[job_id] = dest
        self.block_pool.free(req.block_ids[:first] + req.block_ids[first + len(dest) :])
        req.block_ids = []
        self.integrity.loads_failed += 1
        if req.aborted:
            self.finished.append(req)
            return
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self._pending_preempts.add(req.req_id)

    @property
    def quarantined_blocks(self) -> dict[int, list[int]]:
        """GPU blocks held back from the pool per timed-out load job (a copy)."""
        return {jid: list(b) for jid, b in self._quarantined_blocks.items()}

    def _cache_loaded(self, req: EngineRequest, num_local: int, external: int) -> None:
        """Loaded blocks join the GPU prefix cache (as vLLM caches them once the load is done), so a
        request deferred while this one loaded the same chunks hits them instead of loading again."""
        tpb = self.config.tokens_per_block
        hashes = req.block_hashes
        for b in range(num_local // tpb, (num_local + external) // tpb):
            self.block_pool.cache(req.block_ids[b], hashes[b])

    def _verify_loaded(self, req: EngineRequest, num_local: int, external: int) -> None:
        tpb = self.config.tokens_per_block
        hashes = req.block_hashes
        for b in range(num_local // tpb, (num_local + external) // tpb):
            block_id = req.block_ids[b]
            for layer, kv in enumerate(self.kv_caches):
                if torch.equal(kv[block_id].cpu(), self.expected_block(hashes[b], layer)):
                    self.integrity.blocks_verified += 1
                else:
                    self.integrity.mismatches += 1

    # ------------------------------------------------------------------ admin

    def reset_prefix_cache(self) -> None:
        """Forget the GPU prefix cache (vLLM's reset_prefix_cache); offloaded copies stay."""
        self.block_pool.reset_prefix_cache()

    def reset_offload_cache(self) -> None:
        self.scheduler.reset_cache()

    def shutdown(self, timeout: float | None = None, max_rounds: int = 10_000) -> ShutdownReport:
        """Abort live requests, drain what can be drained, stop (the one place a wait is allowed).

        With ``timeout`` (seconds) the whole shutdown returns within about ``timeout`` plus a small
        margin, even when a transfer or a tier hangs: empty steps run until nothing is pending or the
        deadline passes; then jobs no worker launched are cancelled and launched ones time out (their
        memory is quarantined until their copies report), ``stop`` fires, and the workers and the manager
        are shut down within the time left, on helper threads. Without ``timeout`` it waits for every
        transfer (the old behaviour). Returns what had to be given up on.
        """
        start = time.monotonic()
        report = ShutdownReport()
        if self.state is EngineState.STOPPED:
            report.already_stopped = True
            return report
        end = None if timeout is None else start + max(0.0, timeout)

        def left() -> float:
            return _SHUTDOWN_GRACE_S if end is None else max(end - time.monotonic(), _SHUTDOWN_GRACE_S)

        for req_id in [r.req_id for r in (*self.waiting, *self.running)]:
            self.abort(req_id)
        self._machine.fire(self, EngineEvent.SHUTDOWN)
        for _ in range(max_rounds):
            # An empty step: plan the finished requests' last stores, poll the manager, launch.
            meta = self.scheduler.build_connector_meta(SchedulerOutput())
            for w in self.workers:
                w.before_forward(meta)
                w.after_forward(meta)
            if not self.has_pending_push_work():
                break
            if end is None:
                for w in self.workers:
                    w.wait_all()
            elif time.monotonic() >= end:
                report.deadline_hit = True
                break
            else:
                time.sleep(min(0.001, max(0.0, end - time.monotonic())))  # let copies and tier I/O progress
            out = WorkerOutput()
            for w in self.workers:
                out.merge(w.poll())
            self.scheduler.update_connector_output(out)
            self._finish_loads()
        if self.has_pending_push_work():
            cancelled, timed_out = self.scheduler.abandon_jobs()
            report.jobs_cancelled += cancelled
            report.jobs_timed_out += timed_out
            self._finish_loads()
        self._machine.fire(self, EngineEvent.STOP)
        if end is None:
            for w in self.workers:
                w.shutdown()
            stuck: list[str] = []
        else:
            stuck = run_bounded_all([(f"worker {w.rank}", w.shutdown) for w in self.workers], left())
            report.abandoned.extend(stuck)
        # Copies that ended while the workers shut down report now, which releases their quarantine.
        out = WorkerOutput()
        for w in self.workers:
            if f"worker {w.rank}" not in stuck:
                out.merge(w.poll())
        try:
            self.scheduler.update_connector_output(out)
        except KvfsmError:
            logger.exception("reports collected at shutdown were malformed; ignoring them")
        before = self.scheduler.stats.quarantine_abandoned
        if not self.scheduler.shutdown(None if end is None else left()):
            report.abandoned.append("manager")
        report.quarantine_abandoned = self.scheduler.stats.quarantine_abandoned - before
        self._finish_loads()
        for blocks in self._quarantined_blocks.values():
            self.block_pool.free(blocks)
        self._quarantined_blocks.clear()
        report.elapsed_s = time.monotonic() - start
        return report
