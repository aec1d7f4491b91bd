"""The CPU primary tier's bookkeeping (vLLM's ``CPUOffloadingManager``), driven by the slot machine.

Every held key has one :class:`Slot` whose state moves only through ``slot_machine().fire``. vLLM's
reference count is a view of it: writing = -1, ready = 0, reading = number of readers. A key that is not
held has no Slot at all (it is absent). The policy holds exactly the ready and reading keys; ready ones
are its evictable ones. Every count is kept incrementally, so each call costs O(keys it is given) plus
O(victims) when it evicts; only :meth:`CPUOffloadingManager.reset_cache` visits every slot.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import asdict, dataclass, field
from operator import attrgetter
from types import MappingProxyType
from typing import NoReturn, cast

from typing_extensions import override

from kvfsm.control.manager import OffloadingManager
from kvfsm.control.policies import CachePolicy, KeyPosition, RequestAccess, make_policy
from kvfsm.control.types import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
)
from kvfsm.errors import ConfigError, InvalidTransition, KeyNotReadyError
from kvfsm.machines import slot_machine
from kvfsm.machines.compiled import SpecMachine, tracing
from kvfsm.machines.names import SlotEffect, SlotEvent, SlotState
from kvfsm.validation import is_int

__all__ = ["CPUCounters", "CPUOffloadingManager", "CPUStats", "Slot", "SlotModel", "is_evictable"]

_EMPTY_STORE = PrepareStoreOutput((), SlotSpec(()), ())
_NO_KEYS: frozenset[OffloadKey] = frozenset()
_READABLE = (SlotState.READY, SlotState.READING)
# Enum members read through their class cost a descriptor call each (Python 3.11): the hot paths use these.
_WRITING, _READY = SlotState.WRITING, SlotState.READY
_EMIT_STORED = SlotEffect.EMIT_STORED
_MISS, _HIT, _HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING
_by_seq = attrgetter("seq")


def _tally(answers: Mapping[OffloadKey, LookupResult]) -> tuple[int, int, int]:
    """(hits, misses, hit_pending) among a request's latest answers: three counts in C, where a Counter
    would cost more than the request's few lookups (it runs once per finished request)."""
    results = list(answers.values())
    return results.count(_HIT), results.count(_MISS), results.count(_HIT_PENDING)


def is_evictable(state: SlotState) -> bool:
    """Whether eviction may take a slot in ``state``: the spec's only ``evict`` row leaves ``ready``.

    The manager keeps the policy's evictable set in step with this (a slot leaving an evictable state is
    marked non-evictable, one entering it evictable); the model checker (kvfsm.check) asks the same
    function, so a bug planted here is seen by both.
    """
    return state is _READY


@dataclass(slots=True)
class CPUCounters:
    """What a CPU manager has counted since it was built (a reset keeps the counts).

    Lookups are counted as vLLM counts them: once per request and key, under the key's latest answer to
    that request, so ``lookups == hits + misses + hit_pending`` always. A deferred request asks again
    every step; those repeats are ``lookup_retries``, and they only move the key to its new answer.
    """

    #: Distinct (request, key) lookups.
    lookups: int = 0
    #: Of those, the ones whose latest answer was HIT.
    hits: int = 0
    #: ... MISS.
    misses: int = 0
    #: ... HIT_PENDING (the request was still waiting on the key's store or promotion).
    hit_pending: int = 0
    #: Repeated lookups of a key by a request that already asked for it (per-step retries of a deferral).
    lookup_retries: int = 0
    evictions: int = 0
    stores_committed: int = 0
    stores_failed: int = 0
    promotions_committed: int = 0
    promotions_failed: int = 0
    #: New keys offered for storing that the admission filter (``store_threshold``) turned away.
    stores_skipped: int = 0


