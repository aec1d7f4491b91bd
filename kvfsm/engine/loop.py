"""The engine loop, torch-free: ``step()`` follows the engine machine and never blocks on a transfer.

One step: admit arrivals; schedule (running requests first, then waiting ones through the GPU prefix
cache and the connector's lookup); build the connector metadata; workers flush and launch loads; the
stand-in forward writes KV; workers launch stores; poll; the connector commits what finished. Then the
engine machine settles (:func:`kvfsm.control.decisions.settle_event`): running, finishing, draining
(nothing to run but has_pending_push_work()) or idle.

:class:`EngineLoop` runs over a :class:`KVMemory`, the GPU KV cache as the loop sees it: the forward writes
a block's content, a finished load's blocks are verified. :class:`kvfsm.engine.core.ReferenceEngine` is the
loop over real torch tensors and copies (:class:`kvfsm.engine.tensor_memory.TensorMemory`);
:class:`kvfsm.testing.control.TagEngine` is the same loop over tags (hashes) and held copies, for fast
control-plane tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

from kvfsm.control.deadlines import (
    ShutdownReport,
    ShutdownTimeout,
    resolve_shutdown_timeout,
    run_bounded,
    run_bounded_all,
)
from kvfsm.control.decisions import settle_event
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.worker import OffloadingWorker
from kvfsm.engine.block_pool import BlockPool
from kvfsm.engine.requests import EngineRequest, RequestStatus
from kvfsm.errors import DuplicateRequestError, KvfsmError, UnknownRequestError
from kvfsm.machines import engine_machine
from kvfsm.machines.names import EngineEffect, EngineEvent, EngineState

__all__ = ["EngineLoop", "IntegrityStats", "KVMemory", "PollMode", "StepRecord", "partial_block_key"]

logger = logging.getLogger(__name__)

#: Time a bounded shutdown still gives each phase once its deadline has passed (the "small margin").
_SHUTDOWN_GRACE_S = 0.05

#: The idle wait of an idle-polling step (``PollMode.WAIT``): the first one waits this long at most...
IDLE_WAIT_MIN_S = 50e-6
#: ...each further one in a row twice as long, up to this bound (the most a finished transfer that sends
#: no signal waits to be noticed).
IDLE_WAIT_MAX_S = 1e-3


class PollMode(Enum):
    """How an engine step that had nothing to do but poll its transfers ends (``EngineConfig.poll``).

    ``WAIT`` (the default): it waits on the engine's readiness signal (a new request, or
    :meth:`EngineLoop.notify`) for a short bounded time that doubles while such steps follow each other
    (``IDLE_WAIT_MIN_S`` up to ``IDLE_WAIT_MAX_S``), so waiting on loads, promotions or a drain costs little
    CPU. A new request ends the wait at once: it is still admitted at the very next step. ``BUSY``: it
    returns at once (a polling step only yields the GIL), the behaviour before the wait existed, kept to
    measure against (``kvfsm bench``, drain section).
    """

    WAIT = "wait"
    BUSY = "busy"


class KVMemory(Protocol):
    """The GPU KV cache as the engine loop uses it (every layer, every rank's head shard)."""

    def write(self, block_id: int, key: bytes) -> None:
        """The forward writes the KV of content ``key`` into GPU block ``block_id``."""
        ...

    def verify(self, block_id: int, block_hash: bytes) -> tuple[int, int]:
        """Compare a loaded block with the KV of content ``block_hash``: (parts that match, parts that
        differ), a part being whatever unit the memory compares (a layer, a rank)."""
        ...


def partial_block_key(hashes: Sequence[bytes], block: int, end: int) -> bytes:
    """The content key of a partly written block: a value of its own (it is never offloaded)."""
    return b"partial" + (hashes[block - 1] if block else b"") + end.to_bytes(4, "little")


@dataclass(slots=True)
class IntegrityStats:
    """What the verification of finished loads found. ``blocks_verified`` and ``mismatches`` count the
    parts the memory compares per block (:meth:`KVMemory.verify`: layers of tensors, ranks of tags)."""

    blocks_verified: int = 0
    mismatches: int = 0
    loads_completed: int = 0
    loads_failed: int = 0


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One engine step as the timeline keeps it: the state it settled in and what it did."""

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


class LoopGeometry(Protocol):
    """The sizes the loop schedules with (``EngineConfig`` and the stateful tests' ``SystemConfig`` have them)."""

    @property
    def tokens_per_block(self) -> int: ...

    @property
    def max_num_batched_tokens(self) -> int: ...

    @property
    def num_gpu_blocks(self) -> int: ...


class EngineLoop:
    """A small vLLM-like engine loop over a :class:`KVMemory`, the connector's scheduler half and W workers.

    ``threaded``: the copies (and tier transfers) run on threads of their own, as the real backends'
    do: a pure polling step yields the GIL to them, and a bounded shutdown stops the workers and the
    manager on helper threads. False for held copies and manually completed tiers, which only run when
    called: nothing to yield to, and their shutdown never blocks, so it runs on the calling thread.
    """

    def __init__(
        self,
        geometry: LoopGeometry,
        *,
        memory: KVMemory,
        scheduler: OffloadingScheduler,
        workers: list[OffloadingWorker],
        threaded: bool = True,
        poll: PollMode = PollMode.WAIT,
    ) -> None:
        self.tokens_per_block = geometry.tokens_per_block
        self.max_num_batched_tokens = geometry.max_num_batched_tokens
        num_gpu_blocks = geometry.num_gpu_blocks
        self.memory = memory
        self.scheduler = scheduler
        self.manager = scheduler.manager
        self.workers = workers
        self.block_pool = BlockPool(num_gpu_blocks)
        self.state = EngineState.IDLE
        self._threaded = threaded
        self.poll_mode = poll
        #: Set by whatever may give an idle-polling step something to do (an arrival, :meth:`notify`).
        self._wake = threading.Event()
        self._idle_streak = 0  # idle-polling steps in a row
        #: Time idle-polling steps spent waiting for the readiness signal, and how many waited.
        self.idle_wait_s = 0.0
        self.idle_waits = 0
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
        return EngineRequest(req_id, prompt, max_tokens, self.tokens_per_block)

    def _check_new_id(self, req_id: str) -> None:
        """Raise DuplicateRequestError if ``req_id`` is known: admitted (live or finished), queued in the
        inbox, or waiting in the late-arrival list. Call with ``_inbox_lock`` held."""
        if (
            req_id in self.requests
            or any(r.req_id == req_id for r in self._inbox)
            or any(r.req_id == req_id for r in self._late_arrivals)
        ):
            raise DuplicateRequestError(f"request id {req_id!r} is already in use; expected a new id")

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; thread-safe. It is admitted at the start of the next step.

        Raises DuplicateRequestError (and queues nothing) if its id is already in use.
        """
        with self._inbox_lock:
            self._check_new_id(request.req_id)
            request.arrival_time = time.perf_counter()
            self._inbox.append(request)
        self._wake.set()

    def add_request_during_next_step(self, request: EngineRequest) -> None:
        """Queue a request that arrives while the next step runs (after its admission phase).

        Models a request reaching the engine-core input queue mid-step: it is admitted one step later,
        after whatever that step blocks on. Raises DuplicateRequestError (and queues nothing) if its id is
        already in use, checked now, so a bad id never reaches a step.
        """
        with self._inbox_lock:
            self._check_new_id(request.req_id)
            self._late_arrivals.append(request)
        self._wake.set()

    def notify(self) -> None:
        """Wake a step that waits for something to do (thread-safe). Arrivals call it; a copy backend or a
        tier may call it when a transfer finishes, so the engine notices before its idle wait ends."""
        self._wake.set()

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
        self._wake.clear()  # before admission: whatever arrives from here on ends this step's idle wait
        if self.state is EngineState.IDLE:
            self._admit_late()  # an idle engine has no step for them to arrive during
        admitted = self._admit()
        if self.state is EngineState.IDLE:
            return None
        self.step_count += 1
        self._admit_late()
        state_before = self.state
        plan = self._schedule()
        meta = self.scheduler.build_connector_meta(
            SchedulerOutput(tuple(plan.scheduled), frozenset(plan.preempted), frozenset(plan.allocated))
        )
        if meta.jobs_to_flush:
            self.blocking_waits += 1
        busy = self.poll_mode is PollMode.BUSY
        if busy and self._threaded and not plan.scheduled and self.state is EngineState.DRAINING:
            # A pure polling step: let the CPU copy threads take the GIL (a yield, not a wait; GPU copies
            # don't need it). Not in the finishing step, which plans the final stores.
            time.sleep(0)
        for w in self.workers:
            w.before_forward(meta)
        self._forward(plan)
        for w in self.workers:
            w.after_forward(meta)
        reported = self._collect()
        self._finish_loads()
        self._settle()
        did_work = bool(
            admitted or plan.scheduled or plan.preempted or meta.store_jobs or meta.load_jobs or meta.jobs_to_flush
        )
        if did_work or reported or self.state is not state_before:
            self._idle_streak = 0
        elif not busy and self._threaded and self.current_state() is not EngineState.IDLE:
            self._idle_wait()
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

    def _collect(self) -> bool:
        """Every worker's poll, summed, to the connector; True if any job reported."""
        out = WorkerOutput()
        for w in self.workers:
            out.merge(w.poll())
        self.scheduler.update_connector_output(out)
        return bool(out.completed or out.failed or out.finished_recving)

    def _idle_wait(self) -> None:
        """The end of a step that only polled: wait for the readiness signal, a bounded and growing time.

        Never a wait on a transfer: a copy or a tier job that finishes is noticed by the next step's poll
        (at the latest ``IDLE_WAIT_MAX_S`` later, at once if it calls :meth:`notify`), and a new request
        ends the wait at once.
        """
        with self._inbox_lock:
            if self._inbox or self._late_arrivals:
                return  # arrivals to admit next step: no waiting
        timeout = min(IDLE_WAIT_MAX_S, IDLE_WAIT_MIN_S * (1 << min(self._idle_streak, 16)))
        self._idle_streak += 1
        t0 = time.perf_counter()
        self._wake.wait(timeout)
        self.idle_wait_s += time.perf_counter() - t0
        self.idle_waits += 1

    def run_until_idle(self, max_steps: int = 100_000) -> int:
        """Step until the engine is idle; returns the number of steps taken."""
        taken = 0
        while self.step() is not None:
            taken += 1
            if taken >= max_steps:
                raise RuntimeError(f"engine still {self.state.value} after {max_steps} steps")
        return taken

    def _admit_late(self) -> None:
        with self._inbox_lock:
            late, self._late_arrivals = self._late_arrivals, []
            now = time.perf_counter()
            for req in late:  # ids were checked on entry: none can clash with the inbox or the admitted
                req.arrival_time = now
                self._inbox.append(req)

    def _admit(self) -> bool:
        """Admit the inbox; True if anything arrived."""
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
        return bool(arrivals)

    def _settle(self) -> None:
        event = settle_event(self.state, self.has_unfinished_requests())
        if event is not None:
            self._machine.fire(self, event)

    # ------------------------------------------------------------------ scheduling

    def _blocks_needed(self, req: EngineRequest, num_tokens: int) -> int:
        tpb = self.tokens_per_block
        return max(0, -(-num_tokens // tpb) - len(req.block_ids))

    def _schedule(self) -> _StepPlan:
        plan = _StepPlan()
        # Requests re-queued after a timed-out load: the connector sees them preempted this step.
        plan.preempted |= {r for r in self._pending_preempts if not self.requests[r].is_finished}
        self._pending_preempts.clear()
        budget = self.max_num_batched_tokens
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
        tpb = self.tokens_per_block
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

    def _forward(self, plan: _StepPlan) -> None:
        tpb = self.tokens_per_block
        for req_id, n in plan.tokens.items():
            req = self.requests[req_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            hashes = req.block_hashes
            for b in range(start // tpb, -(-end // tpb)):
                full = (b + 1) * tpb <= end
                block_id = req.block_ids[b]
                self.memory.write(block_id, hashes[b] if full else partial_block_key(hashes, b, end))
                if full:
                    self.block_pool.cache(block_id, hashes[b])
            req.num_computed_tokens = end
            if end == req.num_tokens:
                req.append_output(req.sample_next())
                if req.num_output_tokens >= req.max_tokens:
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
        tpb = self.tokens_per_block
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
        tpb = self.tokens_per_block
        hashes = req.block_hashes
        for b in range(num_local // tpb, (num_local + external) // tpb):
            self.block_pool.cache(req.block_ids[b], hashes[b])

    def _verify_loaded(self, req: EngineRequest, num_local: int, external: int) -> None:
        tpb = self.tokens_per_block
        hashes = req.block_hashes
        for b in range(num_local // tpb, (num_local + external) // tpb):
            good, bad = self.memory.verify(req.block_ids[b], hashes[b])
            self.integrity.blocks_verified += good
            self.integrity.mismatches += bad

    # ------------------------------------------------------------------ admin

    def reset_prefix_cache(self) -> None:
        """Forget the GPU prefix cache (vLLM's reset_prefix_cache); offloaded copies stay."""
        self.block_pool.reset_prefix_cache()

    def reset_offload_cache(self) -> None:
        self.scheduler.reset_cache()

    def shutdown(
        self,
        timeout: float | ShutdownTimeout | None = ShutdownTimeout.FROM_DEADLINES,
        max_rounds: int = 10_000,
    ) -> ShutdownReport:
        """Abort live requests, drain what can be drained, stop (the one place a wait is allowed).

        ``shutdown`` fires first; its effect, ``flush_all``, runs empty steps until nothing is pending (or
        the deadline passes), waiting on the workers' copies and on the manager's own transfers (a
        tiering manager's cascades), then gives up on what is left: jobs no worker launched are
        cancelled and launched ones time out (their memory is quarantined until their copies report).
        Then ``stop`` fires and the workers and the manager are shut down within the time left, on helper
        threads (when ``threaded``). ``timeout``: seconds; by default the scheduler's
        ``Deadlines.shutdown_s``; None waits for every transfer. Bounded, the whole shutdown returns
        within about ``timeout`` plus a small margin, even when a transfer or a tier hangs. Returns what
        had to be given up on.
        """
        start = time.monotonic()
        bound = resolve_shutdown_timeout(timeout, self.scheduler.deadlines)
        report = ShutdownReport(timeout_s=bound)
        if self.state is EngineState.STOPPED:
            report.already_stopped = True
            return report
        end = None if bound is None else start + bound
        for req_id in [r.req_id for r in (*self.waiting, *self.running)]:
            self.abort(req_id)
        effect = self._machine.fire(self, EngineEvent.SHUTDOWN)
        if effect is EngineEffect.FLUSH_ALL:
            self._flush_all(end, max_rounds, report)
        self._machine.fire(self, EngineEvent.STOP)
        self._stop_parts(end, report)
        report.elapsed_s = time.monotonic() - start
        return report

    def _flush_all(self, end: float | None, max_rounds: int, report: ShutdownReport) -> None:
        """The ``flush_all`` effect: wait for transfers until ``end`` (None: as long as it takes, at most
        ``max_rounds`` waits), then give up on every job still pending."""
        rounds = 0
        while True:
            # An empty step: plan the finished requests' last stores, poll the manager, launch.
            meta = self.scheduler.build_connector_meta(SchedulerOutput())
            for w in self.workers:
                w.before_forward(meta)
                w.after_forward(meta)
            if not self.has_pending_push_work():
                break
            # Only the manager's own transfers (tier cascades) are left: wait for them, not for a step. A
            # quarantined GPU copy is the workers' to finish (pending work until it reports).
            manager_only = self.scheduler.num_jobs == 0 and self.scheduler.num_quarantined == 0
            if end is None:
                rounds += 1
                if rounds > max_rounds:
                    break
                for w in self.workers:
                    w.wait_all()
                if manager_only:
                    self.scheduler.manager.drain_pending_work()
            elif time.monotonic() >= end:
                report.deadline_hit = True
                break
            elif manager_only:
                left = max(0.0, end - time.monotonic())
                if not run_bounded(self.scheduler.manager.drain_pending_work, left, "manager drain"):
                    report.deadline_hit = True  # still draining at the deadline: give up below
            else:
                time.sleep(min(0.001, max(0.0, end - time.monotonic())))  # let copies and tier I/O progress
            self._collect()
            self._finish_loads()
        if self.has_pending_push_work():
            cancelled, timed_out, transfers = self.scheduler.abandon_jobs()
            report.jobs_cancelled += cancelled
            report.jobs_timed_out += timed_out
            report.transfers_timed_out += transfers
            self._finish_loads()

    def _stop_parts(self, end: float | None, report: ShutdownReport) -> None:
        """Shut the workers and the manager down within the time left before ``end``."""

        def left() -> float:
            return _SHUTDOWN_GRACE_S if end is None else max(end - time.monotonic(), _SHUTDOWN_GRACE_S)

        bounded = end is not None and self._threaded
        if bounded:
            stuck = run_bounded_all([(f"worker {w.rank}", w.shutdown) for w in self.workers], left())
            report.abandoned.extend(stuck)
        else:
            for w in self.workers:
                w.shutdown()
            stuck = []
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
        if not self.scheduler.shutdown(left() if bounded else None):
            report.abandoned.append("manager")
        report.quarantine_abandoned = self.scheduler.stats.quarantine_abandoned - before
        self._finish_loads()
        for blocks in self._quarantined_blocks.values():
            self.block_pool.free(blocks)
        self._quarantined_blocks.clear()
