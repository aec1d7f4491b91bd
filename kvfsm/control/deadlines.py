"""Deadlines for every waiting state, an expiry queue, and bounded calls for shutdown.

Time always comes from an injected clock (a callable returning seconds), so the control plane stays
sans-IO and tests advance time by hand instead of sleeping. See spec/README.md, "Failures, deadlines and
shutdown".
"""

from __future__ import annotations

import functools
import heapq
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable, Container, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum

from kvfsm.errors import ConfigError
from kvfsm.machines.names import JobKind

__all__ = [
    "Clock",
    "DeadlineQueue",
    "Deadlines",
    "ManualClock",
    "ShutdownReport",
    "ShutdownTimeout",
    "accepts_timeout",
    "resolve_shutdown_timeout",
    "run_bounded",
    "run_bounded_all",
    "with_timeout",
]

# Enum members read through their class cost a descriptor call each (Python 3.11).
_STORE, _LOAD, _CASCADE = JobKind.STORE, JobKind.LOAD, JobKind.CASCADE

logger = logging.getLogger(__name__)

#: Seconds on a monotonic scale; ``time.monotonic`` in production, a :class:`ManualClock` in tests.
Clock = Callable[[], float]


@dataclass(frozen=True, slots=True)
class Deadlines:
    """How long each waiting state may last, in seconds; None means no deadline for that state.

    The defaults bound every waiting state (spec/README.md, "Deadlines", says why each value): a job of
    each kind from its submission to its terminal outcome (and with it every slot the job pins or
    reserves), a request's wait on a chunk that is not readable yet, and the engine's shutdown. vLLM has
    none of these (its ``HIT_PENDING`` waits forever, #49829, and its shutdown synchronises without a
    bound). :meth:`none` is the explicit opt-out, :meth:`uniform` one value for every state.
    """

    #: GPU -> CPU store job, seconds from submission (default 30). A copy runs at PCIe speed, so even a
    #: 1 GB job takes well under a second: 30 s fires only on a wedged copy. vLLM: no equivalent.
    store_s: float | None = 30.0
    #: CPU -> GPU load job, seconds (default 30). The request waits in ``loading`` meanwhile; on time-out
    #: its blocks are recomputed. vLLM: no equivalent (a load is awaited forever).
    load_s: float | None = 30.0
    #: CPU -> secondary tier (disk) cascade, seconds (default 60: a disk under contention writes far
    #: slower than PCIe; a time-out only unpins the CPU copy, which stays valid). vLLM: no equivalent.
    cascade_s: float | None = 60.0
    #: Secondary tier -> CPU promotion, seconds (default 30; a time-out frees the slot, the request
    #: computes the chunk). vLLM: no equivalent.
    promote_s: float | None = 30.0
    #: How long one request may keep waiting on a chunk that answers HIT_PENDING or RETRY (or that another
    #: request is loading) before its lookup treats the chunk as a miss and computes it, seconds
    #: (default 5: recomputing even a 32k-token prefill takes a few seconds on one GPU, so a longer wait
    #: costs more time to first token than it saves). vLLM: none, ``HIT_PENDING`` waits forever (#49829).
    lookup_wait_s: float | None = 5.0
    #: The engine's ``shutdown()`` when no timeout is passed, seconds (default 20: inside Kubernetes'
    #: default 30 s termination grace period, with room for the process to exit). ``shutdown(None)``
    #: waits for everything. vLLM: none (its shutdown synchronises without a bound).
    shutdown_s: float | None = 20.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
                raise ConfigError(f"deadline {f.name}={value!r}; expected a finite number of seconds > 0, or None")

    @classmethod
    def uniform(cls, seconds: float) -> Deadlines:
        """The same deadline for every waiting state (shutdown included)."""
        return cls(seconds, seconds, seconds, seconds, seconds, seconds)

    @classmethod
    def none(cls) -> Deadlines:
        """No deadline at all: every wait lasts as long as it takes (the explicit opt-out of the defaults)."""
        return cls(None, None, None, None, None, None)

    def for_kind(self, kind: JobKind) -> float | None:
        if kind is _STORE:  # once per job planned
            return self.store_s
        if kind is _LOAD:
            return self.load_s
        if kind is _CASCADE:
            return self.cascade_s
        return self.promote_s

    @property
    def any_job_deadline(self) -> bool:
        return any(v is not None for v in (self.store_s, self.load_s, self.cascade_s, self.promote_s))


class ManualClock:
    """A clock that moves only when told to: ``clock()`` reads it, ``advance(s)`` moves it forward."""

    __slots__ = ("_lock", "_now")

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._lock = threading.Lock()

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> float:
        if not seconds >= 0:
            raise ConfigError(f"cannot move a clock by {seconds!r} seconds; expected >= 0")
        with self._lock:
            self._now += seconds
            return self._now


