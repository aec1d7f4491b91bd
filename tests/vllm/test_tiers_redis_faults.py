"""Faults of a real redis-server under vLLM's own tiering manager with kvfsm's Redis tier (``KvfsmRedisTier``).

The fault table of tests/test_redis_faults.py (kvfsm's own engine), driven instead through vLLM's
``TieringOffloadingManager`` built by vLLM's spec factory from a ``secondary_tiers`` entry: SIGKILL the server
while the tier's writes are in flight, and while its reads are, then restart it (with and without an AOF);
stall it with ``CLIENT PAUSE``; fill it past ``maxmemory`` (refused writes under ``noeviction``, keys evicted
between lookup and load under ``allkeys-lru``); overwrite values with garbage. In-flight I/O is held by a HANG
fault inside the tier's real path (``tier.faults``, released by the test), never by sleeping.

After each, judged from ground truth (tests/vllm/test_tiers_conformance.py's :class:`JobLedger` on the adapter's
vLLM-facing methods, and the bytes in vLLM's primary memory): every chunk vLLM served was compared with the
bytes stored under its key (0 wrong), every job vLLM submitted was reported back exactly once, the kvfsm tier
holds no job, and vLLM's manager and the tier have no pending work (the engine goes idle). The counts are
printed (``pytest -s``) and asserted.

The last test runs :func:`kvfsm.vllm.tier_bench.bench_vllm_redis_tier` tiny (its smoke test).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
pytest.importorskip("vllm.v1.kv_offload.tiering.factory")

import vllm.v1.kv_offload.base as offload_base
from redis_support import GUARD_S, VALUE_DAMAGES, RedisServer, needs_redis, running_server
from test_tiers_conformance import JobLedger
from tiers_support import ROW, build, empty_primary, flat, key, payload, redis_entry, step

from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

pytestmark = needs_redis

pytest.importorskip("kvfsm.tiers.redis", reason="redis-py not installed: pip install 'kvfsm[redis]'")
import redis.exceptions  # noqa: E402

from kvfsm.tiers.redis_codec import ValueMismatch, decode_value  # noqa: E402

NUM_CHUNKS = 16  #: vLLM's primary chunks (of tiers_support.ROW bytes)
HIT, MISS = offload_base.LookupResult.HIT, offload_base.LookupResult.MISS
WAITING = (offload_base.LookupResult.HIT_PENDING, offload_base.LookupResult.RETRY)
_n = itertools.count()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as s:
        yield s


class Harness:
    """vLLM's manager with one ``KvfsmRedisTier`` on ``server``; a fault plan in the tier's real I/O path; the
    job ledger on the adapter; and what vLLM served, compared byte for byte."""

    def __init__(self, server: RedisServer, **keys: Any) -> None:
        self.server = server
        self.manager: Any = build(
            [redis_entry(server.url, redis_prefix=f"vllm-fault{next(_n)}-{time.time_ns()}", **keys)],
            num_chunks=NUM_CHUNKS,
        )
        (self.adapter,) = self.manager.secondary_tiers
        self.inner: Any = self.adapter.tier  # kvfsm's RedisTier
        self.plan = FaultPlan()
        self.inner.faults = self.plan
        self.reader: Any = redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=5.0)
        self.ledger = JobLedger(self.adapter, flat(self.manager), self._server_copy)
        self.served_verified = 0
        self.served_wrong = 0
        self.misses = 0

    def _server_copy(self, k: Any) -> bytes | None:
        """The value on the server now, decoded; None where there is no ground truth to read (the server is
        down, or the value is gone: killed without persistence, evicted), judged at load time instead."""
        try:
            raw = self.reader.get(self.inner.redis_key(k))
        except (redis.exceptions.RedisError, OSError):
            return None
        if raw is None:
            return None
        try:
            return decode_value(raw, self.inner.namespace.digest(), k, ROW)
        except ValueMismatch:
            return b"\0"  # reported stored, but the server holds a value that does not decode

    # -- vLLM's scheduler --

    def request(self, what: str) -> Any:
        ctx = offload_base.ReqContext(req_id=f"{what}-{next(_n)}")
        self.manager.on_new_request(ctx)
        return ctx

    def store(self, ids: Sequence[int]) -> None:
        """A request stores chunks (their bytes written into vLLM's primary), which cascades them."""
        ctx = self.request("writer")
        try:
            out = self.manager.prepare_store([key(i) for i in ids], ctx)
            assert out is not None, "no room in vLLM's primary"
            view = flat(self.manager)
            index = {key(i): i for i in ids}
            for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
                view[int(chunk) * ROW : (int(chunk) + 1) * ROW] = payload(index[k])
            if out.keys_to_store:
                self.manager.complete_store(list(out.keys_to_store), ctx)
        finally:
            self.manager.on_request_finished(ctx)

    def step(self, *, wait: bool = True) -> None:
        """One scheduler step; then (``wait``) the tier's I/O goes idle (what the step sent has run)."""
        step(self.manager)
        if wait:
            assert self.inner.wait_idle(GUARD_S), "the tier's I/O never went idle"

    def settle(self) -> int:
        """Step until vLLM's manager has no pending work; the steps it took."""
        end = time.monotonic() + GUARD_S
        steps = 0
        while self.manager.has_pending_work():
            assert time.monotonic() < end, "vLLM's manager never went idle"
            self.step()
            steps += 1
        return steps

    def serve(self, ids: Sequence[int]) -> dict[int, bool]:
        """A request for chunks ``ids``: lookups (promotions run meanwhile) until each is HIT or MISS; every
        HIT is loaded from vLLM's primary and compared with the key's bytes. Whether each was served."""
        ctx = self.request("reader")
        try:
            end = time.monotonic() + GUARD_S
            while True:
                answers = {i: self.manager.lookup(key(i), ctx) for i in ids}
                if not any(a in WAITING for a in answers.values()):
                    break
                assert time.monotonic() < end, f"lookups still waiting after the guard: {answers}"
                self.step()
            hits = [i for i in ids if answers[i] is HIT]
            if hits:
                spec = self.manager.prepare_load([key(i) for i in hits], ctx)
                view = flat(self.manager)
                for i, chunk in zip(hits, spec.chunk_ids.tolist(), strict=True):
                    if bytes(view[int(chunk) * ROW : (int(chunk) + 1) * ROW]) == payload(i):
                        self.served_verified += 1
                    else:
                        self.served_wrong += 1
                self.manager.complete_load([key(i) for i in hits], ctx)
            self.misses += len(ids) - len(hits)
            return {i: answers[i] is HIT for i in ids}
        finally:
            self.manager.on_request_finished(ctx)

    def hold_promotion(self, ids: Sequence[int]) -> Any:
        """A request whose lookups start promotions of ``ids``; the step submits them and their MGET hangs on
        the tier's read thread (a HANG on ``redis.get`` is in the plan). The request stays open (returned)."""
        ctx = self.request("held-reader")
        answers = [self.manager.lookup(key(i), ctx) for i in ids]
        assert all(a is offload_base.LookupResult.HIT_PENDING for a in answers), answers
        self.step(wait=False)
        assert self.plan.wait_for_hangs(1, GUARD_S), "the promotion's MGET never reached its I/O point"
        assert self.adapter.has_pending_work() and self.manager.has_pending_work()
        return ctx

    def wait_backoff_over(self) -> None:
        """The tier backs off after a connection failure (its own clock); wait for that to end, so the next
        operation reconnects (a bounded wait on the tier's real state, not a hold of any I/O)."""
        end = time.monotonic() + GUARD_S
        while self.inner.stats().backing_off:
            assert time.monotonic() < end, "the tier never stopped backing off"
            time.sleep(0.01)

    # -- the end --

    def finish(self, name: str) -> dict[str, Any]:
        """Go idle, judge the end state, report the counts, shut down."""
        try:
            self.settle()
            ledger = self.ledger
            assert not ledger.violations, "; ".join(ledger.violations[:6])
            assert not ledger.unreported(), f"jobs never reported: {ledger.unreported()}"
            assert not self.inner.pending_job_ids(), f"the kvfsm tier still holds jobs {self.inner.pending_job_ids()}"
            assert not self.manager.has_pending_work() and not self.adapter.has_pending_work()
            assert self.plan.hanging == 0
            assert self.served_wrong == 0, f"{self.served_wrong} chunks served with wrong bytes"
            counters = self.inner.stats().counters
            counts: dict[str, Any] = {
                **ledger.counts(),
                "served_verified": self.served_verified,
                "served_wrong": self.served_wrong,
                "misses": self.misses,
                **{
                    k: counters[k]
                    for k in (
                        "stores_committed",
                        "stores_failed",
                        "loads_completed",
                        "loads_failed",
                        "values_rejected",
                        "reconnects",
                        "failures",
                        "mismatches",
                    )
                },
            }
            print(f"\nvLLM + KvfsmRedisTier, {name}: {counts}")
            return counts
        finally:
            self.close()

    def close(self) -> None:
        try:
            self.manager.shutdown()
        finally:
            self.reader.close()


# ---------------------------------------------------------------------------------------------- SIGKILL


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "aof"])
def test_sigkill_with_writes_in_flight_then_restart(tmp_path: Path, persistent: bool) -> None:
    with running_server(tmp_path / "redis", persistent=persistent) as srv:
        h = Harness(srv)
        h.store(range(4))
        h.settle()  # keys 0-3 are on the server
        assert h.reader.dbsize() == 4
        hang = h.plan.add(FaultRule("redis.set", FaultKind.HANG))
        h.store(range(4, 8))
        h.step(wait=False)  # the step sends keys 4-7's SET batch: held on the tier's write thread
        assert h.plan.wait_for_hangs(1, GUARD_S)
        assert h.inner.writes_sent == 4
        assert h.adapter.has_pending_work() and h.manager.has_pending_work()  # the engine may not idle
        srv.kill()
        h.plan.remove(hang)
        h.plan.release_hangs()
        h.settle()  # the held SET batch runs into a dead server: the cascades fail, the CPU copies stay valid
        assert h.inner.counters.stores_failed == 4
        assert h.serve(range(4, 8)) == dict.fromkeys(range(4, 8), True)  # served from vLLM's primary
        srv.start()
        h.wait_backoff_over()
        h.store(range(8, 10))  # the next operation reconnects
        h.settle()
        empty_primary(h.manager)
        served = h.serve(range(10))
        counts = h.finish(f"sigkill with writes in flight ({'aof' if persistent else 'no persistence'})")
        # Keys 0-3 were acknowledged before the kill: the AOF (appendfsync always) keeps them; without it the
        # restarted server is empty and they are misses (their promotions fail: evicted). Keys 4-7 never
        # reached the server; keys 8-9 were stored after the restart.
        assert [i for i, ok in served.items() if ok] == ([*range(4), 8, 9] if persistent else [8, 9])
        assert counts["reconnects"] >= 1
        assert counts["failures"].get("refused", 0) + counts["failures"].get("reset", 0) >= 4
        assert counts["served_verified"] == 4 + (6 if persistent else 2)


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "aof"])
def test_sigkill_with_reads_in_flight_then_restart(tmp_path: Path, persistent: bool) -> None:
    with running_server(tmp_path / "redis", persistent=persistent) as srv:
        h = Harness(srv, lookup_ttl_steps=2)  # a failed load's MISS expires after two steps
        h.store(range(4))
        h.settle()
        empty_primary(h.manager)
        hang = h.plan.add(FaultRule("redis.get", FaultKind.HANG))
        ctx = h.hold_promotion(range(4))  # their MGET is held on the tier's read thread
        srv.kill()
        h.plan.remove(hang)
        h.plan.release_hangs()
        h.settle()  # the promotion fails (connection refused): vLLM drops the keys, nothing is served
        h.manager.on_request_finished(ctx)
        assert h.inner.counters.loads_failed == 4
        assert h.serve(range(4)) == dict.fromkeys(range(4), False)  # failed loads answer MISS
        srv.start()
        h.wait_backoff_over()
        for _ in range(3):  # the failed loads' verdicts expire
            h.step()
        served = h.serve(range(4))
        counts = h.finish(f"sigkill with reads in flight ({'aof' if persistent else 'no persistence'})")
        assert served == dict.fromkeys(range(4), persistent)  # the AOF kept them; otherwise they are gone
        assert counts["failures"].get("refused", 0) + counts["failures"].get("reset", 0) >= 4
        assert counts["promotion_jobs_failed"] >= 1 and counts["served_verified"] == (4 if persistent else 0)


