"""Eviction policies: LRU and ARC order, touch order, evictability, protection, atomic eviction."""

from __future__ import annotations

import random

import pytest

from kvfsm.control.policies import (
    ARCPolicy,
    CachePolicy,
    LRUPolicy,
    RequestAccess,
    RequestARCPolicy,
    RequestLRUPolicy,
    make_policy,
)
from kvfsm.control.types import OffloadKey, make_offload_key
from kvfsm.errors import ConfigError, KeyNotReadyError


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def filled(policy: CachePolicy, n: int) -> CachePolicy:
    for i in range(n):
        policy.insert(k(i))
    return policy


POLICIES = [pytest.param(LRUPolicy, id="lru"), pytest.param(ARCPolicy, id="arc")]


# -- both policies --


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_takes_oldest_first(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 4)
    assert p.evict(2, frozenset()) == [k(0), k(1)]
    assert len(p) == 2
    assert k(0) not in p and k(2) in p


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_skips_non_evictable_and_protected(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 5)
    p.mark_non_evictable(k(0))
    assert p.evict(2, frozenset({k(1)})) == [k(2), k(3)]
    assert k(0) in p and k(1) in p
    assert not p.is_evictable(k(0))
    assert p.num_evictable == 2  # k1 and k4


@pytest.mark.parametrize("cls", POLICIES)
def test_evict_is_all_or_nothing(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 4)
    p.mark_non_evictable(k(1))
    before = (p.keys(), p.num_evictable, len(p))
    # 3 evictable keys, one protected: 2 candidates for 3 victims.
    assert p.evict(3, frozenset({k(0)})) is None
    assert (p.keys(), p.num_evictable, len(p)) == before
    assert p.evict(5, frozenset()) is None
    assert (p.keys(), p.num_evictable, len(p)) == before
    assert p.evict(0, frozenset()) == []
    with pytest.raises(ConfigError, match="expected a count >= 0"):
        p.evict(-1, frozenset())


@pytest.mark.parametrize("cls", POLICIES)
def test_mark_evictable_returns_key_to_eviction(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 3)
    p.mark_non_evictable(k(0))
    p.mark_non_evictable(k(0))  # idempotent
    assert p.num_evictable == 2
    p.mark_evictable(k(0))
    p.mark_evictable(k(0))  # idempotent
    assert p.num_evictable == 3
    assert p.is_evictable(k(0))
    # Release counts as a use: k0 is now the most recent.
    assert p.evict(2, frozenset()) == [k(1), k(2)]


@pytest.mark.parametrize("cls", POLICIES)
def test_insert_non_evictable(cls: type[CachePolicy]) -> None:
    p = cls()
    p.insert(k(0), evictable=False)
    p.insert(k(1))
    assert p.evict(1, frozenset()) == [k(1)]
    assert p.evict(1, frozenset()) is None
    assert k(0) in p


@pytest.mark.parametrize("cls", POLICIES)
def test_bad_input_raises_typed_errors_and_changes_nothing(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 2)
    before = (p.keys(), p.num_evictable)
    with pytest.raises(KeyNotReadyError, match="already holds"):
        p.insert(k(0))
    for op in (p.remove, p.mark_evictable, p.mark_non_evictable):
        with pytest.raises(KeyNotReadyError, match="policy holds no key"):
            op(k(9))
    assert (p.keys(), p.num_evictable) == before


@pytest.mark.parametrize("cls", POLICIES)
def test_remove_and_clear(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 3)
    p.remove(k(1))
    assert k(1) not in p and len(p) == 2 and p.num_evictable == 2
    p.clear()
    assert len(p) == 0 and p.num_evictable == 0 and p.keys() == []
    assert p.evict(1, frozenset()) is None


@pytest.mark.parametrize("cls", POLICIES)
def test_touch_ignores_unknown_keys(cls: type[CachePolicy]) -> None:
    p = filled(cls(), 2)
    p.touch([k(7), k(8)])
    assert len(p) == 2 and k(7) not in p


def test_make_policy() -> None:
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("ARC"), ARCPolicy)
    with pytest.raises(ConfigError, match=r"unknown cache policy 'fifo'; expected one of lru, arc"):
        make_policy("fifo")
    with pytest.raises(ValueError):  # ConfigError is a ValueError
        make_policy("")


# -- LRU --


def test_lru_touch_in_reverse_first_key_most_recent() -> None:
    p = filled(LRUPolicy(), 4)
    p.touch([k(0), k(1)])
    assert p.keys() == [k(2), k(3), k(1), k(0)]
    assert p.evict(3, frozenset()) == [k(2), k(3), k(1)]


def test_lru_touch_of_pinned_key_keeps_recency_when_released() -> None:
    p = filled(LRUPolicy(), 3)
    p.mark_non_evictable(k(0))
    p.touch([k(0)])
    assert p.keys() == [k(1), k(2), k(0)]
    p.mark_evictable(k(0))
    assert p.evict(3, frozenset()) == [k(1), k(2), k(0)]


