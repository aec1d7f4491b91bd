"""The connector's scheduler half: plans load and store jobs, tracks them to commit, never waits.

Sans-IO: it talks to an :class:`OffloadingManager` and returns :class:`ConnectorMetadata`; the workers
run the copies and their summed :class:`WorkerOutput` comes back through ``update_connector_output``.
Method names follow vLLM's ``OffloadingConnectorScheduler`` so that its users feel at home.

The engine contract (spec/README.md, "the drain"): while ``has_pending_push_work()`` is True the engine
keeps stepping, so ``build_connector_meta`` and ``update_connector_output`` keep running with nothing
scheduled. No method here blocks; a fence or preemption flush is a *request* to the workers.

Failures and deadlines (spec/README.md, "Failures, deadlines and shutdown"): a job ends in exactly one of
complete, failed, cancelled, timed_out or stale. With :class:`~kvfsm.control.deadlines.Deadlines`, a job past its
deadline times out at the next ``build_connector_meta``; its launched copies may still be running, so its
slots stay quarantined until every launched worker has reported (late reports are absorbed by id), and a
timed-out load's GPU blocks are reported through :meth:`OffloadingScheduler.is_quarantined` /
:meth:`OffloadingScheduler.take_released_quarantine` so the engine keeps them out of its pool meanwhile.
A request waiting on HIT_PENDING / RETRY chunks waits at most ``lookup_wait_s``. Time comes from an
injected clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Protocol

from kvfsm.control.config import DrainMode, OffloadConfig
from kvfsm.control.deadlines import Clock, DeadlineQueue, Deadlines, run_bounded, with_timeout
from kvfsm.control.job import Job, Quarantined
from kvfsm.control.manager import OffloadingManager
from kvfsm.control.messages import RankReport, StepMessage, merge_reports
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.types import (
    GPUBlockSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    SlotSpec,
    make_offload_keys,
)
from kvfsm.errors import (
    AckCountError,
    DuplicateRequestError,
    InvalidTransition,
    KvfsmError,
    UnknownJobError,
    UnknownRequestError,
)
from kvfsm.machines import job_machine, request_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import JobEffect, JobKind, JobState, RequestEffect, RequestEvent, RequestState

__all__ = [
    "OffloadRequest",
    "OffloadingScheduler",
    "PendingJob",
    "RequestRecord",
    "ScheduledRequest",
    "SchedulerOutput",
    "SchedulerStats",
    "fenced_jobs",
    "pending_push_work",
    "stale_threshold_after_reset",
]

logger = logging.getLogger(__name__)

# Enum members read through their class cost a descriptor call each (Python 3.11): the per-job paths use these.
_IN_FLIGHT = JobState.IN_FLIGHT
_COMMIT, _RELEASE = JobEffect.COMMIT, JobEffect.RELEASE
_STORE, _LOAD = JobKind.STORE, JobKind.LOAD
_RUNNING, _FINISHED_SIGNALLED = RequestState.RUNNING, RequestState.FINISHED_SIGNALLED
_LOADING, _FINISHED_UNSIGNALLED = RequestState.LOADING, RequestState.FINISHED_UNSIGNALLED
_SCHEDULE, _START_LOAD, _LOAD_DONE = RequestEvent.SCHEDULE, RequestEvent.START_LOAD, RequestEvent.LOAD_DONE
_FINISH, _SIGNAL, _DELETE = RequestEvent.FINISH, RequestEvent.SIGNAL, RequestEvent.DELETE
_SIGNAL_MANAGER = RequestEffect.SIGNAL_MANAGER
_NO_RANKS: frozenset[int] = frozenset()
#: The states a lookup needs (a waiting request).
_LOOKUP_STATES = frozenset((RequestState.TRACKED, RequestState.DEFERRED, RequestState.PREEMPTED))
_MISS, _HIT, _RETRY = LookupResult.MISS, LookupResult.HIT, LookupResult.RETRY


def _in_rank_order(ranks: AbstractSet[int]) -> Iterable[int]:
    """The reporting ranks, lowest first (so a refusal names the same rank every time); one rank as it is."""
    return ranks if len(ranks) < 2 else sorted(ranks)


class _KeyPositions:
    """A request's key -> end-token position, as vLLM's scheduler records it on its request context
    (``ReqContext.set_offload_key_position``): chunk ``i``'s key ends at token ``(i + 1) * tokens_per_chunk``.
    Indexed lazily from the request record's key list, which only ever grows."""

    __slots__ = ("_indexed", "_keys", "_positions", "_tpc")

    def __init__(self, keys: list[OffloadKey], tokens_per_chunk: int) -> None:
        self._keys = keys
        self._tpc = tokens_per_chunk
        self._positions: dict[OffloadKey, int] = {}
        self._indexed = 0

    def __call__(self, key: OffloadKey) -> int | None:
        positions = self._positions
        position = positions.get(key)
        if position is None and self._indexed < len(self._keys):
            keys, tpc = self._keys, self._tpc
            for i in range(self._indexed, len(keys)):
                positions.setdefault(keys[i], (i + 1) * tpc)
            self._indexed = len(keys)
            position = positions.get(key)
        return position


class PendingJob(Protocol):
    """What :func:`pending_push_work` may read of an awaited job (a :class:`Job`, or a model checker's record)."""

    @property
    def pending(self) -> int: ...
    @property
    def world_size(self) -> int: ...


# ---------------------------------------------------------------------------------------------------------
# Pure decisions. The scheduler computes each of these through the function below, and so does the model
# checker (kvfsm.check) on its abstract state: a bug planted in one of them is seen by both.


def pending_push_work(jobs: Collection[PendingJob], manager_has_pending_work: Callable[[], bool]) -> bool:
    """has_pending_push_work(): True while any job is awaited or the manager has pending work. O(1).

    ``jobs`` are the awaited jobs (every planned, uncommitted, non-stale job, whatever its acks so far);
    the manager is asked only when there is none.
    """
    return bool(jobs) or manager_has_pending_work()