# ---------------------------------------------------------------------------------------------- stalls


def test_client_pause_stalls_writes_and_the_engine_keeps_stepping(server: RedisServer) -> None:
    """CLIENT PAUSE WRITE: the SET batch reaches the server (which lists the tier's connection blocked in
    ``set``) and waits there; the engine keeps stepping, nothing is reported; once unpaused every write lands."""
    h = Harness(server)
    admin = server.client()
    try:
        admin.execute_command("CLIENT", "PAUSE", str(int(GUARD_S * 1000)), "WRITE")
        h.store(range(6))
        h.step(wait=False)
        for _ in range(1000):  # a bounded number of real CLIENT LIST round trips, no sleeping
            if any(c.get("cmd") == "set" and "b" in c.get("flags", "") for c in admin.client_list()):
                break
        else:
            raise AssertionError("the tier's SET never reached the server")
        for _ in range(5):  # however long the server stalls, the engine keeps stepping
            h.step(wait=False)
            assert h.manager.has_pending_work() and h.adapter.has_pending_work()
        assert h.inner.counters.stores_committed == 0 and len(h.ledger.unreported()) == 1
        admin.execute_command("CLIENT", "UNPAUSE")
        h.settle()
        assert h.inner.counters.stores_committed == 6 and h.inner.counters.stores_failed == 0
    finally:
        admin.close()
    empty_primary(h.manager)
    assert h.serve(range(6)) == dict.fromkeys(range(6), True)
    counts = h.finish("client pause write (stall, then resume)")
    assert counts["store_jobs_ok"] == 1 and counts["served_verified"] == 6


