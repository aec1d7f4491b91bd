"""Eviction policies of the CPU primary (vLLM's ``kv_offload/cpu/policies``): LRU and ARC.

A policy holds only keys whose data is readable (the manager inserts a key when its write commits). Each
key is either evictable (ready, nobody reading it) or pinned (being read); only evictable keys that the
caller does not protect are ever returned by :meth:`CachePolicy.evict`, and an eviction is all-or-nothing.

Recency: a key is used when it is inserted, touched, or released by its last reader
(:meth:`CachePolicy.mark_evictable`). Counting the release as a use keeps a second ``OrderedDict`` of the
evictable keys in exactly the same order as the full one, so eviction walks only evictable keys: its cost
is O(victims + protected keys met), never O(all keys).
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from dataclasses import dataclass, field
from typing import ClassVar, Final

from typing_extensions import override

from kvfsm.control.types import OffloadKey
from kvfsm.errors import ConfigError, KeyNotReadyError

__all__ = [
    "POLICY_NAMES",
    "ARCPolicy",
    "CachePolicy",
    "LRUPolicy",
    "RequestARCPolicy",
    "RequestAccess",
    "RequestLRUPolicy",
    "make_policy",
]

#: ``lru`` and ``arc`` are kvfsm's commit-order policies (what the model checker abstracts);
#: ``request-lru`` and ``request-arc`` carry vLLM 0.33's request-scoped rules (spec/README.md, "vLLM semantics").
POLICY_NAMES: Final[tuple[str, ...]] = ("lru", "arc", "request-lru", "request-arc")

#: A request's token position of a key (the end token of its chunk), or None when not known.
KeyPosition = Callable[[OffloadKey], "int | None"]


def _no_position(key: OffloadKey) -> int | None:
    return None


@dataclass(slots=True, eq=False)
class RequestAccess:
    """What one request did to the cache until it finished (vLLM's ``_RequestCacheAccess`` and ``_RequestRank``).

    The CPU manager owns one per live request of a request-scoped policy and hands it to the policy's
    hooks. ``key_groups`` holds the keys the request offered or read, per KV-cache group, first seen first;
    ``inserted`` the keys it stored, ``reused`` the ready keys it read or re-offered, ``store_misses`` the
    keys the policy has already seen missed by it (one ARC adaptation per request and key).
    """

    key_position: KeyPosition = _no_position
    #: The LRU rank every positioned key of this request shares (0: none drawn yet).
    rank: int = 0
    key_groups: dict[int, list[OffloadKey]] = field(default_factory=dict)
    seen: set[OffloadKey] = field(default_factory=set)
    inserted: set[OffloadKey] = field(default_factory=set)
    reused: set[OffloadKey] = field(default_factory=set)
    store_misses: set[OffloadKey] = field(default_factory=set)

    def ordered_keys(self) -> list[OffloadKey]:
        """Every key seen, head to tail: by token position when each key has one, else group by group in
        the order first seen (vLLM's ``order_request_keys`` over its sorted groups)."""
        pos = self.key_position
        groups: list[list[OffloadKey]] = []
        for group in sorted(self.key_groups):
            keys = self.key_groups[group]
            known = [(p, key) for key in keys if (p := pos(key)) is not None]
            if len(known) == len(keys):
                keys = [key for _, key in sorted(known, key=lambda e: e[0])]
            groups.append(keys)
        flat = [key for keys in groups for key in keys]
        positions = {key: p for key in flat if (p := pos(key)) is not None}
        if len(positions) == len(flat):
            flat.sort(key=positions.__getitem__)
        return flat


def _show(key: OffloadKey) -> str:
    return key.hex() if len(key) <= 40 else key[:20].hex() + "..."


class CachePolicy(ABC):
    """Recency bookkeeping of the readable keys of one tier, and the choice of eviction victims."""

    __slots__ = ()

    #: Whether the policy keeps vLLM's request-scoped recency: it then holds writing keys too (inserted
    #: when their store is prepared, made ready by :meth:`mark_ready`), and the manager feeds it each
    #: request's accesses (:meth:`on_store_miss`, :meth:`on_request_access`, :meth:`on_request_finished`).
    request_scoped: ClassVar[bool] = False

    @abstractmethod
    def insert(self, key: OffloadKey, *, evictable: bool = True, access: RequestAccess | None = None) -> None:
        """Add a key that is not held yet, as the most recent; KeyNotReadyError if it is already held."""

    def insert_many(self, keys: Sequence[OffloadKey], *, evictable: bool = True) -> None:
        """:meth:`insert` for each key, in order (a policy may batch it)."""
        for key in keys:
            self.insert(key, evictable=evictable)

    def mark_ready(self, key: OffloadKey) -> None:
        """A held writing key's store committed (request-scoped policies only; others insert at commit)."""
        self.mark_evictable(key)

    def insert_pending(self, keys: Sequence[OffloadKey], access: RequestAccess | None) -> None:
        """Insert keys whose store was just prepared, not evictable, in order (request-scoped policies)."""
        for key in keys:
            self.insert(key, evictable=False, access=access)

    def mark_ready_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`mark_ready` for each key, in order (a policy may batch it)."""
        for key in keys:
            self.mark_ready(key)

    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`mark_evictable` for each key, in order (a policy may batch it)."""
        for key in keys:
            self.mark_evictable(key)

    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`mark_non_evictable` for each key (a policy may batch it); nothing changes if one is not held."""
        for key in keys:
            if key not in self:
                raise _not_held(key, "mark_non_evictable()")
        for key in keys:
            self.mark_non_evictable(key)

    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027 - optional hook
        """Keys a request offered for storing that are not held (ARC learns from its ghosts here)."""

    def on_request_access(self, keys: Sequence[OffloadKey], access: RequestAccess) -> None:  # noqa: B027
        """First accesses of a live request (optional hook): keep its prefix order, commit nothing yet."""

    def on_request_finished(
        self, ordered: Sequence[OffloadKey], insertion_only: Set[OffloadKey], reused: Set[OffloadKey]
    ) -> None:
        """A request finished: apply its accesses, ``ordered`` head to tail. Default: one touch."""
        self.touch(ordered)

    @abstractmethod
    def remove(self, key: OffloadKey) -> None:
        """Forget a held key (no ghost entry); KeyNotReadyError if it is not held."""

    @abstractmethod
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark keys used, in reverse so that ``keys[0]`` ends most recent; keys not held are ignored."""

    @abstractmethod
    def mark_evictable(self, key: OffloadKey) -> None:
        """The key's last reader finished: it may be evicted again (and counts as just used)."""

    @abstractmethod
    def mark_non_evictable(self, key: OffloadKey) -> None:
        """The key is being read: never evict it until :meth:`mark_evictable`."""

    @abstractmethod
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        """Remove and return exactly ``n`` evictable keys not in ``protected``, oldest first.

        None, with nothing changed, when fewer than ``n`` such keys exist.
        """

    @abstractmethod
    def clear(self) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def is_evictable(self, key: OffloadKey) -> bool: ...

    @property
    @abstractmethod
    def num_evictable(self) -> int: ...

    @abstractmethod
    def keys(self) -> list[OffloadKey]:
        """Held keys, least recent first (ARC: T1 then T2). For tests and metrics, O(all keys)."""


def _check_n(n: int) -> None:
    if n < 0:
        raise ConfigError(f"cannot evict {n} keys; expected a count >= 0")


def _not_held(key: OffloadKey, what: str) -> KeyNotReadyError:
    return KeyNotReadyError(f"policy holds no key {_show(key)}; expected a key inserted before {what}")


class LRUPolicy(CachePolicy):
    """Least recently used first; ``_order`` has every key, ``_evictable`` the evictable ones, same order."""

    __slots__ = ("_evictable", "_order")

    def __init__(self) -> None:
        self._order: OrderedDict[OffloadKey, None] = OrderedDict()
        self._evictable: OrderedDict[OffloadKey, None] = OrderedDict()

    @override
    def insert(self, key: OffloadKey, *, evictable: bool = True, access: RequestAccess | None = None) -> None:
        if key in self._order:
            raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        self._order[key] = None
        if evictable:
            self._evictable[key] = None

    @override
    def insert_many(self, keys: Sequence[OffloadKey], *, evictable: bool = True) -> None:
        """:meth:`insert` for each key in order, without a call per key (every store's commit)."""
        order, ready = self._order, self._evictable
        for key in keys:
            if key in order:
                raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
            order[key] = None
            if evictable:
                ready[key] = None

    @override
    def remove(self, key: OffloadKey) -> None:
        if key not in self._order:
            raise _not_held(key, "remove()")
        del self._order[key]
        self._evictable.pop(key, None)

    @override
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        order, evictable = self._order, self._evictable
        for key in reversed(keys):
            if key in order:
                order.move_to_end(key)
                if key in evictable:
                    evictable.move_to_end(key)

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        if key not in self._order:
            raise _not_held(key, "mark_evictable()")
        if key in self._evictable:
            return
        # The release is a use: moving the key to the recent end of both maps keeps them in one order.
        self._order.move_to_end(key)
        self._evictable[key] = None

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key not in self._order:
            raise _not_held(key, "mark_non_evictable()")
        self._evictable.pop(key, None)

    @override
    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`mark_evictable` for each key in order, without a call per key (every load's commit)."""
        order, evictable = self._order, self._evictable
        for key in keys:
            if key not in order:
                raise _not_held(key, "mark_evictable()")
            if key not in evictable:
                order.move_to_end(key)
                evictable[key] = None

    @override
    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        """:meth:`mark_non_evictable` for each key, all checked first, without a call per key (every load)."""
        order = self._order
        for key in keys:
            if key not in order:
                raise _not_held(key, "mark_non_evictable()")
        pop = self._evictable.pop
        for key in keys:
            pop(key, None)

    @override
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_n(n)
        if n == 0:
            return []
        if n > len(self._evictable):
            return None
        victims: list[OffloadKey] = []
        for key in self._evictable:
            if key in protected:
                continue
            victims.append(key)
            if len(victims) == n:
                break
        else:
            return None  # too few unprotected: nothing was removed yet
        for key in victims:
            del self._evictable[key]
            del self._order[key]
        return victims

    @override
    def clear(self) -> None:
        self._order.clear()
        self._evictable.clear()

    @override
    def __len__(self) -> int:
        return len(self._order)

    @override
    def __contains__(self, key: object) -> bool:
        return key in self._order

    @override
    def is_evictable(self, key: OffloadKey) -> bool:
        return key in self._evictable

    @override
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @override
    def keys(self) -> list[OffloadKey]:
        return list(self._order)


def _next_unprotected(it: Iterator[OffloadKey], protected: Set[OffloadKey]) -> OffloadKey | None:
    for key in it:
        if key not in protected:
            return key
    return None


class ARCPolicy(CachePolicy):
    """Adaptive replacement cache: T1 (seen once) and T2 (seen again), with ghost lists B1 and B2.

    A key evicted from T1 (T2) is remembered in B1 (B2). Re-inserting a B1 ghost means T1 was too small:
    the target size of T1 grows; a B2 ghost shrinks it. Either way the key returns straight into T2.
    Eviction takes from T1 while T1 (less the victims already chosen) is above the target, else from T2,
    falling back to the other list when the preferred one has no evictable, unprotected key.

    ``capacity`` bounds the ghost lists and the target; None uses the most keys ever held at once.
    """

    __slots__ = ("_b1", "_b2", "_capacity", "_max_held", "_t1", "_t1_ev", "_t2", "_t2_ev", "_target")

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ConfigError(f"ARC capacity {capacity} is too small; expected >= 1 or None")
        self._capacity = capacity
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t1_ev: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2_ev: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._target = 0
        self._max_held = 0

    # -- introspection (tests, metrics) --

    @property
    def target_t1_size(self) -> int:
        return self._target

    @property
    def capacity(self) -> int:
        """The ARC size c: the configured capacity, else the most keys held at once (at least 1)."""
        return self._capacity if self._capacity is not None else max(1, self._max_held)

    def t1_keys(self) -> list[OffloadKey]:
        return list(self._t1)

    def t2_keys(self) -> list[OffloadKey]:
        return list(self._t2)

    def b1_keys(self) -> list[OffloadKey]:
        return list(self._b1)

    def b2_keys(self) -> list[OffloadKey]:
        return list(self._b2)

    # -- CachePolicy --

    @override
    def insert(self, key: OffloadKey, *, evictable: bool = True, access: RequestAccess | None = None) -> None:
        if key in self._t1 or key in self._t2:
            raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        c = self.capacity
        if key in self._b1:
            # A T1 ghost came back: T1 was evicted too early, so give it more room.
            self._target = min(c, self._target + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            lst, ev = self._t2, self._t2_ev
        elif key in self._b2:
            self._target = max(0, self._target - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            lst, ev = self._t2, self._t2_ev
        else:
            lst, ev = self._t1, self._t1_ev
        lst[key] = None
        if evictable:
            ev[key] = None
        self._max_held = max(self._max_held, len(self))
        self._trim_ghosts()

    @override
    def remove(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
            self._t1_ev.pop(key, None)
        elif key in self._t2:
            del self._t2[key]
            self._t2_ev.pop(key, None)
        else:
            raise _not_held(key, "remove()")

    @override
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2, t1_ev, t2_ev = self._t1, self._t2, self._t1_ev, self._t2_ev
        for key in reversed(keys):
            if key in t1:
                # Seen again: promote from T1 (recency) to T2 (frequency).
                del t1[key]
                t2[key] = None
                if key in t1_ev:
                    del t1_ev[key]
                    t2_ev[key] = None
            elif key in t2:
                t2.move_to_end(key)
                if key in t2_ev:
                    t2_ev.move_to_end(key)

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        if key in self._t1:
            lst, ev = self._t1, self._t1_ev
        elif key in self._t2:
            lst, ev = self._t2, self._t2_ev
        else:
            raise _not_held(key, "mark_evictable()")
        if key in ev:
            return
        lst.move_to_end(key)  # the release is a use; keeps ``ev`` in the list's order
        ev[key] = None

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key in self._t1:
            self._t1_ev.pop(key, None)
        elif key in self._t2:
            self._t2_ev.pop(key, None)
        else:
            raise _not_held(key, "mark_non_evictable()")

    @override
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_n(n)
        if n == 0:
            return []
        if n > len(self._t1_ev) + len(self._t2_ev):
            return None
        # Plan first without touching any map, so a shortfall leaves everything as it was.
        it1, it2 = iter(self._t1_ev), iter(self._t2_ev)
        c1 = _next_unprotected(it1, protected)
        c2 = _next_unprotected(it2, protected)
        virtual_t1 = len(self._t1)
        plan: list[tuple[OffloadKey, bool]] = []  # (key, from T1)
        while len(plan) < n:
            if c1 is not None and (c2 is None or virtual_t1 > self._target):
                plan.append((c1, True))
                virtual_t1 -= 1
                c1 = _next_unprotected(it1, protected)
            elif c2 is not None:
                plan.append((c2, False))
                c2 = _next_unprotected(it2, protected)
            else:
                return None
        for key, from_t1 in plan:
            if from_t1:
                del self._t1[key]
                del self._t1_ev[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                del self._t2_ev[key]
                self._b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in plan]

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self._b1 and len(self._t1) + len(self._b1) > c:
            self._b1.popitem(last=False)
        while self._b2 and len(self) + len(self._b1) + len(self._b2) > 2 * c:
            self._b2.popitem(last=False)

    @override
    def clear(self) -> None:
        for m in (self._t1, self._t2, self._t1_ev, self._t2_ev, self._b1, self._b2):
            m.clear()
        self._target = 0
        self._max_held = 0

    @override
    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @override
    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    @override
    def is_evictable(self, key: OffloadKey) -> bool:
        return key in self._t1_ev or key in self._t2_ev

    @override
    @property
    def num_evictable(self) -> int:
        return len(self._t1_ev) + len(self._t2_ev)

    @override
    def keys(self) -> list[OffloadKey]:
        return [*self._t1, *self._t2]


_Rank = tuple[int, int]
_HeapEntry = tuple[_Rank, OffloadKey]


class RequestLRUPolicy(CachePolicy):
    """vLLM 0.33's LRU: recency is a rank, committed per request when it finishes, head most recent.

    Every held key (writing ones too) has a rank ``(r, -position)``; the evictable key with the smallest
    ``(rank, key)`` is the least recent, so the order is total and never depends on the order a caller
    lists keys in, nor on Python's hash seed. A key stored with a known token position takes its request's
    shared rank (the tail of a request is older than its head); one without a position, a touched key and
    every key of a finished request (tail first, so the head ends newest) draw fresh ranks. Becoming
    evictable (store committed, last reader gone) changes no rank. Evictable keys sit in a lazily
    invalidated min-heap: a stale entry (rank changed, or pinned) is skipped when popped.
    """

    __slots__ = ("_evictable", "_heap", "_next_rank", "_ranks")

    request_scoped: ClassVar[bool] = True

    def __init__(self) -> None:
        self._ranks: dict[OffloadKey, _Rank] = {}
        self._evictable: set[OffloadKey] = set()
        self._heap: list[_HeapEntry] = []
        self._next_rank = 0

    def _request_rank(self, access: RequestAccess) -> int:
        if access.rank == 0:
            self._next_rank += 1
            access.rank = self._next_rank
        return access.rank

    def _refresh(self, keys: Iterable[OffloadKey]) -> None:
        """Give ``keys`` fresh ranks in iteration order (the last one ends most recent)."""
        ranks, evictable = self._ranks, self._evictable
        moved: list[OffloadKey] = []
        rank = self._next_rank
        for key in keys:
            if key in ranks:
                rank += 1
                ranks[key] = (rank, 0)
                if key in evictable:
                    moved.append(key)
        self._next_rank = rank
        self._requeue(moved)

    def _requeue(self, moved: Sequence[OffloadKey]) -> None:
        if not moved:
            return
        if len(moved) >= max(64, len(self._evictable) // 4):
            self._rebuild()  # linear, cheaper than many pushes for a long prefix
        else:
            heap, ranks = self._heap, self._ranks
            for key in moved:
                heapq.heappush(heap, (ranks[key], key))
            self._maybe_compact()

    def _rebuild(self) -> None:
        ranks = self._ranks
        self._heap = [(ranks[key], key) for key in self._evictable]
        heapq.heapify(self._heap)

    def _maybe_compact(self) -> None:
        if len(self._heap) >= max(64, 2 * len(self._evictable)):
            self._rebuild()

    @override
    def insert(self, key: OffloadKey, *, evictable: bool = True, access: RequestAccess | None = None) -> None:
        if key in self._ranks:
            raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        position = None if access is None else access.key_position(key)
        if access is None or position is None:
            self._next_rank += 1
            rank: _Rank = (self._next_rank, 0)
        else:
            rank = (self._request_rank(access), -position)
        self._ranks[key] = rank
        if evictable:
            self._evictable.add(key)
            heapq.heappush(self._heap, (rank, key))

    @override
    def insert_pending(self, keys: Sequence[OffloadKey], access: RequestAccess | None) -> None:
        ranks = self._ranks
        for key in keys:
            if key in ranks:
                raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        if access is None:
            for key in keys:
                self._next_rank += 1
                ranks[key] = (self._next_rank, 0)
            return
        position = access.key_position
        for key in keys:
            p = position(key)
            if p is None:
                self._next_rank += 1
                ranks[key] = (self._next_rank, 0)
            else:
                ranks[key] = (self._request_rank(access), -p)

    @override
    def remove(self, key: OffloadKey) -> None:
        if key not in self._ranks:
            raise _not_held(key, "remove()")
        del self._ranks[key]
        self._evictable.discard(key)

    @override
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        self._refresh(reversed(keys))

    @override
    def on_request_access(self, keys: Sequence[OffloadKey], access: RequestAccess) -> None:
        ranks, evictable, pos = self._ranks, self._evictable, access.key_position
        request_rank = self._request_rank(access)
        moved: list[OffloadKey] = []
        for key in keys:
            position = pos(key)
            if position is None or key not in ranks:
                continue
            rank = (request_rank, -position)
            if ranks[key] >= rank:
                continue  # already as recent (a newer request, or this one's later position)
            ranks[key] = rank
            if key in evictable:
                moved.append(key)
        self._requeue(moved)

    @override
    def on_request_finished(
        self, ordered: Sequence[OffloadKey], insertion_only: Set[OffloadKey], reused: Set[OffloadKey]
    ) -> None:
        self._refresh(reversed(ordered))

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        if key not in self._ranks:
            raise _not_held(key, "mark_evictable()")
        if key in self._evictable:
            return
        self._evictable.add(key)
        heapq.heappush(self._heap, (self._ranks[key], key))
        self._maybe_compact()

    @override
    def mark_ready_many(self, keys: Sequence[OffloadKey]) -> None:
        self.mark_evictable_many(keys)

    @override
    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        ranks, evictable = self._ranks, self._evictable
        if not ranks.keys() >= set(keys):
            raise _not_held(next(key for key in keys if key not in ranks), "mark_evictable()")
        # One heap update for the batch (no rank changes: becoming evictable is not a use).
        added = [key for key in dict.fromkeys(keys) if key not in evictable]
        evictable.update(added)
        self._requeue(added)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key not in self._ranks:
            raise _not_held(key, "mark_non_evictable()")
        self._evictable.discard(key)

    @override
    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        ranks = self._ranks
        if not ranks.keys() >= set(keys):
            raise _not_held(next(key for key in keys if key not in ranks), "mark_non_evictable()")
        self._evictable.difference_update(keys)

    @override
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_n(n)
        if n == 0:
            return []
        if n > len(self._evictable):
            return None
        heap, ranks, evictable = self._heap, self._ranks, self._evictable
        selected: list[_HeapEntry] = []
        chosen: set[OffloadKey] = set()
        deferred: list[_HeapEntry] = []
        while heap and len(selected) < n:
            entry = heapq.heappop(heap)
            rank, key = entry
            if key not in evictable or ranks.get(key) != rank or key in chosen:
                continue  # stale, or a duplicate entry of a re-pinned key
            if key in protected:
                deferred.append(entry)
                continue
            selected.append(entry)
            chosen.add(key)
        for entry in deferred:
            heapq.heappush(heap, entry)
        if len(selected) < n:
            for entry in selected:
                heapq.heappush(heap, entry)
            return None
        victims = [key for _, key in selected]
        for key in victims:
            evictable.remove(key)
            del ranks[key]
        self._maybe_compact()
        return victims

    @override
    def clear(self) -> None:
        self._ranks.clear()
        self._evictable.clear()
        self._heap.clear()
        self._next_rank = 0

    @override
    def __len__(self) -> int:
        return len(self._ranks)

    @override
    def __contains__(self, key: object) -> bool:
        return key in self._ranks

    @override
    def is_evictable(self, key: OffloadKey) -> bool:
        return key in self._evictable

    @override
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @override
    def keys(self) -> list[OffloadKey]:
        ranks = self._ranks
        return sorted(ranks, key=lambda key: (ranks[key], key))

    def rank(self, key: OffloadKey) -> tuple[int, int] | None:
        """The key's recency rank (smaller is older), None if not held. Read-only view for tests."""
        return self._ranks.get(key)


class RequestARCPolicy(CachePolicy):
    """vLLM 0.33's ARC: T1/T2 hold writing keys too, and frequency comes from request reuse.

    - A key enters T1 when its store is prepared (not when it commits), and leaves a ghost list then.
    - A ghost offered for storing (once per request) or touched adapts the target: a B1 ghost grows it by
      ``max(1, |B2|/|B1|)`` (up to c), a B2 ghost shrinks it by ``max(1, |B1|/|B2|)`` (down to 0).
    - A finished request moves each ready key it reused from T1 to T2 (or to T2's recent end), tail
      first; a key it only inserted keeps its list and moves to that list's recent end.
    - A touch moves a ready T1 key to T2; a writing one stays in T1 (recent end).
    - Eviction takes T1's oldest evictable key while ``|T1|`` (less the victims chosen) ``>= int(target)``,
      else T2's, else T1's; afterwards each ghost list is cut to at most c keys.
    """

    __slots__ = ("_b1", "_b2", "_capacity", "_evictable", "_pending", "_t1", "_t2", "_target")

    request_scoped: ClassVar[bool] = True

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ConfigError(f"ARC capacity {capacity} is negative; expected >= 0")
        self._capacity = capacity
        self._t1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self._evictable: set[OffloadKey] = set()
        self._pending: set[OffloadKey] = set()
        self._target = 0.0

    # -- read-only views (tests, metrics) --

    @property
    def target_t1_size(self) -> float:
        return self._target

    @property
    def capacity(self) -> int:
        return self._capacity

    def t1_keys(self) -> list[OffloadKey]:
        return list(self._t1)

    def t2_keys(self) -> list[OffloadKey]:
        return list(self._t2)

    def b1_keys(self) -> list[OffloadKey]:
        return list(self._b1)

    def b2_keys(self) -> list[OffloadKey]:
        return list(self._b2)

    # -- CachePolicy --

    @override
    def insert(self, key: OffloadKey, *, evictable: bool = True, access: RequestAccess | None = None) -> None:
        if key in self._t1 or key in self._t2:
            raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)
        if evictable:
            self._evictable.add(key)
        else:
            self._pending.add(key)

    @override
    def mark_ready(self, key: OffloadKey) -> None:
        if key not in self:
            raise _not_held(key, "mark_ready()")
        self._pending.discard(key)
        self._evictable.add(key)

    @override
    def remove(self, key: OffloadKey) -> None:
        if key in self._t1:
            del self._t1[key]
        elif key in self._t2:
            del self._t2[key]
        else:
            raise _not_held(key, "remove()")
        self._evictable.discard(key)
        self._pending.discard(key)

    def _adapt(self, key: OffloadKey) -> None:
        b1, b2 = self._b1, self._b2
        if key in b1:
            self._target = min(self._target + max(1, len(b2) / len(b1)), self._capacity)
            b1.move_to_end(key)
        elif key in b2:
            self._target = max(self._target - max(1, len(b1) / len(b2)), 0)
            b2.move_to_end(key)

    @override
    def on_store_miss(self, keys: Sequence[OffloadKey]) -> None:
        for key in reversed(keys):
            self._adapt(key)

    @override
    def touch(self, keys: Sequence[OffloadKey]) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in t1:
                del t1[key]
                if key in self._pending:
                    t1[key] = None  # only prepared for storing: not a second use
                else:
                    t2[key] = None
            elif key in t2:
                t2.move_to_end(key)
            else:
                self._adapt(key)

    @override
    def on_request_finished(
        self, ordered: Sequence[OffloadKey], insertion_only: Set[OffloadKey], reused: Set[OffloadKey]
    ) -> None:
        t1, t2 = self._t1, self._t2
        for key in reversed(ordered):
            if key in insertion_only:
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)
            elif key in reused:
                if key in t1:
                    del t1[key]
                    t2[key] = None
                elif key in t2:
                    t2.move_to_end(key)

    def _check_held(self, keys: Sequence[OffloadKey], what: str) -> None:
        t1, t2 = self._t1, self._t2
        missing = [key for key in keys if key not in t1 and key not in t2]
        if missing:
            raise _not_held(missing[0], what)

    @override
    def mark_ready_many(self, keys: Sequence[OffloadKey]) -> None:
        self._check_held(keys, "mark_ready()")
        self._pending.difference_update(keys)
        self._evictable.update(keys)

    @override
    def mark_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        self._check_held(keys, "mark_evictable()")
        self._evictable.update(keys)

    @override
    def mark_non_evictable_many(self, keys: Sequence[OffloadKey]) -> None:
        self._check_held(keys, "mark_non_evictable()")
        self._evictable.difference_update(keys)

    @override
    def mark_evictable(self, key: OffloadKey) -> None:
        if key not in self:
            raise _not_held(key, "mark_evictable()")
        self._evictable.add(key)

    @override
    def mark_non_evictable(self, key: OffloadKey) -> None:
        if key not in self:
            raise _not_held(key, "mark_non_evictable()")
        self._evictable.discard(key)

    @override
    def evict(self, n: int, protected: Set[OffloadKey]) -> list[OffloadKey] | None:
        _check_n(n)
        if n == 0:
            return []
        if n > len(self._evictable):
            return None
        evictable = self._evictable

        def next_candidate(it: Iterator[OffloadKey]) -> OffloadKey | None:
            for key in it:
                if key in evictable and key not in protected:
                    return key
            return None

        # Plan first (the scans only move forward), apply only once n victims are found.
        it1, it2 = iter(self._t1), iter(self._t2)
        virtual_t1 = len(self._t1)
        target = int(self._target)
        plan: list[tuple[OffloadKey, bool]] = []
        for _ in range(n):
            key = None
            if virtual_t1 >= target:
                key = next_candidate(it1)
                if key is not None:
                    plan.append((key, True))
                    virtual_t1 -= 1
                    continue
            key = next_candidate(it2)
            if key is not None:
                plan.append((key, False))
                continue
            key = next_candidate(it1)
            if key is None:
                return None
            plan.append((key, True))
            virtual_t1 -= 1
        for key, from_t1 in plan:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
            evictable.discard(key)
        for ghost in (self._b1, self._b2):
            for _ in range(len(ghost) - self._capacity):
                ghost.popitem(last=False)
        return [key for key, _ in plan]

    @override
    def clear(self) -> None:
        for m in (self._t1, self._t2, self._b1, self._b2):
            m.clear()
        self._evictable.clear()
        self._pending.clear()
        self._target = 0.0

    @override
    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    @override
    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    @override
    def is_evictable(self, key: OffloadKey) -> bool:
        return key in self._evictable

    @override
    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @override
    def keys(self) -> list[OffloadKey]:
        return [*self._t1, *self._t2]


def make_policy(name: str, capacity: int | None = None) -> CachePolicy:
    """Build a policy by name (one of :data:`POLICY_NAMES`); ``capacity`` sizes ARC's ghost lists."""
    key = name.strip().lower()
    if key == "lru":
        return LRUPolicy()
    if key == "arc":
        return ARCPolicy(None if capacity is None else max(1, capacity))
    if key == "request-lru":
        return RequestLRUPolicy()
    if key == "request-arc":
        return RequestARCPolicy(0 if capacity is None else capacity)
    raise ConfigError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