@dataclass(frozen=True, slots=True)
class CPUStats:
    """A snapshot of a CPU manager: its counters and its slots now."""

    lookups: int
    hits: int
    misses: int
    hit_pending: int
    lookup_retries: int
    evictions: int
    stores_committed: int
    stores_failed: int
    promotions_committed: int
    promotions_failed: int
    stores_skipped: int
    num_slots: int
    used: int
    writing: int
    ready: int
    reading: int

    def as_dict(self) -> dict[str, int]:
        """The same numbers by field name (logs, JSON, metrics)."""
        return asdict(self)

    @property
    def usage(self) -> float:
        """Fraction of the slots pinned by transfers (writing or read), vLLM's cache-usage gauge; 0 with no slots."""
        return (self.writing + self.reading) / self.num_slots if self.num_slots else 0.0

    @property
    def write_usage(self) -> float:
        """Fraction of the slots pinned by stores still in flight."""
        return self.writing / self.num_slots if self.num_slots else 0.0

    @property
    def read_usage(self) -> float:
        """Fraction of the slots pinned by loads (or cascades) still reading them."""
        return self.reading / self.num_slots if self.num_slots else 0.0


def _show(key: OffloadKey) -> str:
    return key.hex() if len(key) <= 40 else key[:20].hex() + "..."


@dataclass(slots=True, eq=False, kw_only=True)
class SlotModel:
    """The slot machine's model: ``state`` and its one integer of extended state, ``readers``.

    Like :class:`~kvfsm.control.job.Job`, the record owns its bookkeeping: each method fires the slot
    machine and then updates ``readers``, so no caller assigns either. Methods whose transition carries
    an effect return it (:class:`~kvfsm.machines.names.SlotEffect`) for the tier to carry out. Tiers subclass it
    (slotted dataclasses) with what they keep per key.
    """

    state: SlotState = SlotState.ABSENT
    readers: int = 0
    machine: SpecMachine[SlotState, SlotEvent, SlotEffect] = field(default_factory=slot_machine, repr=False)

    def current(self) -> SlotState:
        """The state, read through a call so that mypy does not narrow it across transitions."""
        return self.state

    def begin_write(self) -> None:
        self.machine.fire(self, SlotEvent.BEGIN_WRITE)

    def commit_write(self) -> SlotEffect | None:
        """writing -> ready; returns EMIT_STORED."""
        return self.machine.fire(self, SlotEvent.COMMIT_WRITE)

    def abort_write(self) -> SlotEffect | None:
        """writing -> absent; returns EMIT_REMOVED (a metadata-only removal: never announced stored)."""
        return self.machine.fire(self, SlotEvent.ABORT_WRITE)

    def begin_read(self) -> None:
        """One more reader (ready or reading -> reading)."""
        self.machine.fire(self, SlotEvent.BEGIN_READ)
        self.readers += 1

    def end_read(self) -> None:
        """One reader fewer; the last one makes the slot ready (the guard reads ``readers`` first)."""
        self.machine.fire(self, SlotEvent.END_READ)
        self.readers -= 1

    def evict(self) -> SlotEffect | None:
        """ready -> absent; returns EMIT_REMOVED."""
        return self.machine.fire(self, SlotEvent.EVICT)

    def reset(self) -> None:
        """Any state -> absent, readers dropped (reset_cache)."""
        self.machine.fire(self, SlotEvent.RESET)
        self.readers = 0


@dataclass(slots=True, eq=False)
class Slot(SlotModel):
    """One held key: its CPU slot and its slot-machine state (only the machine assigns ``state``)."""

    key: OffloadKey
    slot_id: int
    #: Reservation order: a completed store's keys enter a commit-order policy in this order, whatever
    #: order the caller lists them in (a ``set`` from vLLM included), so eviction never depends on it.
    seq: int = 0

    @property
    def ref_cnt(self) -> int:
        if self.state is _WRITING:
            return -1
        return self.readers


