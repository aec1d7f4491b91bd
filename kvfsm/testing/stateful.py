"""Conformance of any :class:`~kvfsm.control.manager.SecondaryTier`, through the real TieringManager.

No torch. Subclass :class:`SecondaryTierStateMachine`, implement :meth:`~SecondaryTierStateMachine.make_tier`
and let pytest collect the ``TestCase``::

    from kvfsm.testing import SecondaryTierStateMachine

    class MyTierMachine(SecondaryTierStateMachine):
        def make_tier(self, slot_io):
            return MyTier(tmp_dir, slot_io=slot_io)

    TestMyTier = MyTierMachine.TestCase

The machine puts the tier behind a :class:`~kvfsm.control.tiering.TieringManager` with a small CPU primary
(a :class:`~kvfsm.control.cpu.CPUOffloadingManager`) whose slot bytes live in a :class:`KitSlotIO`, and
plays the scheduler: it stores chunks (which cascade to the tier), looks them up (a secondary hit is
promoted back into the primary), loads them, steps, drains and resets. Content is addressed by key: every
key has one fixed byte pattern, so any byte a tier returns can be checked.

What a tier must do (each is checked after every rule; see :meth:`SecondaryTierStateMachine.check`):

* report every submitted job exactly once, and only jobs it was given; ``drain_jobs`` returns only once
  every submitted job has finished (the next ``get_finished_jobs`` reports all of them);
* read only the slots of cascades in flight, write only the slots of promotions in flight, and write
  exactly ``nbytes_per_slot`` bytes;
* return, through a successful promotion, exactly the bytes that were cascaded for that key;
* keep ``TieringManager.has_pending_work()`` True while any job is submitted and not yet reported (the
  manager counts it; the tier only has to report it eventually);
* answer lookups with HIT, MISS or RETRY, and never HIT for a key whose promotion just failed (if the
  tier overrides ``SecondaryTier.invalidate``; otherwise a failed promotion would be retried forever).

Tiers complete their jobs on their own (threads) or when told: for the latter, override
:meth:`~SecondaryTierStateMachine.pending_jobs` and :meth:`~SecondaryTierStateMachine.complete` and the
machine also decides when each job finishes, and whether it fails. Rules draw keys from a fixed universe,
never from state a tier changes in the background, so an asynchronous tier cannot make the draws flaky.

A tier that does real I/O on its own threads can be run with that I/O held in flight, deterministically:
set :attr:`~SecondaryTierStateMachine.holds_io` and override :meth:`~SecondaryTierStateMachine.hold_io`
(hold every I/O operation from now on, e.g. with a HANG fault), :meth:`~SecondaryTierStateMachine.let_io_run`
(stop holding it) and :meth:`~SecondaryTierStateMachine.wait_io` (block until the tier's I/O is idle). A tier
that consults a :class:`~kvfsm.tiers.faults.FaultPlan` at every I/O operation gets the first two from
:class:`FaultPlanHeldTierMachine`: build the tier with ``faults=self.plan``. Its
I/O then runs only in the ``io_runs`` rule and inside ``drain_jobs`` (which must still finish every job
itself); every other rule, and every check, sees it queued or running on the real threads. Override
:meth:`~SecondaryTierStateMachine.io_pending` to give the machine the tier's own ground truth (work queued or
running on its threads that must finish before the engine may idle): whenever it says so,
``TieringManager.has_pending_work()`` must be True.

Set :attr:`~SecondaryTierStateMachine.checks_copies` and override :meth:`~SecondaryTierStateMachine.tier_copy`
to have every successful cascade checked at the moment it is reported: the tier's own copy of each key
(its file, its buffer) must then hold exactly the key's bytes, unless the tier no longer holds the key. So a
tier that reports a cascade before its I/O ran is caught at once.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from hypothesis import note
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.manager import JobResult, SecondaryTier, TierJob
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext, make_offload_key
from kvfsm.machines.names import SlotState
from kvfsm.testing.coverage import TransitionLog
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

__all__ = ["FaultPlanHeldTierMachine", "KitSlotIO", "RecordingTier", "SecondaryTierStateMachine", "key_content"]

_CTX = ReqContext("kvfsm-conformance")


def key_content(key: OffloadKey, nbytes: int) -> bytes:
    """The one byte pattern chunk ``key`` has (content addressing: same key, same bytes)."""
    out = bytearray()
    counter = 0
    while len(out) < nbytes:
        out += hashlib.blake2b(key + counter.to_bytes(4, "little"), digest_size=32).digest()
        counter += 1
    return bytes(out[:nbytes])


class KitSlotIO:
    """The CPU primary's slot bytes, with the access rules a tier must follow.

    A tier may read a slot only while a cascade of it is in flight and write one only while a promotion
    into it is in flight (:class:`RecordingTier` opens and closes those windows). Anything else is
    recorded in :attr:`violations`. Thread-safe: tiers may copy on their own threads.
    """

    def __init__(self, num_slots: int, nbytes_per_slot: int) -> None:
        self.num_slots = num_slots
        self._nbytes = nbytes_per_slot
        self._slots: dict[int, bytes] = {}
        self._readable: Counter[int] = Counter()
        self._writable: Counter[int] = Counter()
        self._lock = threading.Lock()
        self.violations: list[str] = []

    @property
    def nbytes_per_slot(self) -> int:
        return self._nbytes

    # -- the tier's side --

    def read_slot(self, slot_id: int) -> bytes:
        with self._lock:
            if self._readable[slot_id] <= 0:
                self.violations.append(f"read slot {slot_id}, which no cascade in flight pins")
            return self._slots.get(slot_id, bytes(self._nbytes))

    def write_slot(self, slot_id: int, data: bytes) -> None:
        with self._lock:
            if self._writable[slot_id] <= 0:
                self.violations.append(f"wrote slot {slot_id}, which no promotion in flight reserves")
            if len(data) != self._nbytes:
                self.violations.append(f"wrote {len(data)} bytes into slot {slot_id}; expected {self._nbytes}")
            self._slots[slot_id] = bytes(data)

    # -- the machine's side (the GPU copies and the windows) --

    def put(self, slot_id: int, data: bytes) -> None:
        with self._lock:
            self._slots[slot_id] = data

    def get(self, slot_id: int) -> bytes:
        with self._lock:
            return self._slots.get(slot_id, bytes(self._nbytes))

    def open(self, slot_ids: Iterable[int], *, write: bool) -> None:
        with self._lock:
            (self._writable if write else self._readable).update(slot_ids)

    def close(self, slot_ids: Iterable[int], *, write: bool) -> None:
        with self._lock:
            (self._writable if write else self._readable).subtract(slot_ids)


class RecordingTier(SecondaryTier):
    """Wraps the tier under test: records submissions and reports, and opens the slot windows."""

    def __init__(
        self,
        inner: SecondaryTier,
        io: KitSlotIO,
        *,
        before_drain: Callable[[], None] | None = None,
        after_drain: Callable[[], None] | None = None,
        on_report: Callable[[TierJob, JobResult], None] | None = None,
    ) -> None:
        self.inner = inner
        self._on_report = on_report
        self._before_drain = before_drain
        self._after_drain = after_drain
        self.name = inner.name
        self.io = io
        self.in_flight: dict[int, TierJob] = {}
        self.reported: set[int] = set()
        self.violations: list[str] = []
        self.failed_promotions: list[OffloadKey] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        # The tier's own API beyond SecondaryTier (test controls such as ``pending_job_ids``).
        return getattr(self.inner, name)

    @property
    def forgets_failed_promotions(self) -> bool:
        """Whether the tier under test implements :meth:`SecondaryTier.invalidate` (the default forgets
        nothing, so a failed promotion may be retried)."""
        return type(self.inner).invalidate is not SecondaryTier.invalidate

    @override
    def invalidate(self, key: OffloadKey) -> None:
        self.inner.invalidate(key)

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        answer: object = self.inner.lookup(key, ctx)
        if not isinstance(answer, LookupResult):
            self.violations.append(f"lookup returned {answer!r}; expected a LookupResult")
            return LookupResult.MISS
        return answer

    def _submit(self, job: TierJob, promotion: bool) -> None:
        with self._lock:
            if job.job_id in self.in_flight or job.job_id in self.reported:
                self.violations.append(f"the manager reused job id {job.job_id}")
            self.in_flight[job.job_id] = job
        self.io.open(job.slot_ids, write=promotion)
        try:
            if promotion:
                self.inner.submit_load(job)
            else:
                self.inner.submit_store(job)
        except BaseException:
            with self._lock:
                del self.in_flight[job.job_id]
            self.io.close(job.slot_ids, write=promotion)
            raise

    @override
    def submit_store(self, job: TierJob) -> None:
        self._submit(job, promotion=False)

    @override
    def submit_load(self, job: TierJob) -> None:
        self._submit(job, promotion=True)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = list(self.inner.get_finished_jobs())
        for res in results:
            with self._lock:
                job = self.in_flight.pop(res.job_id, None)
                if job is None:
                    why = "twice" if res.job_id in self.reported else "but it was never submitted"
                    self.violations.append(f"reported job {res.job_id} {why}")
                    continue
                self.reported.add(res.job_id)
            self.io.close(job.slot_ids, write=job.is_promotion)
            if self._on_report is not None:
                self._on_report(job, res)
            if job.is_promotion and not res.success:
                self.failed_promotions.extend(job.keys)
        return results

    @override
    def has_pending_work(self) -> bool:
        return self.inner.has_pending_work()

    @override
    def drain_jobs(self) -> None:
        """The tier's drain, with its held I/O let run meanwhile (a drain would wait on a hold forever)."""
        if self._before_drain is not None:
            self._before_drain()
        try:
            self.inner.drain_jobs()
        finally:
            if self._after_drain is not None:
                self._after_drain()

    @override
    def on_schedule_end(self) -> None:
        self.inner.on_schedule_end()

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.inner.touch(keys, ctx)

    @override
    def take_events(self) -> list[OffloadingEvent]:
        return self.inner.take_events()

    @override
    def shutdown(self) -> None:
        self.inner.shutdown()


