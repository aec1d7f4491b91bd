"""The abstract model that :mod:`kvfsm.check` explores: the offloading protocol at small bounds.

What it models, at the granularity of the implementation's API (so that a path can be replayed on the real
code, step for step, by :mod:`kvfsm.check.replay`):

* an engine (the engine machine) that admits requests, looks them up, runs steps, preempts, finishes or
  aborts them, and resets the offload cache;
* requests (the request machine) with one of ``P`` prompts of ``C`` chunks; all prompts share chunk 0, so
  requests compete for chunks and CPU slots;
* the connector's scheduler half: store and load jobs (the job machine), each copied by ``W`` workers
  that launch, finish and report their shards independently (a shard may fail);
* the CPU primary tier: one slot machine per chunk key, ``S`` slots, LRU eviction;
* up to two write-through secondary tiers (every commit cascades to each), whose cascades are the
  tiering manager's pending work; with ``Bounds.durable`` the last tier syncs each written cascade in the
  background, its own ``has_pending_work()``;
* GPU memory as ``G`` block groups (one request's blocks each), so a finished request's blocks can be
  handed to another request while its stores still read them (fences).

Every transition of a job, slot, request or engine goes through the compiled spec tables
(:func:`kvfsm.machines.job_machine` and friends) with the spec's guards, and every decision that the
implementation makes in a pure function (``pending_push_work``, ``fenced_jobs``,
``stale_threshold_after_reset``, ``is_evictable``) is taken by calling that same function, looked up when
the :class:`Model` is built: a bug planted in one of them is seen here as in the real system.

States are immutable named tuples. :meth:`Model.canonical` maps a state to a representative of its
symmetry class: requests (interchangeable apart from their prompt), jobs, GPU block groups and worker
ranks are renumbered in a deterministic order, which is sound (the representative is isomorphic to the
state) even where it does not merge every symmetric pair.

Ground truth: "a transfer remains" is judged from the model's own shard states (unlaunched, copying,
finished but unreported, reported while still copying) and tier I/O states (copying, done, syncing), never
by re-evaluating ``pending_push_work``; the value the engine is told is computed from the bookkeeping
(the scheduler's awaited jobs, the tiering manager's terms) and compared with it. The components that
answer the engine (:meth:`Model.manager_pending`, :meth:`Model.backend_reports`, :meth:`Model.tier_reports`)
are separate methods, so that a bug planted in one (tests/planted_model_bugs.py) is caught by that ground
truth.

Options widen the scope (:class:`Bounds`): promotions from the tiers (``promotions``), store deadlines
with time-out and quarantine (``deadlines``), promotion deadlines with deferred release
(``promotion_deadlines``), a bounded shutdown with ``flush_all``, give-up and ``stop``
(``shutdown``), a durable last tier (``durable``), up to two tiers (``tiers``); and one hazard, not a tier
kvfsm runs: a last tier whose own ``has_pending_work()`` is always True (``tier_pending_always``, vLLM's
KVCR tier), which the liveness check rejects; and vLLM 0.34's bounded synchronous loads
(``sync_load_budget``): a hit that fits the step's remaining budget is loaded in the step that runs its
request, which waits for that load's copies before its forward (the ``blocked`` flag, in a running engine);
and the late write of a copy that a reset discarded (``late_writes``), with the reset hold (``reset_hold``,
kvfsm's and vLLM 0.34's): the reset's fence of discarded copies keeps promotions from the slots they may
write until they have reported.

Abstractions (what the model leaves out, on purpose): one GPU block per chunk and a request's blocks as
one group, allocated whole at admission; no GPU prefix cache (every lookup starts at token 0); deadlines
on stores and, with ``promotion_deadlines``, promotions (not on loads or cascades); a timed-out promotion's key
keeps its ``writing`` slot until the release (vLLM drops the key at once and holds a chunk for no key, which
per-key slots cannot say); one primary slot per key, so which freed slot a late copy writes after a reset is not
modelled (``late_writes`` treats every freed slot as possibly that one); a flush's blocking wait always
completes the copy successfully; a reset is modelled with relative job ids (a discarded job is "below the
threshold" iff its id 0 is below ``stale_threshold_after_reset(1, 0)``). The drain mode
(:class:`~kvfsm.check.properties.DrainMode`) is the spec's: non-blocking, or the #42611 blocking baseline,
whose ``flush_all`` wait is the ``blocked`` flag. A sync step's wait always ends (its copies finish or fail;
a failed sync load sends its request back to recompute: the forward that read it is thrown away).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, TypeVar

import kvfsm.control.cpu as cpu_mod
import kvfsm.control.scheduler as scheduler_mod
from kvfsm.check.properties import DrainMode, load_drain_modes
from kvfsm.control.decisions import settle_event
from kvfsm.errors import ConfigError, InvalidTransition
from kvfsm.machines import engine_machine, job_machine, request_machine, slot_machine
from kvfsm.machines.names import (
    EngineEffect,
    EngineEvent,
    EngineState,
    JobEffect,
    JobEvent,
    JobState,
    RequestEffect,
    RequestEvent,
    RequestState,
    SlotEvent,
    SlotState,
)

__all__ = [
    "ABSENT",
    "CHECKED_INVARIANTS",
    "EXPIRED",
    "E_DONE",
    "E_LOAD",
    "E_RUN",
    "E_WAIT",
    "LOAD",
    "RELEASE_DEFERRED",
    "RELEASE_DUE",
    "REPORTED_COPYING",
    "STORE",
    "SYNCING",
    "TOKENS_PER_BLOCK",
    "WRITING",
    "Bounds",
    "Canonical",
    "JobRec",
    "Label",
    "Model",
    "ModelViolation",
    "Req",
    "RequestScratch",
    "State",
    "TierRec",
    "sync_loads",
]

# The spec enums' members used on the hot paths, as Final names: the compiled build keeps each in a C static,
# where ``JobState.STALE`` would be a module-global lookup and a class-attribute lookup on every use (EV: an
# event, FX: an effect).
_JOB_CANCELLED: Final = JobState.CANCELLED
_JOB_COMPLETE: Final = JobState.COMPLETE
_JOB_FAILED: Final = JobState.FAILED
_JOB_IN_FLIGHT: Final = JobState.IN_FLIGHT
_JOB_STALE: Final = JobState.STALE
_JOB_SUBMITTED: Final = JobState.SUBMITTED
_JOB_TIMED_OUT: Final = JobState.TIMED_OUT
_REQ_DEFERRED: Final = RequestState.DEFERRED
_REQ_DELETED: Final = RequestState.DELETED
_REQ_FINISHED_SIGNALLED: Final = RequestState.FINISHED_SIGNALLED
_REQ_FINISHED_UNSIGNALLED: Final = RequestState.FINISHED_UNSIGNALLED
_REQ_LOADING: Final = RequestState.LOADING
_REQ_PREEMPTED: Final = RequestState.PREEMPTED
_REQ_RUNNING: Final = RequestState.RUNNING
_REQ_TRACKED: Final = RequestState.TRACKED
_ENGINE_IDLE: Final = EngineState.IDLE
_ENGINE_SHUTTING_DOWN: Final = EngineState.SHUTTING_DOWN
_ENGINE_STOPPED: Final = EngineState.STOPPED
_SLOT_ABSENT: Final = SlotState.ABSENT
_SLOT_READING: Final = SlotState.READING
_SLOT_READY: Final = SlotState.READY
_SLOT_WRITING: Final = SlotState.WRITING
_JOB_EV_ACK: Final = JobEvent.ACK
_JOB_EV_CANCEL: Final = JobEvent.CANCEL
_JOB_EV_DISCARD: Final = JobEvent.DISCARD
_JOB_EV_FAIL: Final = JobEvent.FAIL
_JOB_EV_LAUNCH: Final = JobEvent.LAUNCH
_JOB_EV_TIME_OUT: Final = JobEvent.TIME_OUT
_REQ_EV_DEFER: Final = RequestEvent.DEFER
_REQ_EV_DELETE: Final = RequestEvent.DELETE
_REQ_EV_FINISH: Final = RequestEvent.FINISH
_REQ_EV_LOAD_DONE: Final = RequestEvent.LOAD_DONE
_REQ_EV_PREEMPT: Final = RequestEvent.PREEMPT
_REQ_EV_RESET: Final = RequestEvent.RESET
_REQ_EV_SCHEDULE: Final = RequestEvent.SCHEDULE
_REQ_EV_SIGNAL: Final = RequestEvent.SIGNAL
_REQ_EV_START_LOAD: Final = RequestEvent.START_LOAD
_ENGINE_EV_ADMIT: Final = EngineEvent.ADMIT
_ENGINE_EV_SETTLE: Final = EngineEvent.SETTLE
_ENGINE_EV_SHUTDOWN: Final = EngineEvent.SHUTDOWN
_ENGINE_EV_STOP: Final = EngineEvent.STOP
_SLOT_EV_ABORT_WRITE: Final = SlotEvent.ABORT_WRITE
_SLOT_EV_BEGIN_READ: Final = SlotEvent.BEGIN_READ
_SLOT_EV_BEGIN_WRITE: Final = SlotEvent.BEGIN_WRITE
_SLOT_EV_COMMIT_WRITE: Final = SlotEvent.COMMIT_WRITE
_SLOT_EV_END_READ: Final = SlotEvent.END_READ
_SLOT_EV_EVICT: Final = SlotEvent.EVICT
_SLOT_EV_RESET: Final = SlotEvent.RESET
_JOB_FX_COMMIT: Final = JobEffect.COMMIT
_JOB_FX_START_COPY: Final = JobEffect.START_COPY
_ENGINE_FX_FLUSH_ALL: Final = EngineEffect.FLUSH_ALL

#: Tokens per GPU block in the model (one block per chunk). A prompt has ``2 * chunks + 1`` tokens: the
#: last token is always recomputed, so every chunk of a prompt can be loaded.
TOKENS_PER_BLOCK: Final = 2

# Engine's view of a request.
E_WAIT: Final = 0
E_LOAD: Final = 1
E_RUN: Final = 2
E_DONE: Final = 3
E_NAMES: Final = ("waiting", "loading", "running", "done")
# Job kinds.
STORE: Final = 0
LOAD: Final = 1
KIND_NAMES: Final = ("store", "load")
# A worker's shard of a job.
UNLAUNCHED: Final = 0
COPYING: Final = 1
DONE_OK: Final = 2
DONE_FAIL: Final = 3
REPORTED: Final = 4
#: A shard its backend reported finished while its copy still runs (only a lying backend does that): the
#: model's ground truth keeps the copy running until it really ends.
REPORTED_COPYING: Final = 5
#: A cascade to a durable tier whose write was reported, while its fsync, directory sync and index
#: persistence still run in the background (the tier's own has_pending_work()).
SYNCING: Final = 6
#: Bounds.promotion_deadlines, a promotion's record only: its deadline (Deadlines.promote_s) has passed while
#: its tier I/O runs; the manager's next on_schedule_end times it out (unless a poll sees the I/O over first).
EXPIRED: Final = 7
#: A promotion timed out (reported failed, out of the manager's transfer map) whose tier I/O still runs: its
#: slot is held, out of the free pool, until the I/O is over (vLLM 0.34's JobResult.deferred_release).
RELEASE_DEFERRED: Final = 8
#: A timed-out promotion whose tier I/O is over, not polled yet: the next poll hands its slot back.
RELEASE_DUE: Final = 9
SHARD_NAMES: Final = (
    "unlaunched",
    "copying",
    "done",
    "failed",
    "reported",
    "reported-while-copying",
    "syncing",
    "copying past its deadline",
    "timed out, copying (release deferred)",
    "timed out, I/O over (release due)",
)
#: Shard states in which a copy still runs or has not been reported: a transfer remains (ground truth).
_UNFINISHED_SHARDS: Final = frozenset({UNLAUNCHED, COPYING, DONE_OK, DONE_FAIL, REPORTED_COPYING})
#: Shard states in which a copy has not started or still runs (its memory must stay put).
_BUSY: Final = frozenset({UNLAUNCHED, COPYING, REPORTED_COPYING})
#: Shard states in which a copy runs or has finished unreported (it holds memory until a poll hands it back).
_UNREPORTED_COPIES: Final = frozenset({COPYING, DONE_OK, DONE_FAIL, REPORTED_COPYING})
#: Shard states the scheduler's bookkeeping sees as launched and not reported (``launched_mask &
#: ~reported_mask``): what its reset fence waits for. A shard reported while its copy runs is not one.
_LAUNCHED_UNREPORTED: Final = frozenset({COPYING, DONE_OK, DONE_FAIL})
# A slot as vLLM's ref_cnt: -2 absent, -1 writing, 0 ready, n >= 1 reading (n readers).
ABSENT: Final = -2
WRITING: Final = -1
READY: Final = 0

_LIVE: Final = (_JOB_SUBMITTED, _JOB_IN_FLIGHT)
_WAITING_PHASES: Final = (_REQ_TRACKED, _REQ_DEFERRED, _REQ_PREEMPTED)
_FINISHED_PHASES: Final = (_REQ_FINISHED_UNSIGNALLED, _REQ_FINISHED_SIGNALLED, _REQ_DELETED)

#: An event of the model, e.g. ``("copy", 1, 0, True)``: kind first, then indices into the source state.
Label = tuple[Any, ...]


@dataclass(frozen=True, slots=True)
class Bounds:
    """The bounds of one exploration (the ``kvfsm check`` options)."""

    requests: int = 2  #: requests that arrive, in all
    prompts: int = 2  #: distinct prompts (all share chunk 0)
    chunks: int = 2  #: chunks per prompt
    workers: int = 2  #: W, tensor-parallel workers copying each job
    slots: int = 2  #: CPU primary slots
    groups: int = 2  #: GPU block groups (one request's blocks each)
    tiers: int = 1  #: 0, 1 or 2 write-through secondary tiers (each commit cascades to every tier)
    durable: bool = False  #: the last tier is durable: after a cascade's write it syncs in the background
    promotions: bool = False  #: the tiers answer HIT for what they hold: a lookup promotes it into the primary
    deadlines: int = 0  #: store deadlines (Deadlines.store_s) that may pass, in all: time_out and quarantine
    shutdown: bool = False  #: the engine may be shut down (bounded): flush_all, give up at the deadline, stop
    resets: int = 1  #: reset_cache calls
    preemptions: int = 1  #: preemptions
    failures: bool = True  #: worker shards and cascades may fail
    max_jobs: int = 0  #: jobs created in all, 0 for no bound (edges past it are pruned, not explored)
    #: the last tier's own has_pending_work() answers True at every call, whatever it holds (vLLM's
    #: KVCRSecondaryTierManager): a hazard the liveness check must reject, not a tier kvfsm runs
    tier_pending_always: bool = False
    #: vLLM 0.34's bounded synchronous loads (sync_load_budget_bytes), in chunks per step; 0: off. A lookup hit
    #: of at most the step's remaining budget is loaded in the step that schedules its request: the step
    #: waits for that load's copies before its forward (spec/README.md, "Bounded synchronous loads")
    sync_load_budget: int = 0
    #: a copy that reset_cache discarded may still write a primary slot, which the reset freed for reuse,
    #: until a step has flushed it: a promotion submitted before then may be the late write's victim, which
    #: breaks stale_ids_ignored (spec/README.md, "The reset hold")
    late_writes: bool = False
    #: the reset hold (spec/README.md, "The reset hold"; kvfsm's TieringManager, vLLM 0.34's _promotions_held):
    #: reset_cache fences the store copies it discards that are launched and unreported; until each has
    #: reported no promotion is reserved: a key missing from the primary is a MISS
    reset_hold: bool = False
    #: promotion deadlines (Deadlines.promote_s) may pass too, sharing the ``deadlines`` bound: a promotion
    #: timed out is failed at once, its slot held until its tier I/O is over (deferred release, pending work)
    promotion_deadlines: bool = False

    def __post_init__(self) -> None:
        positive = ("requests", "prompts", "chunks", "workers", "slots", "groups")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"bound {name} must be a positive integer, got {value!r}")
        for name in ("tiers", "resets", "preemptions", "max_jobs", "deadlines", "sync_load_budget"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"bound {name} must be a non-negative integer, got {value!r}")
        if self.tiers > 2:
            raise ConfigError(f"the model has at most two secondary tiers, got tiers={self.tiers}")
        if self.durable and not self.tiers:
            raise ConfigError("durable=True needs a secondary tier (tiers >= 1)")
        if self.promotions and not self.tiers:
            raise ConfigError("promotions=True needs a secondary tier (tiers >= 1)")
        if self.tier_pending_always and not self.tiers:
            raise ConfigError("tier_pending_always=True needs a secondary tier (tiers >= 1)")
        if self.promotion_deadlines and not (self.promotions and self.deadlines):
            raise ConfigError("promotion_deadlines=True needs promotions=True and deadlines >= 1")
        if (self.late_writes or self.reset_hold) and not self.promotions:
            raise ConfigError("late_writes=True and reset_hold=True are about promotions: they need promotions=True")
        if self.workers > 8:
            raise ConfigError(f"workers={self.workers} is too many to explore; expected at most 8")

    @property
    def num_keys(self) -> int:
        return 1 + self.prompts * (self.chunks - 1)

    @property
    def prompt_tokens(self) -> int:
        return TOKENS_PER_BLOCK * self.chunks + 1

    def key(self, prompt: int, chunk: int) -> int:
        """The key id of chunk ``chunk`` of prompt ``prompt``: chunk 0 is shared by all prompts."""
        return 0 if chunk == 0 else 1 + prompt * (self.chunks - 1) + (chunk - 1)

    def as_dict(self) -> dict[str, int | bool]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


class Req(NamedTuple):
    """A request: the scheduler's request-machine state plus what the engine knows of it."""

    phase: RequestState  #: request machine state (deleted once the scheduler forgot it)
    eng: int  #: E_WAIT, E_LOAD, E_RUN or E_DONE
    prompt: int
    computed: int  #: num_computed_tokens
    next_chunk: int  #: the scheduler's next_stored_chunk
    group: int  #: GPU block group of its blocks as the scheduler knows them (-1: none); the engine holds it
    #: only while the request is loading or running
    pos: int  #: position in the engine's running list (E_RUN) or loading map (E_LOAD), else -1
    fin_pos: int  #: position among requests finished since the last step (finished_unsignalled), else -1
    alloc: bool  #: its group was allocated in the step being scheduled (the open batch)