class CPUOffloadingManager(OffloadingManager):
    """``num_slots`` CPU slots with an eviction policy; GPU stores/loads and tier promotions/cascades."""

    __slots__ = (
        "_allocation_sizes",
        "_answers",
        "_counts",
        "_events",
        "_free_ids",
        "_key_positions",
        "_lookup_calls",
        "_machine",
        "_max_tracker_size",
        "_medium",
        "_next_id",
        "_next_seq",
        "_num_reading",
        "_num_ready",
        "_num_slots",
        "_num_writing",
        "_policy",
        "_request_scoped",
        "_requests",
        "_slots",
        "_stats",
        "_store_threshold",
        "enable_events",
    )

    def __init__(
        self,
        num_slots: int,
        policy: str = "lru",
        *,
        medium: str = "CPU",
        enable_events: bool = True,
        checked: bool | None = None,
        store_threshold: int = 0,
        max_tracker_size: int = 64_000,
    ) -> None:
        if not is_int(num_slots) or num_slots < 0:
            raise ConfigError(f"CPU tier needs a slot count, got num_slots={num_slots!r}; expected an int >= 0")
        if not is_int(store_threshold) or store_threshold < 0:
            raise ConfigError(f"store_threshold={store_threshold!r}; expected an int >= 0 (0 or 1: no filter)")
        if not is_int(max_tracker_size) or max_tracker_size < 1:
            raise ConfigError(f"max_tracker_size={max_tracker_size!r}; expected an int >= 1")
        self._num_slots = num_slots
        self._policy: CachePolicy = make_policy(policy, capacity=num_slots)
        # Read once: the policy is fixed for the manager's life, and the store paths branch on it per call.
        self._request_scoped = self._policy.request_scoped
        if num_slots == 0 and not self._request_scoped:
            # vLLM runs a manager with no chunks (its spec computes 0 when cpu_bytes_to_use is below one
            # chunk); kvfsm's own engine treats a CPU tier without slots as the misconfiguration it is.
            raise ConfigError(
                f"CPU tier needs at least one slot with policy {policy!r}, got num_slots=0; expected >= 1 "
                "(only the request-scoped policies of the vLLM route accept 0)"
            )
        self._store_threshold = store_threshold
        self._max_tracker_size = max_tracker_size
        # Admission filter (vLLM's reuse counter): how often each recent key was offered, oldest first.
        self._counts: OrderedDict[OffloadKey, int] | None = OrderedDict() if store_threshold >= 2 else None
        # Request-scoped policies: each live request's accesses, and how to read its keys' token positions.
        self._requests: dict[str, RequestAccess] = {}
        self._key_positions: dict[str, KeyPosition] = {}
        # How many prepare_store calls tried to allocate each number of new keys (vLLM's histogram), cumulative.
        self._allocation_sizes: Counter[int] = Counter()
        self._next_seq = 0
        self._medium = medium
        self.enable_events = enable_events
        self._machine: SpecMachine[SlotState, SlotEvent, SlotEffect] = slot_machine(checked)
        self._slots: dict[OffloadKey, Slot] = {}
        # Allocator: a bump pointer over never-used ids, then a stack of freed ones.
        self._next_id = 0
        self._free_ids: list[int] = []
        self._num_writing = 0
        self._num_ready = 0
        self._num_reading = 0
        self._events: list[OffloadingEvent] = []
        self._stats = CPUCounters()
        # Per request: the latest answer to each key it looked up, so a retry is counted as one, not as
        # another lookup. Folded into the counters when the request finishes (or the cache is reset);
        # ``stats`` adds the live requests' answers, so a lookup costs one store and one increment.
        self._answers: dict[str, dict[OffloadKey, LookupResult]] = {}
        self._lookup_calls = 0

    # -- introspection --

    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def num_free(self) -> int:
        return self._num_slots - len(self._slots)

    @property
    def num_writing(self) -> int:
        return self._num_writing

    @property
    def num_reading(self) -> int:
        """Slots with at least one reader."""
        return self._num_reading

    @property
    def num_evictable(self) -> int:
        """Ready slots (ref 0): the only ones eviction may take."""
        return self._num_ready

    @property
    def medium(self) -> str:
        return self._medium

    @property
    def policy(self) -> CachePolicy:
        return self._policy

    @override
    @property
    def primary(self) -> CPUOffloadingManager:
        """A CPU manager is its own primary."""
        return self

    @property
    def machine(self) -> SpecMachine[SlotState, SlotEvent, SlotEffect]:
        return self._machine

    def slot_state(self, key: OffloadKey) -> SlotState:
        slot = self._slots.get(key)
        return SlotState.ABSENT if slot is None else slot.state

    def ref_cnt(self, key: OffloadKey) -> int | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.ref_cnt

    def slot_id(self, key: OffloadKey) -> int | None:
        slot = self._slots.get(key)
        return None if slot is None else slot.slot_id

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    @property
    def store_threshold(self) -> int:
        return self._store_threshold

    def offer_counts(self) -> Mapping[OffloadKey, int] | None:
        """The admission filter's offer counts, least recently offered first (read-only); None without one."""
        return None if self._counts is None else MappingProxyType(self._counts)

    def allocation_sizes(self) -> Mapping[int, int]:
        """Number of new keys -> how many ``prepare_store`` calls tried to allocate that many, since the
        manager was built (vLLM's allocation-size histogram; failed attempts included). Read-only."""
        return MappingProxyType(self._allocation_sizes)

    @property
    def stores_skipped(self) -> int:
        """New keys the admission filter turned away so far (O(1), unlike :meth:`stats`)."""
        return self._stats.stores_skipped

    def stats(self) -> CPUStats:
        """The counters (live requests' lookups included, O(their looked-up keys)) and the slots now."""
        counts = asdict(self._stats)
        for answers in self._answers.values():
            self._fold_into(counts, answers)
        counts["lookup_retries"] = self._lookup_calls - counts["lookups"]
        return CPUStats(
            **counts,
            num_slots=self._num_slots,
            used=len(self._slots),
            writing=self._num_writing,
            ready=self._num_ready,
            reading=self._num_reading,
        )

    # -- OffloadingManager --

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        slot = self._slots.get(key)
        if slot is None:
            result = _MISS
        elif slot.state is _WRITING:
            result = _HIT_PENDING
        else:
            result = _HIT
        # Counted once per request and key, under its latest answer: only the answer is kept here, the
        # counts are taken from it when the request finishes (lookup is the hottest call).
        answers = self._answers.get(ctx.req_id)
        if answers is None:
            answers = self._answers[ctx.req_id] = {}
        answers[key] = result
        self._lookup_calls += 1
        return result

    @staticmethod
    def _fold_into(counts: dict[str, int], answers: Mapping[OffloadKey, LookupResult]) -> None:
        hits, misses, hit_pending = _tally(answers)
        counts["lookups"] += len(answers)
        counts["hits"] += hits
        counts["misses"] += misses
        counts["hit_pending"] += hit_pending

    def _fold_answers(self, req_id: str) -> None:
        """Count a finished request's lookups (each key once, under its latest answer)."""
        answers = self._answers.pop(req_id, None)
        if answers:
            hits, misses, hit_pending = _tally(answers)
            stats = self._stats
            stats.lookups += len(answers)
            stats.hits += hits
            stats.misses += misses
            stats.hit_pending += hit_pending

    @override
    def on_new_request(self, ctx: ReqContext, key_position: KeyPosition | None = None) -> None:
        """A request starts. ``key_position`` maps its keys to their token positions (vLLM's
        ``ReqContext.get_offload_key_position``); a request-scoped policy orders its keys by them."""
        if key_position is not None:
            self._key_positions[ctx.req_id] = key_position
            access = self._requests.get(ctx.req_id)
            if access is not None:
                access.key_position = key_position

    def _access(self, ctx: ReqContext) -> RequestAccess | None:
        """The request's access record (created on first use) when the policy is request-scoped."""
        if not self._request_scoped:
            return None
        access = self._requests.get(ctx.req_id)
        if access is None:
            position = self._key_positions.get(ctx.req_id)
            access = RequestAccess() if position is None else RequestAccess(position)
            self._requests[ctx.req_id] = access
        return access

    def _record_access(
        self, access: RequestAccess, keys: Iterable[OffloadKey], reused: Iterable[OffloadKey] = ()
    ) -> None:
        seen, groups = access.seen, access.key_groups
        new_keys = [key for key in dict.fromkeys(keys) if key not in seen]
        if new_keys:
            seen.update(new_keys)
            # A request's keys mostly share their group (the key's last 4 bytes): one dict probe per run.
            tail: bytes | None = None
            members: list[OffloadKey] = []
            for key in new_keys:
                if key[-4:] != tail:
                    tail = key[-4:]
                    members = groups.setdefault(int.from_bytes(tail, "big"), [])
                members.append(key)
            self._policy.on_request_access(new_keys, access)
        inserted = access.inserted
        # Re-reading a key this request stored is an internal transfer (a cascade), not a reuse.
        access.reused.update(key for key in reused if key not in inserted)

    @override
    def on_request_finished(self, ctx: ReqContext) -> None:
        """A request-scoped policy commits the request's recency now (vLLM 0.33), head most recent."""
        self._fold_answers(ctx.req_id)
        self._key_positions.pop(ctx.req_id, None)
        access = self._requests.pop(ctx.req_id, None)
        if access is not None:
            self._policy.on_request_finished(access.ordered_keys(), access.inserted - access.reused, access.reused)

    @override
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> SlotSpec:
        spec = self.prepare_read(keys)
        access = self._access(ctx) if self._request_scoped else None
        if access is not None:
            self._record_access(access, keys, reused=keys)
        return spec

    @override
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.complete_read(keys)

    @override
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Reserve writing slots for the offered keys not held yet, in the order offered.

        With ``store_threshold >= 2`` a new key is admitted only once it has been offered that many times
        (the count is kept for the ``max_tracker_size`` most recently offered keys). A request-scoped
        policy also learns from the offer (ghost hits, the request's prefix order) before any early return.
        """
        slots = self._slots
        offered = list(dict.fromkeys(keys)) if len(keys) > 1 else list(keys)
        counts = self._counts
        if counts is not None:
            self._count_offers(offered)
        new_keys: list[OffloadKey] = []
        for key in offered:  # a plain loop: most offers are one or two keys, and a comprehension is a call
            if key not in slots:
                new_keys.append(key)
        if counts is not None:
            threshold = self._store_threshold
            admitted = [key for key in new_keys if counts.get(key, 0) >= threshold]
            self._stats.stores_skipped += len(new_keys) - len(admitted)
            new_keys = admitted
        access = self._access(ctx) if self._request_scoped else None
        if access is not None:
            ready_held = [key for key in offered if (slot := slots.get(key)) is not None and slot.state is not _WRITING]
            misses = [key for key in new_keys if key not in access.store_misses]
            if misses:
                self._policy.on_store_miss(misses)  # before insert() drops the ghosts
                access.store_misses.update(misses)
            recorded = {*new_keys, *ready_held}
            self._record_access(access, [key for key in offered if key in recorded], reused=ready_held)
        if not new_keys:
            return _EMPTY_STORE
        self._allocation_sizes[len(new_keys)] += 1
        # Every held key offered (in any state) is protected: not re-stored, and not evicted by this call.
        # Only an eviction reads the set, so it is built only when the new keys do not fit the free slots.
        evicting = len(new_keys) > self._num_slots - len(slots)
        reserved = self._reserve(new_keys, slots.keys() & set(offered) if evicting else _NO_KEYS, access)
        if reserved is None:
            return None
        slot_ids, evicted = reserved
        if access is not None:
            access.inserted.update(new_keys)
        return PrepareStoreOutput(tuple(new_keys), SlotSpec(slot_ids), evicted)

    def _count_offers(self, keys: list[OffloadKey]) -> None:
        """Count one more offer of each key; a full tracker forgets its least recently offered key, but
        never one offered in this call."""
        counts = self._counts
        assert counts is not None
        offered_now = 0
        for key in keys:
            if key in counts:
                counts.move_to_end(key)
                counts[key] += 1
                offered_now += 1
        unprotected = len(counts) - offered_now
        limit = self._max_tracker_size
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= limit:
                if unprotected == 0:
                    continue
                counts.popitem(last=False)
                unprotected -= 1
            counts[key] = 1

    @override
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        """Commit (or roll back) the writing keys; keys in any other state are ignored (idempotent).

        ``keys`` may come in any order (vLLM passes a set, the adapter a list of it): they are applied in
        reservation order.
        """
        slots = self._slots
        # Deduplicated in the order given: a job's keys come in reservation order already, and sorting a
        # sorted list is one linear pass (a set's order would make it a full sort).
        writing = [
            slot for key in dict.fromkeys(keys) if (slot := slots.get(key)) is not None and slot.state is _WRITING
        ]
        if len(writing) > 1 and (self.enable_events or not self._request_scoped or tracing()):
            # The order is seen (events, a commit-order policy's insertions, tracers): reservation order.
            # A request-scoped policy marks the batch ready as a set, so it needs none.
            writing.sort(key=_by_seq)
        self._finish_writes(writing, success, promotion=False)

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._policy.touch(keys)

    @override
    def take_events(self) -> list[OffloadingEvent]:
        """Events since the last call. A failed store's removal (``metadata_only``) leaves out the keys a
        retry has reserved again since, as vLLM does."""
        events, self._events = self._events, []
        if not any(e.metadata_only for e in events):
            return events
        slots = self._slots
        out: list[OffloadingEvent] = []
        for event in events:
            if event.metadata_only:
                kept = tuple(key for key in event.keys if key not in slots)
                if not kept:
                    continue
                event = OffloadingEvent(kept, event.medium, removed=True, metadata_only=True)
            out.append(event)
        return out

    @override
    def reset_cache(self) -> None:
        """Drop everything: RESET every slot, then clear the policy, the allocator and the counts.

        Safe only because callers guarantee no pre-reset transfer still touches a slot (stale job ids,
        loads flushed before new stores; tiering drains its tiers first).
        """
        for slot in self._slots.values():
            slot.reset()
        self._slots.clear()
        self._policy.clear()
        self._next_id = 0
        self._free_ids.clear()
        self._num_writing = self._num_ready = self._num_reading = 0
        for req_id in list(self._answers):
            self._fold_answers(req_id)  # counted; a lookup after the reset is a new one
        self._requests.clear()  # accesses before the reset commit nothing after it

    # -- tier side (CPU primary of a tiering manager) --

    def prepare_write(self, keys: Sequence[OffloadKey], protected: Set[OffloadKey] = frozenset()) -> SlotSpec | None:
        """Reserve writing slots for absent keys (a promotion); None when they cannot fit now without
        evicting a key in ``protected`` (spec/README.md: "promote what fits, compute the rest").

        Every key must be absent and listed once (InvalidTransition otherwise, nothing changed).
        """
        seen: set[OffloadKey] = set()
        for key in keys:
            if key in self._slots or key in seen:
                state = self.slot_state(key)
                raise InvalidTransition(
                    "slot",
                    str(state),
                    str(SlotEvent.BEGIN_WRITE),
                    f"key {_show(key)} is {'listed twice' if key in seen else 'already held'}; "
                    "prepare_write expects distinct absent keys",
                )
            seen.add(key)
        if not keys:
            return SlotSpec(())
        reserved = self._reserve(list(keys), protected)
        return None if reserved is None else SlotSpec(reserved[0])

    def complete_write(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish a promotion: writing -> ready (success) or absent. Every key must be writing."""
        unique = list(dict.fromkeys(keys))
        for key in unique:
            state = self.slot_state(key)
            if state is not SlotState.WRITING:
                event = SlotEvent.COMMIT_WRITE if success else SlotEvent.ABORT_WRITE
                raise InvalidTransition(
                    "slot", str(state), str(event), f"key {_show(key)} is not being written; expected writing"
                )
        self._finish_writes([self._slots[key] for key in unique], success, promotion=True)

    def prepare_read(self, keys: Sequence[OffloadKey]) -> SlotSpec:
        """Pin readable keys (ready or reading) until :meth:`complete_read`; one reader per listing."""
        slots = self._slots
        pinned = [slots.get(key) for key in keys]
        if None in pinned or len(set(keys)) != len(pinned):
            return self._prepare_read_each(keys)
        try:
            groups = self._machine.fire_many(cast("list[Slot]", pinned), SlotEvent.BEGIN_READ, distinct=True)
        except InvalidTransition:
            return self._prepare_read_each(keys)  # raises KeyNotReadyError for the first unreadable key
        for source, dest, _effect, members in groups:
            for slot in members:
                slot.readers += 1
            if is_evictable(source) and not is_evictable(dest):
                # 0 -> 1 reader: eviction must not take them until the last reader is done.
                self._policy.mark_non_evictable_many(keys if members is pinned else [slot.key for slot in members])
                self._num_ready -= len(members)
                self._num_reading += len(members)
        return SlotSpec(tuple([slot.slot_id for slot in cast("list[Slot]", pinned)]))

    def _prepare_read_each(self, keys: Sequence[OffloadKey]) -> SlotSpec:
        """:meth:`prepare_read` one listing at a time (a key listed twice, or the error path)."""
        slots = self._slots
        for key in keys:
            slot = slots.get(key)
            if slot is None or slot.state not in _READABLE:
                state = SlotState.ABSENT if slot is None else slot.state
                raise KeyNotReadyError(
                    f"cannot read key {_show(key)} from {self._medium}: its slot is {state.value}; "
                    "expected ready or reading"
                )
        policy = self._policy
        ids: list[int] = []
        for key in keys:
            slot = slots[key]
            was_evictable = is_evictable(slot.state)
            slot.begin_read()
            if was_evictable and not is_evictable(slot.state):
                policy.mark_non_evictable(key)
                self._num_ready -= 1
                self._num_reading += 1
            ids.append(slot.slot_id)
        return SlotSpec(tuple(ids))

    def complete_read(self, keys: Sequence[OffloadKey]) -> None:
        """Unpin keys pinned by :meth:`prepare_read` (once per listing); the last reader makes it ready."""
        slots = self._slots
        pinned = [slots.get(key) for key in keys]
        if None in pinned or len(set(keys)) != len(pinned):
            self._complete_read_each(keys)
            return
        try:
            groups = self._machine.fire_many(cast("list[Slot]", pinned), SlotEvent.END_READ, distinct=True)
        except InvalidTransition:
            self._complete_read_each(keys)  # raises for the first key that is not being read
            raise AssertionError("unreachable: complete_read_each raises") from None
        for _source, dest, _effect, members in groups:
            for slot in members:
                slot.readers -= 1
            if is_evictable(dest):  # the last reader is done (a reading slot was not evictable)
                self._policy.mark_evictable_many(keys if members is pinned else [slot.key for slot in members])
                self._num_reading -= len(members)
                self._num_ready += len(members)

    def _complete_read_each(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`complete_read` when a key is listed more than once, or to raise for the bad key."""
        slots = self._slots
        counts: dict[OffloadKey, int] = {}
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        for key, n in counts.items():
            slot = slots.get(key)
            if slot is None or slot.state is not SlotState.READING or slot.readers < n:
                self._raise_end_read(key, n)
        released: list[OffloadKey] = []
        for key in keys:
            slot = slots[key]
            slot.end_read()
            if is_evictable(slot.state):
                released.append(slot.key)
        if released:
            self._policy.mark_evictable_many(released)
            self._num_reading -= len(released)
            self._num_ready += len(released)

    def _raise_end_read(self, key: OffloadKey, n: int) -> NoReturn:
        slot = self._slots.get(key)
        state = SlotState.ABSENT if slot is None else slot.state
        readers = 0 if slot is None else slot.readers
        raise InvalidTransition(
            "slot",
            str(state),
            str(SlotEvent.END_READ),
            f"key {_show(key)} has {readers} reader(s) but {n} read(s) end; "
            "expected a reading slot with at least that many readers",
        )

    # -- internals --

    def _reserve(
        self, new_keys: list[OffloadKey], protected: Set[OffloadKey], access: RequestAccess | None = None
    ) -> tuple[tuple[int, ...], tuple[OffloadKey, ...]] | None:
        """Evict what is needed, then BEGIN_WRITE a slot per (absent, distinct) key; None if it can't fit."""
        slots = self._slots
        n = len(new_keys)
        need = n - (self._num_slots - len(slots))
        victims: list[OffloadKey] = []
        if need > 0:
            if need > self._num_ready:
                return None
            chosen = self._policy.evict(need, protected)
            if chosen is None:
                return None
            victims = chosen
            self._evict(victims)
        machine = self._machine
        ids = self._alloc_ids(n)
        seq = self._next_seq
        fresh: list[Slot] = []
        for key, slot_id in zip(new_keys, ids, strict=True):  # a plain loop: a comprehension costs a call per batch
            seq += 1
            fresh.append(Slot(key, slot_id, seq, machine=machine))
        machine.fire_many(fresh, SlotEvent.BEGIN_WRITE, distinct=True)  # absent -> writing: one row for all
        for slot in fresh:
            slots[slot.key] = slot
        self._next_seq = seq
        if self._request_scoped:
            self._policy.insert_pending(new_keys, access)  # held (not evictable) while being written
        self._num_writing += n
        return ids, tuple(victims)

    def _evict(self, victims: list[OffloadKey]) -> None:
        """Victims already left the policy; free their slots and report them removed."""
        slots = self._slots
        gone = [slots[key] for key in victims]
        removed: list[OffloadKey] = []
        for _source, _dest, effect, members in self._machine.fire_many(gone, SlotEvent.EVICT, distinct=True):
            if effect is SlotEffect.EMIT_REMOVED:
                removed.extend([slot.key for slot in members])
        for key in victims:
            del slots[key]
        self._free_ids.extend([slot.slot_id for slot in gone])
        self._num_ready -= len(victims)
        self._stats.evictions += len(victims)
        if removed and self.enable_events:
            self._events.append(OffloadingEvent(tuple(removed), self._medium, removed=True))

    def _finish_writes(self, slots_written: list[Slot], success: bool, *, promotion: bool) -> None:
        """``slots_written`` holds distinct slots, all in the writing state, of GPU stores or of promotions."""
        if not slots_written:
            return
        policy = self._policy
        holds_writing = self._request_scoped
        n = len(slots_written)
        if success:
            emit = self.enable_events
            stored: list[OffloadKey] = []
            for _source, dest, effect, members in self._machine.fire_many(
                slots_written, SlotEvent.COMMIT_WRITE, distinct=True
            ):
                if effect is _EMIT_STORED and emit:
                    stored.extend([slot.key for slot in members])
                if not holds_writing:
                    policy.insert_many([slot.key for slot in members], evictable=is_evictable(dest))
            if holds_writing:
                # One batch: a request-scoped policy re-heaps once.
                policy.mark_ready_many([slot.key for slot in slots_written])
            self._num_ready += n
            if promotion:
                self._stats.promotions_committed += n
            else:
                self._stats.stores_committed += n
            if stored:
                self._events.append(OffloadingEvent(tuple(stored), self._medium, removed=False))
        else:
            slots = self._slots
            writing = [slot.key for slot in slots_written]
            released: list[OffloadKey] = []
            for _source, _dest, effect, members in self._machine.fire_many(
                slots_written, SlotEvent.ABORT_WRITE, distinct=True
            ):
                if effect is SlotEffect.EMIT_REMOVED:
                    released.extend([slot.key for slot in members])
            for key in writing:
                del slots[key]
            if holds_writing:
                for key in writing:
                    policy.remove(key)
            self._free_ids.extend([slot.slot_id for slot in slots_written])
            if released and self.enable_events:
                # Never announced as stored; the removal tells listeners to drop their bookkeeping.
                self._events.append(OffloadingEvent(tuple(released), self._medium, removed=True, metadata_only=True))
            if promotion:
                self._stats.promotions_failed += n
            else:
                self._stats.stores_failed += n
        self._num_writing -= n

    def _alloc_ids(self, n: int) -> tuple[int, ...]:
        """``n`` ids: never-used ones first (ascending), then the most recently freed ones, last freed
        first (vLLM's chunk-pool order). The caller made room for ``n``."""
        first = self._next_id
        if n <= self._num_slots - first:  # never-used ids only (until the pool has been used once)
            self._next_id = first + n
            return (first,) if n == 1 else tuple(range(first, first + n))
        fresh = self._num_slots - first
        self._next_id = self._num_slots
        free = self._free_ids
        cut = len(free) - (n - fresh)
        reused = free[cut:]
        del free[cut:]
        reused.reverse()
        return (*range(first, first + fresh), *reused)