class SecondaryTierStateMachine(RuleBasedStateMachine):
    """Conformance of a SecondaryTier (see the module docs). Override :meth:`make_tier`."""

    #: CPU primary slots: few, so cascades pin, promotions evict and stores sometimes do not fit.
    num_primary_slots: ClassVar[int] = 3
    slot_nbytes: ClassVar[int] = 48
    #: The key universe: small, so keys are stored, evicted, promoted and re-stored.
    num_keys: ClassVar[int] = 6
    #: Whether the machine holds the tier's real I/O in flight (see :meth:`hold_io`): it then runs only in
    #: the ``io_runs`` rule and during drains.
    holds_io: ClassVar[bool] = False
    #: Whether :meth:`tier_copy` is implemented: every successful cascade is then checked when reported.
    checks_copies: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.log = TransitionLog().install()
        self.io = KitSlotIO(self.num_primary_slots, self.slot_nbytes)
        self.keys = [
            make_offload_key(hashlib.blake2b(b"kit%d" % i, digest_size=16).digest()) for i in range(self.num_keys)
        ]
        self._tier: RecordingTier | None = None
        self._manager: TieringManager | None = None
        self._promoted_failed_seen = 0
        #: checks made while :meth:`io_pending` said the tier had work of its own in flight
        self.checks_with_io_pending = 0

    # -- to override --

    def make_tier(self, slot_io: KitSlotIO) -> SecondaryTier:
        """The tier under test; it moves slot bytes through ``slot_io`` (read_slot / write_slot)."""
        raise NotImplementedError("subclass SecondaryTierStateMachine and implement make_tier(slot_io)")

    def pending_jobs(self, tier: SecondaryTier) -> Sequence[int] | None:
        """Ids of the jobs the tier holds unfinished, if the test decides when they finish (else None)."""
        return None

    def complete(self, tier: SecondaryTier, job_id: int, success: bool) -> None:
        """Finish one of :meth:`pending_jobs` (only called when that returns a sequence)."""
        raise NotImplementedError

    def hold_io(self, tier: SecondaryTier) -> None:
        """With :attr:`holds_io`: from now on, hold every real I/O operation of the tier (on its own
        threads) until :meth:`let_io_run`. Called once the tier is built and after every release."""

    def let_io_run(self, tier: SecondaryTier) -> None:
        """With :attr:`holds_io`: let the held I/O, and all I/O from now on, run (until :meth:`hold_io`)."""

    def wait_io(self, tier: SecondaryTier) -> None:
        """With :attr:`holds_io`: block until the tier's I/O is idle (called while it is let run)."""

    def tier_copy(self, tier: SecondaryTier, key: OffloadKey) -> bytes | None:
        """With :attr:`checks_copies`: the bytes the tier holds for ``key`` now (b"" if it holds the key
        but no committed bytes yet), or None if it does not hold the key."""
        raise NotImplementedError("set checks_copies only with tier_copy(tier, key) implemented")

    def _check_report(self, job: TierJob, res: JobResult) -> None:
        if job.is_promotion or not res.success:
            return
        for key in job.keys:
            copy = self.tier_copy(self.tier.inner, key)
            if copy is not None and copy != key_content(key, self.slot_nbytes):
                what = "no committed bytes" if not copy else f"{len(copy)} other bytes"
                self.tier.violations.append(
                    f"cascade job {job.job_id} reported done, but the tier's copy of key {key.hex()[:12]} holds {what}"
                )

    def io_pending(self, tier: SecondaryTier) -> bool | None:
        """The tier's own ground truth: whether work that must finish before the engine may idle is queued
        or running on its threads (None: not known). Asked only at moments the machine controls; with
        free-running threads it must be stable between two reads, or None."""
        return None

    # -- plumbing --

    @property
    def tier(self) -> RecordingTier:
        assert self._tier is not None, "the initialize rule has not run"
        return self._tier

    @property
    def manager(self) -> TieringManager:
        assert self._manager is not None, "the initialize rule has not run"
        return self._manager

    @property
    def primary(self) -> CPUOffloadingManager:
        return self.manager.primary

    def _pending(self) -> list[int]:
        if self._tier is None:
            return []
        ids = self.pending_jobs(self.tier.inner)
        return [] if ids is None else sorted(ids)

    # -- rules --

    @initialize()
    def build(self) -> None:
        inner = self.make_tier(self.io)
        on_report = self._check_report if self.checks_copies else None
        if self.holds_io:
            self._tier = RecordingTier(
                inner,
                self.io,
                before_drain=lambda: self.let_io_run(inner),
                after_drain=lambda: self.hold_io(inner),
                on_report=on_report,
            )
            self.hold_io(inner)
        else:
            self._tier = RecordingTier(inner, self.io, on_report=on_report)
        primary = CPUOffloadingManager(self.num_primary_slots)
        self._manager = TieringManager(primary, [self._tier], deadlines=Deadlines.none())  # no clock here

    @rule(k=st.integers(0, 1_000), ok=st.booleans())
    def store(self, k: int, ok: bool) -> None:
        """The GPU stores a chunk into the primary; on success it is cascaded to the tier."""
        key = self.keys[k % self.num_keys]
        prepared = self.manager.prepare_store([key], _CTX)
        if prepared is None or not prepared.keys_to_store:
            note(f"store key {k % self.num_keys}: {'no room' if prepared is None else 'already held'}")
            return  # no room now, or already held
        (slot_id,) = prepared.store_spec.slot_ids
        note(f"store key {k % self.num_keys} into slot {slot_id} ({'succeeds' if ok else 'fails'})")
        if ok:
            self.io.put(slot_id, key_content(key, self.slot_nbytes))
        self.manager.complete_store([key], _CTX, success=ok)

    @rule(k=st.integers(0, 1_000), end_step=st.booleans())
    def lookup(self, k: int, end_step: bool) -> None:
        """A scheduler lookup: a secondary hit reserves a primary slot and queues a promotion, which the
        end of the step (``end_step``) submits."""
        key = self.keys[k % self.num_keys]
        answer = self.manager.lookup(key, _CTX)
        assert isinstance(answer, LookupResult), f"lookup returned {answer!r}"
        state = self.primary.slot_state(key)
        note(f"lookup key {k % self.num_keys}: {answer.value} (primary slot {state.value})")
        if answer is LookupResult.HIT:
            assert state in (SlotState.READY, SlotState.READING), f"HIT for a key that is {state.value}"
        if answer is LookupResult.HIT_PENDING:
            assert state is SlotState.WRITING, f"HIT_PENDING for a key that is {state.value}"
        if end_step:
            self.manager.on_schedule_end()

    @rule(k=st.integers(0, 1_000))
    def load(self, k: int) -> None:
        """The GPU loads a readable chunk back: exactly its bytes."""
        key = self.keys[k % self.num_keys]
        if self.primary.slot_state(key) not in (SlotState.READY, SlotState.READING):
            return
        spec = self.manager.prepare_load([key], _CTX)
        (slot_id,) = spec.slot_ids
        note(f"load key {k % self.num_keys} from slot {slot_id}")
        assert self.io.get(slot_id) == key_content(key, self.slot_nbytes), f"slot {slot_id} lost its bytes"
        self.manager.complete_load([key], _CTX)

    @rule()
    def step(self) -> None:
        """The end of a scheduler step: the manager polls the tier and submits queued promotions."""
        note(f"step ({self.manager.num_transfer_jobs} transfers in flight)")
        self.manager.on_schedule_end()

    @rule()
    def drain(self) -> None:
        """drain_jobs blocks until every submitted job has finished; the next poll reports all of them."""
        note(f"drain ({self.manager.num_transfer_jobs} transfers in flight)")
        self.tier.drain_jobs()
        self.manager.on_schedule_end()  # applies the drained results, then submits queued promotions
        self.tier.drain_jobs()
        self.manager.on_schedule_end()
        assert self.manager.num_transfer_jobs == 0, (
            f"{self.manager.num_transfer_jobs} transfers still in flight after drain_jobs and a poll"
        )

    @precondition(lambda self: self.holds_io)
    @rule()
    def io_runs(self) -> None:
        """The tier's held I/O runs to the end (its results are applied at the next poll), then is held again."""
        note("the tier's held I/O runs")
        self.let_io_run(self.tier.inner)
        self.wait_io(self.tier.inner)
        self.hold_io(self.tier.inner)

    @precondition(lambda self: bool(self._pending()))
    @rule(data=st.data(), success=st.booleans())
    def complete_one(self, data: st.DataObject, success: bool) -> None:
        """One job the test controls finishes (applied at the next poll)."""
        job_id = data.draw(st.sampled_from(self._pending()), label="tier job")
        note(f"tier job {job_id} finishes ({'succeeds' if success else 'fails'})")
        self.complete(self.tier.inner, job_id, success)

    @rule()
    def reset(self) -> None:
        """reset_cache: the manager drains the tier, then empties the primary (the tier keeps its data)."""
        note("reset_cache")
        self.manager.reset_cache()
        # No GPU copy runs in this machine, so no discarded copy can write a freed slot: the reset hold ends
        # at once (a scheduler calls this once every copy the reset discarded has reported).
        self.manager.on_reset_flushed()
        assert self.manager.num_transfer_jobs == 0

    # -- checks --

    def violations(self) -> list[str]:
        out = list(self.io.violations) + list(self.tier.violations)
        m, primary = self.manager, self.primary
        unreported = len(self.tier.in_flight)
        if unreported and not m.has_pending_work():
            out.append(f"{unreported} tier jobs submitted and unreported, but has_pending_work() is False")
        if self.io_pending(self.tier.inner):
            self.checks_with_io_pending += 1
            if not m.has_pending_work():
                out.append("the tier has its own work queued or running, but has_pending_work() is False")
        in_flight_keys = {(key, job.is_promotion) for job in list(self.tier.in_flight.values()) for key in job.keys}
        slots: dict[int, OffloadKey] = {}
        for key in self.keys:
            state = primary.slot_state(key)
            if state is SlotState.ABSENT:
                continue
            sid = primary.slot_id(key)
            assert sid is not None
            if sid in slots:
                out.append(f"slot {sid} is held by two keys")
            slots[sid] = key
            if state is SlotState.WRITING and (key, True) not in in_flight_keys and m.num_queued_promotions() == 0:
                out.append(f"key {key.hex()[:12]} is writing with no promotion in flight or queued")
            if state is SlotState.READING and (key, False) not in in_flight_keys:
                out.append(f"key {key.hex()[:12]} is reading with no cascade in flight")
            if state in (SlotState.READY, SlotState.READING) and self.io.get(sid) != key_content(key, self.slot_nbytes):
                out.append(f"readable key {key.hex()[:12]} (slot {sid}) does not hold its bytes")
        # A failed promotion must not be promoted again and again (no livelock): the tier forgets the key.
        fresh = self.tier.failed_promotions[self._promoted_failed_seen :]
        self._promoted_failed_seen = len(self.tier.failed_promotions)
        if self.tier.forgets_failed_promotions:
            for key in fresh:
                if (
                    primary.slot_state(key) is SlotState.ABSENT
                    and self.tier.inner.lookup(key, _CTX) is LookupResult.HIT
                ):
                    out.append(f"key {key.hex()[:12]} still answers HIT after its promotion failed")
        return out

    @invariant()
    def check(self) -> None:
        problems = self.violations()
        assert not problems, "; ".join(problems[:6])

    @override
    def teardown(self) -> None:
        try:
            if self._manager is not None:
                if self.holds_io:
                    self.let_io_run(self.tier.inner)
                self.tier.drain_jobs()
                self.manager.on_schedule_end()
                self.manager.shutdown()
        finally:
            self.log.uninstall()


class FaultPlanHeldTierMachine(SecondaryTierStateMachine):
    """For a tier that consults a :class:`~kvfsm.tiers.faults.FaultPlan` at every I/O operation: ``self.plan``
    hangs every operation while it is enabled, so holding the tier's I/O is enabling the plan and letting it
    run is disabling it and releasing the hung operations. Build the tier with ``faults=self.plan``; still
    override :meth:`make_tier` and :meth:`wait_io`."""

    holds_io: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.plan = FaultPlan([FaultRule("*", FaultKind.HANG)])

    @override
    def hold_io(self, tier: SecondaryTier) -> None:
        self.plan.enabled = True

    @override
    def let_io_run(self, tier: SecondaryTier) -> None:
        self.plan.enabled = False
        self.plan.release_hangs()