def fenced_jobs(allocated: Iterable[int], fences: Mapping[int, AbstractSet[int]]) -> set[int]:
    """The store jobs a step must flush: those fenced on a GPU block that the step hands out again.

    A fenced block was freed by a finished request while an uncommitted store still reads it; once
    re-allocated, this step's forward or a load may overwrite it, so the store must finish first
    (invariant gpu_source_not_overwritten). O(len(allocated)).
    """
    flush: set[int] = set()
    for block in allocated:
        jobs = fences.get(block)
        if jobs:
            flush.update(jobs)
    return flush


def stale_threshold_after_reset(job_counter: int, threshold: int) -> int:
    """The stale threshold after reset_cache: every id issued so far (below ``job_counter``) becomes stale,
    so late reports for discarded jobs are ignored (invariant stale_ids_ignored)."""
    return job_counter


class OffloadRequest(Protocol):
    """What the scheduler half reads of an engine request."""

    @property
    def req_id(self) -> str: ...
    @property
    def block_hashes(self) -> Sequence[bytes]: ...  # one chained hash per full GPU block
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def is_aborted(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    req_id: str
    new_block_ids: tuple[int, ...]
    num_scheduled_tokens: int
    #: True when the request was (re-)admitted this step: its block list restarts from ``new_block_ids``.
    admitted: bool = False


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The engine scheduler's decisions for one step, as the connector needs them."""

    scheduled: tuple[ScheduledRequest, ...] = ()
    preempted_req_ids: frozenset[str] = frozenset()
    #: Every GPU block handed out this step (new blocks, load destinations, copy-on-write targets).
    allocated_block_ids: frozenset[int] = frozenset()


@dataclass(slots=True)
class SchedulerStats:
    load_jobs: int = 0
    store_jobs: int = 0
    committed_stores: int = 0
    committed_loads: int = 0
    failed_stores: int = 0
    failed_loads: int = 0
    allocation_failures: int = 0
    fence_flushes: int = 0
    preemption_flushes: int = 0
    stale_reports_ignored: int = 0
    deferred_lookups: int = 0
    timed_out_stores: int = 0
    timed_out_loads: int = 0
    cancelled_jobs: int = 0
    #: Reports that arrived for timed-out jobs (absorbed; they release the quarantine when complete).
    late_reports_ignored: int = 0
    #: Lookups that stopped waiting on a HIT_PENDING / RETRY chunk after ``lookup_wait_s``.
    lookup_wait_timeouts: int = 0
    #: Timed-out jobs whose copies never reported before shutdown released their memory anyway.
    quarantine_abandoned: int = 0


class RequestRecord:
    """The request machine's model (its ``state`` is a :class:`RequestState`), plus the connector's
    per-request bookkeeping."""

    __slots__ = (
        "block_ids",
        "ctx",
        "jobs",
        "keys",
        "load_job",
        "next_stored_chunk",
        "num_local_tokens",
        "request",
        "state",
    )

    def __init__(self, request: OffloadRequest) -> None:
        self.request = request
        self.ctx = ReqContext(request.req_id)
        self.state = RequestState.TRACKED
        self.block_ids: list[int] = []
        self.jobs: set[int] = set()
        self.load_job: int | None = None
        self.next_stored_chunk = 0
        self.num_local_tokens = 0
        #: The offload keys of the request's first full chunks, made once each (a request's block hashes
        #: only ever grow: a chunk's key never changes).
        self.keys: list[OffloadKey] = []

    def has_jobs(self) -> bool:
        return bool(self.jobs)


@dataclass(slots=True)
class _Batch:
    """Per-step accumulators, emptied by every build_connector_meta."""

    loads: dict[int, Job] = field(default_factory=dict)
    flush: set[int] = field(default_factory=set)
    allocated: set[int] = field(default_factory=set)

    def is_empty(self) -> bool:
        return not (self.loads or self.flush or self.allocated)


class OffloadingScheduler:
    """vLLM's OffloadingConnectorScheduler, over the spec's job and request machines."""

    def __init__(
        self,
        config: OffloadConfig,
        manager: OffloadingManager,
        *,
        checked: bool | None = None,
        deadlines: Deadlines | None = None,
        clock: Clock | None = None,
        expiry: DeadlineQueue | None = None,
    ) -> None:
        """``deadlines`` bound the jobs, timed on ``clock`` (default ``time.monotonic``); ``expiry`` is the
        queue their deadlines wait in (default a fresh :class:`DeadlineQueue`; the model-based replay passes
        one that holds each deadline back until the checker's event passes it, spec/README.md "Deadlines")."""
        self.config = config
        # The geometry, read on every lookup, allocation and store plan (the config is frozen).
        self._tpb = config.tokens_per_block
        self._bpc = config.blocks_per_chunk
        self._tpc = config.tokens_per_chunk
        self._world_size = config.world_size
        self._prompt_only = config.offload_prompt_only
        self.manager = manager
        # A request-scoped policy (vLLM's eviction order) orders a request's keys by their token positions.
        primary = manager.primary
        self._scoped_primary = primary if primary is not None and primary.policy.request_scoped else None
        self._job_machine = job_machine(checked)
        self._req_machine: SpecMachine[RequestState, RequestEvent, RequestEffect] = request_machine(checked)
        self._requests: dict[str, RequestRecord] = {}
        # Finished requests whose final stores are planned at the next build_connector_meta.
        self._finished_unsignalled: dict[str, RequestRecord] = {}
        self._num_finished = 0  # tracked requests in a finished_* state, so "any live request?" is O(1)
        self._jobs: dict[int, Job] = {}
        self._job_counter = 0
        self._stale_threshold = 0
        self._fences: dict[int, set[int]] = {}  # GPU block id -> uncommitted store jobs reading it
        self._job_fence_blocks: dict[int, tuple[int, ...]] = {}  # store job -> its fenced blocks
        self._chunks_being_loaded: set[OffloadKey] = set()
        self._batch = _Batch()
        self._reset_flush: set[int] = set()
        # The reset fence: store job a reset discarded -> mask of the ranks whose report is still due. Until
        # it is empty a discarded copy may still write a primary slot the reset freed (spec/README.md, "The
        # reset hold"); then the manager is told (on_reset_flushed).
        self._reset_fence: dict[int, int] = {}
        self._events: list[OffloadingEvent] = []
        self._load_errors: dict[str, tuple[int, ...]] = {}
        self.stats = SchedulerStats()
        self.deadlines = deadlines if deadlines is not None else Deadlines()
        self._clock: Clock = clock if clock is not None else time.monotonic
        self._expiry = expiry if expiry is not None else DeadlineQueue()
        self._quarantine: dict[int, Quarantined] = {}
        self._abandoned = False  # a bounded shutdown gave up: quarantined copies are no longer pending work
        self._released: list[int] = []  # quarantined job ids whose memory was handed back since last taken
        self._waiting_since: dict[str, float] = {}  # request -> when its lookup started waiting on a chunk
        # Requests preempted by preempt_unannounced whose engine notice (preempted_req_ids) is still to come.
        self._preempted_early: set[str] = set()

    # ------------------------------------------------------------------ queries

    def has_pending_push_work(self) -> bool:
        """True while any job is unfinished, a quarantined copy has not reported, or the manager has
        pending work. O(1)."""
        return pending_push_work(self._jobs.values(), self._other_pending_work)

    def _other_pending_work(self) -> bool:
        """Pending work besides the awaited jobs: quarantined copies that have not reported (until a
        shutdown gives them up, spec/README.md "Quarantine"), then the manager's own. The reset fence is
        not pending work: a reset's discarded jobs stop the signal at once (spec/README.md, "The reset
        hold")."""
        return (bool(self._quarantine) and not self._abandoned) or self.manager.has_pending_work()

    def request_state(self, req_id: str) -> RequestState:
        """The state of a tracked request. An untracked id (never seen, or deleted: a request's record is
        dropped when it reaches ``deleted``) raises :class:`UnknownRequestError`; :meth:`is_tracked` asks
        without raising."""
        st = self._requests.get(req_id)
        if st is None:
            raise UnknownRequestError(
                f"request {req_id!r} is not tracked (never seen, or already deleted); "
                "expected the id of a request the connector tracks"
            )
        return st.state

    def is_tracked(self, req_id: str) -> bool:
        return req_id in self._requests

    def state_or_none(self, req_id: str) -> RequestState | None:
        """The state of a tracked request, None for an untracked one (one lookup, never raises)."""
        st = self._requests.get(req_id)
        return None if st is None else st.state

    @property
    def num_jobs(self) -> int:
        return len(self._jobs)

    def jobs(self) -> dict[int, Job]:
        """Every job still awaited (a copy)."""
        return dict(self._jobs)

    def job(self, job_id: int) -> Job | None:
        return self._jobs.get(job_id)

    def request_jobs(self, req_id: str) -> frozenset[int]:
        st = self._requests.get(req_id)
        return frozenset() if st is None else frozenset(st.jobs)

    def fenced_blocks(self) -> dict[int, frozenset[int]]:
        return {b: frozenset(j) for b, j in self._fences.items()}

    def chunks_being_loaded(self) -> frozenset[OffloadKey]:
        return frozenset(self._chunks_being_loaded)

    @property
    def stale_threshold(self) -> int:
        return self._stale_threshold

    @property
    def job_counter(self) -> int:
        return self._job_counter

    def take_events(self) -> list[OffloadingEvent]:
        events = self._events + self.manager.take_events()
        self._events = []
        return events

    def is_quarantined(self, job_id: int) -> bool:
        """True while a timed-out job's launched copies have not all reported (its memory is held)."""
        return job_id in self._quarantine

    @property
    def abandoned(self) -> bool:
        """A bounded shutdown gave up (:meth:`abandon_jobs`): quarantined copies are no longer pending work."""
        return self._abandoned

    @property
    def num_quarantined(self) -> int:
        """Timed-out jobs whose launched copies have not all reported (each is pending work)."""
        return len(self._quarantine)

    def quarantined_jobs(self) -> dict[int, Job]:
        return {jid: q.job for jid, q in self._quarantine.items()}

    def take_released_quarantine(self) -> list[int]:
        """Ids of quarantined jobs whose memory has been handed back since the last call (the engine
        returns a timed-out load's GPU blocks to its pool then)."""
        released, self._released = self._released, []
        return released

    def take_load_errors(self) -> dict[str, tuple[int, ...]]:
        """GPU blocks of failed loads, per request: the engine must recompute them."""
        errors, self._load_errors = self._load_errors, {}
        return errors

    # ------------------------------------------------------------------ helpers

    def _keys(self, st: RequestRecord, request: OffloadRequest) -> list[OffloadKey]:
        """One key per full chunk: the hash of the chunk's last block."""
        hashes = request.block_hashes
        return self._keys_upto(st, hashes, len(hashes) // self._bpc)

    def _keys_upto(self, st: RequestRecord, hashes: Sequence[bytes], stop: int) -> list[OffloadKey]:
        """The request's keys of chunks ``0..stop-1`` (cached on the record: each key is made once)."""
        keys = st.keys
        if len(keys) < stop:
            bpc = self._bpc
            # Chunk i's key is make_offload_key(hashes[i * bpc + bpc - 1]): the chunks' last hashes, one slice.
            keys.extend(make_offload_keys(hashes[len(keys) * bpc + bpc - 1 : stop * bpc : bpc]))
        return keys

    def _chunk_keys(self, st: RequestRecord, hashes: Sequence[bytes], start: int, stop: int) -> list[OffloadKey]:
        """The keys of chunks ``start..stop-1`` only: O(chunks asked for), not O(prompt)."""
        return self._keys_upto(st, hashes, stop)[start:stop]

    def _fire(self, st: RequestRecord, event: RequestEvent) -> None:
        # SIGNAL_MANAGER is the request machine's one effect (None: nothing to carry out).
        if self._req_machine.fire(st, event) is _SIGNAL_MANAGER:
            self.manager.on_request_finished(st.ctx)

    def _new_job(
        self,
        kind: JobKind,
        st: RequestRecord,
        keys: tuple[OffloadKey, ...],
        gpu: GPUBlockSpec,
        slots: SlotSpec,
    ) -> Job:
        """A job over the manager's own (frozen) slot spec: no copy of it per job."""
        job = Job(
            self._job_counter,
            kind,
            st.ctx.req_id,
            keys,
            gpu,
            slots,
            self._world_size,
            self._job_machine,
        )
        self._job_counter += 1
        self._jobs[job.job_id] = job
        st.jobs.add(job.job_id)
        limit = self.deadlines.for_kind(kind)
        if limit is not None:
            self._expiry.push(job.job_id, self._clock() + limit)
        return job

    def _fence(self, job_id: int, blocks: Iterable[int]) -> None:
        fenced = tuple(dict.fromkeys(blocks))
        self._job_fence_blocks[job_id] = fenced
        for b in fenced:
            self._fences.setdefault(b, set()).add(job_id)

    def _unfence(self, job_id: int) -> None:
        for b in self._job_fence_blocks.pop(job_id, ()):
            jobs = self._fences.get(b)
            if jobs is not None:
                jobs.discard(job_id)
                if not jobs:
                    del self._fences[b]

    # ------------------------------------------------------------------ admission

    def on_new_request(self, request: OffloadRequest) -> None:
        """Start tracking a request; a duplicate id is a typed error."""
        if request.req_id in self._requests:
            raise DuplicateRequestError(
                f"request {request.req_id!r} is already tracked (state "
                f"{self._requests[request.req_id].state.value}); expected a new request id"
            )
        st = self._requests[request.req_id] = RequestRecord(request)
        ctx = ReqContext(request.req_id)
        self.manager.on_new_request(ctx)
        scoped = self._scoped_primary
        if scoped is not None:
            # vLLM's scheduler records each key's end token on the request context; its request-scoped
            # policies rank a live request's tail before its head by them.
            scoped.on_new_request(ctx, key_position=_KeyPositions(st.keys, self._tpc))

    def get_num_new_matched_tokens(self, request: OffloadRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond the GPU prefix cache that can be loaded: (None, False) means ask again later."""
        st = self._requests.get(request.req_id)
        if st is None:
            self.on_new_request(request)
            st = self._requests[request.req_id]
        if st.state not in _LOOKUP_STATES:
            raise KvfsmError(
                f"request {request.req_id!r} is {st.state.value}; a lookup needs a waiting request "
                "(tracked, deferred or preempted)"
            )
        st.block_ids = []
        if st.jobs:
            # Its own stores (flushed at preemption) are not acked yet: look up once they are.
            self._defer(st)
            return None, False
        tpc = self._tpc
        keys = self._keys(st, request)
        first = num_computed_tokens // tpc
        # The last prompt token is always recomputed (its logits are needed).
        last_allowed = (request.num_tokens - 1) // tpc
        hits = 0
        must_wait = False
        lookup, ctx, being_loaded = self.manager.lookup, st.ctx, self._chunks_being_loaded
        for key in keys[first : max(first, min(len(keys), last_allowed))]:  # never a negative stop
            result = lookup(key, ctx)
            if result is _MISS:
                break
            if must_wait:
                if result is _RETRY:
                    continue  # still unanswered: its check is staged too, scan on (no slot is taken)
                break  # a promotion reserved or under way, or a hit: wait for the earlier chunk first
            # HIT_PENDING or RETRY: the chunk will be readable later; being loaded by another request:
            # this one hits the GPU prefix cache later. Either way it waits, but not forever.
            if result is not _HIT or key in being_loaded:
                if self._lookup_wait_expired(st.ctx.req_id):
                    self.stats.lookup_wait_timeouts += 1
                    if result is not _HIT:
                        # Reserving a promotion for this chunk may have evicted an earlier hit of this
                        # very scan, so none of them is safe to load: compute them all instead.
                        hits = 0
                    break  # waited long enough: compute the chunk instead
                must_wait = True
                if result is _RETRY:
                    # A tier has not answered yet (a remote tier's existence check): scan on over the
                    # later chunks that are unanswered too, so their checks run side by side with this one.
                    continue
                break
            hits += 1
        if must_wait:
            self._defer(st)
            return None, False
        self._waiting_since.pop(st.ctx.req_id, None)
        st.num_local_tokens = num_computed_tokens
        if hits == 0:
            return 0, False
        num_external = (first + hits) * tpc - num_computed_tokens
        return num_external, num_external > 0

    def _lookup_wait_expired(self, req_id: str) -> bool:
        """Start (or check) the request's lookup wait; True once it lasted ``lookup_wait_s``."""
        limit = self.deadlines.lookup_wait_s
        if limit is None:
            return False
        now = self._clock()
        since = self._waiting_since.setdefault(req_id, now)
        return now - since >= limit

    def _defer(self, st: RequestRecord) -> None:
        self._fire(st, RequestEvent.DEFER)
        self.stats.deferred_lookups += 1

    def update_state_after_alloc(
        self, request: OffloadRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The engine allocated ``block_ids`` (all of the request's blocks); plan its load if any."""
        st = self._requests.get(request.req_id)
        if st is None:
            raise UnknownRequestError(
                f"request {request.req_id!r} is not tracked; call get_num_new_matched_tokens first"
            )
        # Blocks past the local prefix are fresh: writing them must not race a fenced store.
        fresh = block_ids[st.num_local_tokens // self._tpb :]
        if num_external_tokens == 0:
            self._fire(st, _SCHEDULE)
            st.block_ids = list(block_ids)
            self._batch.allocated.update(fresh)
            return
        tpb, bpc = self._tpb, self._bpc
        first_block = st.num_local_tokens // tpb
        end_block = (st.num_local_tokens + num_external_tokens) // tpb
        if end_block > len(block_ids) or end_block % bpc:
            raise KvfsmError(
                f"request {request.req_id!r}: {num_external_tokens} external tokens after "
                f"{st.num_local_tokens} local ones need whole chunks within {len(block_ids)} blocks"
            )
        hashes = request.block_hashes
        keys = tuple(self._chunk_keys(st, hashes, first_block // bpc, min(end_block, len(hashes)) // bpc))
        if not self._req_machine.can_fire(st, _START_LOAD):
            raise KvfsmError(f"request {request.req_id!r} in {st.state.value} with jobs {sorted(st.jobs)} cannot load")
        slots = self.manager.prepare_load(keys, st.ctx)  # raises KeyNotReadyError before any change
        self._fire(st, _START_LOAD)
        st.block_ids = list(block_ids)
        self._batch.allocated.update(fresh)
        gpu = GPUBlockSpec(tuple(block_ids[first_block:end_block]), first_block % bpc)
        job = self._new_job(JobKind.LOAD, st, keys, gpu, slots)
        st.load_job = job.job_id
        st.next_stored_chunk = end_block // bpc  # chunk-level: the loaded chunks are not stored again
        self._chunks_being_loaded.update(keys)
        self._batch.loads[job.job_id] = job
        self.stats.load_jobs += 1

    def extend_running_blocks(self, request: OffloadRequest, block_ids: Sequence[int]) -> None:
        """vLLM's second ``update_state_after_alloc`` (no external tokens) for a running request: once an
        asynchronous load has finished, vLLM calls it again when it reschedules the request (spec/README.md,
        "The scheduler/worker boundary"). Not an event of the request machine: only the request's block list
        grows, and the blocks past those it held are fresh (they count as allocated for the fences).
        A request that is not running raises :class:`InvalidTransition`, and nothing changes."""
        st = self._requests.get(request.req_id)
        if st is None:
            raise UnknownRequestError(f"request {request.req_id!r} is not tracked; expected a running request")
        if st.state is not RequestState.RUNNING:
            raise InvalidTransition(
                "request",
                st.state.value,
                "extend_blocks",
                f"request {request.req_id!r} is not running; only a running request's blocks can be extended",
            )
        held = st.block_ids
        if list(block_ids[: len(held)]) != held:
            raise KvfsmError(
                f"request {request.req_id!r}: blocks {list(block_ids)} do not extend the held {held}; "
                "expected the held block list followed by new blocks"
            )
        self._batch.allocated.update(block_ids[len(held) :])
        st.block_ids = list(block_ids)

    def preempt_unannounced(self, request: OffloadRequest) -> None:
        """The engine preempted a running request and looks it up again before the step's
        ``preempted_req_ids`` says so (vLLM: ``reset_prefix_cache(reset_running_requests=True)``; spec/README.md,
        "The scheduler/worker boundary"). Fires ``preempt`` now, exactly as the notice would (its jobs are
        flushed by this step), and ignores the notice when it comes. A request that is not running raises
        :class:`InvalidTransition`, and nothing changes."""
        st = self._requests.get(request.req_id)
        if st is None:
            raise UnknownRequestError(f"request {request.req_id!r} is not tracked; expected a running request")
        if not self._req_machine.can_fire(st, RequestEvent.PREEMPT):
            raise InvalidTransition(
                "request", st.state.value, RequestEvent.PREEMPT.value, f"request {request.req_id!r} is not running"
            )
        if st.jobs:
            self.stats.preemption_flushes += 1
            self._batch.flush.update(st.jobs)
        st.block_ids = []
        self._fire(st, RequestEvent.PREEMPT)
        self._preempted_early.add(request.req_id)

    # ------------------------------------------------------------------ per step

    def build_connector_meta(self, output: SchedulerOutput) -> ConnectorMetadata:
        """Plan this step's stores and flushes. Never waits for a transfer."""
        self._check_step(output)
        self.expire_jobs()
        batch = self._batch
        batch.allocated.update(output.allocated_block_ids)
        for sched in output.scheduled:
            st = self._requests.get(sched.req_id)
            if st is None:
                raise UnknownRequestError(f"scheduled request {sched.req_id!r} is not tracked by the connector")
            if sched.admitted:
                st.block_ids = list(sched.new_block_ids)  # fresh ones are in allocated_block_ids
            else:
                st.block_ids.extend(sched.new_block_ids)
                batch.allocated.update(sched.new_block_ids)

        self.manager.on_schedule_end()

        for req_id in output.preempted_req_ids:
            if req_id in self._preempted_early:
                self._preempted_early.discard(req_id)
                continue  # already preempted when the engine looked it up again (preempt_unannounced)
            st = self._requests.get(req_id)
            if st is None:
                continue
            if st.jobs:
                self.stats.preemption_flushes += 1
                batch.flush.update(st.jobs)
            st.block_ids = []
            self._fire(st, RequestEvent.PREEMPT)

        self.stats.fence_flushes += sum(1 for block in batch.allocated if block in self._fences)
        batch.flush.update(fenced_jobs(batch.allocated, self._fences))

        # O(scheduled + newly finished requests), never O(all requests or jobs).
        new_stores: dict[int, Job] = {}
        for sched in output.scheduled:
            st = self._requests[sched.req_id]
            if st.state is _RUNNING:
                self._plan_stores(st, sched.num_scheduled_tokens, new_stores)
        finished = list(self._finished_unsignalled.values())
        self._finished_unsignalled.clear()
        for st in finished:
            self._plan_stores(st, None, new_stores)
        for st in finished:
            self._fire(st, _SIGNAL)
            if not st.jobs:
                self._delete(st)

        if self.config.drain is DrainMode.BLOCKING and self._num_finished == len(self._requests):
            # The pre-#45595 baseline: no live request left, so flush everything now (blocking).
            batch.flush.update(self._jobs)

        flush = frozenset(batch.flush | self._reset_flush)
        meta = ConnectorMetadata(load_jobs=dict(batch.loads), store_jobs=new_stores, jobs_to_flush=flush)
        self._reset_flush = set()
        self._batch = _Batch()
        return meta

    # ------------------------------------------------------------------ across a process boundary

    def build_step_message(self, output: SchedulerOutput) -> StepMessage:
        """:meth:`build_connector_meta` for workers in other processes: the step's jobs as plain
        :class:`StepMessage` records (spec/README.md, "The scheduler/worker boundary").

        The engine hands every step's message to all W workers, and each starts every job it receives in
        that step, so the scheduler fires ``launch`` for every rank here: from now on each rank owes one
        report per job (a timed-out job stays quarantined until all W have reported)."""
        meta = self.build_connector_meta(output)
        for jobs in (meta.load_jobs, meta.store_jobs):
            if self._world_size == 1:
                # One rank: rank-major order is job-major order, so the step's launches are one batch.
                Job.launch_all([job for job in jobs.values() if not job.is_terminal], 0)
                continue
            for job in jobs.values():
                if job.is_terminal:
                    continue
                for rank in range(job.world_size):
                    if not (job.launched_mask >> rank) & 1:
                        job.launch(rank)
        return StepMessage.of(meta)

    def apply_reports(self, reports: Iterable[RankReport]) -> None:
        """Apply the workers' :class:`RankReport` records of one step (any number per rank, each job at
        most once per rank): :meth:`update_connector_output` over their merge."""
        output = merge_reports(reports)
        if not output.is_empty():
            self.update_connector_output(output)

    def _check_step(self, output: SchedulerOutput) -> None:
        """Refuse a step that schedules an untracked request or preempts one that is not running, before
        anything changes: an operation that raises leaves every machine as it was. O(scheduled + preempted)."""
        for sched in output.scheduled:
            if sched.req_id not in self._requests:
                raise UnknownRequestError(f"scheduled request {sched.req_id!r} is not tracked by the connector")
        for req_id in output.preempted_req_ids:
            st = self._requests.get(req_id)
            if req_id in self._preempted_early:
                continue
            if st is not None and not self._req_machine.can_fire(st, RequestEvent.PREEMPT):
                raise InvalidTransition(
                    "request",
                    st.state.value,
                    RequestEvent.PREEMPT.value,
                    f"request {req_id!r} is not running; only a running request can be preempted",
                )

    def _plan_stores(self, st: RequestRecord, num_scheduled: int | None, out: dict[int, Job]) -> None:
        request = st.request
        tpc, bpc = self._tpc, self._bpc
        if num_scheduled is None:  # finished
            horizon = (
                request.num_computed_tokens
                if request.is_aborted
                # The last sampled token's KV is never written, so it cannot complete a chunk.
                else max(request.num_prompt_tokens, request.num_tokens - 1)
            )
            horizon = min(horizon, request.num_computed_tokens)
        else:
            horizon = request.num_computed_tokens + num_scheduled
        if self._prompt_only:
            horizon = min(horizon, request.num_prompt_tokens)
        start = st.next_stored_chunk
        if horizon // tpc <= start:
            return  # no chunk completed since the last store (most decode steps): O(1)
        hashes = request.block_hashes
        storable = min(horizon // tpc, len(st.block_ids) // bpc, len(hashes) // bpc)
        if storable <= start:
            return
        candidates = self._chunk_keys(st, hashes, start, storable)
        prepared = self.manager.prepare_store(candidates, st.ctx)
        if prepared is None:
            self.stats.allocation_failures += 1  # retried next step, including the finishing one
            return
        st.next_stored_chunk = storable
        if not prepared.keys_to_store:
            return
        if prepared.keys_to_store == tuple(candidates):
            # Every candidate is new (the common case): its blocks are one contiguous run.
            blocks = st.block_ids[start * bpc : storable * bpc]
        else:
            index = {k: start + i for i, k in enumerate(candidates)}
            blocks = []
            for key in prepared.keys_to_store:
                c = index[key]
                blocks.extend(st.block_ids[c * bpc : (c + 1) * bpc])
        gpu = GPUBlockSpec(tuple(blocks), 0)
        job = self._new_job(_STORE, st, prepared.keys_to_store, gpu, prepared.store_spec)
        self.stats.store_jobs += 1
        out[job.job_id] = job
        if st.state is _FINISHED_UNSIGNALLED:
            # The request's blocks are already free: fence now and flush if reused this very step.
            self._fence(job.job_id, blocks)
            if job.job_id in fenced_jobs(self._batch.allocated.intersection(blocks), self._fences):
                self.stats.fence_flushes += 1
                self._batch.flush.add(job.job_id)

    def update_connector_output(self, output: WorkerOutput) -> None:
        """Apply the workers' merged reports, attributed to ranks. Validates everything before changing
        anything: a report from a rank that never launched the job, a second report from one rank (or a
        rank reporting both success and failure) raises :class:`AckCountError`."""
        threshold = self._stale_threshold
        completed, failed = output.completed, output.failed
        jobs, quarantine = self._jobs, self._quarantine
        # Most steps report only successes: then the jobs are completed's keys, in the same order.
        for job_id in output.job_ids() if failed else completed:
            ok: AbstractSet[int] = completed.get(job_id, _NO_RANKS)
            bad: AbstractSet[int] = failed.get(job_id, _NO_RANKS) if failed else _NO_RANKS
            if job_id < 0:
                raise UnknownJobError(
                    f"worker reported {'failures' if bad else 'acks'} for job {job_id}, an id the scheduler "
                    f"never issues; expected an id >= 0 (ids {threshold}..{self._job_counter - 1} are current)"
                )
            if job_id < threshold:
                continue
            if not ok and not bad:
                raise AckCountError(f"job {job_id}: a report that names no worker rank")
            if bad and ok & bad:
                raise AckCountError(f"job {job_id}: ranks {sorted(ok & bad)} reported both success and failure")
            ranks = ok | bad if bad else ok
            job = jobs.get(job_id)
            if job is None:
                late = quarantine.get(job_id)
                if late is None:
                    raise UnknownJobError(
                        f"worker reported {'failures' if bad else 'acks'} for job {job_id}, which is not awaited "
                        f"(ids {threshold}..{self._job_counter - 1} are current)"
                    )
                for rank in _in_rank_order(ranks):
                    late.check_report(rank)
                continue
            if job.state is not _IN_FLIGHT:
                raise AckCountError(f"job {job_id}: ranks {sorted(ranks)} reported a job no rank launched")
            for rank in ranks if len(ranks) < 2 else sorted(ranks):  # _in_rank_order, inline: once per job
                job.check_report(rank)
        # Every report was checked above against the state it is applied in (each job's ranks are distinct,
        # and only its last report ends it), so the job does not check them again.
        for reports, success in ((failed, False), (completed, True)):
            for job_id, ranks in reports.items():
                if job_id < threshold:
                    self.stats.stale_reports_ignored += 1
                    if self._reset_fence:
                        self._fence_report(job_id, ranks)
                    continue
                for rank in ranks if len(ranks) < 2 else sorted(ranks):  # _in_rank_order, inline
                    if quarantine and job_id in quarantine:
                        self._late_report(job_id, rank)
                        continue
                    job = jobs.get(job_id)
                    if job is None:
                        break  # released by this output's last report (a late one, or the job's W-th)
                    self._finish(job, job.ack(rank, validated=True) if success else job.fail(rank, validated=True))

    def _finish(self, job: Job, effect: JobEffect | None, *, timed_out: bool = False) -> None:
        """Carry out a job effect: COMMIT completes the job on the manager, RELEASE rolls it back."""
        # None, or START_COPY (the workers'; the scheduler never fires launch): nothing to carry out.
        if effect is _COMMIT:
            ok = True
        elif effect is _RELEASE:
            ok = False
        else:
            return
        st = self._requests.get(job.req_id)
        ctx = st.ctx if st is not None else ReqContext(job.req_id)
        # A timed-out job's launched copies may still be running: keep its memory until they report.
        outstanding = job.launched_mask & ~job.reported_mask if timed_out else 0
        if outstanding:
            self._quarantine[job.job_id] = Quarantined(job, ctx, outstanding)
        if job.kind is _STORE:
            if outstanding <= 0:
                self.manager.complete_store(job.keys, ctx, success=ok)
            if ok:
                self.stats.committed_stores += 1
            elif timed_out:
                self.stats.timed_out_stores += 1
            else:
                self.stats.failed_stores += 1
        else:
            if outstanding <= 0:
                self.manager.complete_load(job.keys, ctx)
            self._chunks_being_loaded.difference_update(job.keys)
            if ok:
                self.stats.committed_loads += 1
            else:
                if timed_out:
                    self.stats.timed_out_loads += 1
                else:
                    self.stats.failed_loads += 1
                self._load_errors[job.req_id] = job.gpu.block_ids
        if self._job_fence_blocks:  # only a finished request's stores are fenced
            self._unfence(job.job_id)
        del self._jobs[job.job_id]
        if st is None:
            return
        st.jobs.discard(job.job_id)
        if job.kind is _LOAD:
            st.load_job = None
            if st.state is _LOADING:
                self._fire(st, _LOAD_DONE)
        if st.state is _FINISHED_SIGNALLED and not st.jobs:
            self._delete(st)

    def _fence_report(self, job_id: int, ranks: AbstractSet[int]) -> None:
        """Ranks reported a job a reset discarded: once every such copy has, release the reset hold."""
        due = self._reset_fence.get(job_id)
        if due is None:
            return
        for rank in ranks:
            due &= ~(1 << rank)
        if due:
            self._reset_fence[job_id] = due
            return
        del self._reset_fence[job_id]
        if not self._reset_fence:
            self.manager.on_reset_flushed()

    def _late_report(self, job_id: int, rank: int) -> None:
        q = self._quarantine[job_id]
        self.stats.late_reports_ignored += 1
        if q.report(rank):
            del self._quarantine[job_id]
            self._release_quarantined(q)

    def _release_quarantined(self, q: Quarantined) -> None:
        """Every launched copy has reported: hand the memory back exactly as for a failure."""
        if q.job.kind is JobKind.STORE:
            self.manager.complete_store(q.job.keys, q.ctx, success=False)
        else:
            self.manager.complete_load(q.job.keys, q.ctx)
        self._released.append(q.job.job_id)

    # ------------------------------------------------------------------ deadlines and shutdown

    def expire_jobs(self, now: float | None = None) -> int:
        """Time out every job past its deadline (``build_connector_meta`` calls this); returns how many."""
        if not self._expiry:
            return 0
        now = self._clock() if now is None else now
        n = 0
        for job_id in self._expiry.pop_expired(now):
            job = self._jobs.get(job_id)
            if job is not None and not job.is_terminal:
                self._finish(job, job.time_out(), timed_out=True)
                n += 1
        self._expiry.compact(self._jobs, len(self._jobs))
        return n

    def abandon_jobs(self) -> tuple[int, int, int]:
        """Bounded shutdown gives up on every job: those no worker launched are cancelled, the others
        time out (quarantined until their copies report), and so do the manager's own transfers.
        Returns (jobs cancelled, jobs timed out, manager transfers timed out)."""
        cancelled = timed_out = 0
        for job in list(self._jobs.values()):
            if job.launched_mask == 0:
                self._finish(job, job.cancel())
                self.stats.cancelled_jobs += 1
                cancelled += 1
            else:
                self._finish(job, job.time_out(), timed_out=True)
                timed_out += 1
        self._expiry.clear()
        self._abandoned = True  # the quarantined copies are given up too: shutdown releases their memory
        # A tiering manager gives up on its cascades and promotions the same way (others: 0).
        return cancelled, timed_out, self.manager.abandon_transfers()

    def release_quarantine(self) -> int:
        """Hand back the memory of every quarantined job now (shutdown: its copies were abandoned)."""
        quarantined = list(self._quarantine.values())
        self._quarantine.clear()
        for q in quarantined:
            self._release_quarantined(q)
        self.stats.quarantine_abandoned += len(quarantined)
        return len(quarantined)

    def _delete(self, st: RequestRecord) -> None:
        self._waiting_since.pop(st.ctx.req_id, None)
        self._fire(st, _DELETE)
        del self._requests[st.ctx.req_id]
        self._num_finished -= 1

    def request_finished(self, request: OffloadRequest) -> bool:
        """The engine finished or aborted the request; its GPU blocks are freed at once (returns False)."""
        st = self._requests.get(request.req_id)
        if st is None:
            ctx = ReqContext(request.req_id)
            self.manager.on_new_request(ctx)
            self.manager.on_request_finished(ctx)
            return False
        st.request = request
        self._fire(st, _FINISH)
        self._finished_unsignalled[request.req_id] = st
        self._num_finished += 1
        for job_id in st.jobs:
            job = self._jobs[job_id]
            if job.kind is JobKind.STORE:
                self._fence(job_id, job.gpu.block_ids)
        return False

    def reset_cache(self) -> None:
        """Drop every offloaded block; in-flight jobs become stale and are flushed by the next step."""
        if not self._batch.is_empty():
            raise KvfsmError("reset_cache called mid-step (loads planned but not yet sent); call it between steps")
        for job in self._jobs.values():
            if job.state in (JobState.SUBMITTED, JobState.IN_FLIGHT):
                job.discard()
            running = job.launched_mask & ~job.reported_mask
            if job.kind is JobKind.STORE and running:
                # Its launched copies may still write the slots the reset frees; the next step's flush waits
                # for them and each rank reports. (A rank that had not launched it never will: it is stale.)
                self._reset_fence[job.job_id] = running
            if job.kind is JobKind.LOAD:
                # Its late report will be ignored by id, so its outcome is unknown: recompute the blocks.
                self._load_errors[job.req_id] = job.gpu.block_ids
        self._reset_flush.update(self._jobs)
        # Quarantined copies are flushed like every stale job; the reset frees their memory wholesale.
        self._reset_flush.update(self._quarantine)
        for job_id, q in self._quarantine.items():
            if q.job.kind is JobKind.STORE and q.outstanding:
                self._reset_fence[job_id] = q.outstanding
        self._released.extend(self._quarantine)
        self._quarantine.clear()
        self._expiry.clear()
        for st in list(self._requests.values()):
            st.jobs.clear()
            st.load_job = None
            st.next_stored_chunk = 0
            if st.state in (
                RequestState.FINISHED_UNSIGNALLED,
                RequestState.FINISHED_SIGNALLED,
                RequestState.LOADING,
            ):
                self._fire(st, RequestEvent.RESET)
            if st.state is RequestState.DELETED:
                del self._requests[st.ctx.req_id]
                self._num_finished -= 1
        self.manager.reset_cache()
        if not self._reset_fence:
            self.manager.on_reset_flushed()  # no discarded copy can write a freed slot: nothing to hold
        self._stale_threshold = stale_threshold_after_reset(self._job_counter, self._stale_threshold)
        self._jobs.clear()
        self._fences.clear()
        self._job_fence_blocks.clear()
        self._chunks_being_loaded.clear()
        self._finished_unsignalled.clear()
        self._events.clear()
        self._preempted_early.clear()

    # --- queries for verifiers ---

    def request_block_ids(self, req_id: str) -> tuple[int, ...] | None:
        """The GPU blocks the connector holds for a tracked request (None: not tracked)."""
        st = self._requests.get(req_id)
        return None if st is None else tuple(st.block_ids)

    def next_stored_chunk(self, req_id: str) -> int:
        """The first chunk of a tracked request not planned for a store yet (0: not tracked)."""
        st = self._requests.get(req_id)
        return 0 if st is None else st.next_stored_chunk

    def planned_load_ids(self) -> frozenset[int]:
        """Load jobs planned in the step being scheduled, not handed to the workers yet."""
        return frozenset(self._batch.loads)

    def has_reset_flush(self) -> bool:
        """A reset_cache left jobs for the next build_connector_meta to flush."""
        return bool(self._reset_flush)

    def shutdown(self, timeout: float | None = None) -> bool:
        """Release what timed-out copies still held, then shut the manager down within ``timeout``
        (None: as long as it takes). Returns False if the manager did not finish in time."""
        self.release_quarantine()
        if timeout is None:
            self.manager.shutdown()
            return True
        return run_bounded(with_timeout(self.manager.shutdown, timeout), timeout + 0.05, "manager")