def test_lru_evict_matches_reference_model() -> None:
    """The evictable map stays in the full map's order under random operations."""
    rng = random.Random(7)
    p = LRUPolicy()
    order: list[OffloadKey] = []  # least recent first
    pinned: set[OffloadKey] = set()
    for step in range(3000):
        op = rng.randrange(6)
        key = k(rng.randrange(40))
        if op == 0 and key not in order:
            p.insert(key)
            order.append(key)
        elif op == 1 and key in order:
            p.mark_non_evictable(key)
            pinned.add(key)
        elif op == 2 and key in pinned:
            p.mark_evictable(key)
            pinned.discard(key)
            order.remove(key)
            order.append(key)
        elif op == 3:
            keys = [k(rng.randrange(40)) for _ in range(rng.randrange(4))]
            p.touch(keys)
            for t in reversed(keys):
                if t in order:
                    order.remove(t)
                    order.append(t)
        elif op == 4:
            n = rng.randrange(4)
            protected = frozenset(k(rng.randrange(40)) for _ in range(rng.randrange(5)))
            candidates = [x for x in order if x not in pinned and x not in protected]
            expected = candidates[:n] if len(candidates) >= n else None
            assert p.evict(n, protected) == expected, step
            for x in expected or ():
                order.remove(x)
        elif op == 5 and key in order and rng.random() < 0.2:
            p.remove(key)
            order.remove(key)
            pinned.discard(key)
        assert p.keys() == order
        assert p.num_evictable == len(order) - len(pinned)


# -- ARC --


def test_arc_touch_promotes_t1_to_t2() -> None:
    p = ARCPolicy(capacity=4)
    filled(p, 3)
    assert p.t1_keys() == [k(0), k(1), k(2)] and p.t2_keys() == []
    p.touch([k(1), k(0)])
    assert p.t1_keys() == [k(2)]
    assert p.t2_keys() == [k(0), k(1)]  # reverse order: k1 ends most recent
    p.touch([k(0)])
    assert p.t2_keys() == [k(1), k(0)]


def test_arc_promotion_keeps_pin() -> None:
    p = ARCPolicy(capacity=4)
    filled(p, 2)
    p.mark_non_evictable(k(0))
    p.touch([k(0)])
    assert p.t2_keys() == [k(0)]
    assert not p.is_evictable(k(0))
    assert p.evict(1, frozenset()) == [k(1)]
    assert p.evict(1, frozenset()) is None
    p.mark_evictable(k(0))
    assert p.evict(1, frozenset()) == [k(0)]
    assert p.b2_keys() == [k(0)]


def test_arc_ghost_hit_in_b1_grows_target_and_lands_in_t2() -> None:
    p = ARCPolicy(capacity=2)
    filled(p, 2)
    assert p.evict(1, frozenset()) == [k(0)]
    assert p.b1_keys() == [k(0)]
    assert p.target_t1_size == 0
    p.insert(k(0))
    assert p.target_t1_size == 1
    assert p.b1_keys() == []
    assert p.t2_keys() == [k(0)] and p.t1_keys() == [k(1)]


def test_arc_ghost_hit_in_b2_shrinks_target() -> None:
    p = ARCPolicy(capacity=4)
    filled(p, 3)
    p.evict(1, frozenset())  # k0 -> B1
    p.insert(k(0))  # target 1, k0 in T2
    assert p.target_t1_size == 1
    p.touch([k(1)])  # T1=[k2], T2=[k0, k1]
    # |T1| = 1 is not above the target: eviction prefers T2's oldest.
    assert p.evict(1, frozenset()) == [k(0)]
    assert p.b2_keys() == [k(0)]
    p.insert(k(0))
    assert p.target_t1_size == 0
    assert p.t2_keys() == [k(1), k(0)]


def test_arc_eviction_prefers_t1_above_target_and_falls_back() -> None:
    p = ARCPolicy(capacity=8)
    filled(p, 4)
    p.touch([k(3)])  # T1=[k0,k1,k2], T2=[k3]
    # T1 above target 0 -> T1 first; once T1 has no unprotected evictable key, T2.
    assert p.evict(2, frozenset({k(1), k(2)})) == [k(0), k(3)]
    assert p.b1_keys() == [k(0)] and p.b2_keys() == [k(3)]


def test_arc_eviction_is_atomic() -> None:
    p = ARCPolicy(capacity=8)
    filled(p, 4)
    p.touch([k(3)])
    before = (p.t1_keys(), p.t2_keys(), p.b1_keys(), p.b2_keys(), p.target_t1_size, p.num_evictable)
    assert p.evict(3, frozenset({k(0), k(1)})) is None
    after = (p.t1_keys(), p.t2_keys(), p.b1_keys(), p.b2_keys(), p.target_t1_size, p.num_evictable)
    assert after == before


def test_arc_ghosts_are_bounded() -> None:
    p = ARCPolicy(capacity=3)
    for i in range(50):
        p.insert(k(i))
        if len(p) > 3:
            assert p.evict(len(p) - 3, frozenset()) is not None
        assert len(p.t1_keys()) + len(p.b1_keys()) <= 3
        assert len(p) + len(p.b1_keys()) + len(p.b2_keys()) <= 6
    assert len(p) == 3


