"""CPUOffloadingManager: slot transitions, lookup per state, eviction safety, events, reset, errors."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterable, Iterator

import pytest

from kvfsm.control.cpu import CPUOffloadingManager, Slot
from kvfsm.control.policies import RequestARCPolicy
from kvfsm.control.types import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
    make_offload_key,
)
from kvfsm.errors import ConfigError, InvalidTransition, KeyNotReadyError
from kvfsm.machines import slot_machine
from kvfsm.machines.compiled import SpecMachine, add_tracer, remove_tracer
from kvfsm.machines.names import SlotEffect, SlotEvent, SlotState

CTX = ReqContext("r1")
A, W, R, RD = SlotState.ABSENT, SlotState.WRITING, SlotState.READY, SlotState.READING


def k(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"))


def keys(*ids: int) -> list[OffloadKey]:
    return [k(i) for i in ids]


def store(m: CPUOffloadingManager, *ids: int) -> PrepareStoreOutput:
    out = m.prepare_store(keys(*ids), CTX)
    assert out is not None
    m.complete_store(out.keys_to_store, CTX)
    return out


Snapshot = tuple[tuple[tuple[SlotState, int | None, int | None], ...], int, int, int, int, int, list[OffloadKey]]


def snapshot(m: CPUOffloadingManager, universe: Iterable[int] = range(16)) -> Snapshot:
    per_key = tuple((m.slot_state(k(i)), m.ref_cnt(k(i)), m.slot_id(k(i))) for i in universe)
    return (
        per_key,
        m.num_free,
        m.num_writing,
        m.num_reading,
        m.num_evictable,
        len(m.policy),
        m.policy.keys(),
    )


def check_counts(m: CPUOffloadingManager, universe: Iterable[int]) -> None:
    """The incremental counts agree with a full scan."""
    states = [m.slot_state(k(i)) for i in universe]
    assert m.num_writing == states.count(W)
    assert m.num_evictable == states.count(R) == m.policy.num_evictable
    assert m.num_reading == states.count(RD)
    assert m.num_free == m.num_slots - (len(states) - states.count(A))
    # A request-scoped policy (vLLM's rules) also holds the keys being written.
    writing = states.count(W) if m.policy.request_scoped else 0
    assert len(m.policy) == states.count(R) + states.count(RD) + writing


class RecordingMachine:
    """A transition tracer on the real slot machine; logs every slot transition as (key, before, event, after)."""

    def __init__(self, inner: SpecMachine[SlotState, SlotEvent, SlotEffect]) -> None:
        self.inner = inner
        self.log: list[tuple[OffloadKey, SlotState, SlotEvent, SlotState]] = []

    def __call__(self, machine: str, model: object, event: str, source: str, dest: str) -> None:
        if machine == "slot" and isinstance(model, Slot):
            self.log.append((model.key, SlotState(source), SlotEvent(event), SlotState(dest)))


@pytest.fixture
def recorder() -> Iterator[RecordingMachine]:
    rec = RecordingMachine(slot_machine(True))
    handle = add_tracer(rec)
    try:
        yield rec
    finally:
        remove_tracer(handle)


# -- construction --


def test_config_errors() -> None:
    with pytest.raises(ConfigError, match="expected an int >= 0"):
        CPUOffloadingManager(-1)
    with pytest.raises(ConfigError, match="store_threshold"):
        CPUOffloadingManager(4, store_threshold=-1)
    with pytest.raises(ConfigError, match="max_tracker_size"):
        CPUOffloadingManager(4, max_tracker_size=0)
    with pytest.raises(ConfigError, match="unknown cache policy"):
        CPUOffloadingManager(4, "mru")
    m = CPUOffloadingManager(4, "arc", medium="PINNED", checked=True)
    assert (m.num_slots, m.num_free, m.medium) == (4, 4, "PINNED")


# -- transitions --


@pytest.mark.parametrize("checked", [True, False])
def test_every_slot_change_goes_through_the_machine(recorder: RecordingMachine, checked: bool) -> None:
    m = CPUOffloadingManager(2, checked=checked)
    out = m.prepare_store(keys(0, 1), CTX)
    assert out is not None
    m.complete_store(keys(0), CTX)
    m.complete_store(keys(1), CTX, success=False)
    m.prepare_load(keys(0), CTX)
    m.prepare_load(keys(0), CTX)
    m.complete_load(keys(0), CTX)
    m.complete_load(keys(0), CTX)
    out = m.prepare_store(keys(2, 3), CTX)  # one free slot; k0 is evicted for the other
    assert out is not None and out.evicted_keys == (k(0),)
    m.reset_cache()
    assert recorder.log == [
        (k(0), A, SlotEvent.BEGIN_WRITE, W),
        (k(1), A, SlotEvent.BEGIN_WRITE, W),
        (k(0), W, SlotEvent.COMMIT_WRITE, R),
        (k(1), W, SlotEvent.ABORT_WRITE, A),
        (k(0), R, SlotEvent.BEGIN_READ, RD),
        (k(0), RD, SlotEvent.BEGIN_READ, RD),
        (k(0), RD, SlotEvent.END_READ, RD),
        (k(0), RD, SlotEvent.END_READ, R),
        (k(0), R, SlotEvent.EVICT, A),
        (k(2), A, SlotEvent.BEGIN_WRITE, W),
        (k(3), A, SlotEvent.BEGIN_WRITE, W),
        (k(2), W, SlotEvent.RESET, A),
        (k(3), W, SlotEvent.RESET, A),
    ]
    table = recorder.inner.table()
    for _key, before, event, after in recorder.log:
        assert any(e.dest == after.value for e in table[(before.value, event.value)])


def test_lookup_per_state_and_ref_cnt_view() -> None:
    m = CPUOffloadingManager(4, checked=True)
    assert m.lookup(k(0), CTX) is LookupResult.MISS
    assert (m.slot_state(k(0)), m.ref_cnt(k(0)), m.slot_id(k(0))) == (A, None, None)
    m.prepare_store(keys(0), CTX)
    assert m.lookup(k(0), CTX) is LookupResult.HIT_PENDING
    assert (m.slot_state(k(0)), m.ref_cnt(k(0)), m.slot_id(k(0))) == (W, -1, 0)
    m.complete_store(keys(0), CTX)
    assert m.lookup(k(0), CTX) is LookupResult.HIT
    assert (m.slot_state(k(0)), m.ref_cnt(k(0))) == (R, 0)
    m.prepare_load(keys(0), CTX)
    m.prepare_load(keys(0), CTX)
    assert m.lookup(k(0), CTX) is LookupResult.HIT
    assert (m.slot_state(k(0)), m.ref_cnt(k(0))) == (RD, 2)
    s = m.stats()
    # One request ("probe") asked four times: one distinct lookup, counted under its latest answer.
    assert (s.lookups, s.misses, s.hit_pending, s.hits, s.lookup_retries) == (1, 0, 0, 1, 3)


def test_a_deferred_requests_retries_are_counted_apart_from_its_lookups() -> None:
    # Regression (issue 13, bug 8): every per-step retry of a deferred request counted as a lookup (the
    # demo showed 998 lookups for 11 misses). vLLM counts each request's lookup once.
    m = CPUOffloadingManager(4)
    a, b = ReqContext("a"), ReqContext("b")
    m.prepare_store(keys(0), CTX)
    for _ in range(100):
        assert m.lookup(k(0), a) is LookupResult.HIT_PENDING  # a waits, asking every step
    assert m.lookup(k(1), a) is LookupResult.MISS
    s = m.stats()
    assert (s.lookups, s.hit_pending, s.misses, s.hits, s.lookup_retries) == (2, 1, 1, 0, 99)
    m.complete_store(keys(0), CTX)
    assert m.lookup(k(0), a) is LookupResult.HIT  # the wait ends: the same lookup, now a hit
    assert m.lookup(k(0), b) is LookupResult.HIT  # another request's lookup is a lookup of its own
    s = m.stats()
    assert (s.lookups, s.hit_pending, s.misses, s.hits, s.lookup_retries) == (3, 0, 1, 2, 100)
    assert s.lookups == s.hits + s.misses + s.hit_pending
    m.on_request_finished(a)  # forgets a's answers; the counts stay
    assert m.stats().lookups == 3


# -- store path --


def test_prepare_store_drops_present_keys_dedups_and_allocates_in_order() -> None:
    m = CPUOffloadingManager(8)
    store(m, 0)
    m.prepare_store(keys(1), CTX)  # writing
    out = m.prepare_store(keys(0, 1, 2, 2, 3), CTX)
    assert out == PrepareStoreOutput((k(2), k(3)), SlotSpec((2, 3)), ())
    assert m.prepare_store(keys(0, 1, 2), CTX) == PrepareStoreOutput((), SlotSpec(()), ())
    assert m.prepare_store([], CTX) == PrepareStoreOutput((), SlotSpec(()), ())
    assert m.num_writing == 3 and m.num_free == 4


def test_freed_slot_ids_are_reused() -> None:
    m = CPUOffloadingManager(3)
    out = m.prepare_store(keys(0, 1, 2), CTX)
    assert out is not None and out.store_spec.slot_ids == (0, 1, 2)
    m.complete_store(keys(1), CTX, success=False)
    out = m.prepare_store(keys(5), CTX)
    assert out is not None and out.store_spec.slot_ids == (1,)


def test_failed_store_frees_slots_and_key_becomes_absent() -> None:
    m = CPUOffloadingManager(2)
    m.prepare_store(keys(0, 1), CTX)
    assert m.num_free == 0
    m.complete_store(keys(0, 1), CTX, success=False)
    assert m.num_free == 2 and m.num_writing == 0
    assert m.lookup(k(0), CTX) is LookupResult.MISS
    assert len(m.policy) == 0
    assert m.stats().stores_failed == 2
    # vLLM's rule: the failed keys are released with a metadata-only removal (never announced stored).
    assert m.take_events() == [OffloadingEvent((k(0), k(1)), "CPU", removed=True, metadata_only=True)]


def test_complete_store_is_idempotent_and_ignores_non_writing_keys() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0)
    m.prepare_load(keys(0), CTX)
    m.prepare_store(keys(1), CTX)
    m.take_events()
    before = snapshot(m)
    m.complete_store(keys(0, 7), CTX)  # reading and absent: ignored
    m.complete_store(keys(0, 7), CTX, success=False)
    assert snapshot(m) == before
    m.complete_store(keys(1), CTX)
    after = snapshot(m)
    m.complete_store(keys(1), CTX)
    m.complete_store(keys(1), CTX, success=False)  # already ready: failure changes nothing
    assert snapshot(m) == after
    assert m.take_events() == [OffloadingEvent((k(1),), "CPU", removed=False)]
    assert m.stats().stores_committed == 2


# -- eviction --


def test_eviction_never_takes_writing_or_reading_slots() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0, 1)
    m.prepare_store(keys(2), CTX)  # writing
    m.prepare_load(keys(0), CTX)  # reading
    out = m.prepare_store(keys(3, 4), CTX)  # one free slot + one eviction: only k1 qualifies
    assert out is not None and out.evicted_keys == (k(1),)
    assert out.store_spec.slot_ids == (3, 1)  # a never-used id first, then the freed one (vLLM's order)
    assert m.slot_state(k(0)) is RD and m.slot_state(k(2)) is W
    before = snapshot(m)
    assert m.prepare_store(keys(5), CTX) is None  # nothing evictable
    assert snapshot(m) == before
    m.complete_load(keys(0), CTX)
    out = m.prepare_store(keys(5), CTX)
    assert out is not None and out.evicted_keys == (k(0),)
    assert m.stats().evictions == 2


def test_prepare_store_none_when_too_few_evictable_or_protected() -> None:
    m = CPUOffloadingManager(3)
    store(m, 0, 1, 2)
    before = snapshot(m)
    assert m.prepare_store(keys(3, 4, 5, 6), CTX) is None  # needs 4 > 3 slots
    assert snapshot(m) == before
    # k0, k1 listed: protected; only k2 may go, but two slots are needed.
    assert m.prepare_store(keys(0, 1, 3, 4), CTX) is None
    assert snapshot(m) == before
    out = m.prepare_store(keys(0, 1, 3), CTX)
    assert out is not None and out.keys_to_store == (k(3),) and out.evicted_keys == (k(2),)


def test_touch_changes_victim() -> None:
    m = CPUOffloadingManager(2)
    store(m, 0, 1)
    m.touch(keys(0), CTX)
    out = m.prepare_store(keys(2), CTX)
    assert out is not None and out.evicted_keys == (k(1),)


def test_arc_manager_evicts_once_seen_before_touched() -> None:
    m = CPUOffloadingManager(3, "arc")
    store(m, 0, 1, 2)
    m.touch(keys(0), CTX)
    out = m.prepare_store(keys(3, 4), CTX)
    assert out is not None and out.evicted_keys == (k(1), k(2))


# -- events --


def test_events_stored_and_removed() -> None:
    m = CPUOffloadingManager(2, medium="CPU")
    store(m, 0, 1)
    store(m, 2)
    assert m.take_events() == [
        OffloadingEvent((k(0), k(1)), "CPU", removed=False),
        OffloadingEvent((k(0),), "CPU", removed=True),
        OffloadingEvent((k(2),), "CPU", removed=False),
    ]
    assert m.take_events() == []


def test_events_disabled() -> None:
    m = CPUOffloadingManager(1, enable_events=False)
    store(m, 0)
    store(m, 1)
    assert m.take_events() == []
    assert m.stats().evictions == 1


# -- reset --


def test_reset_clears_everything_and_late_completions_are_ignored() -> None:
    m = CPUOffloadingManager(4, checked=True)
    store(m, 0, 1)
    m.prepare_load(keys(0), CTX)
    m.prepare_store(keys(2), CTX)
    m.reset_cache()
    assert [m.slot_state(k(i)) for i in range(3)] == [A, A, A]
    assert (m.num_free, m.num_writing, m.num_reading, m.num_evictable, len(m.policy)) == (4, 0, 0, 0, 0)
    m.complete_store(keys(2), CTX)  # a stale completion: the key is absent now
    assert m.slot_state(k(2)) is A
    out = m.prepare_store(keys(5), CTX)
    assert out is not None and out.store_spec.slot_ids == (0,)  # allocator restarted


# -- typed errors leave state unchanged --


def test_prepare_load_of_unready_key_raises_and_changes_nothing() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0)
    m.prepare_store(keys(1), CTX)
    before = snapshot(m)
    with pytest.raises(KeyNotReadyError, match=rf"{k(1).hex()}.*writing; expected ready or reading"):
        m.prepare_load(keys(0, 1), CTX)
    assert snapshot(m) == before
    with pytest.raises(KeyNotReadyError, match="absent"):
        m.prepare_load(keys(0, 9), CTX)
    assert snapshot(m) == before
    assert m.prepare_load(keys(0), CTX) == SlotSpec((0,))


def test_complete_load_of_unpinned_key_raises_and_changes_nothing() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0, 1)
    m.prepare_load(keys(0), CTX)
    before = snapshot(m)
    with pytest.raises(InvalidTransition, match="end_read"):
        m.complete_load(keys(0, 1), CTX)  # k1 is ready, not reading
    assert snapshot(m) == before
    with pytest.raises(InvalidTransition, match="1 reader"):
        m.complete_load(keys(0, 0), CTX)  # two reads end, one reader
    assert snapshot(m) == before
    with pytest.raises(InvalidTransition):
        m.complete_load(keys(7), CTX)
    assert snapshot(m) == before


def test_prepare_write_errors_change_nothing() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0)
    before = snapshot(m)
    with pytest.raises(InvalidTransition, match="already held"):
        m.prepare_write(keys(1, 0))
    with pytest.raises(InvalidTransition, match="listed twice"):
        m.prepare_write(keys(1, 1))
    assert snapshot(m) == before
    assert m.prepare_write([]) == SlotSpec(())


def test_complete_write_requires_writing_keys() -> None:
    m = CPUOffloadingManager(4)
    store(m, 0)
    assert m.prepare_write(keys(1)) == SlotSpec((1,))
    before = snapshot(m)
    with pytest.raises(InvalidTransition, match="commit_write"):
        m.complete_write(keys(1, 0), True)
    with pytest.raises(InvalidTransition, match="abort_write"):
        m.complete_write(keys(1, 5), False)
    assert snapshot(m) == before
    m.complete_write(keys(1), True)
    assert m.slot_state(k(1)) is R
    assert m.stats().promotions_committed == 1


# -- tier-side helpers --


def test_prepare_write_evicts_like_prepare_store_and_returns_none_when_full() -> None:
    m = CPUOffloadingManager(2)
    store(m, 0)
    assert m.prepare_write(keys(1)) == SlotSpec((1,))
    assert m.prepare_write(keys(2)) == SlotSpec((0,))  # evicts k0
    assert m.slot_state(k(0)) is A
    before = snapshot(m)
    assert m.prepare_write(keys(3)) is None  # both slots writing
    assert snapshot(m) == before
    m.complete_write(keys(1), False)
    assert m.num_free == 1 and m.stats().promotions_failed == 1


def test_prepare_read_pins_until_complete_read() -> None:
    m = CPUOffloadingManager(1)
    store(m, 0)
    assert m.prepare_read(keys(0)) == SlotSpec((0,))
    assert m.prepare_store(keys(1), CTX) is None
    m.complete_read(keys(0))
    assert m.ref_cnt(k(0)) == 0 and m.num_evictable == 1
    out = m.prepare_store(keys(1), CTX)
    assert out is not None and out.evicted_keys == (k(0),)


def test_has_pending_work_default_false() -> None:
    m = CPUOffloadingManager(2)
    m.prepare_store(keys(0), CTX)
    assert m.has_pending_work() is False


# -- counts under random operations --


@pytest.mark.parametrize("policy", ["lru", "arc", "request-lru", "request-arc"])
def test_counts_stay_consistent_under_random_operations(policy: str) -> None:
    rng = random.Random(11)
    universe = range(24)
    m = CPUOffloadingManager(8, policy, checked=True, store_threshold=rng.choice([0, 2]))
    ctx = CTX
    for _ in range(1500):
        op = rng.randrange(9)
        ks = keys(*(rng.randrange(24) for _ in range(rng.randrange(1, 4))))
        if op == 8:
            m.on_request_finished(ctx)  # commits a request-scoped policy's recency
            ctx = ReqContext(f"r{rng.randrange(4)}")
        elif op == 0:
            m.prepare_store(ks, ctx)
        elif op == 1:
            m.complete_store(ks, CTX, success=rng.random() < 0.8)
        elif op == 2:
            ready = [x for x in ks if m.slot_state(x) in (R, RD)]
            if ready:
                m.prepare_load(ready, CTX)
        elif op == 3:
            reading = list({x for x in ks if m.slot_state(x) is RD})
            if reading:
                m.complete_load(reading, CTX)
        elif op == 4:
            m.touch(ks, CTX)
        elif op == 5:
            before = snapshot(m, universe)
            try:
                m.prepare_load(ks, CTX)
            except KeyNotReadyError:
                assert snapshot(m, universe) == before
        elif op == 6:
            m.lookup(ks[0], CTX)
        elif rng.random() < 0.05:
            m.reset_cache()
        check_counts(m, universe)
        ids = [m.slot_id(k(i)) for i in universe]
        held = [i for i in ids if i is not None]
        assert len(held) == len(set(held)) and all(0 <= i < 8 for i in held)


# -- vLLM 0.33 semantics (spec/README.md, "vLLM semantics") --

_SEED_SCENARIO = """
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.types import ReqContext, make_offload_key
for policy in ("lru", "arc", "request-lru", "request-arc"):
    m = CPUOffloadingManager(8, policy)
    ctx = ReqContext("r")
    ks = [make_offload_key(i.to_bytes(8, "big")) for i in range(8)]
    m.prepare_store(ks, ctx)
    m.complete_store(set(ks), ctx)  # vLLM passes a set: its order follows the hash seed
    out = m.prepare_store([make_offload_key(b"new" + bytes([i])) for i in range(3)], ctx)
    assert out is not None
    print(policy, [k[7] for k in out.evicted_keys])
