"""States, events and effects of the four spec machines, as Enums.

These mirror spec/*.toml exactly (``states``, ``[[transitions]].event`` and ``[effects]``);
``SpecMachine`` refuses to start if they drift, and tests/test_spec_conformance.py checks both
directions. What each state means, and why, is in ``spec/README.md``.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "JOB_TERMINAL",
    "EngineEffect",
    "EngineEvent",
    "EngineState",
    "JobEffect",
    "JobEvent",
    "JobKind",
    "JobState",
    "RequestEffect",
    "RequestEvent",
    "RequestState",
    "SlotEffect",
    "SlotEvent",
    "SlotState",
]


class JobKind(StrEnum):
    """The four kinds of transfer job (spec/job.toml); each names the direction of its copy."""

    STORE = "store"  #: GPU -> CPU primary
    LOAD = "load"  #: CPU primary -> GPU
    CASCADE = "cascade"  #: CPU primary -> secondary tier
    PROMOTE = "promote"  #: secondary tier -> CPU primary


class JobState(StrEnum):
    """The states of a transfer job (spec/job.toml ``states``); five of them are terminal."""

    #: Planned and emitted in the step's metadata; no worker has launched its shard yet.
    SUBMITTED = "submitted"
    #: At least one worker launched; reports are still outstanding.
    IN_FLIGHT = "in_flight"
    #: Every worker acknowledged: committed exactly once (terminal).
    COMPLETE = "complete"
    #: A worker failed (or a tier refused the job) and every worker has reported (terminal).
    FAILED = "failed"
    #: Rolled back before any worker launched (terminal).
    CANCELLED = "cancelled"
    #: Its deadline passed; late reports are ignored by id (terminal).
    TIMED_OUT = "timed_out"
    #: Discarded by reset_cache; no effect, late reports ignored (terminal).
    STALE = "stale"


class JobEvent(StrEnum):
    """The events a job machine accepts (spec/job.toml ``[[transitions]]``)."""

    LAUNCH = "launch"
    ACK = "ack"
    FAIL = "fail"
    CANCEL = "cancel"
    DISCARD = "discard"
    TIME_OUT = "time_out"


class JobEffect(StrEnum):
    """What the receiver of a job transition must do (spec/job.toml ``[effects]``)."""

    START_COPY = "start_copy"  #: the launching worker starts its shard of the copy
    COMMIT = "commit"  #: the manager completes the job (complete_store / _load / _write / _read)
    RELEASE = "release"  #: the manager rolls the job back (frees, unpins, invalidates; quarantine)


class SlotState(StrEnum):
    """The states of one key's slot in a tier (spec/slot.toml); vLLM's ref count is a view of it."""

    #: The tier does not hold the key (the slot does not exist).
    ABSENT = "absent"
    #: A store or promotion is filling it (ref -1); lookups answer HIT_PENDING.
    WRITING = "writing"
    #: Readable and evictable (ref 0).
    READY = "ready"
    #: Pinned by n >= 1 loads or cascades (ref n); not evictable.
    READING = "reading"


class SlotEvent(StrEnum):
    """The events a slot machine accepts (spec/slot.toml ``[[transitions]]``)."""

    BEGIN_WRITE = "begin_write"
    COMMIT_WRITE = "commit_write"
    ABORT_WRITE = "abort_write"
    BEGIN_READ = "begin_read"
    END_READ = "end_read"
    EVICT = "evict"
    RESET = "reset"


class SlotEffect(StrEnum):
    """What the tier must do after a slot transition (spec/slot.toml ``[effects]``)."""

    EMIT_STORED = "emit_stored"  #: emit a stored event for the key
    EMIT_REMOVED = "emit_removed"  #: emit a removed event for the key


class RequestState(StrEnum):
    """The connector's view of a request (spec/request.toml), from its first lookup to its deletion."""

    #: Known to the connector, not yet scheduled.
    TRACKED = "tracked"
    #: Its lookup is waiting on chunks that are not readable yet (HIT_PENDING / RETRY).
    DEFERRED = "deferred"
    #: A load job is bringing its offloaded prefix back to the GPU.
    LOADING = "loading"
    #: Scheduled by the engine; its stores are planned step by step.
    RUNNING = "running"
    #: The engine preempted it; its GPU blocks are gone.
    PREEMPTED = "preempted"
    #: Finished; its last stores are planned at the next step, the manager not told yet.
    FINISHED_UNSIGNALLED = "finished_unsignalled"
    #: Finished and the manager told (on_request_finished); waiting for its jobs to end.
    FINISHED_SIGNALLED = "finished_signalled"
    #: Forgotten: no job of it remains (terminal).
    DELETED = "deleted"


class RequestEvent(StrEnum):
    """The events a request machine accepts (spec/request.toml ``[[transitions]]``)."""

    DEFER = "defer"
    START_LOAD = "start_load"
    SCHEDULE = "schedule"
    LOAD_DONE = "load_done"
    PREEMPT = "preempt"
    FINISH = "finish"
    SIGNAL = "signal"
    DELETE = "delete"
    RESET = "reset"


class RequestEffect(StrEnum):
    """What the connector must do after a request transition (spec/request.toml ``[effects]``)."""

    SIGNAL_MANAGER = "signal_manager"  #: call the manager's on_request_finished, exactly once


class EngineState(StrEnum):
    """The engine loop's states (spec/engine.toml): busy, draining push work, idle, shut down."""

    #: No request and no pending push work: the loop may sleep.
    IDLE = "idle"
    #: Requests are running.
    RUNNING = "running"
    #: Every request finished; the finishing step plans their last stores.
    FINISHING = "finishing"
    #: No request left, push work (jobs or manager work) still pending: keep stepping.
    DRAINING = "draining"
    #: Shutdown requested: transfers are flushed, bounded by the shutdown timeout.
    SHUTTING_DOWN = "shutting_down"
    #: Shut down (terminal).
    STOPPED = "stopped"


class EngineEvent(StrEnum):
    """The events the engine machine accepts (spec/engine.toml ``[[transitions]]``)."""

    ADMIT = "admit"
    ALL_FINISHED = "all_finished"
    SETTLE = "settle"
    SHUTDOWN = "shutdown"
    STOP = "stop"


class EngineEffect(StrEnum):
    """What the engine loop must do after an engine transition (spec/engine.toml ``[effects]``)."""

    FLUSH_ALL = "flush_all"  #: wait (bounded) for every transfer to finish; shutdown only


#: The job states no transition leaves.
JOB_TERMINAL: frozenset[JobState] = frozenset(
    {JobState.COMPLETE, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT, JobState.STALE}
)
