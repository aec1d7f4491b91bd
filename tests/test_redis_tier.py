"""The Redis tier against real redis-server processes: the value codec, its configuration, a round trip, and
kvfsm.testing's tier conformance machine against a standalone server and a local three-node Redis Cluster,
with the tier's real network I/O held in flight on its own threads (a HANG fault at each of its I/O points,
released only by the machine's ``io_runs`` rule and by drains)."""

from __future__ import annotations

import inspect
import itertools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from helpers import defect_search
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import run_state_machine_as_test
from redis_support import (
    GUARD_S,
    RedisServer,
    k,
    needs_redis,
    running_server,
    session_cluster,
    session_server,
    stop_session_servers,
)
from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.manager import SecondaryTier
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.errors import ConfigError
from kvfsm.testing.stateful import FaultPlanHeldTierMachine, KitSlotIO
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.tiers.slotio import DictSlotIO

pytestmark = needs_redis

redis_tier = pytest.importorskip("kvfsm.tiers.redis", reason="redis-py not installed: pip install 'kvfsm[redis]'")
from kvfsm.tiers.redis import RedisFailure, RedisTier, _Item, _Outcome  # noqa: E402
from kvfsm.tiers.redis_codec import (  # noqa: E402
    MismatchKind,
    Namespace,
    ValueMismatch,
    decode_value,
    encode_value,
)

R1 = ReqContext("r1")


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as server:
        yield server


@pytest.fixture(scope="module", autouse=True)
def _module_servers() -> Iterator[None]:
    yield
    stop_session_servers()


SLOT = 64
_prefixes = itertools.count()


def namespace(prefix: str | None = None, model: str = "test-model", world_size: int = 1) -> Namespace:
    """A namespace of its own per call (unless ``prefix`` is given): tests never see each other's values."""
    return Namespace(
        model=model,
        num_layers=2,
        num_heads=4,
        head_dim=8,
        tokens_per_block=16,
        blocks_per_chunk=1,
        dtype="float16",
        world_size=world_size,
        prefix=prefix if prefix is not None else f"t{next(_prefixes)}",
    )


