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

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence, Set
from typing import Final

from typing_extensions import override

from kvfsm.control.types import OffloadKey
from kvfsm.errors import ConfigError, KeyNotReadyError

__all__ = ["POLICY_NAMES", "ARCPolicy", "CachePolicy", "LRUPolicy", "make_policy"]

POLICY_NAMES: Final[tuple[str, ...]] = ("lru", "arc")


def _show(key: OffloadKey) -> str:
    return key.hex() if len(key) <= 40 else key[:20].hex() + "..."


class CachePolicy(ABC):
    """Recency bookkeeping of the readable keys of one tier, and the choice of eviction victims."""

    __slots__ = ()

    @abstractmethod
    def insert(self, key: OffloadKey, *, evictable: bool = True) -> None:
        """Add a key that is not held yet, as the most recent; KeyNotReadyError if it is already held."""

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
    def insert(self, key: OffloadKey, *, evictable: bool = True) -> None:
        if key in self._order:
            raise KeyNotReadyError(f"policy already holds key {_show(key)}; expected a key not yet inserted")
        self._order[key] = None
        if evictable:
            self._evictable[key] = None

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
    def insert(self, key: OffloadKey, *, evictable: bool = True) -> None:
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


def make_policy(name: str, capacity: int | None = None) -> CachePolicy:
    """Build a policy by name (``"lru"`` or ``"arc"``); ``capacity`` sizes ARC's ghost lists."""
    key = name.strip().lower()
    if key == "lru":
        return LRUPolicy()
    if key == "arc":
        return ARCPolicy(capacity)
    raise ConfigError(f"unknown cache policy {name!r}; expected one of {', '.join(POLICY_NAMES)}")