class DeadlineQueue:
    """A min-heap of ``(deadline, id)``. Removal is lazy: callers ignore ids that are no longer live.

    ``push`` and ``pop_expired`` cost O(log n); :meth:`compact` drops dead entries when the heap has grown
    well past the number of live ids.
    """

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[float, int]] = []

    def __len__(self) -> int:
        return len(self._heap)

    def push(self, item: int, deadline: float) -> None:
        heapq.heappush(self._heap, (deadline, item))

    def next_deadline(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def pop_expired(self, now: float) -> list[int]:
        """Every id whose deadline is at or before ``now``, earliest first."""
        heap = self._heap
        out: list[int] = []
        while heap and heap[0][0] <= now:
            out.append(heapq.heappop(heap)[1])
        return out

    def compact(self, live: Container[int], live_count: int) -> None:
        """Drop entries of ids not in ``live`` once the heap holds more than twice ``live_count`` (+64)."""
        if len(self._heap) > 2 * live_count + 64:
            self._heap = [e for e in self._heap if e[1] in live]
            heapq.heapify(self._heap)

    def clear(self) -> None:
        self._heap.clear()


class ShutdownTimeout(Enum):
    """The default of ``shutdown(timeout=...)``: take the bound from the scheduler's
    :attr:`Deadlines.shutdown_s` (a number passed instead bounds it; None waits for everything)."""

    FROM_DEADLINES = "from_deadlines"


def resolve_shutdown_timeout(timeout: float | ShutdownTimeout | None, deadlines: Deadlines) -> float | None:
    """The seconds a shutdown may take: ``timeout`` itself, or ``deadlines.shutdown_s`` for the default."""
    if isinstance(timeout, ShutdownTimeout):
        return deadlines.shutdown_s
    if timeout is not None and not timeout >= 0:  # also refuses NaN
        raise ConfigError(f"shutdown timeout={timeout!r}; expected seconds >= 0, or None to wait for everything")
    return timeout


@dataclass(slots=True)
class ShutdownReport:
    """What a shutdown did and what it gave up on. ``clean`` is True when nothing had to be given up."""

    elapsed_s: float = 0.0
    #: The bound it ran under, seconds (None: it waited for everything).
    timeout_s: float | None = None
    deadline_hit: bool = False
    #: GPU store/load jobs no worker had launched, cancelled (their slots freed, nothing written).
    jobs_cancelled: int = 0
    #: GPU store/load jobs still copying at the deadline, timed out (their memory quarantined).
    jobs_timed_out: int = 0
    #: Cascades and promotions between the CPU primary and a secondary tier given up on at the deadline:
    #: a cascade given up on never reached its tier (the CPU copy was still valid until the stop).
    transfers_timed_out: int = 0
    #: Timed-out jobs whose copies never reported; their memory was released at the stop anyway.
    quarantine_abandoned: int = 0
    #: Names of components whose shutdown did not return within the time left (their daemon threads
    #: were left behind).
    abandoned: list[str] = field(default_factory=list)
    already_stopped: bool = False

    @property
    def clean(self) -> bool:
        return not (
            self.deadline_hit
            or self.jobs_cancelled
            or self.jobs_timed_out
            or self.transfers_timed_out
            or self.quarantine_abandoned
            or self.abandoned
        )


def run_bounded(fn: Callable[[], object], timeout: float | None, name: str) -> bool:
    """Run ``fn`` on a daemon thread and wait at most ``timeout`` seconds (None: no bound).

    Returns True if ``fn`` returned (or raised: the error is logged, not re-raised, because a shutdown
    must go on with the next component); False if it was still running, in which case its thread is left
    behind as a daemon thread and cannot keep the process alive.
    """
    done = threading.Event()

    def target() -> None:
        try:
            fn()
        except BaseException:
            logger.exception("%s: shutdown raised", name)
        finally:
            done.set()

    thread = threading.Thread(target=target, name=f"kvfsm-shutdown-{name}", daemon=True)
    thread.start()
    finished = done.wait(None if timeout is None else max(0.0, timeout))
    if not finished:
        logger.warning("%s: shutdown did not return within %.3f s; leaving its thread behind", name, timeout)
    return finished


def run_bounded_all(calls: Sequence[tuple[str, Callable[[], object]]], timeout: float) -> list[str]:
    """Run every call at once, each on its own daemon thread, and wait at most ``timeout`` seconds in all.

    Returns the names of the calls still running then (left behind, like :func:`run_bounded`'s).
    """
    events: list[tuple[str, threading.Event]] = []
    for name, fn in calls:
        done = threading.Event()

        def target(fn: Callable[[], object] = fn, done: threading.Event = done, name: str = name) -> None:
            try:
                fn()
            except BaseException:
                logger.exception("%s: shutdown raised", name)
            finally:
                done.set()

        threading.Thread(target=target, name=f"kvfsm-shutdown-{name}", daemon=True).start()
        events.append((name, done))
    end = time.monotonic() + max(0.0, timeout)
    stuck = [name for name, done in events if not done.wait(max(0.0, end - time.monotonic()))]
    for name in stuck:
        logger.warning("%s: shutdown did not return within %.3f s; leaving its thread behind", name, timeout)
    return stuck


def accepts_timeout(fn: Callable[..., object]) -> bool:
    """True if ``fn`` takes a ``timeout`` keyword (a shutdown that can bound itself)."""
    try:
        return "timeout" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def with_timeout(fn: Callable[..., object], timeout: float | None) -> Callable[[], object]:
    """``fn`` bound to ``timeout=`` when it takes one (see :func:`accepts_timeout`), else ``fn`` itself."""
    if accepts_timeout(fn):
        return functools.partial(fn, timeout=timeout)
    return fn