class JobRec(NamedTuple):
    """A store or load job: the scheduler's job-machine model plus each worker's shard."""

    kind: int  #: STORE or LOAD
    keys: tuple[int, ...]
    req: int  #: index of its request while the scheduler awaits it, else -1
    group: int  #: GPU group a store reads or a load writes
    state: JobState
    pending: int
    failed_reports: int
    shards: tuple[int, ...]  #: per worker rank: UNLAUNCHED .. REPORTED
    ignored: bool  #: discarded by a reset and below the stale threshold: late reports are dropped
    world_size: int
    expired: bool = False  #: its deadline has passed (the clock, ground truth); the next step times it out


class TierRec(NamedTuple):
    """A cascade (primary to a secondary tier) that is not over: its tier's I/O is COPYING, DONE_OK or
    DONE_FAIL (finished, not polled yet) or SYNCING (a durable tier's background sync after the write)."""

    keys: tuple[int, ...]
    status: int  #: the tier's I/O, the ground truth: COPYING, DONE_OK, DONE_FAIL or SYNCING
    tier: int = 0  #: which secondary tier
    #: the tiering manager polled it as finished (it left the manager's transfer map): an honest tier's
    #: record is then gone or SYNCING; a lying tier's may still be COPYING
    harvested: bool = False
    #: a promotion (tier to primary) rather than a cascade; UNLAUNCHED while it is queued for the step
    promote: bool = False


class State(NamedTuple):
    engine: EngineState
    reqs: tuple[Req, ...]
    jobs: tuple[JobRec, ...]
    slots: tuple[int, ...]  #: per key: ABSENT, WRITING, READY or the number of readers
    lru: tuple[int, ...]  #: evictable keys, least recently used first
    tier: tuple[TierRec, ...]
    polled: bool  #: the tiering manager's once-per-step poll gate is closed
    reset_flush: bool  #: the next metadata flushes the jobs a reset discarded
    arrivals: int
    resets: int
    preemptions: int
    created: int  #: jobs created (counted only when Bounds.max_jobs is set)
    #: DrainMode.BLOCKING only: the engine-core thread is inside flush_all's wait, in the middle of a step
    #: (the input queue is not read, no lookup or step runs) until every flushed copy has finished.
    blocked: bool = False
    #: Bounds.promotions only: per secondary tier, the bitmask of keys whose copy it holds (ground truth:
    #: a cascade's I/O that succeeded wrote it; a failed promotion invalidates it)
    held: tuple[int, ...] = ()
    expiries: int = 0  #: deadlines that have passed (counted only when Bounds.deadlines is set)
    #: a bounded shutdown gave up (abandon_jobs, abandon_transfers): what is left is no longer pending work
    abandoned: bool = False


#: The counters: State fields that only the guards in Model.successors() read and only the events that use
#: them up increment. The memos key on the state without them (see Model._memo), and _shift moves a
#: memoized result onto a state with other counters.
_COUNTER_FIELDS: Final = ("arrivals", "resets", "preemptions", "expiries")
_COUNTERS: Final = tuple(State._fields.index(name) for name in _COUNTER_FIELDS)
# The counters' positions as literal constants: the compiled build reads them as direct tuple items (mypyc
# inlines a Final int), where _COUNTERS would be a loop over a tuple of boxed ints.
_S_ARRIVALS: Final = 8
_S_RESETS: Final = 9
_S_PREEMPTIONS: Final = 10
_S_EXPIRIES: Final = 14
assert (
    len(State._fields) == 16
    and tuple(State._fields[i] for i in (_S_ARRIVALS, _S_RESETS, _S_PREEMPTIONS, _S_EXPIRIES)) == _COUNTER_FIELDS
), "State's fields moved: update _S_* and _with_counters"
_without_counters: Final = operator.itemgetter(*(i for i in range(len(State._fields)) if i not in _COUNTERS))
#: The same without the poll gate too, for the events that poll the tiers before reading it.
_without_counters_or_poll: Final = operator.itemgetter(
    *(i for i, name in enumerate(State._fields) if i not in _COUNTERS and name != "polled")
)


def compiled() -> bool:
    """True when this module runs compiled (a wheel built with ``KVFSM_MYPYC=1``, setup.py), False when it
    runs from its Python source. Both explore the same graphs (tests/test_check_fingerprints.py); the
    compiled one is faster."""
    return not __file__.endswith(".py")


class ModelViolation(Exception):
    """A transition of the model broke a spec invariant (or asked a machine for a disabled event)."""

    def __init__(self, invariant: str, detail: str) -> None:
        super().__init__(f"{invariant}: {detail}")
        self.invariant = invariant
        self.detail = detail


class _Pruned(Exception):
    """The transition would exceed Bounds.max_jobs."""


# --------------------------------------------------------------------------------------------- scratch models


class _JobScratch:
    __slots__ = ("failed_reports", "launched_mask", "reported_mask", "state", "world_size")

    def __init__(self, state: JobState, reported: int, failed: int, mask: int, world_size: int) -> None:
        self.state = state
        self.reported_mask = reported
        self.failed_reports = failed
        self.launched_mask = mask
        self.world_size = world_size


class _SlotScratch:
    __slots__ = ("readers", "state")

    def __init__(self, state: SlotState, readers: int) -> None:
        self.state = state
        self.readers = readers


class RequestScratch:
    """A request machine model of a given phase, with or without jobs (to ask the machine about it)."""

    __slots__ = ("_jobs", "state")

    def __init__(self, state: RequestState, has_jobs: bool) -> None:
        self.state = state
        self._jobs = has_jobs

    def has_jobs(self) -> bool:
        return self._jobs


class _EngineScratch:
    __slots__ = ("_pending", "state")

    def __init__(self, state: EngineState, pending: bool) -> None:
        self.state = state
        self._pending = pending

    def has_pending_push_work(self) -> bool:
        return self._pending


def slot_state(code: int) -> SlotState:
    if code == ABSENT:
        return _SLOT_ABSENT
    if code == WRITING:
        return _SLOT_WRITING
    return _SLOT_READY if code == READY else _SLOT_READING


def _slot_code(state: SlotState, readers: int) -> int:
    if state is _SLOT_ABSENT:
        return ABSENT
    if state is _SLOT_WRITING:
        return WRITING
    return readers


def _mask(shards: Sequence[int]) -> int:
    mask = 0
    for rank, shard in enumerate(shards):
        if shard != UNLAUNCHED:
            mask |= 1 << rank
    return mask


def _reported(shards: Sequence[int]) -> int:
    """The job's ``reported_mask``: the ranks whose shard has reported."""
    mask = 0
    for rank, shard in enumerate(shards):
        if shard in (REPORTED, REPORTED_COPYING):
            mask |= 1 << rank
    return mask


# --------------------------------------------------------------------------------------------- the model


class _World:
    """A mutable copy of a State, for the transitions that touch many parts of it."""

    __slots__ = (
        "abandoned",
        "arrivals",
        "blocked",
        "created",
        "engine",
        "expiries",
        "held",
        "jobs",
        "lru",
        "polled",
        "preemptions",
        "reqs",
        "reset_flush",
        "resets",
        "slots",
        "tier",
    )

    def __init__(self, s: State) -> None:
        self.engine = s.engine
        # Comprehensions rather than map(): the compiled build makes them native loops (map and list would be
        # looked up among the builtins and called generically).
        self.reqs: list[list[Any]] = [list(r) for r in s.reqs]
        self.jobs: list[list[Any]] = [list(j) for j in s.jobs]
        self.slots = list(s.slots)
        self.lru = list(s.lru)
        self.tier: list[list[Any]] = [list(t) for t in s.tier]
        self.polled = s.polled
        self.reset_flush = s.reset_flush
        self.arrivals = s.arrivals
        self.resets = s.resets
        self.preemptions = s.preemptions
        self.created = s.created
        self.blocked = s.blocked
        self.held = list(s.held)
        self.expiries = s.expiries
        self.abandoned = s.abandoned

    def freeze(self) -> State:
        return _new(
            _STATE_CLASS,
            (
                self.engine,
                tuple([_new(_REQ_CLASS, r) for r in self.reqs]),
                tuple([_new(_JOB_CLASS, j) for j in self.jobs]),
                tuple(self.slots),
                tuple(self.lru),
                tuple([_new(_TIER_CLASS, t) for t in self.tier]),
                self.polled,
                self.reset_flush,
                self.arrivals,
                self.resets,
                self.preemptions,
                self.created,
                self.blocked,
                tuple(self.held),
                self.expiries,
                self.abandoned,
            ),
        )


# Field positions, for the mutable lists of _World.
_R_PHASE: Final = 0
_R_ENG: Final = 1
_R_PROMPT: Final = 2
_R_COMPUTED: Final = 3
_R_NEXT: Final = 4
_R_GROUP: Final = 5
_R_POS: Final = 6
_R_FIN: Final = 7
_R_ALLOC: Final = 8
_J_KIND: Final = 0
_J_KEYS: Final = 1
_J_REQ: Final = 2
_J_GROUP: Final = 3
_J_STATE: Final = 4
_J_PENDING: Final = 5
_J_FAILED: Final = 6
_J_SHARDS: Final = 7
_J_IGNORED: Final = 8
_J_WORLD: Final = 9
_J_EXPIRED: Final = 10
_T_KEYS: Final = 0
_T_STATUS: Final = 1
_T_TIER: Final = 2
_T_HARVESTED: Final = 3
_T_PROMOTE: Final = 4

#: The spec invariants (spec/invariants.toml) this model checks, each in every state or on every transition.
CHECKED_INVARIANTS: Final = (
    "pending_work_covers_jobs",
    "idle_only_when_nothing_pending",
    "readable_only_after_commit",
    "evict_only_ready_unreferenced",
    "gpu_source_not_overwritten",
    "one_load_per_request",
    "single_loader_per_chunk",
    "complete_exactly_once",
    "stale_ids_ignored",
)

#: Which invariant a disabled transition of each machine violates.
_MACHINE_INVARIANT: Final = {
    "job": "complete_exactly_once",
    "slot": "readable_only_after_commit",
    "request": "one_load_per_request",
    "engine": "idle_only_when_nothing_pending",
}