"""


def test_eviction_order_does_not_depend_on_the_hash_seed() -> None:
    """The same calls evict the same keys under every PYTHONHASHSEED (a set's order differs by seed)."""
    outputs = set()
    for seed in ("0", "1", "2", "3", "5", "8"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _SEED_SCENARIO], capture_output=True, text=True, env=env, timeout=120, check=False
        )
        assert out.returncode == 0, out.stderr
        outputs.add(out.stdout)
    assert len(outputs) == 1, outputs
    assert "lru [0, 1, 2]" in outputs.pop()


def test_request_lru_commits_recency_at_finish_head_most_recent() -> None:
    """A request's keys are ordered by token position, head most recent, whatever order they come in."""
    m = CPUOffloadingManager(6, "request-lru")
    old = ReqContext("old")
    store_ctx(m, old, 0, 1)
    assert m.policy.keys() == keys(0, 1)  # no positions: in the order stored
    m.on_request_finished(old)
    assert m.policy.keys() == keys(1, 0)  # finished: its head (k0) most recent
    new = ReqContext("new")
    positions = {k(0): 0, k(2): 16, k(3): 32, k(4): 48, k(5): 64}
    m.on_new_request(new, key_position=positions.get)
    out = m.prepare_store(keys(5, 3, 4, 2), new)  # offered out of order: the token position decides
    assert out is not None
    m.complete_store(list(set(out.keys_to_store)), new)  # in a hash-seed order, as the vLLM adapter passes
    assert m.policy.keys() == keys(1, 0, 5, 4, 3, 2)  # one shared rank, the tail oldest
    m.prepare_load(keys(0), new)  # the request reads the old head: it takes the request's rank
    m.complete_load(keys(0), new)
    assert m.policy.keys() == keys(1, 5, 4, 3, 2, 0)
    m.on_request_finished(new)
    assert m.policy.keys() == keys(1, 5, 4, 3, 2, 0)
    out = m.prepare_store(keys(6, 7), ReqContext("later"))
    assert out is not None and out.evicted_keys == (k(1), k(5))


