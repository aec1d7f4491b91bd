"""An in-memory secondary tier for tests: jobs finish only when the test (or ``autocomplete``) says so.

Without a :class:`SlotIO` it tracks only which keys it holds; with one, a store copies each primary slot's
bytes at completion and a load writes them back into the reserved primary slot, so a data plane can check
real contents end to end. Nothing here blocks, sleeps or spawns a thread.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from typing_extensions import override

from kvfsm.control.manager import JobResult, SecondaryTier, TierJob, validate_tier_job
from kvfsm.control.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from kvfsm.errors import ConfigError, UnknownJobError
from kvfsm.tiers.slotio import SlotIO

__all__ = ["InMemoryTier"]


class InMemoryTier(SecondaryTier):
    """A dict of keys (and optionally bytes) with LRU eviction at ``capacity``, and manual job completion.

    - ``name`` (str; default ``"mem"``): the tier's name in events and error messages.
    - ``capacity`` (int blocks >= 1, or None; default None: unbounded): the most keys held; storing more
      evicts the least recently used (stored, touched or promoted) ones. It counts blocks, not bytes: LMCache's
      nearest setting is ``max_local_cpu_size`` (GB of pinned CPU memory, default 5.0), vLLM's native CPU
      offloading ``num_cpu_blocks`` / ``cpu_bytes_to_use``; both size the CPU primary, which this tier is
      not (it sits below it).
    - ``autocomplete`` (bool; default False): finish every pending job successfully at the next
      :meth:`get_finished_jobs` (one step later), instead of when the test calls :meth:`complete`. No
      equivalent: a test control.
    - ``slot_io`` (:class:`~kvfsm.tiers.slotio.SlotIO`; default None): with it, a store copies each CPU slot's
      bytes when the job completes and a promotion writes them back, so contents can be checked end to
      end; without it, only which keys are held is tracked (a promotion of a key held without bytes fails).
    """

    __slots__ = (
        "_autocomplete",
        "_capacity",
        "_events",
        "_fail_budget",
        "_finished",
        "_keys",
        "_pending",
        "slot_io",
    )

    def __init__(
        self,
        name: str = "mem",
        capacity: int | None = None,
        *,
        autocomplete: bool = False,
        slot_io: SlotIO | None = None,
    ) -> None:
        if capacity is not None and capacity < 1:
            raise ConfigError(f"tier {name!r}: capacity {capacity} is too small; expected >= 1 or None")
        self.name = name
        self.slot_io = slot_io
        self._capacity = capacity
        self._autocomplete = autocomplete
        self._keys: OrderedDict[OffloadKey, bytes | None] = OrderedDict()  # least recent first
        self._pending: dict[int, TierJob] = {}  # submission order
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._fail_budget = 0

    # -- test controls --

    @property
    def capacity(self) -> int | None:
        return self._capacity

    def pending_job_ids(self) -> list[int]:
        return list(self._pending)

    def pending_job(self, job_id: int) -> TierJob:
        job = self._pending.get(job_id)
        if job is None:
            raise UnknownJobError(f"tier {self.name!r} has no pending job {job_id}; expected one submitted")
        return job

    def complete(self, job_id: int, success: bool = True) -> None:
        """Finish one pending job; its result is reported by the next :meth:`get_finished_jobs`."""
        job = self.pending_job(job_id)
        del self._pending[job_id]
        self._finish(job, success)

    def complete_all(self, success: bool = True) -> None:
        for job_id in list(self._pending):
            self.complete(job_id, success)

    def fail_next(self, n: int = 1) -> None:
        """The next ``n`` completions fail whatever they were asked to do."""
        if n < 0:
            raise ConfigError(f"tier {self.name!r}: fail_next({n}); expected a count >= 0")
        self._fail_budget = n

    def put(self, key: OffloadKey, data: bytes | None = None) -> None:
        """Hold ``key`` (as most recent) without a job, e.g. data left by an earlier process."""
        self._insert([(key, data)])

    @override
    def invalidate(self, key: OffloadKey) -> None:
        """Forget ``key`` (a failed promotion showed its copy is bad); a key not held is ignored."""
        if key in self._keys:
            del self._keys[key]
            self._events.append(OffloadingEvent((key,), self.name, removed=True))

    def data(self, key: OffloadKey) -> bytes | None:
        return self._keys.get(key)

    def keys(self) -> list[OffloadKey]:
        """Held keys, least recent first."""
        return list(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    # -- SecondaryTier --

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        return LookupResult.HIT if key in self._keys else LookupResult.MISS

    @override
    def submit_store(self, job: TierJob) -> None:
        self._submit(job, promotion=False)

    @override
    def submit_load(self, job: TierJob) -> None:
        self._submit(job, promotion=True)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._autocomplete:
            self.complete_all()
        finished, self._finished = self._finished, []
        return finished

    @override
    def drain_jobs(self) -> None:
        self.complete_all()

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        for key in reversed(keys):
            if key in self._keys:
                self._keys.move_to_end(key)

    @override
    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    # -- internals --

    def _submit(self, job: TierJob, *, promotion: bool) -> None:
        validate_tier_job(self.name, job, promotion=promotion, running=self._pending)
        self._pending[job.job_id] = job

    def _finish(self, job: TierJob, success: bool) -> None:
        if self._fail_budget > 0:
            self._fail_budget -= 1
            success = False
        if success:
            success = self._load(job) if job.is_promotion else self._store(job)
        self._finished.append(JobResult(job.job_id, success))

    def _store(self, job: TierJob) -> bool:
        io = self.slot_io
        items = [
            (key, None if io is None else io.read_slot(sid)) for key, sid in zip(job.keys, job.slot_ids, strict=True)
        ]
        self._insert(items)
        return True

    def _load(self, job: TierJob) -> bool:
        keys = self._keys
        # Every key must still be here (it may have been evicted or invalidated since the lookup).
        if any(key not in keys for key in job.keys):
            return False
        io = self.slot_io
        if io is not None:
            blobs: list[bytes] = []
            for key in job.keys:
                blob = keys[key]
                if blob is None:
                    return False  # held without bytes: nothing real to copy
                blobs.append(blob)
            for sid, blob in zip(job.slot_ids, blobs, strict=True):
                io.write_slot(sid, blob)
        self.touch(job.keys, ReqContext(job.req_id))
        return True

    def _insert(self, items: list[tuple[OffloadKey, bytes | None]]) -> None:
        keys = self._keys
        for key, data in items:
            keys[key] = data
            keys.move_to_end(key)
        if items:
            self._events.append(OffloadingEvent(tuple(k for k, _ in items), self.name, removed=False))
        if self._capacity is not None and len(keys) > self._capacity:
            evicted = [keys.popitem(last=False)[0] for _ in range(len(keys) - self._capacity)]
            self._events.append(OffloadingEvent(tuple(evicted), self.name, removed=True))