# ---------------------------------------------------------------------------------------------- memory


def _limit_memory(srv: RedisServer, extra_bytes: int, policy: str) -> None:
    c = srv.client()
    try:
        used = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory", str(used + extra_bytes))
        c.config_set("maxmemory-policy", policy)
    finally:
        c.close()


def test_writes_past_maxmemory_with_noeviction_fail_as_oom(server: RedisServer) -> None:
    _limit_memory(server, 128 * 1024, "noeviction")  # room for some of the 4 KiB values (and the connections)
    h = Harness(server)
    for first in range(0, 64, 8):
        h.store(range(first, first + 8))
        h.settle()
    assert h.inner.counters.failures.get("oom", 0) > 0
    landed = h.reader.dbsize()
    empty_primary(h.manager)
    served: dict[int, bool] = {}
    for first in range(0, 64, 8):  # half a primary's worth at a time
        served.update(h.serve(range(first, first + 8)))
    counts = h.finish("maxmemory noeviction (OOM)")
    assert 0 < counts["stores_committed"] == landed < 64
    assert sum(served.values()) == landed == counts["served_verified"]  # what fit is served, the rest missed


def test_keys_evicted_between_lookup_and_load_are_misses(server: RedisServer) -> None:
    _limit_memory(server, 1024 * 1024, "allkeys-lru")
    h = Harness(server)
    h.store(range(4))
    h.settle()
    empty_primary(h.manager)
    # The lookups find the keys (the tier's verdicts) and their promotion is submitted; its MGET is held...
    hang = h.plan.add(FaultRule("redis.get", FaultKind.HANG))
    ctx = h.hold_promotion(range(4))
    # ...while other traffic pushes the server past maxmemory: LRU evicts the keys before the MGET runs.
    filler = server.client()
    try:
        for i in range(64):
            filler.set(f"filler:{i}", b"x" * 64 * 1024)
        evicted = {i for i in range(4) if not filler.exists(h.inner.redis_key(key(i)))}
    finally:
        filler.close()
    assert evicted, "the filler evicted none of the keys"
    h.plan.remove(hang)
    h.plan.release_hangs()
    h.settle()
    h.manager.on_request_finished(ctx)
    served = h.serve(range(4))
    counts = h.finish(f"allkeys-lru eviction between lookup and load ({len(evicted)} of 4 evicted)")
    # The evicted keys' reads fail (a miss each); the survivors of the same promotion arrive (per-key success).
    assert served == {i: i not in evicted for i in range(4)}
    assert counts["failures"].get("evicted", 0) == len(evicted) and counts["promotion_jobs_failed"] == 1
    assert counts["served_verified"] == 4 - len(evicted)