def data(key: OffloadKey, n: int = SLOT) -> bytes:
    return (key * (n // len(key) + 1))[:n]


# ---------------------------------------------------------------------------------------------- codec


def test_codec_round_trip_and_every_mismatch_kind() -> None:
    ns = namespace()
    key, other = k(1), k(2)
    raw = encode_value(ns.digest(), key, data(key))
    assert decode_value(raw, ns.digest(), key, SLOT) == data(key)
    cases: list[tuple[bytes, bytes, bytes, int | None, MismatchKind]] = [
        (raw[:10], ns.digest(), key, SLOT, MismatchKind.TRUNCATED),
        (raw[:-1], ns.digest(), key, SLOT, MismatchKind.TRUNCATED),
        (b"GARBAGE!" * 20, ns.digest(), key, SLOT, MismatchKind.MAGIC),
        (raw[:4] + b"\x09" + raw[5:], ns.digest(), key, SLOT, MismatchKind.VERSION),
        (raw, namespace(model="other").digest(), key, SLOT, MismatchKind.NAMESPACE),
        (raw, ns.digest(), other, SLOT, MismatchKind.KEY),
        (raw, ns.digest(), key, SLOT + 1, MismatchKind.LENGTH),
        (raw[:-1] + bytes([raw[-1] ^ 1]), ns.digest(), key, SLOT, MismatchKind.CHECKSUM),
    ]
    for value, digest, want_key, n, kind in cases:
        with pytest.raises(ValueMismatch) as err:
            decode_value(value, digest, want_key, n)
        assert err.value.kind is kind, (kind, err.value)


def test_namespace_hashes_model_geometry_dtype_and_world_size() -> None:
    base = namespace(prefix="p")
    variants = [
        namespace(prefix="p", model="other"),
        namespace(prefix="p", world_size=2),
        Namespace("test-model", 3, 4, 8, 16, 1, "float16", 1, "p"),
        Namespace("test-model", 2, 4, 8, 16, 1, "bfloat16", 1, "p"),
        Namespace("test-model", 2, 4, 8, 16, 2, "float16", 1, "p"),
    ]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 1 + len(variants)
    assert namespace(prefix="p").redis_key(k(1)) == base.redis_key(k(1))
    assert namespace(prefix="q").redis_key(k(1)) != base.redis_key(k(1))
    assert "{" not in base.redis_key(k(1))  # no hash tag: chunks spread over every cluster slot
    with pytest.raises(ConfigError, match="prefix"):
        namespace(prefix="a{b}")
    with pytest.raises(ConfigError, match="num_layers"):
        Namespace("m", 0, 4, 8, 16, 1, "float16", 1)


def test_bad_configuration_is_refused_before_anything_is_built() -> None:
    ns = namespace()
    cases: list[tuple[dict[str, Any], str]] = [
        ({"url": "localhost:6379"}, "url"),
        ({"op_timeout_s": 0}, "op_timeout_s"),
        ({"max_pending_writes": 0}, "max_pending_writes"),
        ({"max_batch": True}, "max_batch"),
        ({"ttl_s": 0}, "ttl_s"),
        ({"lookup_ttl_steps": 0}, "lookup_ttl_steps"),
    ]
    for kwargs, match in cases:
        args: dict[str, Any] = {"url": "redis://127.0.0.1:1/0", "namespace": ns, **kwargs}
        with pytest.raises(ConfigError, match=match):
            RedisTier(**args)


def test_the_operation_timeout_comes_from_the_deadlines() -> None:
    ns = namespace()
    t = RedisTier("redis://127.0.0.1:1/0", ns, deadlines=Deadlines(cascade_s=7.0, promote_s=3.0))
    try:
        assert t.op_timeout_s == 3.0
    finally:
        t.shutdown()
    t = RedisTier("redis://127.0.0.1:1/0", ns, op_timeout_s=0.25)
    try:
        assert t.op_timeout_s == 0.25
    finally:
        t.shutdown()


def test_every_constructor_parameter_is_documented_with_its_default() -> None:
    doc = inspect.getdoc(RedisTier) or ""
    for p in list(inspect.signature(RedisTier).parameters.values()):
        assert f"``{p.name}``" in doc, f"parameter {p.name!r} is not documented"
        if p.default is not inspect.Parameter.empty:
            assert re.search(rf"``{p.name}`` \([^)]*default", doc), f"{p.name}: its default is not stated"


def test_importing_kvfsm_tiers_does_not_import_redis() -> None:
    import subprocess
    import sys

    code = "import sys, kvfsm, kvfsm.tiers, kvfsm.tiers.redis_codec; assert 'redis' not in sys.modules, 'redis'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=GUARD_S)


# ---------------------------------------------------------------------------------------------- round trip


class Rig:
    """A TieringManager over a CPU primary (slot bytes in a dict) and one Redis tier on a real server."""

    def __init__(self, tier: RedisTier, num_slots: int = 4) -> None:
        self.tier = tier
        self.io = DictSlotIO(SLOT)
        tier.slot_io = self.io
        self.primary = CPUOffloadingManager(num_slots, checked=True)
        self.tm = TieringManager(self.primary, [tier], checked=True, deadlines=Deadlines.none())

    def settle(self) -> None:
        """End the step (sends the staged batches), wait for the tier's I/O, apply the results."""
        self.tm.on_schedule_end()
        assert self.tier.wait_idle(GUARD_S)
        self.tm.on_schedule_end()

    def store(self, key: OffloadKey) -> bool:
        out = self.tm.prepare_store([key], R1)
        if out is None or not out.keys_to_store:
            return False
        self.io.data[out.store_spec.slot_ids[0]] = data(key)
        self.tm.complete_store(out.keys_to_store, R1)
        return True

    def read_through(self, key: OffloadKey, steps: int = 8) -> bytes | None:
        for _ in range(steps):
            answer = self.tm.lookup(key, R1)
            if answer is LookupResult.HIT:
                spec = self.tm.prepare_load([key], R1)
                got = self.io.data[spec.slot_ids[0]]
                self.tm.complete_load([key], R1)
                self.tm.on_schedule_end()
                return got
            if answer is LookupResult.MISS:
                return None
            self.settle()
        raise AssertionError(f"{key.hex()[:12]} never became readable")

    def evict_all(self) -> None:
        self.tm.reset_cache()
        self.tm.on_reset_flushed()  # no GPU copy was discarded: promotions are not held

    def close(self) -> None:
        self.tm.shutdown(timeout=GUARD_S)


def test_cascade_then_promotion_round_trips_the_bytes_in_one_pipelined_batch_each(redis_server: RedisServer) -> None:
    rig = Rig(RedisTier(redis_server.url, namespace()))
    try:
        keys = [k(i) for i in range(3)]
        for key in keys:
            assert rig.store(key)
        assert rig.tier.writes_pending == 3 and rig.tm.has_pending_work()
        rig.settle()
        s = rig.tier.counters
        assert s.stores_committed == 3 and s.write_batches == 1  # one pipelined SET batch for the step
        assert not rig.tier.has_pending_work()
        rig.evict_all()  # the CPU copies go; the server keeps the values
        # A fresh tier on the same server knows nothing: lookups RETRY until EXISTS returns, then HIT.
        tier2 = RedisTier(redis_server.url, rig.tier.namespace, read_threads=0)  # one thread: one batch
        rig2 = Rig(tier2)
        try:
            answers = [rig2.tm.lookup(key, R1) for key in keys]
            assert answers == [LookupResult.RETRY] * 3
            rig2.settle()
            assert [rig2.tm.lookup(key, R1) for key in keys] == [LookupResult.HIT_PENDING] * 3
            rig2.settle()
            assert tier2.counters.exists_batches == 1 and tier2.counters.read_batches == 1  # one MGET
            for key in keys:
                assert rig2.read_through(key) == data(key)
            assert tier2.counters.loads_completed == 3
        finally:
            rig2.close()
    finally:
        rig.close()


def test_backpressure_fails_cascades_beyond_the_bound_and_keeps_their_cpu_copies(redis_server: RedisServer) -> None:
    plan = FaultPlan([FaultRule("redis.set", FaultKind.HANG)])
    rig = Rig(RedisTier(redis_server.url, namespace(), max_pending_writes=2, faults=plan), num_slots=6)
    try:
        for i in range(4):
            assert rig.store(k(i))
        assert rig.tier.writes_pending == 2  # the third and fourth were refused at once
        rig.tm.on_schedule_end()
        assert plan.wait_for_hangs(1, GUARD_S)  # the batch of two is held on the tier's thread
        assert rig.tier.has_pending_work()
        assert rig.tier.counters.failures[RedisFailure.BACKPRESSURE.value] == 2
        plan.clear()
        plan.release_hangs()
        rig.settle()
        assert rig.tier.counters.stores_committed == 2
        for i in range(4):  # every CPU copy stays valid
            assert rig.read_through(k(i)) == data(k(i))
        assert not rig.tm.has_pending_work()
    finally:
        plan.release_hangs()
        rig.close()


# ---------------------------------------------------------------------------------------------- conformance


class RedisTierMachine(FaultPlanHeldTierMachine):
    """The Redis tier on a real server, every network and slot operation held in flight on the tier's own
    threads until the kit lets it run. Every example has a namespace of its own. A successful cascade must
    have put exactly the key's bytes on the server (a missing value is a violation: the test server has
    no eviction)."""

    checks_copies = True
    cluster: ClassVar[bool] = False

    def __init__(self) -> None:
        super().__init__()
        self.ns = namespace()
        self.url = session_cluster().url if self.cluster else session_server().url
        self._reader: Any = session_cluster().cluster_client() if self.cluster else session_server().client()

    @override
    def make_tier(self, slot_io: KitSlotIO) -> SecondaryTier:
        return RedisTier(
            self.url,
            self.ns,
            cluster=self.cluster,
            slot_io=slot_io,
            faults=self.plan,
            read_threads=1,
            write_threads=1,
            op_timeout_s=GUARD_S,
        )

    @override
    def wait_io(self, tier: SecondaryTier) -> None:
        assert isinstance(tier, RedisTier)
        assert tier.wait_idle(GUARD_S), "the tier's I/O never went idle"

    @override
    def tier_copy(self, tier: SecondaryTier, key: OffloadKey) -> bytes | None:
        """The value on the server, decoded and verified (read on the test thread with a client of its own)."""
        assert isinstance(tier, RedisTier)
        raw = self._reader.get(tier.redis_key(key))
        if raw is None:
            return b""  # reported stored, but not on the server
        return decode_value(raw, self.ns.digest(), key, self.slot_nbytes)

    @override
    def io_pending(self, tier: SecondaryTier) -> bool | None:
        assert isinstance(tier, RedisTier)
        return tier.writes_pending > 0

    @override
    def teardown(self) -> None:
        try:
            super().teardown()
        finally:
            self._reader.close()


class RedisClusterTierMachine(RedisTierMachine):
    """The same against a local three-node Redis Cluster (batches split per hash slot and node)."""

    cluster = True


def _profile() -> settings:
    return settings(
        settings(),
        max_examples=min(30, settings().max_examples),
        stateful_step_count=30,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
    )


TestRedisTierConformance = RedisTierMachine.TestCase
TestRedisTierConformance.settings = _profile()
TestRedisClusterTierConformance = RedisClusterTierMachine.TestCase
TestRedisClusterTierConformance.settings = _profile()


@settings(max_examples=1, database=None, deadline=None)
@given(st.just(None))
def test_the_conformance_machine_holds_real_io_in_flight(_: None) -> None:
    """One fixed run (inside a one-example ``given``, where the rules' notes are allowed): a cascade is
    held on the tier's thread mid-write, checks see it pending, then it lands."""
    m = RedisTierMachine()
    try:
        m.build()
        m.store(1, True)
        m.step()  # the end of the step sends the batch; it hangs on the tier's write thread
        assert m.plan.wait_for_hangs(1, GUARD_S)
        m.check()
        assert m.checks_with_io_pending == 1 and m.manager.has_pending_work()
        m.io_runs()
        m.step()
        m.check()
        assert not m.manager.has_pending_work()
        assert m.tier_copy(m.tier.inner, m.keys[1]) is not None
    finally:
        m.teardown()


class _EarlyReportingRedisTier(RedisTier):
    """A planted bug: every write batch reports success without sending anything to the server."""

    @override
    def _write_batch(self, batch: list[_Item]) -> list[_Outcome]:
        return [_Outcome(item, True, None) for item in batch]


class _EarlyReportingRedisTierMachine(RedisTierMachine):
    @override
    def make_tier(self, slot_io: KitSlotIO) -> SecondaryTier:
        return _EarlyReportingRedisTier(
            self.url, self.ns, slot_io=slot_io, faults=self.plan, read_threads=1, write_threads=1
        )


def test_the_conformance_machine_catches_a_tier_that_reports_writes_it_never_made() -> None:
    with pytest.raises(Exception, match="holds no committed bytes"):
        run_state_machine_as_test(
            _EarlyReportingRedisTierMachine,
            settings=defect_search(200, 30),
        )


def test_cluster_keys_spread_over_the_nodes() -> None:
    """Chunks are not hash-tagged into one slot: a cluster's nodes share the values."""
    nodes = session_cluster()
    ns = namespace()
    tier = RedisTier(nodes.url, ns, cluster=True, op_timeout_s=GUARD_S)
    rig = Rig(tier, num_slots=16)
    try:
        for i in range(12):
            assert rig.store(k(i))
        rig.settle()
        assert tier.counters.stores_committed == 12
        per_node = [node.client().dbsize() for node in nodes.nodes]
        assert sum(1 for n in per_node if n > 0) >= 2, per_node
        rig.evict_all()
        for i in range(12):
            assert rig.read_through(k(i)) == data(k(i))
    finally:
        rig.close()
