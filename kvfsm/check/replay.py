"""Model-based tests: the model checker's graph replayed on the real implementation.

:class:`Harness` is the system under test: the real :class:`~kvfsm.control.scheduler.OffloadingScheduler`
and :class:`~kvfsm.control.cpu.CPUOffloadingManager` (behind a real
:class:`~kvfsm.control.tiering.TieringManager` when the bounds have a tier), ``W`` real
:class:`~kvfsm.control.worker.OffloadingWorker` ranks over :class:`~kvfsm.control.worker.HeldCopyBackend`
copies that move nothing and finish only when an event says so, the model's secondary tiers in its order
(:class:`ModelTier`: kvfsm's :class:`~kvfsm.tiers.memory.InMemoryTier`, whose cascades and promotions end
only when an event says so, hitting what it holds with ``Bounds.promotions``, the last one syncing in the
background with ``Bounds.durable``), the real :class:`~kvfsm.control.deadlines.Deadlines` on an injected
:class:`ReplayClock` with the scheduler's expiry queue holding each store deadline back until an ``expire``
event passes it (:class:`HeldDeadlineQueue`, through the scheduler's ``expiry`` seam), and a small engine
loop, at the model's finer granularity (a lookup, a step, a finish are separate events), that fires the
real engine machine as the reference engine does (:func:`~kvfsm.control.decisions.settle_event`) and shuts
down as :meth:`EngineLoop.shutdown <kvfsm.engine.loop.EngineLoop.shutdown>` does (abort, ``shutdown`` /
flush_all's empty steps, ``abandon_jobs`` at the deadline, ``stop`` and the parts' shutdown). No torch.

Every event label of :mod:`kvfsm.check.model` is an operation of the harness (:meth:`Harness.apply`), and
:func:`abstract` reads the harness back into a model :class:`~kvfsm.check.model.State` (through public
accessors and the scheduler's queries for verifiers). Then:

* :func:`replay_edges` walks the explored graph depth-first along its BFS tree, keeps a copy of the
  harness per tree level, and for **every edge** applies the event to a copy of the source's harness and
  compares ``abstract(harness)`` with the model's target state;
* :func:`probe_state` applies, in one reachable state, every event the spec *disables* there, through the
  implementation's own entry points: each must raise a typed :class:`~kvfsm.errors.KvfsmError` and leave
  the abstract state (and the scheduler's counters) exactly as they were.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from typing_extensions import override

from kvfsm.check.bfs import ExplorationResult, describe_label, describe_state
from kvfsm.check.model import (
    ABSENT,
    COPYING,
    DONE_FAIL,
    DONE_OK,
    E_DONE,
    E_LOAD,
    E_RUN,
    E_WAIT,
    LOAD,
    REPORTED,
    STORE,
    SYNCING,
    TOKENS_PER_BLOCK,
    UNLAUNCHED,
    WRITING,
    Bounds,
    JobRec,
    Label,
    Model,
    Req,
    RequestScratch,
    State,
    TierRec,
)
from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import DeadlineQueue, Deadlines
from kvfsm.control.decisions import settle_event
from kvfsm.control.job import Job
from kvfsm.control.manager import JobResult, OffloadingManager, TierJob
from kvfsm.control.metadata import WorkerOutput
from kvfsm.control.requests import TokenRequest, chain_block_hashes
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput, SchedulerStats
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import (
    LookupResult,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from kvfsm.control.worker import HeldCopyBackend, OffloadingWorker
from kvfsm.errors import KvfsmError
from kvfsm.machines import engine_machine, job_machine, request_machine, slot_machine
from kvfsm.machines.names import (
    JOB_TERMINAL,
    EngineEvent,
    EngineState,
    JobEvent,
    JobKind,
    JobState,
    RequestEvent,
    RequestState,
)
from kvfsm.tiers.memory import InMemoryTier

__all__ = [
    "Harness",
    "HeldDeadlineQueue",
    "Mismatch",
    "ModelTier",
    "ReplayClock",
    "ReplayReport",
    "abstract",
    "probe_state",
    "replay_edges",
    "replay_path",
]

_CTX = ReqContext("probe")
_FINISHED = (RequestState.FINISHED_UNSIGNALLED, RequestState.FINISHED_SIGNALLED, RequestState.DELETED, None)


# --------------------------------------------------------------------------------------------- the parts


def shard_state(worker: OffloadingWorker, backend: HeldCopyBackend, job: Job) -> int:
    """Where ``job``'s copy on ``worker``'s rank stands, as the model encodes a shard."""
    ok = backend.done.get(job.job_id)
    if ok is not None:
        return DONE_OK if ok else DONE_FAIL
    if job.job_id in backend.held:
        return COPYING
    return REPORTED if worker.launched_here(job) else UNLAUNCHED


class ModelTier(InMemoryTier):
    """kvfsm's in-memory tier (:class:`~kvfsm.tiers.memory.InMemoryTier`: a job's I/O ends only when the
    test calls :meth:`complete`), seen at the model's abstraction.

    What it adds to the real tier is what the model abstracts: finished jobs are reported in key order
    (the model cannot know the order in which two transfers ended, so it applies them by keys); with
    ``hits=False`` it never answers HIT (the model without ``promotions``); with ``durable=True`` a
    successful cascade, once reported, keeps syncing in the background (the tier's own
    ``has_pending_work()``, as a durable :class:`~kvfsm.tiers.fs.FileSystemTier`'s fsync) until
    :meth:`sync` says it is durable, and :meth:`drain_jobs` waits for the syncs too.
    """

    __slots__ = ("drained", "durable", "hits", "key_ids", "polled", "syncing", "unreported")

    def __init__(self, name: str, key_ids: Mapping[OffloadKey, int], *, hits: bool, durable: bool) -> None:
        super().__init__(name)
        self.key_ids = key_ids
        self.hits = hits
        self.durable = durable
        #: Jobs whose I/O ended and that the manager has not polled yet: job id -> (job, its I/O succeeded).
        self.unreported: dict[int, tuple[TierJob, bool]] = {}
        #: Durable tier: cascades reported as written whose background sync still runs, by job id.
        self.syncing: dict[int, TierJob] = {}
        #: Jobs a drain finished (written and synced) that the manager has not polled yet.
        self.drained: set[int] = set()
        #: The manager polled this tier since the last schedule end (or reset): its poll gate is closed.
        self.polled = False

    def keys_of(self, job: TierJob) -> tuple[int, ...]:
        return tuple(self.key_ids[k] for k in job.keys)

    @override
    def complete(self, job_id: int, success: bool = True) -> None:
        job = self.pending_job(job_id)
        super().complete(job_id, success)
        self.unreported[job_id] = (job, success)

    def sync(self, job_id: int) -> None:
        """The background sync of a reported cascade finishes: its data is durable."""
        if job_id not in self.syncing:
            raise KvfsmError(f"tier {self.name!r} syncs no job {job_id}; expected one of {sorted(self.syncing)}")
        del self.syncing[job_id]

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return super().lookup(key, ctx) if self.hits else LookupResult.MISS

    @override
    def has_pending_work(self) -> bool:
        return bool(self.syncing)

    @override
    def on_schedule_end(self) -> None:
        self.polled = False  # the manager reopens its poll gate right after this hook

    @override
    def get_finished_jobs(self) -> list[JobResult]:
        self.polled = True
        results = list(super().get_finished_jobs())
        jobs = {jid: job for jid, (job, _) in self.unreported.items()}
        self.unreported = {}
        results.sort(key=lambda r: self.keys_of(jobs[r.job_id]))
        if self.durable:
            for r in results:
                job = jobs[r.job_id]
                if r.success and not job.is_promotion and r.job_id not in self.drained:
                    self.syncing[r.job_id] = job
        self.drained.clear()
        return results

    @override
    def drain_jobs(self) -> None:
        super().drain_jobs()
        # The drain returns once every write and every sync is done: what it finished is durable already.
        self.drained.update(self.unreported)
        self.syncing.clear()

    @override
    def shutdown(self) -> None:
        """As :meth:`FileSystemTier.shutdown <kvfsm.tiers.fs.FileSystemTier.shutdown>`: every pending I/O is
        cancelled and reported failed at the next poll, and the background syncs stop."""
        for job_id in self.pending_job_ids():
            self.complete(job_id, False)
        self.drained.update(self.unreported)  # a closed tier starts no sync
        self.syncing.clear()


class ReplayClock:
    """The scheduler's injected clock: it moves only when an ``expire`` event passes a deadline (a plain
    float, so that the harness can be deep-copied; :class:`~kvfsm.control.deadlines.ManualClock` holds a
    lock)."""

    __slots__ = ("now",)

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class HeldDeadlineQueue(DeadlineQueue):
    """The scheduler's real expiry queue, with each job's deadline held back until the checker's
    ``("expire", j)`` event passes it (:meth:`pass_deadline`): then, and only then, the deadline is in the
    queue and the clock past it, so the next ``build_connector_meta`` times out that job alone."""

    __slots__ = ("held", "passed")

    def __init__(self) -> None:
        super().__init__()
        self.held: dict[int, float] = {}  #: job id -> its deadline, not passed yet
        self.passed: set[int] = set()  #: jobs whose deadline the clock has passed (ground truth)

    @override
    def push(self, item: int, deadline: float) -> None:
        self.held[item] = deadline

    def pass_deadline(self, item: int, clock: ReplayClock) -> None:
        deadline = self.held.pop(item)
        super().push(item, deadline)
        self.passed.add(item)
        clock.now = max(clock.now, deadline)

    @override
    def clear(self) -> None:
        super().clear()
        self.held.clear()


class _Engine:
    """The engine machine's model: the reference engine's state and its pending-work signal."""

    __slots__ = ("sched", "state")

    def __init__(self, sched: OffloadingScheduler) -> None:
        self.sched = sched
        self.state = EngineState.IDLE

    def has_pending_push_work(self) -> bool:
        return self.sched.has_pending_push_work()


@dataclass(slots=True)
class _HReq:
    request: TokenRequest
    prompt: int
    eng: int = E_WAIT
    group: int = -1  #: group the engine holds (loading or running)
    external: int = 0


# --------------------------------------------------------------------------------------------- the harness


class Harness:
    """The real control plane at the model's bounds, driven by the model's event labels."""

    def __init__(self, bounds: Bounds, *, checked: bool | None = None) -> None:
        self.bounds = b = bounds
        self.blocks_per_group = b.chunks + 1
        self.tokens = [self._prompt_tokens(p) for p in range(b.prompts)]
        self.key_ids: dict[OffloadKey, int] = {}
        for p, toks in enumerate(self.tokens):
            hashes = chain_block_hashes(toks, TOKENS_PER_BLOCK)
            for c in range(b.chunks):
                self.key_ids[make_offload_key(hashes[c])] = b.key(p, c)
        self.keys_by_id = {k: key for key, k in self.key_ids.items()}
        self.primary = CPUOffloadingManager(b.slots, checked=checked)
        # The model's tiers, in its order; the last one is durable with Bounds.durable.
        self.tiers = [
            ModelTier(f"tier{t}", self.key_ids, hits=b.promotions, durable=b.durable and t == b.tiers - 1)
            for t in range(b.tiers)
        ]
        #: The injected clock, and the scheduler's expiry queue, which holds each store deadline back until
        #: an ``expire`` event passes it. Only store deadlines are in scope (``Bounds.deadlines``).
        self.clock = ReplayClock()
        self.expiry = HeldDeadlineQueue()
        deadlines = (
            Deadlines(store_s=1.0, load_s=None, cascade_s=None, promote_s=None, lookup_wait_s=None, shutdown_s=None)
            if b.deadlines
            else Deadlines.none()
        )
        self.manager: OffloadingManager = (
            TieringManager(self.primary, self.tiers, checked=checked, deadlines=deadlines, clock=self.clock)
            if self.tiers
            else self.primary
        )
        self.config = OffloadConfig(TOKENS_PER_BLOCK, 1, b.workers)
        self.sched = OffloadingScheduler(
            self.config, self.manager, checked=checked, deadlines=deadlines, clock=self.clock, expiry=self.expiry
        )
        self.backends = [HeldCopyBackend() for _ in range(b.workers)]
        self.workers = [OffloadingWorker(r, b.workers, backend) for r, backend in enumerate(self.backends)]
        self.engine = _Engine(self.sched)
        self.engine_machine = engine_machine()
        self.requests: dict[str, _HReq] = {}
        self.running: list[str] = []
        self.loading: dict[str, int] = {}
        self.finished_order: list[str] = []
        self.batch: list[str] = []
        self.arrivals = 0
        self.resets = 0
        self.preemptions = 0
        self.expiries = 0

    def _prompt_tokens(self, prompt: int) -> list[int]:
        toks = [1, 2]
        for c in range(1, self.bounds.chunks):
            toks += [100 + 20 * prompt + 2 * c, 101 + 20 * prompt + 2 * c]
        return [*toks, 7]

    def blocks(self, group: int) -> list[int]:
        n = self.blocks_per_group
        return list(range(group * n, (group + 1) * n))

    def group_of(self, block_ids: Sequence[int]) -> int:
        return block_ids[0] // self.blocks_per_group if block_ids else -1

    def known_jobs(self) -> dict[int, Job]:
        """Every job the scheduler awaits or some worker still holds, by id."""
        jobs = self.sched.jobs()
        for w in self.workers:
            for table in (w.in_flight_jobs(), w.unlaunched_stores()):
                for jid, job in table.items():
                    jobs.setdefault(jid, job)
        return jobs

    def scheduler_group(self, rid: str) -> int:
        blocks = self.sched.request_block_ids(rid)
        if blocks is not None:
            return self.group_of(blocks)
        h = self.requests[rid]
        return h.group if h.eng in (E_LOAD, E_RUN) else -1

    # ------------------------------------------------------------------ events

    def apply(self, label: Label, refs: Refs) -> None:
        """Apply a model event; indices in ``label`` are resolved through ``refs`` (see :func:`abstract`)."""
        kind = label[0]
        if kind == "copy":
            self.backends[refs.workers[label[2]]].complete(refs.jobs[label[1]], label[3])
        elif kind == "tier":
            t, job_id = refs.tier[label[1]]
            self.tiers[t].complete(job_id, label[2])
        elif kind == "sync":
            t, job_id = refs.tier[label[1]]
            self.tiers[t].sync(job_id)
        elif kind == "expire":
            self.expiry.pass_deadline(refs.jobs[label[1]], self.clock)
            self.expiries += 1
        elif kind == "shutdown":
            self.shutdown(refs.reqs)
        elif kind == "give_up":
            self.give_up()
        elif kind == "stop":
            self.stop()
        elif kind == "arrive":
            self.arrive(label[1])
        elif kind == "lookup":
            g = label[2]
            self.lookup(refs.reqs[label[1]], refs.groups[g] if g >= 0 else -1)
        elif kind == "step":
            self.step()
        elif kind == "preempt":
            self.step(preempt=refs.reqs[label[1]])
        elif kind == "finish":
            self.finish(refs.reqs[label[1]])
        elif kind == "reset":
            self.reset()
        else:  # pragma: no cover - the model has no other event
            raise KvfsmError(f"unknown model event {label!r}")

    def _fire_engine(self, event: EngineEvent) -> None:
        self.engine_machine.fire(self.engine, event)

    def arrive(self, prompt: int) -> str:
        rid = f"r{self.arrivals}"
        self.arrivals += 1
        req = TokenRequest(rid, self.tokens[prompt], TOKENS_PER_BLOCK)
        self.requests[rid] = _HReq(req, prompt)
        self.sched.on_new_request(req)
        self._fire_engine(EngineEvent.ADMIT)
        return rid

    def free_groups(self) -> tuple[list[int], list[int]]:
        """Free GPU groups: (clean ones, those still referenced by a job or a request's scheduler state)."""
        held = {h.group for h in self.requests.values() if h.eng in (E_LOAD, E_RUN)}
        referenced = {self.scheduler_group(rid) for rid in self.requests} | {
            self.group_of(j.gpu.block_ids) for j in self.known_jobs().values()
        }
        free = [g for g in range(self.bounds.groups) if g not in held]
        return [g for g in free if g not in referenced], [g for g in free if g in referenced]

    def lookup(self, rid: str, group: int = -1) -> bool:
        """The engine tries to admit waiting request ``rid`` (into ``group``, or any clean free group)."""
        h = self.requests[rid]
        req = h.request
        external, _ = self.sched.get_num_new_matched_tokens(req, 0)
        if external is None:
            return False
        if group < 0:
            clean, _dirty = self.free_groups()
            if not clean:
                # The model deferred or refused this admission (no group is free there): the implementation
                # diverged, its lookup answering what the model's did not.
                raise AssertionError(f"the implementation admits request {rid}, but no clean GPU group is free")
            group = clean[0]
        h.group = group
        h.external = external
        self.sched.update_state_after_alloc(req, self.blocks(group), external)
        self.batch.append(rid)
        if external:
            h.eng = E_LOAD
            (job_id,) = self.sched.request_jobs(rid)
            self.loading[rid] = job_id
        else:
            h.eng = E_RUN
            self.running.append(rid)
        return True

    def step(self, preempt: str | None = None) -> None:
        preempted: frozenset[str] = frozenset()
        if preempt is not None:
            h = self.requests[preempt]
            h.eng, h.group = E_WAIT, -1
            h.request.num_computed_tokens = 0
            self.running.remove(preempt)
            preempted = frozenset({preempt})
            self.preemptions += 1
        scheduled = []
        allocated: set[int] = set()
        for rid in self.batch:
            allocated.update(self.blocks(self.requests[rid].group))
        for rid in self.running:
            h = self.requests[rid]
            n = h.request.num_tokens - h.request.num_computed_tokens
            admitted = rid in self.batch
            new = tuple(self.blocks(h.group)) if admitted else ()
            scheduled.append(ScheduledRequest(rid, new, n, admitted=admitted))
        meta = self.sched.build_connector_meta(SchedulerOutput(tuple(scheduled), preempted, frozenset(allocated)))
        self.batch = []
        self.finished_order = []
        for w in self.workers:
            w.before_forward(meta)
        for s in scheduled:
            self.requests[s.req_id].request.num_computed_tokens += s.num_scheduled_tokens
        for w in self.workers:
            w.after_forward(meta)
        self.sched.update_connector_output(self.poll())
        self._finish_loads()
        if self.engine.state is not EngineState.SHUTTING_DOWN:
            self._settle()  # flush_all's empty steps settle nothing: its end is give_up or stop
        self._forget()

    def poll(self) -> WorkerOutput:
        """Every worker's poll, summed, in the order the model applies reports (kind, then keys)."""
        jobs: dict[int, Job] = {}
        for w in self.workers:
            jobs.update(w.in_flight_jobs())
        summed = WorkerOutput()
        for w in self.workers:
            summed.merge(w.poll())
        ok, bad = summed.completed, summed.failed

        def order(jid: int) -> tuple[int, tuple[int, ...]]:
            job = jobs[jid]
            return (STORE if job.kind is JobKind.STORE else LOAD, tuple(self.key_ids[k] for k in job.keys))

        out = WorkerOutput(finished_recving=summed.finished_recving)
        for jid in sorted(ok.keys() | bad.keys(), key=order):
            if jid in bad:
                out.failed[jid] = bad[jid]
            if jid in ok:
                out.completed[jid] = ok[jid]
        return out

    def _finish_loads(self) -> None:
        errors = self.sched.take_load_errors()
        for rid, job_id in list(self.loading.items()):
            if self.sched.job(job_id) is not None:
                continue
            del self.loading[rid]
            h = self.requests[rid]
            if not self.sched.is_tracked(rid) or self.sched.request_state(rid) in (
                RequestState.FINISHED_UNSIGNALLED,
                RequestState.FINISHED_SIGNALLED,
            ):
                h.eng, h.group = E_DONE, -1
                continue
            if rid not in errors:
                h.request.num_computed_tokens += h.external
            h.eng = E_RUN
            self.running.append(rid)

    def _settle(self) -> None:
        event = settle_event(self.engine.state, any(h.eng in (E_WAIT, E_LOAD, E_RUN) for h in self.requests.values()))
        if event is not None:
            self._fire_engine(event)

    def _forget(self) -> None:
        for rid in [r for r, h in self.requests.items() if h.eng == E_DONE and not self.sched.is_tracked(r)]:
            del self.requests[rid]

    def finish(self, rid: str, *, aborted: bool = False) -> None:
        h = self.requests[rid]
        req = h.request
        req.is_aborted = aborted or not (h.eng == E_RUN and req.num_computed_tokens == req.num_tokens)
        self.sched.request_finished(req)
        self.finished_order.append(rid)
        if h.eng in (E_RUN, E_WAIT):
            if rid in self.running:
                self.running.remove(rid)
            h.eng, h.group = E_DONE, -1
        self._forget()

    def reset(self) -> None:
        self.sched.reset_cache()
        for tier in self.tiers:
            tier.polled = False  # reset_cache reopens the manager's poll gate
        self.resets += 1
        self.finished_order = []
        self._forget()

    # -- bounded shutdown, as EngineLoop.shutdown does it (one flush_all round per step event)

    def shutdown(self, order: Sequence[str]) -> None:
        """EngineLoop.shutdown up to flush_all: abort every live request (in ``order``, the model's), then
        fire ``shutdown``. The flush_all rounds are the ``step`` events that follow (an empty step: no
        request is running any more), and its end is ``give_up`` or ``stop``."""
        for rid in order:
            h = self.requests[rid]
            if h.eng != E_DONE and self.sched.state_or_none(rid) not in _FINISHED:
                self.finish(rid, aborted=True)
        self._fire_engine(EngineEvent.SHUTDOWN)

    def give_up(self) -> None:
        """flush_all's deadline passed with work pending: abandon_jobs, then the loop's _finish_loads."""
        self.sched.abandon_jobs()
        self._finish_loads()

    def stop(self) -> None:
        """``stop`` fires, then EngineLoop._stop_parts (unthreaded): every worker shuts down (its held
        copies run), their last reports are applied, the scheduler shuts down (release_quarantine, the
        tiering manager's shutdown), and the loop's _finish_loads."""
        self._fire_engine(EngineEvent.STOP)
        for w in self.workers:
            w.shutdown()
        self.sched.update_connector_output(self.poll())
        self.sched.shutdown(None)
        self._finish_loads()


# --------------------------------------------------------------------------------------------- abstraction


@dataclass(slots=True)
class Refs:
    """What each index of a canonical model state stands for in the harness."""

    reqs: list[str] = field(default_factory=list)
    jobs: list[int] = field(default_factory=list)
    tier: list[tuple[int, int]] = field(default_factory=list)  #: (tier index, its job id; -1: queued)
    groups: dict[int, int] = field(default_factory=dict)  #: canonical group -> harness group
    workers: list[int] = field(default_factory=list)  #: canonical rank -> harness rank


def abstract(h: Harness, model: Model) -> tuple[State, Refs]:
    """The harness as a canonical model state, with what its indices stand for."""
    sched = h.sched
    W = h.bounds.workers
    rids = [rid for rid, r in h.requests.items() if not (r.eng == E_DONE and not sched.is_tracked(rid))]
    index = {rid: i for i, rid in enumerate(rids)}
    reqs = []
    for rid in rids:
        r = h.requests[rid]
        phase = sched.request_state(rid) if sched.is_tracked(rid) else RequestState.DELETED
        if r.eng == E_RUN:
            pos = h.running.index(rid)
        elif r.eng == E_LOAD:
            pos = list(h.loading).index(rid)
        else:
            pos = -1
        fin = h.finished_order.index(rid) if phase is RequestState.FINISHED_UNSIGNALLED else -1
        reqs.append(
            Req(
                phase,
                r.eng,
                r.prompt,
                r.request.num_computed_tokens,
                sched.next_stored_chunk(rid),
                h.scheduler_group(rid),
                pos,
                fin,
                rid in h.batch,
            )
        )
    live = sched.jobs()
    jobs = []
    job_ids = []
    threshold = sched.stale_threshold
    planned = sched.planned_load_ids()
    for jid, job in sorted(h.known_jobs().items()):
        shards = tuple(
            UNLAUNCHED if jid in planned else shard_state(w, b, job) for w, b in zip(h.workers, h.backends, strict=True)
        )
        in_sched = jid in live
        if not in_sched and not any(sh in (COPYING, DONE_OK, DONE_FAIL) for sh in shards):
            continue
        jobs.append(
            JobRec(
                STORE if job.kind is JobKind.STORE else LOAD,
                tuple(h.key_ids[k] for k in job.keys),
                index[job.req_id] if in_sched else -1,
                h.group_of(job.gpu.block_ids),
                job.state,
                job.pending,
                job.failed_reports,
                shards,
                job.state in (JobState.STALE, JobState.TIMED_OUT) and jid < threshold,
                W,
                jid in h.expiry.passed,
            )
        )
        job_ids.append(jid)
    slots = []
    for k in range(h.bounds.num_keys):
        key = h.keys_by_id[k]
        ref = h.primary.ref_cnt(key)
        slots.append(ABSENT if ref is None else ref)
    policy = h.primary.policy
    order = policy.keys()  # CachePolicy.keys(): held keys, least recent first
    lru = tuple(h.key_ids[k] for k in order if policy.is_evictable(k))
    tier_recs: list[TierRec] = []
    tier_ids: list[tuple[int, int]] = []
    for t, tier in enumerate(h.tiers):
        for jid in tier.pending_job_ids():
            tjob = tier.pending_job(jid)
            tier_recs.append(TierRec(tier.keys_of(tjob), COPYING, t, False, tjob.is_promotion))
            tier_ids.append((t, jid))
        for jid, (tjob, ok) in tier.unreported.items():
            tier_recs.append(TierRec(tier.keys_of(tjob), DONE_OK if ok else DONE_FAIL, t, False, tjob.is_promotion))
            tier_ids.append((t, jid))
        for jid, tjob in tier.syncing.items():
            tier_recs.append(TierRec(tier.keys_of(tjob), SYNCING, t, True, False))
            tier_ids.append((t, jid))
    if isinstance(h.manager, TieringManager):
        for t, _rid, keys in h.manager.queued_promotions():
            for key in keys:  # the model queues one promotion per key
                tier_recs.append(TierRec((h.key_ids[key],), UNLAUNCHED, t, False, True))
                tier_ids.append((t, -1))
    polled = h.tiers[0].polled if h.tiers else False
    held = (
        tuple(sum(1 << h.key_ids[key] for key in InMemoryTier.keys(tier)) for tier in h.tiers)
        if h.bounds.promotions
        else ()
    )
    state = State(
        h.engine.state,
        tuple(reqs),
        tuple(jobs),
        tuple(slots),
        lru,
        tuple(tier_recs),
        polled,
        sched.has_reset_flush(),
        h.arrivals,
        h.resets,
        h.preemptions,
        sched.job_counter if h.bounds.max_jobs else 0,
        False,
        held,
        h.expiries,
        sched.abandoned,
    )
    maps = model.canonical_with_maps(state)
    refs = Refs(
        [rids[i] for i in maps.reqs],
        [job_ids[j] for j in maps.jobs],
        [tier_ids[c] for c in maps.tier],
        {new: old for old, new in maps.groups.items()},
        list(maps.workers),
    )
    return maps.state, refs


# --------------------------------------------------------------------------------------------- replay


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The implementation disagreed with the model (or raised where the model moved on)."""

    what: str
    path: tuple[Label, ...]
    expected: State | None
    actual: State | None

    @override
    def __str__(self) -> str:
        lines = [self.what, f"after {len(self.path)} events: {list(self.path)}"]
        if self.expected is not None:
            lines.append(f"  model:          {describe_state(self.expected)}")
        if self.actual is not None:
            lines.append(f"  implementation: {describe_state(self.actual)}")
        return "\n".join(lines)


@dataclass(slots=True)
class ReplayReport:
    states: int = 0
    edges_replayed: int = 0
    probes: int = 0
    seconds: float = 0.0
    mismatches: list[Mismatch] = field(default_factory=list)
    probe_failures: list[str] = field(default_factory=list)


def _shared_memo(h: Harness) -> dict[int, Any]:
    """deepcopy memo that keeps the (immutable, shared) spec machines and key tables shared."""
    memo: dict[int, Any] = {}
    for machine in (
        engine_machine(),
        *(f(c) for f in (job_machine, slot_machine, request_machine) for c in (None, True, False)),
        job_machine(),
        slot_machine(),
        request_machine(),
        h.engine_machine,
        h.key_ids,
        h.keys_by_id,
        h.config,
        h.bounds,
    ):
        memo[id(machine)] = machine
    for job in h.known_jobs().values():
        # The spec machine and the job's immutable records (frozen dataclasses) are shared.
        for part in (job.machine, job.gpu, job.slots):
            memo[id(part)] = part
    for backend in h.backends:
        for held in backend.held.values():
            memo[id(held)] = held
    return memo


def _clone(h: Harness) -> Harness:
    """An independent copy of the harness (spec machines, key tables and jobs' immutable records shared)."""
    return copy.deepcopy(h, _shared_memo(h))


def replay_path(bounds: Bounds, model: Model, path: Sequence[Label], states: Sequence[State]) -> Harness:
    """A fresh harness driven along ``path``, checked against ``states`` (the path's canonical states)."""
    h = Harness(bounds)
    actual, refs = abstract(h, model)
    if actual != states[0]:
        raise AssertionError(str(Mismatch("initial state differs", (), states[0], actual)))
    for n, label in enumerate(path):
        h.apply(label, refs)
        actual, refs = abstract(h, model)
        if actual != states[n + 1]:
            raise AssertionError(
                str(Mismatch(f"after {describe_label(states[n], label)}", tuple(path[: n + 1]), states[n + 1], actual))
            )
    return h


def replay_edges(
    result: ExplorationResult,
    *,
    probes: bool = True,
    max_mismatches: int = 5,
    progress: Callable[[int, int], None] | None = None,
) -> ReplayReport:
    """Replay every edge of ``result.graph`` on the implementation; optionally probe every state."""
    graph = result.graph
    if graph is None:
        raise KvfsmError("replay_edges needs an exploration with keep_graph=True")
    model = Model(result.bounds)
    report = ReplayReport()
    start = time.perf_counter()
    n = len(graph.states)
    out_edges: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    for s, lab, d in zip(graph.src, graph.label, graph.dst, strict=True):
        out_edges[s].append((lab, d))
    root = Harness(result.bounds)
    actual, _ = abstract(root, model)
    if actual != graph.states[0]:
        report.mismatches.append(Mismatch("initial state differs", (), graph.states[0], actual))
        return report
    # Depth-first along the BFS tree: (state id, its harness, the path to it).
    stack: list[tuple[int, Harness, tuple[Label, ...]]] = [(0, root, ())]
    while stack:
        sid, h, path = stack.pop()
        report.states += 1
        _, refs = abstract(h, model)
        if probes:
            failures, count = probe_state(h, model, graph.states[sid], refs)
            report.probes += count
            report.probe_failures.extend(f"{f} (after {list(path)})" for f in failures)
        for lab, d in out_edges[sid]:
            label = graph.labels[lab]
            child = _clone(h)
            report.edges_replayed += 1
            try:
                child.apply(label, refs)
            except (KvfsmError, AssertionError) as exc:  # AssertionError: the harness cannot follow the event
                report.mismatches.append(
                    Mismatch(
                        f"{describe_label(graph.states[sid], label)} raised {exc!r}",
                        (*path, label),
                        graph.states[d],
                        None,
                    )
                )
                continue
            actual, _ = abstract(child, model)
            if actual != graph.states[d]:
                report.mismatches.append(
                    Mismatch(
                        f"after {describe_label(graph.states[sid], label)}", (*path, label), graph.states[d], actual
                    )
                )
                if len(report.mismatches) >= max_mismatches:
                    report.seconds = time.perf_counter() - start
                    return report
                continue
            if graph.parent[d] == sid and graph.parent_label[d] == lab:
                stack.append((d, child, (*path, label)))
        if progress is not None and report.states % 500 == 0:
            progress(report.states, report.edges_replayed)
    report.seconds = time.perf_counter() - start
    return report


# --------------------------------------------------------------------------------------------- probes


_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(SchedulerStats))


def _fingerprint(h: Harness, model: Model) -> tuple[Any, ...]:
    state, _ = abstract(h, model)
    s = h.sched
    return (
        state,
        tuple(getattr(s.stats, name) for name in _STATS_FIELDS),
        s.job_counter,
        s.stale_threshold,
        tuple(sorted(s.fenced_blocks().items())),
        s.chunks_being_loaded(),
        tuple(
            sorted(
                (jid, j.state, j.launched_mask, j.reported_mask, j.failed_reports) for jid, j in h.known_jobs().items()
            )
        ),
    )


#: A probe: what it tries, and how to try it on a harness.
Probe = tuple[str, Callable[[Harness], object]]


def probe_state(h: Harness, model: Model, state: State, refs: Refs) -> tuple[list[str], int]:
    """Apply every event the spec disables in ``state`` to (a copy of) ``h``: each must raise a typed
    KvfsmError and change nothing. Returns (failures, number of probes)."""
    failures: list[str] = []
    polled = _clone(h)
    if _pre_poll(polled):
        # The poll may have finished something (a cascade: nothing pending any more, so ``stop`` is
        # enabled): what is disabled is read from the polled copy.
        state, refs = abstract(polled, model)
    probes = disabled_events(polled, state, refs)
    work = _clone(polled)
    before = _fingerprint(work, model)
    # All probes on one copy, compared once at the end; only if something changed are they run again
    # one by one, to name the culprit.
    for what, call in probes:
        _try_probe(what, call, work, failures)
    if _fingerprint(work, model) != before:
        failures.clear()
        for what, call in probes:
            work = _clone(polled)
            _try_probe(what, call, work, failures)
            if _fingerprint(work, model) != before:
                failures.append(f"{what}: raised but changed the state")
    return failures, len(probes)


def _try_probe(what: str, call: Callable[[Harness], object], work: Harness, failures: list[str]) -> None:
    try:
        call(work)
    except KvfsmError:
        pass
    except Exception as exc:  # an untyped error is a failure of its own
        failures.append(f"{what}: raised untyped {type(exc).__name__}: {exc}")
    else:
        failures.append(f"{what}: accepted, but the spec disables it")


def _pre_poll(h: Harness) -> bool:
    """Close the tiering manager's poll gate the way a lookup does; True if there is a tiering manager.

    TieringManager's lookup, prepare_load and prepare_store poll the tiers first, by design (finished
    transfers are applied before the decision), so a refused prepare_load may still apply that poll. A
    probe starts from an already polled harness, so that what it compares is the refused event alone.
    """
    if isinstance(h.manager, TieringManager):
        h.manager.prepare_load((), _CTX)  # polls, changes nothing else (a lookup could reserve a promotion)
        return True
    return False


def _req(x: Harness, rid: str) -> TokenRequest:
    return x.requests[rid].request


# Probe factories: each returns a call that tries one event on a harness.


def _p_finish(rid: str) -> Callable[[Harness], object]:
    return lambda x: x.sched.request_finished(_req(x, rid))


def _p_lookup(rid: str) -> Callable[[Harness], object]:
    return lambda x: x.sched.get_num_new_matched_tokens(_req(x, rid), 0)


def _p_alloc(rid: str, external: int) -> Callable[[Harness], object]:
    return lambda x: x.sched.update_state_after_alloc(_req(x, rid), x.blocks(0), external)


def _p_preempt(rid: str) -> Callable[[Harness], object]:
    return lambda x: x.sched.build_connector_meta(SchedulerOutput(preempted_req_ids=frozenset({rid})))


def _p_report(job_id: int | None, ranks: Iterable[int], *, ok: bool) -> Callable[[Harness], object]:
    chosen = set(ranks)

    def call(x: Harness) -> object:
        jid = x.sched.job_counter if job_id is None else job_id
        out = WorkerOutput(completed={jid: set(chosen)}) if ok else WorkerOutput(failed={jid: set(chosen)})
        x.sched.update_connector_output(out)
        return None

    return call


def _p_job(job_id: int, event: JobEvent, arg: int = 0) -> Callable[[Harness], object]:
    def call(x: Harness) -> object:
        job = x.known_jobs()[job_id]
        if event is JobEvent.LAUNCH:
            return job.launch(arg)
        if event is JobEvent.CANCEL:
            job.cancel()
        elif event is JobEvent.DISCARD:
            job.discard()
        else:
            job.ack(0)
        return None

    return call


def _p_slot(key: OffloadKey, what: str) -> Callable[[Harness], object]:
    def call(x: Harness) -> object:
        if what == "prepare_load":
            return x.manager.prepare_load([key], _CTX)
        if what == "complete_load":
            x.manager.complete_load([key], _CTX)
        elif what == "commit_write":
            x.primary.complete_write([key])
        elif what == "abort_write":
            x.primary.complete_write([key], success=False)
        else:
            return x.primary.prepare_write([key])
        return None

    return call


def _p_engine(event: EngineEvent) -> Callable[[Harness], object]:
    return lambda x: x.engine_machine.fire(x.engine, event)


def _p_reset() -> Callable[[Harness], object]:
    return lambda x: x.sched.reset_cache()


def disabled_events(h: Harness, state: State, refs: Refs) -> list[Probe]:
    """Every event the spec disables in ``state``, as a call into the implementation's own entry points."""
    out: list[Probe] = []
    sched = h.sched
    rm = request_machine()
    batch_open = any(r.alloc for r in state.reqs)
    # Request machine: finish, lookup (defer), schedule, start_load, preempt.
    for i, rid in enumerate(refs.reqs):
        if not sched.is_tracked(rid):
            continue
        phase = state.reqs[i].phase
        probe = RequestScratch(phase, bool(sched.request_jobs(rid)))
        where = f"in {phase.value}"
        if not rm.can_fire(probe, RequestEvent.FINISH):
            out.append((f"request_finished({rid}) {where}", _p_finish(rid)))
        if phase not in (RequestState.TRACKED, RequestState.DEFERRED, RequestState.PREEMPTED):
            out.append((f"get_num_new_matched_tokens({rid}) {where}", _p_lookup(rid)))
        if not rm.can_fire(probe, RequestEvent.SCHEDULE):
            out.append((f"update_state_after_alloc({rid}, external=0) {where}", _p_alloc(rid, 0)))
        if not rm.can_fire(probe, RequestEvent.START_LOAD):
            n = TOKENS_PER_BLOCK
            out.append((f"update_state_after_alloc({rid}, external={n}) {where}", _p_alloc(rid, n)))
        if not rm.can_fire(probe, RequestEvent.PREEMPT) and not batch_open:
            out.append((f"build_connector_meta(preempted={rid}) {where}", _p_preempt(rid)))
    # Job machine: reports the scheduler must refuse, and events the job machine disables.
    # Reports are attributed to ranks: a rank that never launched the job, or that already reported it,
    # is refused (AckCountError), as are a report naming no rank and a rank outside 0..W-1.
    for jid, job in sched.jobs().items():
        for rank in range(job.world_size):
            bit = 1 << rank
            if not job.launched_mask & bit:
                out.append(
                    (f"ack job {jid} from rank {rank}, which never launched it", _p_report(jid, [rank], ok=True))
                )
            elif job.reported_mask & bit:
                out.append((f"fail job {jid} from rank {rank} again", _p_report(jid, [rank], ok=False)))
        out.append((f"ack job {jid} from rank {job.world_size}", _p_report(jid, [job.world_size], ok=True)))
        out.append((f"fail job {jid} from no rank", _p_report(jid, [], ok=False)))
    out.append((f"ack never-issued job {sched.job_counter}", _p_report(None, [0], ok=True)))
    # A timed-out job in quarantine absorbs a late report only from a rank whose launched copy has not
    # reported yet (Quarantined.check_report).
    for n, rec in enumerate(state.jobs):
        if rec.state is JobState.TIMED_OUT and not rec.ignored:
            jid = refs.jobs[n]
            for w, shard in enumerate(rec.shards):
                if shard in (UNLAUNCHED, REPORTED):
                    rank = refs.workers[w]
                    what = "never launched it" if shard == UNLAUNCHED else "already reported it"
                    out.append(
                        (
                            f"late ack of timed-out job {jid} from rank {rank}, which {what}",
                            _p_report(jid, [rank], ok=True),
                        )
                    )
    jm = job_machine()
    for jid, job in h.known_jobs().items():
        what = f"job {jid} ({job.state.value})"
        for rank in range(h.bounds.workers):
            if not jm.can_fire(job, JobEvent.LAUNCH, rank):
                out.append((f"launch {what} on rank {rank} again", _p_job(jid, JobEvent.LAUNCH, rank)))
        if not jm.can_fire(job, JobEvent.CANCEL):
            out.append((f"cancel {what}", _p_job(jid, JobEvent.CANCEL)))
        if not jm.can_fire(job, JobEvent.DISCARD):
            out.append((f"discard {what}", _p_job(jid, JobEvent.DISCARD)))
        if job.state in JOB_TERMINAL:
            out.append((f"ack {what}", _p_job(jid, JobEvent.ACK)))
    # Slot machine, through the manager's entry points.
    for k, code in enumerate(state.slots):
        key = h.keys_by_id[k]
        name = "absent" if code == ABSENT else "writing" if code == WRITING else "ready" if code == 0 else "reading"
        if code < 0:  # begin_read is disabled in absent and writing
            out.append((f"prepare_load(key {k}) while {name}", _p_slot(key, "prepare_load")))
        if code < 1:  # end_read is disabled unless reading
            out.append((f"complete_load(key {k}) while {name}", _p_slot(key, "complete_load")))
        if code != WRITING:  # commit_write / abort_write are disabled unless writing
            out.append((f"complete_write(key {k}) while {name}", _p_slot(key, "commit_write")))
            out.append((f"complete_write(key {k}, failed) while {name}", _p_slot(key, "abort_write")))
        if code != ABSENT:  # begin_write is disabled unless absent
            out.append((f"prepare_write(key {k}) while {name}", _p_slot(key, "prepare_write")))
    # Engine machine.
    for event in EngineEvent:
        if not h.engine_machine.can_fire(h.engine, event):
            out.append((f"engine {event.value} in {h.engine.state.value}", _p_engine(event)))
    # The scheduler's own rule: no reset_cache while a step is half scheduled.
    if batch_open:
        out.append(("reset_cache() with a step half scheduled", _p_reset()))
    return out