# ---------------------------------------------------------------------------------------------- values


def test_garbage_values_are_never_served(server: RedisServer) -> None:
    """Per round, the first of four stored values is replaced on the server (garbage, another key's valid
    value, a truncated value, one payload bit flipped); the four are asked for again: the damaged one is
    refused (its kind counted) and missed, the other three are served, every byte compared."""
    h = Harness(server)
    for n, damage in enumerate(VALUE_DAMAGES):
        ids = list(range(4 * n, 4 * n + 4))
        h.store(ids)
        h.settle()
        empty_primary(h.manager)
        first, second = (h.inner.redis_key(key(i)) for i in ids[:2])
        h.ledger.damage[key(ids[0])] += 1
        h.reader.set(first, damage(h.reader.get(first), h.reader.get(second)))
        assert h.serve(ids) == {ids[0]: False, **dict.fromkeys(ids[1:], True)}
        assert h.reader.get(first) is None  # the damaged value was deleted from the server
    counts = h.finish("garbage values")
    assert counts["mismatches"] == {"magic": 1, "key": 1, "truncated": 1, "checksum": 1}, counts["mismatches"]
    assert counts["values_rejected"] == 4 and counts["served_verified"] == 12


# ---------------------------------------------------------------------------------------------- throughput


def test_throughput_bench_runs_tiny(server: RedisServer) -> None:
    from kvfsm.vllm.tier_bench import bench_vllm_redis_tier, format_vllm_redis_tier

    result = bench_vllm_redis_tier(server.url, chunks=8, chunk_bytes=16 * 1024, benchmark_requests=200)
    print("\n" + format_vllm_redis_tier(result))
    assert result.chunks_verified == 8 and result.wrong_chunks == 0
    assert result.store_mb_s > 0 and result.promote_mb_s > 0
    assert set(result.redis_benchmark_mb_s) >= {"SET", "GET"}