class Model:
    """The transition system: :attr:`initial`, :meth:`successors`, :meth:`invariants`, :meth:`canonical`."""

    def __init__(self, bounds: Bounds | None = None, drain: DrainMode = DrainMode.NON_BLOCKING) -> None:
        self.bounds = b = bounds if bounds is not None else Bounds()
        self.drain = DrainMode(drain)
        # The effect the spec's drain mode puts on the settle [pending_push_work] rows (flush_all: blocking).
        self.settle_effect = load_drain_modes()[self.drain].settle_effect
        self.W = b.workers
        self.C = b.chunks
        self.S = b.slots
        self.G = b.groups
        self.total_tokens = b.prompt_tokens
        self.prompt_keys: tuple[tuple[int, ...], ...] = tuple(
            tuple(b.key(p, c) for c in range(b.chunks)) for p in range(b.prompts)
        )
        # The spec machines, and the implementation's pure decisions, looked up now (after any patching).
        self._job = job_machine()
        self._slot = slot_machine()
        self._req = request_machine()
        self._engine = engine_machine()
        self.pending_push_work: Callable[..., bool] = scheduler_mod.pending_push_work
        self.fenced_jobs: Callable[..., set[int]] = scheduler_mod.fenced_jobs
        self.stale_threshold_after_reset: Callable[[int, int], int] = scheduler_mod.stale_threshold_after_reset
        self.is_evictable: Callable[[SlotState], bool] = cpu_mod.is_evictable
        # Bounds.tier_pending_always: the last tier's has_pending_work() never answers False.
        self.tier_pending_always: bool = b.tier_pending_always
        # Bounds.sync_load_budget: chunks per step that lookups may load synchronously (0: none).
        self.sync_budget: int = b.sync_load_budget
        if self.sync_budget and self.drain is DrainMode.BLOCKING:
            raise ConfigError(
                "sync_load_budget needs the non_blocking drain: the blocking baseline's flush_all wait and a sync "
                "step's wait would share the blocked flag"
            )
        self._memo_job: dict[tuple[Any, ...], tuple[JobState, JobEffect | None] | InvalidTransition] = {}
        self._memo_slot: dict[tuple[int, SlotEvent], int | InvalidTransition] = {}
        self._memo_req: dict[tuple[Any, ...], tuple[RequestState, RequestEffect | None] | InvalidTransition] = {}
        self._memo_engine: dict[tuple[Any, ...], EngineState | InvalidTransition] = {}
        self._evictable = {code: self.is_evictable(slot_state(code)) for code in (ABSENT, WRITING, READY, 1)}
        #: (event, arg, rest) -> [its result, the state it was computed on] (a list: see _memo)
        self._memo_events: dict[tuple[Any, ...], list[Any]] = {}
        self._memo_lookups: dict[tuple[Any, ...], tuple[list[tuple[Label, State | ModelViolation | None]], State]] = {}
        self._memo_canonical: dict[tuple[Any, ...], State] = {}
        self._memo_finishes: dict[
            tuple[Any, ...], tuple[tuple[Req, ...], tuple[JobRec, ...]] | ModelViolation | None
        ] = {}
        self._memo_polls: dict[tuple[int, ...], tuple[list[int], list[int], tuple[int, ...]]] = {}
        self._memo_invariants: dict[tuple[Any, ...], list[tuple[str, str]]] = {}
        self.last_kept: tuple[list[int], list[int]] | None = None
        self.initial = State(
            _ENGINE_IDLE,
            (),
            (),
            (ABSENT,) * b.num_keys,
            (),
            (),
            False,
            False,
            0,
            0,
            0,
            0,
            False,
            (0,) * b.tiers if b.promotions else (),
            0,
            False,
        )

    def forget(self) -> None:
        """Drop the memoized events, representatives and invariants (each exploration starts afresh)."""
        self._memo_events.clear()
        self._memo_lookups.clear()
        self._memo_canonical.clear()
        self._memo_finishes.clear()
        self._memo_polls.clear()
        self._memo_invariants.clear()

    def memo_entries(self) -> int:
        """How many results the per-state memos hold (events, lookups, representatives, finishes, invariants)."""
        return (
            len(self._memo_events)
            + len(self._memo_lookups)
            + len(self._memo_canonical)
            + len(self._memo_finishes)
            + len(self._memo_invariants)
        )

    def trim_memos(self, limit: int) -> bool:
        """Drop the memos when they hold more than ``limit`` results; True if they were dropped.

        The memos are caches of pure functions of the state, so dropping them changes no result, only
        how often one is computed again (every shared decision is then called again on its next input:
        more calls, never fewer). They hold about three quarters of an exploration's memory (each keeps a
        successor state of its own), so a large exploration bounds them instead of its state count."""
        if self.memo_entries() <= limit:
            return False
        self.forget()
        return True

    # ------------------------------------------------------------------ spec machines, memoized

    def job_event(
        self, state: JobState, reported: int, failed: int, mask: int, event: JobEvent, arg: int
    ) -> tuple[JobState, JobEffect | None]:
        """Fire ``event`` (``arg``: a rank) on a job whose ranks ``mask`` launched and ``reported`` reported."""
        key = (state, reported, failed, mask, event, arg)
        r = self._memo_job.get(key)
        if r is None:
            scratch = _JobScratch(state, reported, failed, mask, self.W)
            try:
                effect = self._job.fire(scratch, event, arg)
                r = (scratch.state, effect)
            except InvalidTransition as exc:
                r = exc
            self._memo_job[key] = r
        if isinstance(r, InvalidTransition):
            raise ModelViolation(_MACHINE_INVARIANT["job"], str(r))
        return r

    def slot_event(self, code: int, event: SlotEvent, invariant: str | None = None) -> int:
        key = (code, event)
        r = self._memo_slot.get(key)
        if r is None:
            state = slot_state(code)
            scratch = _SlotScratch(state, max(code, 0))
            try:
                self._slot.fire(scratch, event)
                readers = scratch.readers
                if event is _SLOT_EV_BEGIN_READ:
                    readers += 1
                elif event is _SLOT_EV_END_READ:
                    readers -= 1
                elif scratch.state is not _SLOT_READING:
                    readers = 0
                r = _slot_code(scratch.state, readers)
            except InvalidTransition as exc:
                r = exc
            self._memo_slot[key] = r
        if isinstance(r, InvalidTransition):
            raise ModelViolation(invariant or _MACHINE_INVARIANT["slot"], str(r))
        return r

    def req_event(
        self, phase: RequestState, event: RequestEvent, has_jobs: bool
    ) -> tuple[RequestState, RequestEffect | None]:
        key = (phase, event, has_jobs)
        r = self._memo_req.get(key)
        if r is None:
            scratch = RequestScratch(phase, has_jobs)
            try:
                effect = self._req.fire(scratch, event)
                r = (scratch.state, effect)
            except InvalidTransition as exc:
                r = exc
            self._memo_req[key] = r
        if isinstance(r, InvalidTransition):
            raise ModelViolation(_MACHINE_INVARIANT["request"], str(r))
        return r

    def engine_event(self, state: EngineState, event: EngineEvent, pending: bool) -> EngineState:
        key = (state, event, pending)
        r = self._memo_engine.get(key)
        if r is None:
            scratch = _EngineScratch(state, pending)
            try:
                self._engine.fire(scratch, event)
                r = scratch.state
            except InvalidTransition as exc:
                r = exc
            self._memo_engine[key] = r
        if isinstance(r, InvalidTransition):
            raise ModelViolation(_MACHINE_INVARIANT["engine"], str(r))
        return r

    def evictable(self, code: int) -> bool:
        return self._evictable[min(code, 1)]

    # ------------------------------------------------------------------ derived views

    @staticmethod
    def live_jobs(jobs: Sequence[Any]) -> list[Any]:
        """Jobs the scheduler awaits (its ``_jobs``)."""
        return [j for j in jobs if j[_J_STATE] in _LIVE]

    def has_pending_push_work(self, jobs: Sequence[Any], tier: Sequence[Any], abandoned: bool = False) -> bool:
        """The implementation's pending_push_work() over the model's awaited jobs and its tiering manager's
        has_pending_work(): what the engine is told, computed from the bookkeeping. After a shutdown gave
        up (``abandoned``), neither the quarantine nor the manager's transfers count."""
        live = [j if isinstance(j, JobRec) else _new(_JOB_CLASS, j) for j in jobs if j[_J_STATE] in _LIVE]
        if abandoned:
            return self.pending_push_work(live, lambda: False)
        return self.pending_push_work(live, lambda: self.quarantine_pending(jobs) or self.manager_pending(tier))

    # ------------------------------------------------------------------ the model's components
    #
    # Small methods that stand for one component's answer, so that a planted bug can sit in a component
    # (tests/planted_model_bugs.py) rather than in a pure decision shared with the implementation: the
    # checker must then catch it by its own ground truth (the shard and tier states), not by re-asking the
    # component.

    def quarantine_pending(self, jobs: Sequence[Any]) -> bool:
        """The scheduler's quarantine term: a timed-out job whose launched copies have not all reported."""
        return any(
            j[_J_STATE] is _JOB_TIMED_OUT and not j[_J_IGNORED] and not _UNREPORTED_COPIES.isdisjoint(j[_J_SHARDS])
            for j in jobs
        )

    def deadline_queue_pops(self, jobs: Sequence[Any]) -> list[int]:
        """Deadlines.pop_expired at build_connector_meta: every awaited job whose deadline has passed."""
        return [j for j, job in enumerate(jobs) if job[_J_EXPIRED] and job[_J_STATE] in _LIVE]

    def manager_pending(self, tier: Sequence[Any]) -> bool:
        """TieringManager.has_pending_work(): transfers in its map, or a tier's own pending work (and, with
        Bounds.promotion_deadlines, its quarantine: timed-out promotions whose release is deferred)."""
        if self.bounds.promotion_deadlines and self.promotions_quarantined(tier):
            return True
        return self.transfers_pending(tier) or self.tiers_pending(tier)

    def promotions_quarantined(self, tier: Sequence[Any]) -> bool:
        """The tiering manager's quarantine term: a timed-out promotion whose slot is not handed back yet
        (vLLM 0.34: a deferred release outstanding keeps has_pending_work() True)."""
        return any(t[_T_PROMOTE] and (t[_T_STATUS] == RELEASE_DEFERRED or t[_T_STATUS] == RELEASE_DUE) for t in tier)

    def release_deferred(self) -> bool:
        """Whether a timed-out promotion's slot waits for its tier I/O to be over (True) or is handed back at
        the time-out (a planted bug: the next reservation may take a slot the late I/O still writes)."""
        return True

    def transfers_pending(self, tier: Sequence[Any]) -> bool:
        """The manager's transfer-map term: cascades and promotions it has not polled as finished (queued
        promotions are not in the map yet: the step that follows their lookup submits them)."""
        return any(not t[_T_HARVESTED] and not (t[_T_PROMOTE] and t[_T_STATUS] == UNLAUNCHED) for t in tier)

    def tiers_pending(self, tier: Sequence[Any]) -> bool:
        """``any(tier.has_pending_work() for tier in tiers)``: a durable tier's background sync. With
        ``Bounds.tier_pending_always`` the last tier answers True at every call, with nothing in its I/O
        (vLLM's KVCRSecondaryTierManager), so the manager's answer is never False."""
        if self.tier_pending_always:
            return True
        return any(t[_T_HARVESTED] and t[_T_STATUS] == SYNCING for t in tier)

    def backend_reports(self, shard: int) -> bool | None:
        """What a worker's copy backend reports for a shard at a poll: True (done), False (failed), None."""
        if shard == DONE_OK:
            return True
        if shard == DONE_FAIL:
            return False
        return None

    def tier_reports(self, rec: Sequence[Any]) -> bool:
        """Whether a tier reports a cascade or promotion finished at the manager's poll (its I/O ended)."""
        return bool(rec[_T_STATUS] in (DONE_OK, DONE_FAIL))

    def promotion_source(self, held: Sequence[int], key: int) -> int | None:
        """TieringManager.lookup: the first tier (in order) whose lookup answers HIT for ``key``, or None."""
        for t, mask in enumerate(held):
            if mask >> key & 1:
                return t
        return None

    def promotions_held(self, jobs: Sequence[Any]) -> bool:
        """Bounds.reset_hold: the tiering manager's ``_promotions_held``, set by reset_cache and cleared by
        ``on_reset_flushed``, which the scheduler calls once its reset fence is empty (at the reset if it
        fenced nothing): held exactly while the fence is not empty. reset_cache fences the store copies it
        discards that are launched and not reported by the bookkeeping (an awaited store's, a quarantined
        store's outstanding ones; never a load's); each one's report clears it. A discarded job never
        launches again, so the model's shard states say what is still fenced. (The fence is not pending
        work: the engine is told nothing of it.)"""
        return any(
            j[_J_KIND] == STORE
            and (j[_J_STATE] is _JOB_STALE or j[_J_IGNORED])
            and not _LAUNCHED_UNREPORTED.isdisjoint(j[_J_SHARDS])
            for j in jobs
        )

    def sync_wait_jobs(self, reqs: Sequence[Any], jobs: Sequence[Any]) -> list[int]:
        """The jobs whose copies a step with sync loads waits for before its forward (the worker's
        ``wait(sync_job_ids)``): the step's sync loads, nothing else."""
        return sync_loads(reqs, jobs)

    def step_wait_jobs(self, s: State) -> list[int]:
        """The jobs whose copies the blocked engine-core thread waits for: a sync step's wait
        (:meth:`sync_wait_jobs`) when the step has sync loads, else flush_all's (every awaited job)."""
        if self.sync_budget and sync_loads(s.reqs, s.jobs):
            return self.sync_wait_jobs(s.reqs, s.jobs)
        return [j for j, job in enumerate(s.jobs) if job.state in _LIVE]

    def step_wait_chunks(self, s: State) -> int:
        """How many chunks the blocked step of ``s`` still waits to be copied (0 when it is not blocked): the
        keys of every job it waits for that has a copy still running."""
        if not s.blocked:
            return 0
        return sum(len(s.jobs[j].keys) for j in self.step_wait_jobs(s) if COPYING in s.jobs[j].shards)

    # ------------------------------------------------------------------ ground truth

    @staticmethod
    def transfer_remains(s: State) -> str | None:
        """What work remains by the model's own shard and tier states (never by asking a component): a
        non-stale job with a shard not yet launched, copying, or finished but not reported, or a cascade
        whose tier I/O or sync is not over. None when nothing remains."""
        for job in s.jobs:
            if job.state is not _JOB_STALE and not job.ignored:
                # An awaited job still has to launch; a terminal one (timed out) only has its launched copies.
                unfinished = _UNFINISHED_SHARDS if job.state in _LIVE else _UNREPORTED_COPIES
                for rank, sh in enumerate(job.shards):
                    if sh in unfinished:
                        what = "timed-out " if job.state is _JOB_TIMED_OUT else ""
                        return f"rank {rank}'s shard of a {what}{KIND_NAMES[job.kind]} job is {SHARD_NAMES[sh]}"
        for rec in s.tier:
            if not (rec.promote and rec.status == UNLAUNCHED):  # a queued promotion is a reservation
                what = "promotion" if rec.promote else "cascade"
                return f"tier {rec.tier}'s {what} of keys {list(rec.keys)} is {SHARD_NAMES[rec.status]}"
        return None

    # ------------------------------------------------------------------ successors

    def apply(self, s: State, label: Label) -> State | ModelViolation | None:
        """The successor of ``s`` by one event (as :meth:`successors` labels it), without the others.

        Afterwards :attr:`last_kept` says which requests and jobs (old indices) survived, in order, when
        the event dropped some (None when it dropped none); new ones are appended after them.
        """
        self.last_kept = None
        kind = label[0]
        if kind == "copy":
            return self._copy_done(s, label[1], label[2], label[3])
        if kind == "tier":
            return self._tier_done(s, label[1], label[2])
        if kind == "sync":
            return self._sync_done(s, label[1])
        if kind == "expire":
            return self._expire(s, label[1])
        if kind == "expire_promotion":
            return self._expire_promotion(s, label[1])
        if kind == "arrive":
            return self._guard(self._arrive, s, label[1])
        if kind == "lookup":
            for lab, nxt in self._lookup_all(s, label[1]):
                if lab == label:
                    return nxt
            raise ModelViolation("model", f"event {label!r} is not enabled")
        if kind == "step":
            return self._guard(self._step, s, -1)
        if kind == "preempt":
            return self._guard(self._step, s, label[1])
        if kind == "finish":
            return self._guard(self._finish_request, s, label[1])
        if kind == "reset":
            return self._guard(self._reset, s, -1)
        if kind == "unblock":
            return self._guard(self._unblock, s, -1)
        if kind == "shutdown":
            return self._guard(self._shutdown, s, -1)
        if kind == "give_up":
            return self._guard(self._give_up, s, -1)
        if kind == "stop":
            return self._guard(self._stop, s, -1)
        raise ModelViolation("model", f"unknown event {label!r}")

    def _lookup_all(self, s: State, i: int) -> Iterator[tuple[Label, State | ModelViolation | None]]:
        if s.blocked:
            return
        used = self._groups_in_use(s)
        owned = {r.group for r in s.reqs if r.eng in (E_RUN, E_LOAD)}
        free_dirty = sorted(used - owned)
        has_clean = len(used) < self.G
        if s.reqs[i].eng == E_WAIT and (has_clean or free_dirty):
            yield from self._lookup(s, i, -1 if has_clean else free_dirty[0], free_dirty, has_clean)

    def successors(self, s: State) -> list[tuple[Label, State | ModelViolation | None]]:
        """Every enabled event of ``s`` with its successor (not canonical), a violation, or None (pruned), in
        a fixed order (a list rather than a generator: cheaper, and every event is taken anyway)."""
        b = self.bounds
        out: list[tuple[Label, State | ModelViolation | None]] = []
        batch_open = any(r.alloc for r in s.reqs)
        # Environment: a copy or a cascade finishes (or fails).
        failures = b.failures
        for j, job in enumerate(s.jobs):
            for w, shard in enumerate(job.shards):
                if shard == COPYING:
                    out.append((("copy", j, w, True), self._copy_done(s, j, w, True)))
                    if failures:
                        out.append((("copy", j, w, False), self._copy_done(s, j, w, False)))
                elif shard == REPORTED_COPYING:  # already reported: only its end is left
                    out.append((("copy", j, w, True), self._copy_done(s, j, w, True)))
        for c, rec in enumerate(s.tier):
            if rec.status == COPYING or rec.status == EXPIRED or rec.status == RELEASE_DEFERRED:
                out.append((("tier", c, True), self._tier_done(s, c, True)))
                if failures:
                    out.append((("tier", c, False), self._tier_done(s, c, False)))
            elif rec.status == SYNCING:
                out.append((("sync", c), self._sync_done(s, c)))
        if s.expiries < b.deadlines and b.promotion_deadlines:
            for c, rec in enumerate(s.tier):
                if rec.promote and rec.status == COPYING and not rec.harvested:
                    out.append((("expire_promotion", c), self._expire_promotion(s, c)))
        if s.expiries < b.deadlines:
            for j, job in enumerate(s.jobs):
                if job.kind == STORE and job.state in _LIVE and not job.expired:
                    out.append((("expire", j), self._expire(s, j)))
        if s.engine is _ENGINE_STOPPED:
            return out  # the process has stopped: nothing else happens
        if s.engine is _ENGINE_SHUTTING_DOWN:
            # flush_all: empty steps until nothing is pending (stop) or the deadline passes (give up).
            if self.has_pending_push_work(s.jobs, s.tier, s.abandoned):
                out.append((("step",), self._guard(self._step, s, -1)))
                out.append((("give_up",), self._guard(self._give_up, s, -1)))
            else:
                out.append((("stop",), self._guard(self._stop, s, -1)))
            return out
        # Engine inputs.
        if s.arrivals < b.requests:
            for p in range(b.prompts):
                out.append((("arrive", p), self._guard(self._arrive, s, p)))
        if s.blocked:
            # The engine-core thread waits in flush_all: it runs nothing until every flushed copy finished.
            if not any(COPYING in s.jobs[j].shards for j in self.step_wait_jobs(s)):
                out.append((("unblock",), self._guard(self._unblock, s, -1)))
            return out
        if any(r.eng == E_WAIT for r in s.reqs):  # (the GPU groups matter only to a lookup)
            used = self._groups_in_use(s)
            owned = {r.group for r in s.reqs if r.eng == E_RUN or r.eng == E_LOAD}
            free_dirty = sorted(used - owned)
            has_clean = len(used) < self.G
            for i, r in enumerate(s.reqs):
                if r.eng == E_WAIT and (has_clean or free_dirty):
                    out += self._memo_lookup(s, i, -1 if has_clean else free_dirty[0], free_dirty, has_clean)
        if s.engine is _ENGINE_IDLE and batch_open:
            return out
        # What the memo keys of this state's steps and reset hold (see _memo), built once for all of them.
        polls_first = _without_counters_or_poll(s) if b.tiers else _without_counters(s)
        if s.engine is not _ENGINE_IDLE:
            out.append((("step",), self._memo(_STEP, s, -1, polls_first)))
        if not batch_open:
            for i, r in enumerate(s.reqs):
                if r.eng == E_RUN and s.preemptions < b.preemptions:
                    out.append((("preempt", i), self._memo(_STEP, s, i, polls_first)))
                phase = r.phase
                if r.eng != E_DONE and not (
                    phase is _REQ_FINISHED_UNSIGNALLED or phase is _REQ_FINISHED_SIGNALLED or phase is _REQ_DELETED
                ):  # (not in _FINISHED_PHASES, without comparing enum members by ==)
                    out.append((("finish", i), self._memo_finish(s, i)))
            if s.resets < b.resets:
                out.append((("reset",), self._memo(_RESET, s, -1, polls_first)))
            if b.shutdown:
                out.append((("shutdown",), self._memo(_SHUTDOWN, s, -1, _without_counters(s))))
        return out

    # -- memoized events
    #
    # The counters (arrivals, resets, preemptions, expiries) are read only by the guards in successors()
    # and only ever incremented by the events that use them up: every event's result on a state is its
    # result on the same state with other counters, with the counters shifted by as much. So the expensive
    # events are memoized, inside this Model, on the state without them (``created`` stays in the key: it
    # prunes), which computes each about half as often at the default bounds.

    def _memo(self, event: int, s: State, arg: int, rest: tuple[Any, ...]) -> State | ModelViolation | None:
        """Event ``event`` (_STEP: ``arg`` the request to preempt or -1, _RESET, _SHUTDOWN) on ``s`` through
        _guard, memoized on ``rest``: ``s`` without its counters, and for the events that run the tiering
        manager's poll before anything reads the poll gate (a step's build_connector_meta, a reset's drain)
        without ``s.polled`` too when there are tiers (their result does not depend on it). ``rest`` is
        computed once per state by successors(), for all of its events. The event is a number, not a bound
        method: the compiled build then calls the method directly and builds no method object per call."""
        key = (event, arg, rest)
        # One hash of the key, hit or miss: setdefault looks it up and, on a miss, inserts this entry at
        # once, which is then filled in (where get and then a store would hash the key twice).
        entry: list[Any] = [None, s]
        hit = self._memo_events.setdefault(key, entry)
        if hit is not entry:
            return _shift(hit[0], hit[1], s)
        try:
            if event == _STEP:
                r: State | ModelViolation | None = self._step(s, arg)
            elif event == _RESET:
                r = self._reset(s, arg)
            else:
                r = self._shutdown(s, arg)
        except ModelViolation as exc:
            r = exc.with_traceback(None)  # as in _guard
        except _Pruned:
            r = None
        except BaseException:
            del self._memo_events[key]  # no unfilled entry stays behind
            raise
        entry[0] = r
        return r

    def _memo_finish(self, s: State, i: int) -> State | ModelViolation | None:
        """_finish_request through _guard, memoized on what it reads: the requests and the jobs (the request
        machine's answers depend on nothing else); the rest of ``s`` is carried over as it is."""
        key = (i, s[1], s[2])
        hit = self._memo_finishes.get(key, _MISSING)
        if hit is _MISSING:
            r = self._guard(self._finish_request, s, i)
            self._memo_finishes[key] = (r.reqs, r.jobs) if isinstance(r, State) else r
            return r
        if isinstance(hit, tuple):
            return _with_records(s, hit[0], hit[1], s[5])
        return hit if isinstance(hit, ModelViolation) else None

    def _memo_lookup(
        self, s: State, i: int, clean: int, free_dirty: list[int], has_clean: bool
    ) -> list[tuple[Label, State | ModelViolation | None]]:
        key = (i, *_without_counters(s))
        hit = self._memo_lookups.get(key)
        if hit is None:
            out = list(self._lookup(s, i, clean, free_dirty, has_clean))
            self._memo_lookups[key] = (out, s)
            return out
        was = hit[1]
        return [(lab, _shift(r, was, s)) for lab, r in hit[0]]

    def _guard(self, fn: Callable[[State, int], State], s: State, arg: int) -> State | ModelViolation | None:
        try:
            return fn(s, arg)
        except ModelViolation as exc:
            # Without its traceback: the frames it holds (the event's whole scratch world) would live on
            # in the memo, and form cycles.
            return exc.with_traceback(None)
        except _Pruned:
            return None

    @staticmethod
    def _groups_in_use(s: State) -> set[int]:
        used = {r.group for r in s.reqs if r.group >= 0}
        used.update(j.group for j in s.jobs)
        return used

    def _copy_done(self, s: State, j: int, w: int, ok: bool) -> State:
        # Built with tuple.__new__ rather than _replace: this is the checker's most frequent edge.
        jobs = s.jobs
        job = jobs[j]
        shards = job.shards
        value = REPORTED if shards[w] == REPORTED_COPYING else DONE_OK if ok else DONE_FAIL
        # Every field written out (no slices): the compiled build then builds each tuple at once.
        new_job = _new(
            _JOB_CLASS,
            (job[0], job[1], job[2], job[3], job[4], job[5], job[6], _with(shards, w, value), job[8], job[9], job[10]),
        )
        return _with_records(s, s[1], _with(jobs, j, new_job), s[5])

    def _tier_done(self, s: State, c: int, ok: bool) -> State:
        """The tier's I/O for cascade ``c`` ends (ok or failed)."""
        tier = list(s.tier)
        rec = tier[c]
        if rec.status == RELEASE_DEFERRED:  # a timed-out promotion's I/O is over: the next poll releases its slot
            tier[c] = _new(_TIER_CLASS, (rec[0], RELEASE_DUE, *rec[2:]))
            return _with_records(s, s[1], s[2], tuple(tier))
        if rec.harvested:  # a lying tier reported it already: its I/O ends now (and a durable tier syncs)
            if ok and self._durable(rec.tier) and not rec.promote:
                tier[c] = _new(_TIER_CLASS, (rec[0], SYNCING, *rec[2:]))
            else:
                del tier[c]
        else:
            tier[c] = _new(_TIER_CLASS, (rec[0], DONE_OK if ok else DONE_FAIL, *rec[2:]))
        if ok and s.held and not rec.promote:  # the tier now holds a copy of the cascaded keys
            held = list(s.held)
            for key in rec.keys:
                held[rec.tier] |= 1 << key
            return s._replace(tier=tuple(tier), held=tuple(held))
        return _with_records(s, s[1], s[2], tuple(tier))

    def _expire_promotion(self, s: State, c: int) -> State:
        """The clock passes promotion ``c``'s deadline (Deadlines.promote_s) while its tier I/O runs."""
        tier = list(s.tier)
        rec = tier[c]
        tier[c] = _new(_TIER_CLASS, (rec[0], EXPIRED, *rec[2:]))
        return s._replace(tier=tuple(tier), expiries=s.expiries + 1)

    def _expire(self, s: State, j: int) -> State:
        """The clock passes store job ``j``'s deadline (Deadlines.store_s)."""
        jobs = list(s.jobs)
        jobs[j] = jobs[j]._replace(expired=True)
        return s._replace(jobs=tuple(jobs), expiries=s.expiries + 1)

    def _time_out(self, w: _World, j: int) -> None:
        """OffloadingScheduler.expire_jobs for one job: time_out / release, in two parts (spec/README.md,
        "Quarantine"): the job leaves the job map and its request at once; its slots are handed back only
        once every launched copy has reported (at once if none was launched)."""
        job = w.jobs[j]
        shards = job[_J_SHARDS]
        job[_J_STATE] = self.job_event(
            job[_J_STATE], _reported(shards), job[_J_FAILED], _mask(shards), _JOB_EV_TIME_OUT, 0
        )[0]
        i = job[_J_REQ]
        job[_J_REQ] = -1
        if _UNREPORTED_COPIES.isdisjoint(shards):
            self._release(w, job)
        if i >= 0 and w.reqs[i][_R_PHASE] is _REQ_FINISHED_SIGNALLED and not _awaits(w.jobs, i):
            self._fire_req(w, i, _REQ_EV_DELETE)

    def _release(self, w: _World, job: list[Any]) -> None:
        """The RELEASE effect's memory part: a store's slots are freed, a load's unpinned."""
        if job[_J_KIND] == STORE:
            self._complete_store(w, job[_J_KEYS], False)
        else:
            self._complete_load(w, job[_J_KEYS])

    # -- bounded shutdown (EngineLoop.shutdown)

    def _shutdown(self, s: State, _: int) -> State:
        """shutdown(timeout): abort every live request, then fire shutdown / flush_all."""
        w = _World(s)
        for i, r in enumerate(w.reqs):
            if r[_R_ENG] != E_DONE and r[_R_PHASE] not in _FINISHED_PHASES:
                self._fire_req(w, i, _REQ_EV_FINISH)
                r[_R_FIN] = max((x[_R_FIN] for x in w.reqs), default=-1) + 1
                if r[_R_ENG] in (E_RUN, E_WAIT):
                    r[_R_ENG] = E_DONE
                    r[_R_POS] = -1
        w.engine = self.engine_event(w.engine, _ENGINE_EV_SHUTDOWN, False)
        return self._compact(w)

    def _give_up(self, s: State, _: int) -> State:
        """The shutdown deadline passes (abandon_jobs): jobs no worker launched are cancelled, launched ones
        time out (quarantined, but given up on), and the manager gives up its transfers."""
        w = _World(s)
        for j, job in enumerate(w.jobs):
            if job[_J_STATE] not in _LIVE:
                continue
            shards = job[_J_SHARDS]
            if _mask(shards) == 0:
                state, effect = self.job_event(job[_J_STATE], _reported(shards), job[_J_FAILED], 0, _JOB_EV_CANCEL, 0)
                job[_J_STATE] = state
                self._job_finished(w, j, effect)
            else:
                self._time_out(w, j)
        w.abandoned = True
        self._finish_loads(w)  # EngineLoop._flush_all: the loads given up hand their requests back
        return self._compact(w)

    def _stop(self, s: State, _: int) -> State:
        """stop [no_pending_push_work], then release_quarantine and the tiers' shutdown: nothing can use
        the memory any more, so every quarantined slot and every abandoned transfer's pin is handed back."""
        w = _World(s)
        w.engine = self.engine_event(w.engine, _ENGINE_EV_STOP, self.has_pending_push_work(w.jobs, w.tier, w.abandoned))
        for job in w.jobs:
            if (
                job[_J_STATE] is _JOB_TIMED_OUT
                and not job[_J_IGNORED]
                and not _UNREPORTED_COPIES.isdisjoint(job[_J_SHARDS])
            ):
                self._release(w, job)
            # Every worker's shutdown finishes the copies it holds, and their reports are applied (a stale
            # job's too, ignored by id).
            job[_J_SHARDS] = tuple(REPORTED if sh != UNLAUNCHED else sh for sh in job[_J_SHARDS])
        for t in w.tier:
            for key in t[_T_KEYS]:
                if t[_T_PROMOTE]:
                    if w.slots[key] == WRITING:
                        w.slots[key] = self.slot_event(WRITING, _SLOT_EV_ABORT_WRITE)
                    # TieringManager.shutdown's poll: a promotion that did not succeed (failed, or cancelled
                    # by the tier's shutdown) is released with invalidate=True.
                    if w.held and (
                        (not t[_T_HARVESTED] and t[_T_STATUS] in (COPYING, DONE_FAIL, EXPIRED))
                        or t[_T_STATUS] in (RELEASE_DEFERRED, RELEASE_DUE)
                    ):
                        w.held[t[_T_TIER]] &= ~(1 << key)
                elif not t[_T_HARVESTED]:
                    self._end_read(w, key)
        w.tier = []
        if self.bounds.tiers:
            w.polled = True  # TieringManager.shutdown polls the tiers
        self._finish_loads(w)  # EngineLoop._stop_parts
        return self._compact(w)

    def _sync_done(self, s: State, c: int) -> State:
        """A durable tier's background sync of cascade ``c`` finishes: the data is durable."""
        tier = list(s.tier)
        del tier[c]
        return s._replace(tier=tuple(tier))

    def _durable(self, t: int) -> bool:
        return self.bounds.durable and t == self.bounds.tiers - 1

    def _arrive(self, s: State, prompt: int) -> State:
        # A blocked engine does not read its input queue: the request waits there, not admitted yet.
        engine = s.engine if s.blocked else self.engine_event(s.engine, _ENGINE_EV_ADMIT, False)
        req = Req(_REQ_TRACKED, E_WAIT, prompt, 0, 0, -1, -1, -1, False)
        return s._replace(engine=engine, reqs=(*s.reqs, req), arrivals=s.arrivals + 1)

    # -- lookup: get_num_new_matched_tokens + update_state_after_alloc

    def _lookup(
        self, s: State, i: int, clean: int, free_dirty: list[int], has_clean: bool
    ) -> Iterator[tuple[Label, State | ModelViolation | None]]:
        try:
            world = _World(s)
            outcome = self._lookup_result(world, i)
        except ModelViolation as exc:
            yield ("lookup", i, -1), exc
            return
        if outcome is None:  # deferred: no blocks needed
            yield ("lookup", i, -1), world.freeze()
            return
        options = ([-1] if has_clean else []) + free_dirty
        for g in options:
            yield ("lookup", i, g), self._guard(lambda st, gg: self._admit(st, i, gg, outcome), s, g)

    def _lookup_result(self, w: _World, i: int) -> int | None:
        """Runs get_num_new_matched_tokens on ``w``: the number of hit chunks, or None if deferred."""
        r = w.reqs[i]
        has_jobs = _awaits(w.jobs, i)
        if has_jobs:
            r[_R_PHASE] = self.req_event(r[_R_PHASE], _REQ_EV_DEFER, has_jobs)[0]
            return None
        self._maybe_poll(w)
        being_loaded = {k for j in w.jobs if j[_J_KIND] == LOAD and j[_J_STATE] in _LIVE for k in j[_J_KEYS]}
        hits = 0
        must_wait = False
        scanned: set[int] = set()
        for key in self.prompt_keys[r[_R_PROMPT]]:
            code = w.slots[key]
            if code == ABSENT:
                src = (
                    self.promotion_source(w.held, key)
                    if w.held and not (self.bounds.reset_hold and self.promotions_held(w.jobs))
                    else None
                )
                if src is not None and self._reserve(w, key, scanned):
                    w.tier.append([(key,), UNLAUNCHED, src, False, True])
                    must_wait = True  # HIT_PENDING: the request defers until the promotion commits
                break  # else MISS: compute the rest
            scanned.add(key)
            if code == WRITING:
                must_wait = True
                break
            if key in being_loaded:
                must_wait = True
                break
            hits += 1
        if must_wait:
            r[_R_PHASE] = self.req_event(r[_R_PHASE], _REQ_EV_DEFER, False)[0]
            return None
        return hits

    def _admit(self, s: State, i: int, g: int, hits: int) -> State:
        w = _World(s)
        self._lookup_result(w, i)  # the same calls again, on a fresh copy (deterministic)
        if g < 0:
            used = self._groups_in_use(s)
            g = max(used, default=-1) + 1
        r = w.reqs[i]
        r[_R_GROUP] = g
        r[_R_ALLOC] = True
        if hits == 0:
            r[_R_PHASE] = self.req_event(r[_R_PHASE], _REQ_EV_SCHEDULE, False)[0]
            r[_R_ENG] = E_RUN
            r[_R_POS] = sum(1 for x in w.reqs if x[_R_ENG] == E_RUN and x is not r)
            return w.freeze()
        keys = self.prompt_keys[r[_R_PROMPT]][:hits]
        self.req_event(r[_R_PHASE], _REQ_EV_START_LOAD, False)  # can_fire, before prepare_load
        self._maybe_poll(w)
        for key in keys:
            self._begin_read(w, key)
        r[_R_PHASE] = self.req_event(r[_R_PHASE], _REQ_EV_START_LOAD, False)[0]
        # _reserve_sync_load: a hit that fits what is left of the step's budget (and leaves a token to compute)
        # is loaded synchronously: the engine runs the request in this very step, from its hit tokens.
        sync = (
            self.sync_budget > 0
            and r[_R_COMPUTED] + hits * TOKENS_PER_BLOCK < self.total_tokens
            and hits <= self.sync_budget - sum(len(w.jobs[j][_J_KEYS]) for j in sync_loads(w.reqs, w.jobs))
        )
        self._count_job(w)
        w.jobs.append([LOAD, keys, i, g, _JOB_SUBMITTED, self.W, 0, (UNLAUNCHED,) * self.W, False, self.W, False])
        r[_R_NEXT] = hits
        if sync:
            r[_R_COMPUTED] = hits * TOKENS_PER_BLOCK
            r[_R_ENG] = E_RUN
            r[_R_POS] = sum(1 for x in w.reqs if x[_R_ENG] == E_RUN and x is not r)
            return w.freeze()
        r[_R_ENG] = E_LOAD
        r[_R_POS] = sum(1 for x in w.reqs if x[_R_ENG] == E_LOAD and x is not r)
        return w.freeze()

    def _count_job(self, w: _World) -> None:
        if self.bounds.max_jobs:
            w.created += 1
            if w.created > self.bounds.max_jobs:
                raise _Pruned

    # -- the CPU primary (kvfsm.control.cpu) and the tiering manager (kvfsm.control.tiering)

    def _begin_read(self, w: _World, key: int) -> None:
        code = w.slots[key]
        if code < READY:
            raise ModelViolation(
                "readable_only_after_commit", f"prepare_read of key {key} whose slot is {slot_state(code).value}"
            )
        was = self.evictable(code)
        code = self.slot_event(code, _SLOT_EV_BEGIN_READ)
        w.slots[key] = code
        if was and not self.evictable(code):
            w.lru.remove(key)

    def _end_read(self, w: _World, key: int) -> None:
        code = w.slots[key]
        was = self.evictable(code)
        code = self.slot_event(code, _SLOT_EV_END_READ)
        w.slots[key] = code
        if not was and self.evictable(code):
            w.lru.append(key)

    def _poll(self, w: _World) -> None:
        """TieringManager._poll: apply every finished cascade, in the tier's report order (by keys)."""
        w.polled = True
        if not w.tier:
            return
        if self.bounds.promotion_deadlines:
            self._release_due(w)
        done = sorted(
            (t for t in w.tier if not t[_T_HARVESTED] and self.tier_reports(t)), key=lambda t: (t[_T_TIER], t[_T_KEYS])
        )
        if not done:
            return
        kept = []
        for t in w.tier:
            if t[_T_HARVESTED] or not self.tier_reports(t):
                kept.append(t)
            elif t[_T_STATUS] == COPYING or (
                t[_T_STATUS] == DONE_OK and self._durable(t[_T_TIER]) and not t[_T_PROMOTE]
            ):
                # Reported, but the tier's I/O (a lie) or a durable tier's sync still runs.
                status = SYNCING if t[_T_STATUS] == DONE_OK else COPYING
                kept.append([t[_T_KEYS], status, t[_T_TIER], True, t[_T_PROMOTE]])
        w.tier = kept
        for t in done:
            if t[_T_PROMOTE]:
                # The promotion's job commits (the slot becomes readable) or releases it, and a failed
                # promotion invalidates the tier's copy (#49176).
                ok = t[_T_STATUS] != DONE_FAIL
                for key in t[_T_KEYS]:
                    if ok:
                        w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_COMMIT_WRITE)
                        w.lru.append(key)
                    else:
                        w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_ABORT_WRITE)
                        w.held[t[_T_TIER]] &= ~(1 << key)
                continue
            # The cascade's job acks (or fails) its one report; either way the primary copy is unpinned.
            for key in t[_T_KEYS]:
                self._end_read(w, key)

    def _release_due(self, w: _World) -> None:
        """TieringManager._poll's quarantine part: a timed-out promotion whose tier I/O is over hands its slot
        back (the deferred release), and the tier's copy, which failed its deadline, is invalidated."""
        due = [t for t in w.tier if t[_T_PROMOTE] and t[_T_STATUS] == RELEASE_DUE]
        if not due:
            return
        w.tier = [t for t in w.tier if not (t[_T_PROMOTE] and t[_T_STATUS] == RELEASE_DUE)]
        for t in due:
            for key in t[_T_KEYS]:
                if self.release_deferred():
                    w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_ABORT_WRITE)
                w.held[t[_T_TIER]] &= ~(1 << key)

    def _expire_transfers(self, w: _World) -> None:
        """TieringManager.expire_transfers at on_schedule_end, after its poll: every promotion whose deadline
        has passed is timed out. It is reported failed at once (it leaves the transfer map); its slot stays
        reserved until its tier I/O is over (deferred release), which the quarantine counts as pending work."""
        for t in w.tier:
            if t[_T_PROMOTE] and t[_T_STATUS] == EXPIRED:
                t[_T_STATUS] = RELEASE_DEFERRED
                t[_T_HARVESTED] = True
                if not self.release_deferred():  # (a planted bug: the slot handed back while the I/O runs)
                    for key in t[_T_KEYS]:
                        w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_ABORT_WRITE)

    def _maybe_poll(self, w: _World) -> None:
        if self.bounds.tiers and not w.polled:
            self._poll(w)

    def _reserve(self, w: _World, key: int, protected: set[int]) -> bool:
        """primary.prepare_write([key], protected): reserve a slot for a promotion, evicting only an
        unprotected ready slot (this scan's hits are protected); False when none is left (the key MISSes)."""
        held = sum(1 for code in w.slots if code != ABSENT)
        if held >= self.S:
            victims = [k for k in w.lru if k not in protected]
            if not victims:
                return False
            w.lru.remove(victims[0])
            w.slots[victims[0]] = self.slot_event(w.slots[victims[0]], _SLOT_EV_EVICT, "evict_only_ready_unreferenced")
        w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_BEGIN_WRITE)
        return True

    def _prepare_store(self, w: _World, keys: Sequence[int]) -> tuple[int, ...] | None:
        """CPUOffloadingManager.prepare_store: the keys to store, () if none is new, None if they can't fit."""
        self._maybe_poll(w)
        new_keys = [k for k in dict.fromkeys(keys) if w.slots[k] == ABSENT]
        if not new_keys:
            return ()
        protected = {k for k in keys if w.slots[k] != ABSENT}
        held = sum(1 for code in w.slots if code != ABSENT)
        need = len(new_keys) - (self.S - held)
        if need > 0:
            if need > len(w.lru):
                return None
            victims = [k for k in w.lru if k not in protected][:need]
            if len(victims) < need:
                return None
            for key in victims:
                w.lru.remove(key)
                w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_EVICT, "evict_only_ready_unreferenced")
        for key in new_keys:
            w.slots[key] = self.slot_event(w.slots[key], _SLOT_EV_BEGIN_WRITE)
        return tuple(new_keys)

    def _complete_store(self, w: _World, keys: Sequence[int], success: bool) -> None:
        """TieringManager/CPUOffloadingManager.complete_store: commit or roll back the writing keys."""
        writing = [k for k in dict.fromkeys(keys) if w.slots[k] == WRITING]
        if not writing:
            return
        for key in writing:
            if success:
                code = self.slot_event(WRITING, _SLOT_EV_COMMIT_WRITE)
                w.slots[key] = code
                if self.evictable(code):
                    w.lru.append(key)
            else:
                w.slots[key] = self.slot_event(WRITING, _SLOT_EV_ABORT_WRITE)
        if success and self.bounds.tiers:
            cascade = tuple(writing)
            for t in range(self.bounds.tiers):  # written through to every tier, each cascade pinning the keys
                for key in cascade:
                    self._begin_read(w, key)
                w.tier.append([cascade, COPYING, t, False, False])

    def _complete_load(self, w: _World, keys: Sequence[int]) -> None:
        for key in keys:
            if w.slots[key] < 1:
                raise ModelViolation(
                    "evict_only_ready_unreferenced",
                    f"complete_load of key {key} whose slot is {slot_state(w.slots[key]).value}, not reading",
                )
        for key in keys:
            self._end_read(w, key)

    # -- the engine step

    def _fire_req(self, w: _World, i: int, event: RequestEvent) -> RequestEffect | None:
        r = w.reqs[i]
        has_jobs = _awaits(w.jobs, i)
        r[_R_PHASE], effect = self.req_event(r[_R_PHASE], event, has_jobs)
        return effect

    def _step(self, s: State, preempt: int) -> State:
        w = _World(s)
        W = self.W
        reqs = w.reqs
        if preempt >= 0:
            r = reqs[preempt]
            r[_R_GROUP] = -1
            r[_R_ENG] = E_WAIT
            r[_R_COMPUTED] = 0
            r[_R_POS] = -1
            w.preemptions += 1
        running = [i for i, r in enumerate(reqs) if r[_R_ENG] == E_RUN]
        if len(running) > 1:
            running.sort(key=lambda i: reqs[i][_R_POS])
        scheduled = [(i, self.total_tokens - reqs[i][_R_COMPUTED]) for i in running]
        allocated = {r[_R_GROUP] for r in reqs if r[_R_ALLOC]}
        new_jobs_from = len(w.jobs)

        # build_connector_meta: expire_jobs first
        if self.bounds.deadlines:
            for j in self.deadline_queue_pops(w.jobs):
                self._time_out(w, j)
            for job in w.jobs:  # ground truth: the clock; every deadline passed is noticed by this step
                if job[_J_EXPIRED] and job[_J_STATE] in _LIVE:
                    raise ModelViolation(
                        "deadlines_noticed",
                        f"a {KIND_NAMES[job[_J_KIND]]} job (keys {list(job[_J_KEYS])}) is past its deadline and "
                        "still awaited after build_connector_meta",
                    )
        if self.bounds.tiers:  # manager.on_schedule_end: poll, submit the queued promotions, reopen the gate
            self._poll(w)
            if self.bounds.promotion_deadlines:
                self._expire_transfers(w)
            for t in w.tier:
                if t[_T_PROMOTE] and t[_T_STATUS] == UNLAUNCHED:
                    if self.bounds.late_writes:
                        self._check_no_late_write(w, t)
                    t[_T_STATUS] = COPYING
            w.polled = False
        flush: set[int] = set()
        if preempt >= 0:
            flush.update(j for j, job in enumerate(w.jobs) if job[_J_REQ] == preempt and job[_J_STATE] in _LIVE)
            self._fire_req(w, preempt, _REQ_EV_PREEMPT)
        fences = self._fences(w)
        flush |= self.fenced_jobs(allocated, fences)
        for i, n in scheduled:
            if reqs[i][_R_PHASE] is _REQ_RUNNING:
                self._plan_stores(w, i, reqs[i][_R_COMPUTED] + n, allocated, flush)
        finished = [i for i, r in enumerate(reqs) if r[_R_FIN] >= 0]
        if len(finished) > 1:
            finished.sort(key=lambda i: reqs[i][_R_FIN])
        for i in finished:
            self._plan_stores(w, i, reqs[i][_R_COMPUTED], allocated, flush)
        for i in finished:
            reqs[i][_R_FIN] = -1
            self._fire_req(w, i, _REQ_EV_SIGNAL)
            if not _awaits(w.jobs, i):
                self._fire_req(w, i, _REQ_EV_DELETE)
        if w.reset_flush:
            flush.update(j for j, job in enumerate(w.jobs) if job[_J_STATE] is _JOB_STALE or job[_J_IGNORED])
            w.reset_flush = False
        for r in reqs:
            r[_R_ALLOC] = False

        # Workers, before the forward: flush (launch, then wait), then launch this step's loads.
        loads = [j for j, job in enumerate(w.jobs) if job[_J_KIND] == LOAD and UNLAUNCHED in job[_J_SHARDS]]
        if flush or loads:
            ordered = sorted(flush)
            for rank in range(W):
                for j in ordered:
                    job = w.jobs[j]
                    if j >= new_jobs_from and job[_J_KIND] == STORE:
                        self._launch(job, rank)
                for j in flush:
                    job = w.jobs[j]
                    if job[_J_SHARDS][rank] == COPYING:
                        job[_J_SHARDS] = _with(job[_J_SHARDS], rank, DONE_OK)
                for j in loads:
                    self._launch(w.jobs[j], rank)
        # What this step writes on the GPU: loads into their groups, the forward into computed requests'.
        # A request's own jobs are no hazard to it: its stores read chunks it already computed, and its
        # forward writes later blocks.
        written = {w.jobs[j][_J_GROUP]: w.jobs[j][_J_REQ] for j in loads}
        for i, n in scheduled:
            if n > 0:
                written.setdefault(reqs[i][_R_GROUP], i)
        for job in w.jobs if written else ():
            # A timed-out store's blocks are unfenced on purpose: its copy only ever writes a slot that is
            # never committed.
            if (
                job[_J_GROUP] in written
                and job[_J_REQ] != written[job[_J_GROUP]]
                and job[_J_STATE] is not _JOB_TIMED_OUT
            ):
                busy = [rank for rank, sh in enumerate(job[_J_SHARDS]) if sh in _BUSY]
                if busy:
                    what = "reads" if job[_J_KIND] == STORE else "is loading into"
                    raise ModelViolation(
                        "gpu_source_not_overwritten",
                        f"this step writes GPU group {job[_J_GROUP]} while {KIND_NAMES[job[_J_KIND]]} job "
                        f"(keys {list(job[_J_KEYS])}) still {what} it on worker(s) {busy}",
                    )
        if self.sync_budget and loads and sync_loads(reqs, w.jobs):
            # Bounded synchronous loads: the workers wait for the step's sync loads before the forward, on
            # the engine-core thread; the step resumes (unblock) once every copy it waits for has finished.
            self._check_step_wait(w)
            w.blocked = True
            return self._compact(w)
        return self._forward(w, scheduled)

    def _forward(self, w: _World, scheduled: list[tuple[int, int]]) -> State:
        """The step's forward, then every store not launched yet, then the step's tail."""
        reqs = w.reqs
        for i, n in scheduled:
            reqs[i][_R_COMPUTED] += n
        # After the forward: launch every store not launched yet.
        for job in w.jobs:
            if job[_J_KIND] == STORE and UNLAUNCHED in job[_J_SHARDS]:
                for rank in range(self.W):
                    if job[_J_SHARDS][rank] == UNLAUNCHED and job[_J_STATE] not in _TERMINAL_SKIP:
                        self._launch(job, rank)
        return self._step_tail(w)

    def _check_no_late_write(self, w: _World, rec: list[Any]) -> None:
        """Bounds.late_writes, where on_schedule_end submits promotion ``rec`` (its tier I/O starts writing a
        primary slot): no store copy that reset_cache discarded may still be running. The reset freed that
        copy's slot, and the model's slots are per key where the primary's are reused by any key, so the
        promotion's slot may be the one the late copy still writes (ground truth: the shard states)."""
        for job in w.jobs:
            if (
                job[_J_KIND] == STORE
                and (job[_J_STATE] is _JOB_STALE or job[_J_IGNORED])
                and (COPYING in job[_J_SHARDS] or REPORTED_COPYING in job[_J_SHARDS])
            ):
                raise ModelViolation(
                    "stale_ids_ignored",
                    f"a promotion of keys {list(rec[_T_KEYS])} from tier {rec[_T_TIER]} is submitted while a "
                    f"store job (keys {list(job[_J_KEYS])}) that reset_cache discarded may still write the "
                    "primary slot the reset freed: the promotion may fill that very slot, and the late copy "
                    "overwrite it",
                )

    def _check_step_wait(self, w: _World) -> None:
        """Spec property step_wait_bounded, where a step starts its wait: every copy the step waits for is a
        sync load of this step (ground truth: a load whose request the engine runs in this step), and they
        copy at most the budget's chunks."""
        sync = sync_loads(w.reqs, w.jobs)
        chunks = 0
        for j in self.sync_wait_jobs(w.reqs, w.jobs):
            job = w.jobs[j]
            if COPYING not in job[_J_SHARDS]:
                continue
            if j not in sync:
                state = job[_J_STATE].value
                raise ModelViolation(
                    "step_wait_bounded",
                    f"the step waits, before its forward, for the copy of {KIND_NAMES[job[_J_KIND]]} job "
                    f"(keys {list(job[_J_KEYS])}, {state}), which is not one of its sync loads",
                )
            chunks += len(job[_J_KEYS])
        if chunks > self.sync_budget:
            raise ModelViolation(
                "step_wait_bounded",
                f"the step waits for {chunks} chunks of sync loads, over the budget of {self.sync_budget}",
            )

    def _step_tail(self, w: _World) -> State:
        """The end of a step: poll every worker, update_connector_output with the summed reports, settle."""
        self._report(w)
        self._finish_loads(w)
        if w.engine is _ENGINE_SHUTTING_DOWN:
            return self._compact(w)  # flush_all's empty step: no settle
        unfinished = False
        for r in w.reqs:
            if r[_R_ENG] != E_DONE:
                unfinished = True
                break
        event = settle_event(w.engine, unfinished)
        if event is _ENGINE_EV_SETTLE:
            live = [j for j in w.jobs if j[_J_STATE] in _LIVE]
            pending = self.has_pending_push_work(w.jobs, w.tier)
            if pending and self.settle_effect is _ENGINE_FX_FLUSH_ALL and live:
                # The blocking baseline (#42611): flush_all launches every awaited job and waits for all of
                # them inside this step; the step resumes (unblock) once every flushed copy has finished.
                for job in w.jobs:
                    if job[_J_STATE] in _LIVE:
                        for rank in range(self.W):
                            self._launch(job, rank)
                w.blocked = True
                return self._compact(w)
            w.engine = self.engine_event(w.engine, event, pending)
        elif event is not None:
            w.engine = self.engine_event(w.engine, event, False)
        return self._compact(w)

    def _unblock(self, s: State, _: int) -> State:
        """The step's wait returns. flush_all's (every flushed copy finished): the step polls, commits and
        settles. A sync step's (its sync loads' copies finished): the step runs its forward, from the tokens
        its sync loads hit, launches its stores, then polls, commits and settles."""
        w = _World(s)
        w.blocked = False
        if self.sync_budget and sync_loads(w.reqs, w.jobs):
            reqs = w.reqs
            return self._forward(
                w, [(i, self.total_tokens - r[_R_COMPUTED]) for i, r in enumerate(reqs) if r[_R_ENG] == E_RUN]
            )
        return self._step_tail(w)

    def responsiveness(self, s: State, i: int) -> str | None:
        """Why request ``i`` of ``s`` (it just arrived while the engine drained) cannot be looked up within
        one engine step without any transfer finishing, or None when it can (spec property responsiveness)."""
        if any(True for _ in self._lookup_all(s, i)):
            return None
        if s.blocked and self.sync_budget and sync_loads(s.reqs, s.jobs):
            chunks = self.step_wait_chunks(s)
            return (
                "the request that just arrived is waiting while the engine is blocked in a step that waits for "
                f"its sync loads ({chunks} chunk(s) still copying): no lookup and no step can run until they finish"
            )
        if s.blocked:
            copying = sum(sh == COPYING for job in s.jobs if job.state in _LIVE for sh in job.shards)
            return (
                "the request that just arrived is waiting while the engine is blocked in flush_all "
                "(settle with pending push work), "
                f"waiting for {copying} in-flight cop{'y' if copying == 1 else 'ies'}: no lookup and no step "
                "can run until they finish"
            )
        if s.engine is _ENGINE_IDLE:
            return f"request #{i} arrived but the engine is idle and was not admitted"
        nxt = self.apply(s, ("step",))
        if not isinstance(nxt, State):
            return None  # the step itself breaks something, reported on that edge
        kept = self.last_kept
        j = i if kept is None else (kept[0].index(i) if i in kept[0] else -1)
        if j < 0 or nxt.reqs[j].eng != E_WAIT or any(True for _ in self._lookup_all(nxt, j)):
            return None
        return f"request #{i} arrived while the engine drained and is still not looked up after one engine step"

    def _launch(self, job: list[Any], rank: int) -> None:
        """OffloadingWorker._launch: terminal jobs and ranks that already launched are skipped."""
        if job[_J_STATE] in _TERMINAL_SKIP or job[_J_SHARDS][rank] != UNLAUNCHED:
            return
        mask = _mask(job[_J_SHARDS])
        reported = _reported(job[_J_SHARDS])
        state, effect = self.job_event(job[_J_STATE], reported, job[_J_FAILED], mask, _JOB_EV_LAUNCH, rank)
        job[_J_STATE] = state
        job[_J_SHARDS] = _with(job[_J_SHARDS], rank, COPYING if effect is _JOB_FX_START_COPY else REPORTED)

    def _fences(self, w: _World) -> dict[int, set[int]]:
        """The fence index by GPU group: uncommitted stores of finished requests."""
        fences: dict[int, set[int]] = {}
        for j, job in enumerate(w.jobs):
            if job[_J_KIND] == STORE and job[_J_STATE] in _LIVE and w.reqs[job[_J_REQ]][_R_PHASE] in _FINISHED_PHASES:
                fences.setdefault(job[_J_GROUP], set()).add(j)
        return fences

    def _plan_stores(self, w: _World, i: int, horizon: int, allocated: set[int], flush: set[int]) -> None:
        r = w.reqs[i]
        storable = min(horizon // TOKENS_PER_BLOCK, self.C)
        start = r[_R_NEXT]
        if storable <= start:
            return
        keys = self.prompt_keys[r[_R_PROMPT]][start:storable]
        prepared = self._prepare_store(w, keys)
        if prepared is None:
            return  # allocation failure: retried next step
        r[_R_NEXT] = storable
        if not prepared:
            return
        self._count_job(w)
        j = len(w.jobs)
        g = r[_R_GROUP] if r[_R_GROUP] >= 0 else -1
        if g < 0:
            raise ModelViolation("gpu_source_not_overwritten", f"request {i} plans a store without GPU blocks")
        w.jobs.append([STORE, prepared, i, g, _JOB_SUBMITTED, self.W, 0, (UNLAUNCHED,) * self.W, False, self.W, False])
        if r[_R_PHASE] is _REQ_FINISHED_UNSIGNALLED:
            fences = self._fences(w)
            if j in self.fenced_jobs(allocated & {g}, fences):
                flush.add(j)

    def _report(self, w: _World) -> None:
        """Every worker polls; the scheduler applies the merged reports, one event per reporting rank
        (failures first, then acks; ranks in order)."""
        jobs = w.jobs
        memo = self._memo_polls
        polls: list[tuple[int, tuple[list[int], list[int], tuple[int, ...]]]] = []
        for j, job in enumerate(jobs):
            shards = job[_J_SHARDS]
            poll = memo.get(shards)
            if poll is None:
                poll = memo[shards] = self._poll_shards(shards)
            if poll[0] or poll[1]:
                polls.append((j, poll))
        if not polls:
            return  # no worker reported anything
        if len(polls) > 1:  # the scheduler's order: by kind, then keys (ties keep the job order)
            polls.sort(key=lambda p: (jobs[p[0]][_J_KIND], jobs[p[0]][_J_KEYS]))
        completed: dict[int, list[int]] = {}
        failed: dict[int, list[int]] = {}
        reported: dict[int, int] = {}  # job -> its reported_mask before this poll
        for j, (ok, bad, after) in polls:
            job = jobs[j]
            reported[j] = _reported(job[_J_SHARDS])
            job[_J_SHARDS] = after
            if bad:
                failed[j] = bad
            if ok:
                completed[j] = ok
        # The reporting jobs, those with a failure first (dict.fromkeys([*failed, *completed]), built once).
        reporting = list(failed)
        reporting += [j for j in completed if j not in failed]
        # Validate everything first (update_connector_output raises before it changes anything).
        for j in reporting:
            job = w.jobs[j]
            if job[_J_IGNORED]:
                continue
            keys = list(job[_J_KEYS])
            if job[_J_STATE] is _JOB_TIMED_OUT:
                continue  # a late report of a quarantined job: absorbed by id
            if job[_J_STATE] not in _LIVE:
                if job[_J_STATE] is _JOB_STALE:
                    raise ModelViolation(
                        "stale_ids_ignored",
                        f"a worker reported {KIND_NAMES[job[_J_KIND]]} job (keys {keys}) that reset_cache "
                        "discarded, and its id is not below the stale threshold: the scheduler raises",
                    )
                raise ModelViolation(
                    "complete_exactly_once",
                    f"a worker reported {KIND_NAMES[job[_J_KIND]]} job (keys {keys}) after it was already "
                    f"{job[_J_STATE].value}: the scheduler no longer awaits it",
                )
            total = len(failed.get(j, ())) + len(completed.get(j, ()))
            if total > job[_J_PENDING]:
                raise ModelViolation(
                    "complete_exactly_once", f"job (keys {keys}) got {total} reports with {job[_J_PENDING]} pending"
                )
        for reports, event in ((failed, _JOB_EV_FAIL), (completed, _JOB_EV_ACK)):
            for j, ranks in reports.items():
                job = w.jobs[j]
                mask = _mask(job[_J_SHARDS])
                for rank in ranks:
                    if job[_J_IGNORED] or job[_J_STATE] not in _LIVE:
                        break  # ignored, or finished above by a failure report in the same output
                    state, effect = self.job_event(job[_J_STATE], reported[j], job[_J_FAILED], mask, event, rank)
                    job[_J_STATE] = state
                    reported[j] |= 1 << rank
                    job[_J_PENDING] -= 1
                    if event is _JOB_EV_FAIL:
                        job[_J_FAILED] += 1
                    self._job_finished(w, j, effect)
        for j in reporting:
            job = w.jobs[j]
            if (
                job[_J_STATE] is _JOB_TIMED_OUT
                and not job[_J_IGNORED]
                and _UNREPORTED_COPIES.isdisjoint(job[_J_SHARDS])
            ):
                self._release(w, job)  # the last launched copy reported: release

    def _poll_shards(self, shards: tuple[int, ...]) -> tuple[list[int], list[int], tuple[int, ...]]:
        """One job's shards at a poll of every worker: the ranks whose backend reports done, those that
        report failed, and the shards afterwards. A function of ``shards`` alone (memoized on it in _report)."""
        said = [self.backend_reports(sh) if sh not in (REPORTED, REPORTED_COPYING) else None for sh in shards]
        ok = [r for r, x in enumerate(said) if x is True]
        bad = [r for r, x in enumerate(said) if x is False]
        after = tuple(
            sh if x is None else REPORTED if sh in (DONE_OK, DONE_FAIL) else REPORTED_COPYING
            for sh, x in zip(shards, said, strict=True)
        )
        return ok, bad, after

    def _job_finished(self, w: _World, j: int, effect: JobEffect | None) -> None:
        """OffloadingScheduler._finish: the job's outcome reaches the manager and its request."""
        if effect is None:
            return
        job = w.jobs[j]
        i = job[_J_REQ]
        ok = effect is _JOB_FX_COMMIT
        if job[_J_KIND] == STORE:
            self._complete_store(w, job[_J_KEYS], ok)
        else:
            self._complete_load(w, job[_J_KEYS])
            if w.reqs[i][_R_ENG] == E_RUN:
                # A sync load: its request already ran this step's forward from the loaded tokens. A failed
                # one's blocks were never valid, so that forward is discarded and the request recomputes.
                if not ok:
                    w.reqs[i][_R_COMPUTED] = 0
            elif ok:
                w.reqs[i][_R_COMPUTED] = len(job[_J_KEYS]) * TOKENS_PER_BLOCK
        job[_J_REQ] = -1
        r = w.reqs[i]
        if job[_J_KIND] == LOAD and r[_R_PHASE] is _REQ_LOADING:
            self._fire_req(w, i, _REQ_EV_LOAD_DONE)
        if r[_R_PHASE] is _REQ_FINISHED_SIGNALLED and not _awaits(w.jobs, i):
            self._fire_req(w, i, _REQ_EV_DELETE)

    def _finish_loads(self, w: _World) -> None:
        """ReferenceEngine._finish_loads: loads no longer awaited hand their request back to the engine."""
        reqs = w.reqs
        if not any(r[_R_ENG] == E_LOAD for r in reqs):
            return
        loading = sorted((i for i, r in enumerate(reqs) if r[_R_ENG] == E_LOAD), key=lambda i: reqs[i][_R_POS])
        pos = sum(1 for r in reqs if r[_R_ENG] == E_RUN)
        for i in loading:
            r = reqs[i]
            if any(j[_J_REQ] == i and j[_J_KIND] == LOAD and j[_J_STATE] in _LIVE for j in w.jobs):
                continue
            if r[_R_PHASE] in _FINISHED_PHASES:  # aborted while loading: its blocks are free only now
                r[_R_ENG] = E_DONE
                r[_R_POS] = -1
            else:
                r[_R_ENG] = E_RUN
                r[_R_POS] = pos
                pos += 1

    def _compact(self, w: _World) -> State:
        """Drop records nobody needs any more, renumber positions, and freeze."""
        jobs = w.jobs
        keep_jobs = [
            n for n, j in enumerate(jobs) if j[_J_STATE] in _LIVE or not _UNREPORTED_COPIES.isdisjoint(j[_J_SHARDS])
        ]
        if len(keep_jobs) != len(jobs):
            w.jobs = [jobs[n] for n in keep_jobs]
        reqs = w.reqs
        keep = [i for i, r in enumerate(reqs) if not (r[_R_PHASE] is _REQ_DELETED and r[_R_ENG] == E_DONE)]
        self.last_kept = (keep, keep_jobs)
        if len(keep) != len(reqs):
            remap = {old: new for new, old in enumerate(keep)}
            for j in w.jobs:
                if j[_J_REQ] >= 0:
                    j[_J_REQ] = remap[j[_J_REQ]]
            w.reqs = [reqs[i] for i in keep]
        _renumber(w.reqs, _R_POS, _R_ENG)
        _renumber(w.reqs, _R_FIN, -1)
        return w.freeze()

    # -- finish / abort, reset

    def _finish_request(self, s: State, i: int) -> State:
        w = _World(s)
        r = w.reqs[i]
        self._fire_req(w, i, _REQ_EV_FINISH)
        r[_R_FIN] = max((x[_R_FIN] for x in w.reqs), default=-1) + 1
        if r[_R_ENG] in (E_RUN, E_WAIT):  # the engine frees its blocks; the scheduler still knows them
            r[_R_ENG] = E_DONE
            r[_R_POS] = -1
        return self._compact(w)

    def _reset(self, s: State, _: int) -> State:
        w = _World(s)
        w.resets += 1
        if self.bounds.tiers:  # TieringManager.reset_cache: drain every tier, then poll
            for t in w.tier:
                if t[_T_STATUS] == COPYING or t[_T_STATUS] == EXPIRED:
                    t[_T_STATUS] = DONE_OK
                    if w.held and not t[_T_PROMOTE]:
                        for key in t[_T_KEYS]:
                            w.held[t[_T_TIER]] |= 1 << key
                elif t[_T_STATUS] == RELEASE_DEFERRED:
                    t[_T_STATUS] = RELEASE_DUE  # drained: the poll below hands its slot back
            self._poll(w)
            w.tier = []  # drain_pending_work: every tier's writes and syncs are done; queued promotions dropped
        ignored = self.stale_threshold_after_reset(1, 0) > 0
        for job in w.jobs:
            if job[_J_STATE] is _JOB_TIMED_OUT and not _UNREPORTED_COPIES.isdisjoint(job[_J_SHARDS]):
                job[_J_IGNORED] = ignored  # quarantined: flushed like every other stale job
                w.reset_flush = True
            if job[_J_STATE] in _LIVE:
                mask = _mask(job[_J_SHARDS])
                job[_J_STATE] = self.job_event(
                    job[_J_STATE], _reported(job[_J_SHARDS]), job[_J_FAILED], mask, _JOB_EV_DISCARD, 0
                )[0]
                job[_J_REQ] = -1
                job[_J_IGNORED] = ignored
                w.reset_flush = True
        for i, r in enumerate(w.reqs):
            r[_R_NEXT] = 0
            if r[_R_PHASE] in (
                _REQ_FINISHED_UNSIGNALLED,
                _REQ_FINISHED_SIGNALLED,
                _REQ_LOADING,
            ):
                self._fire_req(w, i, _REQ_EV_RESET)
            r[_R_FIN] = -1
        for key, code in enumerate(w.slots):
            if code != ABSENT:
                w.slots[key] = self.slot_event(code, _SLOT_EV_RESET)
        w.lru = []
        if self.bounds.tiers:
            w.polled = False
        return self._compact(w)

    # ------------------------------------------------------------------ invariants

    def invariants(self, s: State) -> list[tuple[str, str]]:
        """Every spec invariant that ``s`` breaks, as (invariant name, detail)."""
        # No invariant reads the counters (arrivals, resets, preemptions, expiries): memoized without them.
        key = _without_counters(s)
        # One hash of the key, hit or miss (as in _memo): on a miss, ``fresh`` is inserted and filled in.
        fresh: list[tuple[str, str]] = []
        out = self._memo_invariants.setdefault(key, fresh)
        if out is fresh:
            try:
                fresh += self._invariants(s)
            except BaseException:
                del self._memo_invariants[key]
                raise
        return list(out)

    def _invariants(self, s: State) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        live = [j for j in s.jobs if j.state in _LIVE]
        tier = s.tier
        # Ground truth from the model's own shard and tier states, against what the engine is told (the
        # implementation's has_pending_push_work() over the scheduler's and the manager's bookkeeping).
        # After a bounded shutdown gave up, what is left is abandoned, not pending (spec: "Bounded shutdown").
        remains = None if s.abandoned else self.transfer_remains(s)
        if remains is not None and not self.has_pending_push_work(s.jobs, tier, s.abandoned):
            out.append(("pending_work_covers_jobs", f"{remains} but has_pending_push_work() is False"))
        if s.engine is _ENGINE_STOPPED:
            if live:
                out.append(("idle_only_when_nothing_pending", f"stopped with {len(live)} awaited job(s)"))
            pinned = [k for k, code in enumerate(s.slots) if code not in (ABSENT, READY)]
            if pinned or tier:
                out.append(("idle_only_when_nothing_pending", f"stopped with keys {pinned} pinned or reserved"))
        if s.engine is _ENGINE_IDLE:
            if remains is not None:
                out.append(("idle_only_when_nothing_pending", f"the engine is idle while {remains}"))
            elif any(sh in _UNREPORTED_COPIES for j in s.jobs for sh in j.shards):
                out.append(("idle_only_when_nothing_pending", "the engine is idle while a discarded job's copy runs"))
        stale_busy = False
        fresh_busy = False
        for job in s.jobs:
            busy = not _BUSY.isdisjoint(job.shards)
            copying = COPYING in job.shards or REPORTED_COPYING in job.shards
            if job.state is _JOB_STALE or job.ignored:
                stale_busy = stale_busy or copying
            else:
                fresh_busy = fresh_busy or copying
            if job.kind == STORE:
                for key in job.keys:
                    if busy and s.slots[key] >= READY:
                        out.append(
                            (
                                "readable_only_after_commit",
                                f"key {key} is {slot_state(s.slots[key]).value} while a store still writes it",
                            )
                        )
                    elif job.state in _LIVE and s.slots[key] != WRITING:
                        out.append(
                            (
                                "readable_only_after_commit",
                                f"key {key} of an uncommitted store is {slot_state(s.slots[key]).value}",
                            )
                        )
            elif job.state is not _JOB_STALE and busy:
                for key in job.keys:
                    if s.slots[key] < 1:
                        out.append(
                            (
                                "evict_only_ready_unreferenced",
                                f"key {key} is {slot_state(s.slots[key]).value} while a load still reads it",
                            )
                        )
        # Every cascade whose tier I/O still runs holds one reader of each of its keys (ground truth: the
        # I/O state, whatever the manager was told), on top of the busy loads'.
        readers: dict[int, int] = {}
        for rec in tier:
            if rec.promote:
                for key in rec.keys:
                    if s.slots[key] != WRITING:
                        out.append(
                            (
                                "readable_only_after_commit",
                                f"key {key} is {slot_state(s.slots[key]).value} while its promotion from tier "
                                f"{rec.tier} is {SHARD_NAMES[rec.status]}",
                            )
                        )
                    if s.held and not s.held[rec.tier] >> key & 1:
                        out.append(
                            (
                                "readable_only_after_commit",
                                f"key {key} is promoted from tier {rec.tier}, which holds no copy of it",
                            )
                        )
            elif rec.status == COPYING:
                for key in rec.keys:
                    readers[key] = readers.get(key, 0) + 1
        if readers:
            for job in s.jobs:
                if job.kind == LOAD and job.state is not _JOB_STALE and not _BUSY.isdisjoint(job.shards):
                    for key in job.keys:
                        readers[key] = readers.get(key, 0) + 1
            for key, n in readers.items():
                if s.slots[key] < n:
                    out.append(
                        (
                            "evict_only_ready_unreferenced",
                            f"key {key} is {slot_state(s.slots[key]).value}"
                            + (f"({s.slots[key]})" if s.slots[key] > 0 else "")
                            + f" while {n} transfer(s) still read it",
                        )
                    )
        if stale_busy and fresh_busy:
            out.append(
                (
                    "stale_ids_ignored",
                    "a transfer discarded by reset_cache is still copying while a post-reset one runs "
                    "(the reset's flush did not happen first)",
                )
            )
        for i in range(len(s.reqs)) if len(live) > 1 else ():  # it takes two awaited jobs to break it
            mine = [j for j in live if j.req == i]
            loads = sum(1 for j in mine if j.kind == LOAD)
            if loads > 1 or (loads and len(mine) > loads):
                out.append(("one_load_per_request", f"request {i} has {loads} load(s) among {len(mine)} jobs"))
        seen: set[int] = set()
        for job in live:
            if job.kind == LOAD:
                if seen.intersection(job.keys):
                    out.append(("single_loader_per_chunk", f"keys {sorted(seen.intersection(job.keys))} loaded twice"))
                seen.update(job.keys)
            if not 1 <= job.pending <= self.W:
                out.append(("complete_exactly_once", f"an awaited job has pending={job.pending}"))
        for job in s.jobs:  # a commit is attributed: every one of the W ranks launched and reported first
            if job.state is _JOB_COMPLETE and any(sh != REPORTED for sh in job.shards):
                shards = ", ".join(f"rank {r} {SHARD_NAMES[sh]}" for r, sh in enumerate(job.shards))
                out.append(("complete_exactly_once", f"a {KIND_NAMES[job.kind]} job committed with {shards}"))
        return out

    # ------------------------------------------------------------------ symmetry

    def canonical(self, s: State) -> State:
        # Memoized on the state without its counters, which the representative keeps as they are (see
        # _memo): states that differ only in them are renumbered once.
        key = _without_counters(s)
        c = self._memo_canonical.get(key)
        if c is None:
            c = self._memo_canonical[key] = self.canonical_with_maps(s).state
            return c
        if (
            c[_S_ARRIVALS] == s[_S_ARRIVALS]
            and c[_S_RESETS] == s[_S_RESETS]
            and c[_S_PREEMPTIONS] == s[_S_PREEMPTIONS]
            and c[_S_EXPIRIES] == s[_S_EXPIRIES]
        ):
            return c
        return _with_counters(c, s[_S_ARRIVALS], s[_S_RESETS], s[_S_PREEMPTIONS], s[_S_EXPIRIES])

    def canonical_with_maps(self, s: State) -> Canonical:
        """The representative of ``s``, and how its indices map back to those of ``s``.

        Requests are ordered by their content (ties keep their order), GPU groups renumbered by first
        appearance, worker ranks ordered by their columns of shard states (workers are interchangeable:
        every rank runs the same protocol and reports are summed), jobs and tier transfers sorted.
        """
        reqs = s.reqs
        nr = len(reqs)
        if nr == 2:  # the common case, without sorting
            rorder = [1, 0] if _req_sort_key(reqs[1]) < _req_sort_key(reqs[0]) else [0, 1]
        else:
            rorder = sorted(range(nr), key=lambda i: _req_sort_key(reqs[i])) if nr > 1 else list(range(nr))
        rmap = {old: new for new, old in enumerate(rorder)}
        rmap[-1] = -1
        gmap: dict[int, int] = {}
        for old in rorder:
            g = reqs[old][_R_GROUP]
            if g >= 0 and g not in gmap:
                gmap[g] = len(gmap)
        jobs = s.jobs
        W = self.W
        if W > 1 and len(jobs) == 1:
            # One job: the ranks ordered by their shard (what the general case below computes, cheaper).
            wperm = _order(list(jobs[0][_J_SHARDS]))
        elif W > 1 and jobs:
            # Order the jobs without looking at which rank holds which shard, then the ranks by their
            # column of shards in that order.
            pre = _order(
                [
                    (
                        job[:2],
                        rmap[job[_J_REQ]],
                        gmap.get(job[_J_GROUP], _FREE_GROUP),
                        job[4:7],
                        sorted(job[_J_SHARDS]),
                        job[_J_IGNORED],
                        job[_J_EXPIRED],
                    )
                    for job in jobs
                ]
            )
            wperm = _order([tuple([jobs[j][_J_SHARDS][w] for j in pre]) for w in range(W)])
        else:
            wperm = list(range(W))
        swap = not _is_identity(wperm)
        keyed = []
        for n, job in enumerate(jobs):
            shards = tuple([job[_J_SHARDS][w] for w in wperm]) if swap else job[_J_SHARDS]
            # (kind, keys, req, group, state, pending, failed_reports, shards, ignored, expired, n), built
            # whole rather than from slices
            keyed.append(
                (
                    job[_J_KIND],
                    job[_J_KEYS],
                    rmap[job[_J_REQ]],
                    gmap.get(job[_J_GROUP], _FREE_GROUP),
                    job[_J_STATE],
                    job[_J_PENDING],
                    job[_J_FAILED],
                    shards,
                    job[_J_IGNORED],
                    job[_J_EXPIRED],
                    n,
                )
            )
        keyed.sort()
        jorder = [k[-1] for k in keyed]
        for k in keyed:
            g = jobs[k[-1]][_J_GROUP]
            if g not in gmap:
                gmap[g] = len(gmap)
        tier = s.tier
        torder = sorted(range(len(tier)), key=tier.__getitem__) if len(tier) > 1 else list(range(len(tier)))
        # (gmap numbers the groups in the order it met them: it is the identity iff its keys are 0, 1, ...)
        if not swap and _is_identity(rorder) and _is_identity(jorder) and _is_identity(torder) and _is_identity(gmap):
            return _new(_CANONICAL_CLASS, (s, rorder, jorder, gmap, torder, wperm))  # s is its own representative
        new_reqs = []
        for i in rorder:
            r = reqs[i]
            g = r[_R_GROUP]
            if g < 0 or gmap[g] == g:
                new_reqs.append(r)
            else:
                new_reqs.append(_new(_REQ_CLASS, (r[0], r[1], r[2], r[3], r[4], gmap[g], r[6], r[7], r[8])))
        new_jobs = []
        for k in keyed:
            job = jobs[k[-1]]
            g = gmap[job[_J_GROUP]]
            if k[2] == job[_J_REQ] and g == job[_J_GROUP] and k[7] is job[_J_SHARDS]:
                new_jobs.append(job)
            else:
                new_jobs.append(
                    _new(
                        _JOB_CLASS,
                        (job[0], job[1], k[2], g, k[4], k[5], k[6], k[7], k[8], job[_J_WORLD], job[_J_EXPIRED]),
                    )
                )
        state = _with_records(s, tuple(new_reqs), tuple(new_jobs), tuple([tier[c] for c in torder]))
        return _new(_CANONICAL_CLASS, (state, rorder, jorder, gmap, torder, wperm))


def _order(keys: list[Any]) -> list[int]:
    """The positions of ``keys`` in the order of their values, ties keeping their order: what
    ``sorted(range(len(keys)), key=keys.__getitem__)`` returns, with the two-element case (the most
    common one: two workers, two jobs) answered by one comparison."""
    if len(keys) == 2:
        return [1, 0] if keys[1] < keys[0] else [0, 1]
    return sorted(range(len(keys)), key=keys.__getitem__)


def _is_identity(order: Iterable[int]) -> bool:
    """Whether ``order`` is 0, 1, 2, ... (a list of positions, or a dict's keys in insertion order)."""
    return all(k == n for n, k in enumerate(order))


class Canonical(NamedTuple):
    """A canonical state and, for each of its positions, the index it had in the original state."""

    state: State
    reqs: list[int]  #: new request position -> old index
    jobs: list[int]  #: new job position -> old index
    groups: dict[int, int]  #: old group -> new group
    tier: list[int]  #: new tier position -> old index
    workers: list[int]  #: new rank -> old rank


_FREE_GROUP: Final = 1 << 20
# The events that Model._memo memoizes.
_STEP: Final = 0
_RESET: Final = 1
_SHUTDOWN: Final = 2
#: Builds a record or a State from a tuple or list of its fields, at C level (NamedTuple's own __new__ is a
#: Python function that takes each field as an argument).
_new: Final = tuple.__new__
# The record classes as Final names, for _new: the compiled build keeps them in C statics (a class name would
# be a module-global lookup on every record built).
_STATE_CLASS: Final = State
_REQ_CLASS: Final = Req
_JOB_CLASS: Final = JobRec
_TIER_CLASS: Final = TierRec
_CANONICAL_CLASS: Final = Canonical
_MISSING: Final[Any] = object()
_T = TypeVar("_T")


def _shift(r: State | ModelViolation | None, was: State, s: State) -> State | ModelViolation | None:
    """``r``, the result of an event on ``was``, moved onto ``s`` (``was`` but for its counters): each
    counter (:data:`_COUNTER_FIELDS`) shifted by as much."""
    if type(r) is not State or was is s:
        return r
    arrivals = s[_S_ARRIVALS] - was[_S_ARRIVALS]
    resets = s[_S_RESETS] - was[_S_RESETS]
    preemptions = s[_S_PREEMPTIONS] - was[_S_PREEMPTIONS]
    expiries = s[_S_EXPIRIES] - was[_S_EXPIRIES]
    if not (arrivals or resets or preemptions or expiries):
        return r
    return _with_counters(
        r,
        r[_S_ARRIVALS] + arrivals,
        r[_S_RESETS] + resets,
        r[_S_PREEMPTIONS] + preemptions,
        r[_S_EXPIRIES] + expiries,
    )


def _with_records(s: State, reqs: tuple[Req, ...], jobs: tuple[JobRec, ...], tier: tuple[TierRec, ...]) -> State:
    """``s`` with these requests, jobs and tier transfers, the rest of it as it is: one tuple, built whole
    (every field written out, so that the compiled build makes it at once rather than from slices)."""
    return _new(
        _STATE_CLASS,
        (s[0], reqs, jobs, s[3], s[4], tier, s[6], s[7], s[8], s[9], s[10], s[11], s[12], s[13], s[14], s[15]),
    )


def _with_counters(s: State, arrivals: int, resets: int, preemptions: int, expiries: int) -> State:
    """``s`` with these counters (:data:`_COUNTER_FIELDS`), the rest of it as it is: one tuple, built whole."""
    return _new(
        _STATE_CLASS,
        (
            s[0],
            s[1],
            s[2],
            s[3],
            s[4],
            s[5],
            s[6],
            s[7],
            arrivals,
            resets,
            preemptions,
            s[11],
            s[12],
            s[13],
            expiries,
            s[15],
        ),
    )


_TERMINAL_SKIP: Final = (
    _JOB_COMPLETE,
    _JOB_FAILED,
    _JOB_CANCELLED,
    _JOB_STALE,
    _JOB_TIMED_OUT,
)


def _req_sort_key(r: Req) -> tuple[Any, ...]:
    return (r.phase, r.eng, r.prompt, r.computed, r.next_chunk, r.group >= 0, r.pos, r.fin_pos, r.alloc)


def sync_loads(reqs: Sequence[Sequence[Any]], jobs: Sequence[Sequence[Any]]) -> list[int]:
    """The sync loads (Bounds.sync_load_budget): the awaited load jobs whose request the engine already runs
    (an asynchronous load's request waits in ``loading`` until its load is reported)."""
    return [
        j
        for j, job in enumerate(jobs)
        if job[_J_KIND] == LOAD
        and (job[_J_STATE] is _JOB_SUBMITTED or job[_J_STATE] is _JOB_IN_FLIGHT)
        and job[_J_REQ] >= 0
        and reqs[job[_J_REQ]][_R_ENG] == E_RUN
    ]


def _awaits(jobs: Sequence[Sequence[Any]], i: int) -> bool:
    """Whether the scheduler awaits a job of request ``i`` (a loop: this is asked on every hot path)."""
    for j in jobs:  # noqa: SIM110 (a loop, not any() over a generator: no generator object per call)
        if j[_J_REQ] == i and (j[_J_STATE] is _JOB_SUBMITTED or j[_J_STATE] is _JOB_IN_FLIGHT):
            return True
    return False


def _with(items: tuple[_T, ...], i: int, value: _T) -> tuple[_T, ...]:
    """``items`` with item ``i`` replaced by ``value`` (the one- and two-item cases, the common ones, without
    slicing)."""
    n = len(items)
    if n == 1:
        return (value,)
    if n == 2:
        return (value, items[1]) if i == 0 else (items[0], value)
    return (*items[:i], value, *items[i + 1 :])


def _renumber(reqs: list[list[Any]], field: int, klass: int) -> None:
    """Compact a position field to 0..n-1 per class (the value of field ``klass``; -1: one class), keeping
    the order."""
    if len(reqs) < 2:
        for r in reqs:
            if r[field] > 0:
                r[field] = 0
        return
    if len(reqs) == 2:  # the common case, without the general one's grouping and sorting
        a, b = reqs
        fa, fb = a[field], b[field]
        if fa >= 0 and fb >= 0 and (klass < 0 or a[klass] == b[klass]):
            a[field], b[field] = (0, 1) if fa <= fb else (1, 0)
        else:
            if fa > 0:
                a[field] = 0
            if fb > 0:
                b[field] = 0
        return
    groups: dict[int, list[list[Any]]] = {}
    for r in reqs:
        if r[field] >= 0:
            groups.setdefault(r[klass] if klass >= 0 else 0, []).append(r)
    for members in groups.values():
        members.sort(key=lambda r: r[field])
        for n, r in enumerate(members):
            r[field] = n