def store_ctx(m: CPUOffloadingManager, ctx: ReqContext, *ids: int) -> None:
    out = m.prepare_store(keys(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def test_store_threshold_admits_a_key_on_its_nth_offer() -> None:
    m = CPUOffloadingManager(4, "request-lru", store_threshold=2, max_tracker_size=2)
    assert m.prepare_store(keys(0), CTX) == PrepareStoreOutput((), SlotSpec(()), ())
    out = m.prepare_store(keys(0, 1), CTX)
    assert out is not None and out.keys_to_store == (k(0),)
    assert m.stats().stores_skipped == 2  # k0 once, k1 once
    m.prepare_store(keys(2, 3), CTX)  # a full tracker forgets its oldest entries (k0, k1)
    out = m.prepare_store(keys(1), CTX)
    assert out is not None and out.keys_to_store == ()  # k1's first offer was forgotten
    assert m.allocation_sizes() == {1: 1}


def test_zero_capacity_manager_stores_nothing() -> None:
    """vLLM accepts a manager with no chunks; kvfsm's own policies refuse one (a misconfigured engine)."""
    for policy in ("lru", "arc"):
        with pytest.raises(ConfigError, match="at least one slot"):
            CPUOffloadingManager(0, policy)
    for policy in ("request-lru", "request-arc"):
        m = CPUOffloadingManager(0, policy)
        assert m.prepare_store(keys(0), CTX) is None
        assert m.prepare_store([], CTX) == PrepareStoreOutput((), SlotSpec(()), ())
        assert m.lookup(k(0), CTX) is LookupResult.MISS
        assert m.stats().usage == 0.0


def test_failed_store_removal_leaves_out_keys_reserved_again() -> None:
    m = CPUOffloadingManager(4, "request-lru")
    m.prepare_store(keys(0, 1), CTX)
    m.complete_store(keys(0, 1), CTX, success=False)
    m.prepare_store(keys(1), CTX)  # a retry holds k1 again before the events are drained
    assert m.take_events() == [OffloadingEvent((k(0),), "CPU", removed=True, metadata_only=True)]


def test_usage_gauges_count_pinned_slots() -> None:
    m = CPUOffloadingManager(4, "request-arc")
    store(m, 0, 1)
    m.prepare_store(keys(2), CTX)
    m.prepare_load(keys(0), CTX)
    s = m.stats()
    assert (s.write_usage, s.read_usage, s.usage) == (0.25, 0.25, 0.5)


def test_request_arc_promotes_reuse_at_finish_and_keeps_insertions_in_t1() -> None:
    m = CPUOffloadingManager(4, "request-arc")
    first = ReqContext("first")
    store_ctx(m, first, 0, 1)
    m.on_request_finished(first)
    policy = m.policy
    assert isinstance(policy, RequestARCPolicy)
    assert policy.t1_keys() == keys(1, 0) and policy.t2_keys() == []  # head most recent
    second = ReqContext("second")
    m.prepare_load(keys(0), second)
    m.complete_load(keys(0), second)
    assert policy.t2_keys() == []  # nothing moves before the request finishes
    m.on_request_finished(second)
    assert policy.t1_keys() == keys(1) and policy.t2_keys() == keys(0)


def test_metrics_export_usage_gauges_and_the_allocation_histogram() -> None:
    """kvfsm's metrics read vLLM's CPU gauges and allocation sizes from a watched CPU manager."""
    from kvfsm.observe.metrics import KvfsmMetrics

    m = CPUOffloadingManager(4, "request-lru")
    metrics = KvfsmMetrics()
    metrics.watch_manager(m)
    store(m, 0, 1)
    m.prepare_store(keys(2, 3, 4), CTX)  # 3 new keys, 2 free slots, 2 evictable: allocated
    snap = metrics.snapshot()
    assert snap["cpu_usage"] == {"cpu": {"all": 0.75, "store": 0.75, "load": 0.0}}
    assert snap["allocation_sizes"] == {"cpu": {"count": 2, "keys": 5.0}}
    hist = metrics.allocation_histograms()["cpu"].cumulative()
    assert hist[:2] == [("1", 0.0), ("4", 2.0)]
