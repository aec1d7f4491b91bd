"""The control plane alone under :class:`SystemStateMachine`: no torch, no threads, cheaper per step.

:class:`ControlPlaneStateMachine` runs the rules and checks of :mod:`kvfsm.testing.system` on the real
:class:`~kvfsm.control.scheduler.OffloadingScheduler`, CPU manager, tiering manager and
:class:`~kvfsm.control.memory_tier.InMemoryTier`, the engine machine and the GPU
:class:`~kvfsm.engine.block_pool.BlockPool`, driven by :class:`TagEngine`: the reference engine's loop
(admission, scheduling with preemption, the connector calls, loads, finishing, quarantine) written over
*tags* instead of tensors. Every GPU block and CPU sub-slot of every rank holds a tag, the hash of the
content the forward wrote there; a copy moves tags. So the data checks still mean something (a store that
copies an overwritten block, a load that reads a reused slot, a slot readable before every rank copied)
while a step costs microseconds.

:class:`TagWorker` is one rank: it launches and holds copies exactly as
:class:`~kvfsm.data.worker.OffloadingWorker` does (flushed stores before the forward and a blocking wait
on them, loads before the forward, the remaining stores after it), and a copy runs only when the machine
completes it or a flush waits on it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfsm.control.config import OffloadConfig
from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import OffloadKey
from kvfsm.deadlines import ManualClock
from kvfsm.engine.block_pool import BlockPool
from kvfsm.engine.requests import EngineRequest, RequestStatus
from kvfsm.errors import UnknownRequestError
from kvfsm.machines import engine_machine
from kvfsm.states import EngineEvent, EngineState, JobKind
from kvfsm.testing.coverage import spec_covered
from kvfsm.testing.system import SYSTEM_EXEMPT, SystemConfig, SystemHarness, SystemStateMachine, make_manager

__all__ = ["ControlHarness", "ControlPlaneStateMachine", "TagEngine", "TagWorker"]

#: What a block or sub-slot holds: the hash of the content written there (None: never written).
Tag = bytes | None


def _rows(job: Job, blocks_per_chunk: int) -> list[tuple[int, int]]:
    """(slot, sub-block) of each of the job's GPU blocks (kvfsm.data.backend.chunk_rows, unflattened)."""
    off = job.gpu.first_block_offset
    slots = job.slots.slot_ids
    return [(slots[p // blocks_per_chunk], p % blocks_per_chunk) for p in range(off, off + len(job.gpu.block_ids))]


class TagWorker:
    """One rank's worker over tag memory (the launch and wait rules of OffloadingWorker)."""

    def __init__(self, rank: int, memory: TagMemory) -> None:
        self.rank = rank
        self.memory = memory
        self.unlaunched: dict[int, Job] = {}
        self.held: dict[int, Job] = {}
        self.done: list[tuple[int, bool]] = []
        self.launched_ids: set[int] = set()

    def _launched_here(self, job: Job) -> bool:
        return bool((job.launched_mask >> self.rank) & 1)

    def _launch(self, job: Job) -> None:
        self.unlaunched.pop(job.job_id, None)
        if job.is_terminal or self._launched_here(job):
            return
        if job.launch(self.rank):
            self.held[job.job_id] = job

    def before_forward(self, meta: ConnectorMetadata) -> None:
        for job in meta.store_jobs.values():
            if not self._launched_here(job):
                self.unlaunched.setdefault(job.job_id, job)
        for job in [j for jid, j in self.unlaunched.items() if jid in meta.jobs_to_flush]:
            self._launch(job)
        for job_id in sorted(meta.jobs_to_flush):
            if job_id in self.held:
                self.run(job_id, ok=True)  # the blocking wait: the flushed copy finishes now
        for job in meta.load_jobs.values():
            if not self._launched_here(job):
                self._launch(job)

    def after_forward(self, meta: ConnectorMetadata) -> None:
        for job in meta.store_jobs.values():
            if not self._launched_here(job):
                self.unlaunched.setdefault(job.job_id, job)
        for job in list(self.unlaunched.values()):
            self._launch(job)

    def run(self, job_id: int, ok: bool) -> None:
        """The held copy runs (moving tags) or fails (moving nothing); the next poll reports it."""
        job = self.held.pop(job_id)
        if ok:
            self.memory.copy(self.rank, job)
        self.done.append((job_id, ok))

    def poll(self) -> WorkerOutput:
        out = WorkerOutput()
        for job_id, ok in self.done:
            target = out.completed if ok else out.failed
            target[job_id] = target.get(job_id, 0) + 1
        self.done = []
        return out

    def wait_all(self) -> None:
        for job_id in list(self.held):
            self.run(job_id, ok=True)


@dataclass
class TagMemory:
    """Every rank's GPU blocks and CPU sub-slots, as tags."""

    world_size: int
    blocks_per_chunk: int
    gpu: list[dict[int, Tag]] = field(default_factory=list)
    cpu: list[dict[tuple[int, int], Tag]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gpu = [{} for _ in range(self.world_size)]
        self.cpu = [{} for _ in range(self.world_size)]

    def copy(self, rank: int, job: Job) -> None:
        gpu, cpu = self.gpu[rank], self.cpu[rank]
        for block, row in zip(job.gpu.block_ids, _rows(job, self.blocks_per_chunk), strict=True):
            if job.kind is JobKind.STORE:
                cpu[row] = gpu.get(block)
            else:
                gpu[block] = cpu.get(row)

    def write(self, block: int, tag: Tag) -> None:
        for gpu in self.gpu:
            gpu[block] = tag


class _SlotBytes:
    """A tier's view of a CPU slot: the tags of all ranks, encoded (so a promotion restores them)."""

    def __init__(self, memory: TagMemory) -> None:
        self.memory = memory

    def read_slot(self, slot_id: int) -> bytes:
        parts = [
            cpu.get((slot_id, sub)) or b"\x00" for cpu in self.memory.cpu for sub in range(self.memory.blocks_per_chunk)
        ]
        return b"|".join(p.hex().encode() for p in parts)

    def write_slot(self, slot_id: int, data: bytes) -> None:
        parts = [bytes.fromhex(p.decode()) for p in data.split(b"|")]
        bpc = self.memory.blocks_per_chunk
        for rank, cpu in enumerate(self.memory.cpu):
            for sub in range(bpc):
                tag = parts[rank * bpc + sub]
                cpu[(slot_id, sub)] = None if tag == b"\x00" else tag


class TagEngine:
    """The reference engine's loop (kvfsm.engine.core.ReferenceEngine.step) over tag memory."""

    def __init__(self, config: SystemConfig, clock: ManualClock) -> None:
        self.config = config
        self.memory = TagMemory(config.world_size, config.blocks_per_chunk)
        manager, self.tier, self.hook = make_manager(config, clock, _SlotBytes(self.memory))
        offload = OffloadConfig(config.tokens_per_block, config.blocks_per_chunk, config.world_size)
        self.scheduler = OffloadingScheduler(offload, manager, deadlines=config.deadlines, clock=clock)
        self.workers = [TagWorker(rank, self.memory) for rank in range(config.world_size)]
        self.block_pool = BlockPool(config.num_gpu_blocks)
        self.state = EngineState.IDLE
        self._machine = engine_machine()
        self.inbox: list[EngineRequest] = []
        self.late: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.loading: dict[str, tuple[EngineRequest, int, int]] = {}
        self.quarantined_blocks: dict[int, list[int]] = {}
        self.pending_preempts: set[str] = set()
        self.mismatches = 0

    # -- the engine machine's model --

    def has_pending_push_work(self) -> bool:
        return self.scheduler.has_pending_push_work()

    def _unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    # -- inputs --

    def abort(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is None or req.is_finished:
            raise UnknownRequestError(f"request {req_id!r} is not live")
        req.aborted = True
        if req.status is RequestStatus.WAITING_FOR_REMOTE_KVS:
            req.status = RequestStatus.FINISHED
            self.scheduler.request_finished(req)
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._finish(req)

    def step(self) -> tuple[EngineState, bool] | None:
        if self.state is EngineState.IDLE:
            self.inbox.extend(self.late)
            self.late.clear()
        arrivals, self.inbox = self.inbox, []
        for req in arrivals:
            self.requests[req.req_id] = req
            self.scheduler.on_new_request(req)
            self.waiting.append(req)
        if arrivals:
            self._machine.fire(self, EngineEvent.ADMIT)
        if self.state is EngineState.IDLE:
            return None
        self.inbox.extend(self.late)
        self.late.clear()
        scheduled, tokens, preempted, allocated = self._schedule()
        meta = self.scheduler.build_connector_meta(
            SchedulerOutput(tuple(scheduled), frozenset(preempted), frozenset(allocated))
        )
        for w in self.workers:
            w.before_forward(meta)
        self._forward(tokens)
        for w in self.workers:
            w.after_forward(meta)
        out = WorkerOutput()
        for w in self.workers:
            out.merge(w.poll())
        self.scheduler.update_connector_output(out)
        self._finish_loads()
        if self._unfinished():
            if self.state is not EngineState.RUNNING:
                self._machine.fire(self, EngineEvent.ADMIT)
        elif self.state is EngineState.RUNNING:
            self._machine.fire(self, EngineEvent.ALL_FINISHED)
        elif self.state in (EngineState.FINISHING, EngineState.DRAINING):
            self._machine.fire(self, EngineEvent.SETTLE)
        return self.state, self.has_pending_push_work()

    # -- scheduling --

    def _schedule(self) -> tuple[list[ScheduledRequest], dict[str, int], set[str], set[int]]:
        scheduled: list[ScheduledRequest] = []
        tokens: dict[str, int] = {}
        preempted = {r for r in self.pending_preempts if not self.requests[r].is_finished}
        self.pending_preempts.clear()
        allocated: set[int] = set()
        budget = self.config.max_num_batched_tokens
        tpb = self.config.tokens_per_block

        def preempt(req: EngineRequest) -> None:
            nonlocal scheduled
            self.block_pool.free(req.block_ids)
            req.block_ids = []
            req.num_computed_tokens = 0
            req.status = RequestStatus.PREEMPTED
            self.waiting.appendleft(req)
            preempted.add(req.req_id)
            scheduled = [s for s in scheduled if s.req_id != req.req_id]
            tokens.pop(req.req_id, None)

        def allocate(req: EngineRequest, num_tokens: int) -> list[int] | None:
            new = self.block_pool.allocate(max(0, -(-num_tokens // tpb) - len(req.block_ids)))
            if new is not None:
                req.block_ids.extend(new)
            return new

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            new = allocate(req, req.num_computed_tokens + n)
            while new is None and len(self.running) > i + 1:
                preempt(self.running.pop())
                new = allocate(req, req.num_computed_tokens + n)
            if new is None:
                self.running.pop(i)
                preempt(req)
                continue
            allocated.update(new)
            scheduled.append(ScheduledRequest(req.req_id, tuple(new), n))
            tokens[req.req_id] = n
            budget -= n
            i += 1
        if preempted:
            return scheduled, tokens, preempted, allocated
        skipped: list[EngineRequest] = []
        while self.waiting and budget > 0:
            req = self.waiting.popleft()
            hashes = req.block_hashes
            cached = self.block_pool.cached_prefix(hashes[: (req.num_tokens - 1) // tpb])
            num_local = len(cached) * tpb
            external, _ = self.scheduler.get_num_new_matched_tokens(req, num_local)
            if external is None:
                skipped.append(req)
                continue
            computed = num_local + external
            n = 0 if external else min(req.num_tokens - computed, budget)
            self.block_pool.acquire(cached)
            new = self.block_pool.allocate(-(-(computed + n) // tpb) - len(cached))
            if new is None:
                self.block_pool.free(cached)
                skipped.append(req)
                if self.block_pool.num_free == 0:
                    break
                continue
            req.block_ids = cached + new
            req.num_computed_tokens = num_local
            self.scheduler.update_state_after_alloc(req, req.block_ids, external)
            allocated.update(new)
            if external:
                req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.loading[req.req_id] = (req, min(self.scheduler.request_jobs(req.req_id)), external)
                continue
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append(ScheduledRequest(req.req_id, tuple(req.block_ids), n, admitted=True))
            tokens[req.req_id] = n
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return scheduled, tokens, preempted, allocated

    # -- forward and completion --

    def _forward(self, tokens: dict[str, int]) -> None:
        tpb = self.config.tokens_per_block
        for req_id, n in tokens.items():
            req = self.requests[req_id]
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            hashes = req.block_hashes
            for b in range(start // tpb, -(-end // tpb)):
                full = (b + 1) * tpb <= end
                tag = hashes[b] if full else b"partial" + (hashes[b - 1] if b else b"") + end.to_bytes(4, "little")
                self.memory.write(req.block_ids[b], tag)
                if full:
                    self.block_pool.cache(req.block_ids[b], hashes[b])
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

    def _finish_loads(self) -> None:
        errors = self.scheduler.take_load_errors()
        for job_id in self.scheduler.take_released_quarantine():
            blocks = self.quarantined_blocks.pop(job_id, None)
            if blocks:
                self.block_pool.free(blocks)
        tpb = self.config.tokens_per_block
        for req_id, (req, job_id, external) in list(self.loading.items()):
            if self.scheduler.job(job_id) is not None:
                continue
            del self.loading[req_id]
            first = req.num_computed_tokens // tpb
            if self.scheduler.is_quarantined(job_id):
                dest = req.block_ids[first : first + external // tpb]
                self.quarantined_blocks[job_id] = dest
                self.block_pool.free(req.block_ids[:first] + req.block_ids[first + len(dest) :])
                req.block_ids = []
                if req.aborted:
                    continue
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(req)
                self.pending_preempts.add(req.req_id)
                continue
            if req.aborted:
                self.block_pool.free(req.block_ids)
                continue
            if req_id not in errors:
                hashes = req.block_hashes
                for b in range(first, first + external // tpb):
                    block = req.block_ids[b]
                    self.mismatches += sum(1 for gpu in self.memory.gpu if gpu.get(block) != hashes[b])
                    self.block_pool.cache(block, hashes[b])
                req.num_computed_tokens += external
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def shutdown(self) -> None:
        """Abort everything, flush every transfer (tiers included), stop."""
        for req_id in [r.req_id for r in (*self.waiting, *self.running)]:
            self.abort(req_id)
        self._machine.fire(self, EngineEvent.SHUTDOWN)
        for _ in range(1000):
            meta = self.scheduler.build_connector_meta(SchedulerOutput())
            for w in self.workers:
                w.before_forward(meta)
                w.after_forward(meta)
            if not self.has_pending_push_work():
                break
            for w in self.workers:
                w.wait_all()
            if self.tier is not None:
                self.tier.complete_all()
            out = WorkerOutput()
            for w in self.workers:
                out.merge(w.poll())
            self.scheduler.update_connector_output(out)
            self._finish_loads()
        self._machine.fire(self, EngineEvent.STOP)
        for w in self.workers:
            w.wait_all()
        out = WorkerOutput()
        for w in self.workers:
            out.merge(w.poll())
        self.scheduler.update_connector_output(out)
        self._finish_loads()
        self.scheduler.shutdown()


class ControlHarness(SystemHarness):
    """A :class:`TagEngine` as the state machine drives and inspects it."""

    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        self.clock = ManualClock()
        self.engine = TagEngine(config, self.clock)
        self.tier = self.engine.tier
        self.hook = self.engine.hook

    @property
    def scheduler(self) -> OffloadingScheduler:
        return self.engine.scheduler

    @property
    def state(self) -> EngineState:
        return self.engine.state

    def make_request(self, req_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
        return EngineRequest(req_id, prompt, max_tokens, self.config.tokens_per_block)

    def add_request(self, request: EngineRequest, late: bool) -> None:
        (self.engine.late if late else self.engine.inbox).append(request)

    def step(self) -> tuple[EngineState, bool] | None:
        return self.engine.step()

    def has_pending_push_work(self) -> bool:
        return self.engine.has_pending_push_work()

    def live_request_ids(self) -> list[str]:
        return sorted(r.req_id for r in self.engine.requests.values() if not r.is_finished)

    def is_admitted(self, req_id: str) -> bool:
        return req_id in self.engine.requests

    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    def reset_offload_cache(self) -> None:
        self.engine.scheduler.reset_cache()

    def reset_prefix_cache(self) -> None:
        self.engine.block_pool.reset_prefix_cache()

    def held_copies(self) -> list[tuple[int, int]]:
        return sorted((job_id, w.rank) for w in self.engine.workers for job_id in w.held)

    def complete_copy(self, job_id: int, rank: int, ok: bool) -> None:
        self.engine.workers[rank].run(job_id, ok)

    def copies_in_flight(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for w in self.engine.workers:
            for job_id in (*w.held, *(j for j, _ in w.done)):
                out.setdefault(job_id, set()).add(w.rank)
        return out

    def unlaunched_store_ids(self, rank: int) -> tuple[int, ...]:
        return tuple(self.engine.workers[rank].unlaunched)

    def load_mismatches(self) -> int:
        return self.engine.mismatches

    def slot_violations(self, key: OffloadKey, slot_id: int, hashes: Sequence[bytes]) -> list[str]:
        out: list[str] = []
        for rank, cpu in enumerate(self.engine.memory.cpu):
            for sub, block_hash in enumerate(hashes):
                if cpu.get((slot_id, sub)) != block_hash:
                    out.append(
                        f"readable key {key.hex()[:12]} (slot {slot_id}, block {sub}) holds the wrong bytes "
                        f"on rank {rank}"
                    )
        return out

    def source_violations(self, job: Job, ranks: set[int], hashes: Sequence[bytes]) -> list[str]:
        out: list[str] = []
        for rank in sorted(ranks):
            gpu = self.engine.memory.gpu[rank]
            for block, block_hash in zip(job.gpu.block_ids, hashes, strict=True):
                if gpu.get(block) != block_hash:
                    out.append(
                        f"GPU block {block} read by store job {job.job_id} was overwritten before rank {rank} copied it"
                    )
        return out

    def shutdown(self, timeout: float | None) -> None:
        if self.engine.state is EngineState.STOPPED:
            return
        if timeout is not None:
            # A bounded shutdown whose deadline has passed: give up on every job, then stop.
            e = self.engine
            for req_id in [r.req_id for r in (*e.waiting, *e.running)]:
                e.abort(req_id)
            e._machine.fire(e, EngineEvent.SHUTDOWN)
            meta = e.scheduler.build_connector_meta(SchedulerOutput())
            for w in e.workers:
                w.before_forward(meta)
                w.after_forward(meta)
            e.scheduler.abandon_jobs()
            e._finish_loads()
            e._machine.fire(e, EngineEvent.STOP)
            out = WorkerOutput()
            for w in e.workers:
                w.wait_all()
                out.merge(w.poll())
            e.scheduler.update_connector_output(out)
            e._finish_loads()
            e.scheduler.shutdown()
            return
        self.engine.shutdown()

    def close(self) -> None:
        pass


@spec_covered("job", "request", "engine", "slot", exempt=SYSTEM_EXEMPT)
class ControlPlaneStateMachine(SystemStateMachine):
    """The control plane over tag memory against the spec (see :mod:`kvfsm.testing.system`)."""

    def make_harness(self, config: SystemConfig) -> SystemHarness:
        return ControlHarness(config)