def test_arc_remove_leaves_no_ghost() -> None:
    p = ARCPolicy(capacity=4)
    filled(p, 2)
    p.remove(k(0))
    assert p.b1_keys() == [] and k(0) not in p
    p.insert(k(0))
    assert p.t1_keys() == [k(1), k(0)] and p.target_t1_size == 0


def test_arc_config_and_clear() -> None:
    with pytest.raises(ConfigError, match="expected >= 1 or None"):
        ARCPolicy(capacity=0)
    p = ARCPolicy()
    filled(p, 3)
    assert p.capacity == 3  # grows with the most keys held
    p.evict(1, frozenset())
    p.insert(k(0))
    assert p.target_t1_size == 1
    p.clear()
    assert (p.t1_keys(), p.t2_keys(), p.b1_keys(), p.b2_keys(), p.target_t1_size) == ([], [], [], [], 0)


# -- request-scoped policies (vLLM 0.33's rules, spec/README.md "vLLM semantics") --


def test_request_lru_orders_by_rank_not_by_the_order_keys_become_evictable() -> None:
    p = RequestLRUPolicy()
    for i in range(4):
        p.insert(k(i), evictable=False)  # reserved (writing) in this order
    for i in (3, 1, 0, 2):
        p.mark_ready(k(i))  # committed in another order
    assert p.keys() == [k(0), k(1), k(2), k(3)]
    p.mark_non_evictable(k(0))  # read...
    p.mark_evictable(k(0))  # ...and released: no recency change (vLLM), unlike LRUPolicy
    assert p.evict(2, frozenset()) == [k(0), k(1)]


def test_request_lru_positions_share_the_request_rank_tail_oldest() -> None:
    p = RequestLRUPolicy()
    positions = {k(i): 16 * i for i in range(3)}
    access = RequestAccess(positions.get)
    for i in (2, 0, 1):
        p.insert(k(i), access=access)
    p.insert(k(9))  # no position: a fresh rank, newer than the request's
    assert p.keys() == [k(2), k(1), k(0), k(9)]
    p.on_request_finished([k(0), k(1), k(2)], set(), set())
    assert p.keys() == [k(9), k(2), k(1), k(0)]  # committed: the head most recent


def test_request_arc_keeps_each_ghost_list_within_capacity_and_adapts_on_store_miss() -> None:
    p = RequestARCPolicy(2)
    for i in range(6):
        p.insert(k(i))
        if len(p) > 2:
            assert p.evict(1, frozenset()) is not None
    assert len(p.b1_keys()) == 2 and p.b1_keys() == [k(2), k(3)]
    p.on_store_miss([k(3)])  # a B1 ghost offered again: T1 deserved more room
    assert p.target_t1_size == 1.0
    p.insert(k(3))
    assert k(3) in p.t1_keys() and k(3) not in p.b1_keys()


def test_request_arc_touch_keeps_a_writing_key_in_t1() -> None:
    p = RequestARCPolicy(4)
    p.insert(k(0), evictable=False)
    p.insert(k(1))
    p.touch([k(0), k(1)])
    assert p.t1_keys() == [k(0)] and p.t2_keys() == [k(1)]
    p.on_request_finished([k(0)], set(), {k(0)})  # reuse at finish promotes
    assert p.t2_keys() == [k(1), k(0)]


def test_request_arc_evicts_from_t1_while_it_reaches_the_target() -> None:
    p = RequestARCPolicy(4)
    for i in range(4):
        p.insert(k(i))
    p.touch([k(2), k(3)])  # T2: k3, k2 (touch runs last-to-first)
    assert p.evict(2, frozenset()) == [k(0), k(1)]  # |T1| >= int(target) = 0: T1 first, then T2
    assert p.b1_keys() == [k(0), k(1)]


def test_make_policy_knows_the_request_scoped_names() -> None:
    assert isinstance(make_policy("request-lru"), RequestLRUPolicy)
    assert isinstance(make_policy("request-arc", 3), RequestARCPolicy)
    assert make_policy("request-lru").request_scoped and not make_policy("lru").request_scoped


def test_request_lru_batch_insert_ranks_as_one_insert_per_key() -> None:
    positions = {k(i): 16 * i for i in (1, 3, 4)}  # k0 and k2 have no position
    batched, single = RequestLRUPolicy(), RequestLRUPolicy()
    a1, a2 = RequestAccess(positions.get), RequestAccess(positions.get)
    ks = [k(i) for i in range(5)]
    batched.insert_pending(ks, a1)
    for key in ks:
        single.insert(key, evictable=False, access=a2)
    assert [batched.rank(key) for key in ks] == [single.rank(key) for key in ks]
    assert a1.rank == a2.rank
    with pytest.raises(KeyNotReadyError, match="already holds"):
        batched.insert_pending([k(9), k(1)], a1)
    assert k(9) not in batched  # nothing inserted
