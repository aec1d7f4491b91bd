"""States and events of the four spec machines, as Enums.

These mirror spec/*.toml exactly; ``SpecMachine`` refuses to start if they drift, and
tests/test_spec_conformance.py checks both directions.
"""

from __future__ import annotations

from enum import StrEnum

__all__ = [
    "EngineEvent",
    "EngineState",
    "JobEvent",
    "JobKind",
    "JobState",
    "RequestEvent",
    "RequestState",
    "SlotEvent",
    "SlotState",
]


class JobKind(StrEnum):
    STORE = "store"  #: GPU -> CPU primary
    LOAD = "load"  #: CPU primary -> GPU
    CASCADE = "cascade"  #: CPU primary -> secondary tier
    PROMOTE = "promote"  #: secondary tier -> CPU primary


class JobState(StrEnum):
    SUBMITTED = "submitted"
    IN_FLIGHT = "in_flight"
    COMPLETE = "complete"
    FAILED = "failed"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    STALE = "stale"


class JobEvent(StrEnum):
    LAUNCH = "launch"
    ACK = "ack"
    FAIL = "fail"
    CANCEL = "cancel"
    DISCARD = "discard"
    TIME_OUT = "time_out"


class SlotState(StrEnum):
    ABSENT = "absent"
    WRITING = "writing"
    READY = "ready"
    READING = "reading"


class SlotEvent(StrEnum):
    BEGIN_WRITE = "begin_write"
    COMMIT_WRITE = "commit_write"
    ABORT_WRITE = "abort_write"
    BEGIN_READ = "begin_read"
    END_READ = "end_read"
    EVICT = "evict"
    RESET = "reset"


class RequestState(StrEnum):
    TRACKED = "tracked"
    DEFERRED = "deferred"
    LOADING = "loading"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_UNSIGNALLED = "finished_unsignalled"
    FINISHED_SIGNALLED = "finished_signalled"
    DELETED = "deleted"


class RequestEvent(StrEnum):
    DEFER = "defer"
    START_LOAD = "start_load"
    SCHEDULE = "schedule"
    LOAD_DONE = "load_done"
    PREEMPT = "preempt"
    FINISH = "finish"
    SIGNAL = "signal"
    DELETE = "delete"
    RESET = "reset"


class EngineState(StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    FINISHING = "finishing"
    DRAINING = "draining"
    SHUTTING_DOWN = "shutting_down"
    STOPPED = "stopped"


class EngineEvent(StrEnum):
    ADMIT = "admit"
    ALL_FINISHED = "all_finished"
    SETTLE = "settle"
    SHUTDOWN = "shutdown"
    STOP = "stop"


JOB_TERMINAL: frozenset[JobState] = frozenset(
    {JobState.COMPLETE, JobState.FAILED, JobState.CANCELLED, JobState.TIMED_OUT, JobState.STALE}
)
