"""Faults of a real redis-server under the reference engine with a Redis tier (no mocks, loopback only).

Each test drives an engine whose secondary tier is a :class:`~kvfsm.tiers.redis.RedisTier` on a real
server and does something to the server: SIGKILL it while the tier's writes or reads are in flight and
restart it (with and without an AOF), stall it with ``CLIENT PAUSE``, fill it past ``maxmemory`` (refused
writes, and keys evicted between lookup and load), overwrite values with garbage, point two namespaces at
it. In-flight I/O is held by a HANG fault inside the tier's real path (released by the test), never by
sleeping. After each: the loads the engine served were verified against the values the forward wrote
(0 mismatches), every job reached a terminal state, the engine drained and went idle, and the counts are
printed (``pytest -s``) and asserted.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_support import GUARD_S, VALUE_DAMAGES, RedisServer, needs_redis, running_server

from kvfsm.control.deadlines import ManualClock
from kvfsm.control.job import Job
from kvfsm.control.tiering import TieringManager
from kvfsm.machines.names import JobKind
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule

pytestmark = needs_redis

pytest.importorskip("torch")
pytest.importorskip("kvfsm.tiers.redis", reason="redis-py not installed: pip install 'kvfsm[redis]'")
from helpers import engine_config, tokens  # noqa: E402

from kvfsm.bench.redis import engine_namespace  # noqa: E402
from kvfsm.engine.core import EngineConfig, ReferenceEngine  # noqa: E402
from kvfsm.engine.requests import EngineRequest  # noqa: E402
from kvfsm.tiers.redis import RedisTier  # noqa: E402

#: A small engine whose CPU primary (4 slots) is smaller than one prefix family (6 chunks): prefixes that
#: fall out of the GPU and the CPU come back from the server. Two blocks a step: stores fit the primary.
CFG = engine_config(num_gpu_blocks=24, num_cpu_slots=4, blocks_per_chunk=1, world_size=2, max_num_batched_tokens=8)
BACKOFF_S = 1.0
_n = itertools.count()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as s:
        yield s


@pytest.fixture
def aof_server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis-aof", persistent=True) as s:
        yield s


class Harness:
    """A reference engine with one Redis tier; steps it with every copy and tier I/O finished in between,
    and keeps every job it ever saw, to check that each one ended."""

    def __init__(
        self, url: str, *, cfg: EngineConfig = CFG, model: str = "m", plan: FaultPlan | None = None, **kw: Any
    ) -> None:
        self.clock = ManualClock()
        self.plan = plan
        self.tier = RedisTier(
            url,
            engine_namespace(cfg, model=model, prefix=f"fault{next(_n)}"),
            faults=plan,
            clock=self.clock,
            reconnect_base_s=BACKOFF_S,
            reconnect_max_s=BACKOFF_S,
            **{"op_timeout_s": GUARD_S, **kw},
        )
        self.engine = ReferenceEngine(cfg, tiers=[self.tier])
        assert isinstance(self.engine.manager, TieringManager)
        self.tm: TieringManager = self.engine.manager
        self.cfg = cfg
        self.jobs: dict[int, Job] = {}

    def _record(self) -> None:
        for job in self.engine.scheduler.jobs().values():
            self.jobs.setdefault(job.job_id, job)
        quarantined = set(self.tm.quarantined_job_ids())
        for jid in self.tier.pending_job_ids():
            if jid not in quarantined and self.tm.transfer_in_flight(jid):
                self.jobs.setdefault(-1 - jid, self.tm.transfer_job(jid))

    def step(self, *, wait: bool = True) -> bool:
        """One step; then every copy finishes and (``wait``) the tier's I/O goes idle. False once idle."""
        busy = self.engine.step() is not None
        self._record()
        self.engine.wait_for_transfers()
        if wait:
            assert self.tier.wait_idle(GUARD_S), "the tier's I/O never went idle"
        return busy

    def promotion_submitted(self) -> bool:
        return any(
            self.tm.transfer_in_flight(j) and self.tm.transfer_job(j).kind is JobKind.PROMOTE
            for j in self.tier.pending_job_ids()
        )

    def prompt(self, family: int) -> list[int]:
        return tokens(f"family{family}", 6 * self.cfg.tokens_per_block) + tokens(f"own{next(_n)}", 2)

    def serve(self, family: int) -> EngineRequest:
        req = self.engine.make_request(f"r{next(_n)}", self.prompt(family), 1)
        self.engine.add_request(req)
        for _ in range(500):
            if req.is_finished:
                return req
            self.step()
        raise AssertionError(f"{req.req_id} never finished")

    def push_out(self, family: int) -> None:
        """Serve other families until ``family`` is out of the GPU cache and the CPU primary (it is on the
        server, if its cascades landed)."""
        self.engine.reset_prefix_cache()
        for other in (100 + family, 200 + family):
            self.serve(other)
        self.drain()
        self.engine.reset_prefix_cache()

    def drain(self) -> int:
        for steps in range(2000):
            if not self.step():
                return steps
        raise AssertionError("the engine never went idle")

    def finish(self, name: str) -> dict[str, Any]:
        """Drain, check the end state, shut down, and report the counts."""
        self.drain()
        assert self.engine.state.value == "idle", "the engine did not go idle"
        assert not self.engine.has_pending_push_work()
        assert not self.tier.has_pending_work()
        integrity = self.engine.integrity
        assert integrity.mismatches == 0, f"{integrity.mismatches} wrong blocks served"
        report = self.engine.shutdown(timeout=GUARD_S)
        assert report.clean, report
        not_ended = [j for j in self.jobs.values() if not j.is_terminal]
        assert not not_ended, f"jobs never ended: {not_ended[:3]}"
        c = self.tier.stats().as_dict()
        counts = {
            "jobs": len(self.jobs),
            "wrong_blocks_served": integrity.mismatches,
            "blocks_verified": integrity.blocks_verified,
            "loads_completed": integrity.loads_completed,
            "loads_failed": integrity.loads_failed,
            **{
                key: c[key]
                for key in (
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
        counts["tier_loads_completed"] = counts.pop("loads_completed")
        counts["loads_completed"] = integrity.loads_completed
        print(f"\nredis fault {name}: {counts}")
        return counts


def _hold_until_hanging(h: Harness, plan: FaultPlan, *, promotion: bool) -> None:
    """Step (without waiting on the tier) until its write or read batch hangs on the tier's thread."""
    for _ in range(500):
        h.step(wait=False)
        if (promotion and h.promotion_submitted()) or (not promotion and h.tier.writes_sent):
            assert plan.wait_for_hangs(1, GUARD_S), "the tier's batch never reached its I/O point"
            return
        assert h.tier.wait_idle(GUARD_S)
    raise AssertionError("nothing was sent to the server")


# ---------------------------------------------------------------------------------------------- SIGKILL


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "aof"])
def test_sigkill_during_writes_then_restart(tmp_path: Path, persistent: bool) -> None:
    with running_server(tmp_path / "redis", persistent=persistent) as srv:
        plan = FaultPlan()
        h = Harness(srv.url, plan=plan)
        h.serve(0)
        h.drain()  # family 0 is on the server
        landed = h.tier.counters.stores_committed
        assert landed >= 6
        hang = plan.add(FaultRule("redis.set", FaultKind.HANG))
        h.engine.add_request(h.engine.make_request(f"r{next(_n)}", h.prompt(1), 1))
        _hold_until_hanging(h, plan, promotion=False)  # family 1's SET batch is held on the write thread
        assert h.engine.has_pending_push_work()  # the engine may not idle with writes in flight
        srv.kill()
        plan.remove(hang)
        plan.release_hangs()
        h.drain()  # the held SET batch fails (connection refused): cascades fail, CPU copies stay
        assert h.tier.counters.stores_failed > 0
        srv.start()
        h.clock.advance(2 * BACKOFF_S)  # the backoff after the failure ends: the next operation reconnects
        h.push_out(0)
        before = h.tier.counters.loads_completed
        h.serve(0)  # AOF: family 0 survived the kill and is promoted; without persistence it is recomputed
        promoted = h.tier.counters.loads_completed - before
        counts = h.finish(f"sigkill-during-writes ({'aof' if persistent else 'no persistence'})")
        if persistent:
            assert promoted > 0, "an acknowledged write did not survive the restart with appendfsync always"
        else:
            assert promoted == 0, "the restarted server has no data; nothing can have been promoted"
        assert counts["reconnects"] >= 1


@pytest.mark.parametrize("persistent", [False, True], ids=["no-persistence", "aof"])
def test_sigkill_during_reads_then_restart(tmp_path: Path, persistent: bool) -> None:
    with running_server(tmp_path / "redis", persistent=persistent) as srv:
        plan = FaultPlan()
        # Verdicts expire within push_out's steps: the failed load's MISS does not outlive the restart.
        h = Harness(srv.url, plan=plan, lookup_ttl_steps=4)
        h.serve(0)
        h.push_out(0)
        hang = plan.add(FaultRule("redis.get", FaultKind.HANG))
        req = h.engine.make_request(f"r{next(_n)}", h.prompt(0), 1)
        h.engine.add_request(req)
        _hold_until_hanging(h, plan, promotion=True)  # the MGET of family 0 is held on the read thread
        srv.kill()
        plan.remove(hang)
        plan.release_hangs()
        for _ in range(500):  # the promotion fails: a miss, and the request computes its prefix
            if req.is_finished:
                break
            h.step()
        assert req.is_finished
        assert h.tier.counters.loads_failed > 0
        srv.start()
        h.clock.advance(2 * BACKOFF_S)
        h.push_out(0)
        before = h.tier.counters.loads_completed
        h.serve(0)
        promoted = h.tier.counters.loads_completed - before
        counts = h.finish(f"sigkill-during-reads ({'aof' if persistent else 'no persistence'})")
        assert counts["failures"].get("refused", 0) + counts["failures"].get("reset", 0) > 0
        # After the restart family 0 comes back from the AOF; without persistence it was gone (its
        # recompute's cascades ran during the backoff and failed), so it was computed again.
        if persistent:
            assert promoted > 0
        else:
            assert promoted == 0


def test_sigkill_with_a_write_on_the_wire_is_a_reset(server: RedisServer) -> None:
    """The SET batch has reached the server (held there by CLIENT PAUSE WRITE: the server lists the tier's
    connection blocked in ``set``) when the server is killed: the connection resets under it."""
    h = Harness(server.url)
    admin = server.client()
    admin.execute_command("CLIENT", "PAUSE", str(int(GUARD_S * 1000)), "WRITE")
    req = h.engine.make_request(f"r{next(_n)}", h.prompt(0), 1)
    h.engine.add_request(req)
    for _ in range(2000):
        h.step(wait=False)
        if req.is_finished and h.tier.writes_sent > 0:
            break
    for _ in range(1000):  # a bounded number of real CLIENT LIST round trips, no sleeping
        if any(c.get("cmd") == "set" and "b" in c.get("flags", "") for c in admin.client_list()):
            break
    else:
        raise AssertionError("the tier's SET never reached the server")
    admin.close()
    server.kill()
    h.drain()
    assert h.tier.counters.failures.get("reset", 0) > 0
    server.start()
    h.clock.advance(2 * BACKOFF_S)
    h.serve(1)
    counts = h.finish("sigkill with a SET on the wire")
    assert counts["reconnects"] >= 1 and counts["stores_committed"] > 0


# ---------------------------------------------------------------------------------------------- stalls


def test_client_pause_stalls_writes_and_the_engine_keeps_stepping_until_they_land(server: RedisServer) -> None:
    h = Harness(server.url)
    admin = server.client()
    try:
        admin.execute_command("CLIENT", "PAUSE", str(int(GUARD_S * 1000)), "WRITE")
        req = h.engine.make_request(f"r{next(_n)}", h.prompt(0), 1)
        h.engine.add_request(req)
        for _ in range(2000):  # steps without waiting on the tier: its SETs block in the paused server
            h.step(wait=False)
            if req.is_finished and h.tier.writes_sent > 0:
                break
        assert req.is_finished and h.tier.writes_sent > 0  # as many as the pinned CPU slots allow
        for _ in range(5):  # however long the server stalls, the engine keeps stepping (not idle)
            assert h.step(wait=False) and h.engine.has_pending_push_work()
        assert h.tier.counters.stores_committed == 0
        sent = h.tier.writes_sent
        admin.execute_command("CLIENT", "UNPAUSE")
        h.drain()
        assert h.tier.counters.stores_committed == sent and h.tier.counters.stores_failed == 0
    finally:
        admin.close()
    h.finish("client-pause (stall, then resume)")


def test_a_stall_past_the_operation_timeout_fails_jobs_cleanly_and_backs_off(server: RedisServer) -> None:
    h = Harness(server.url, op_timeout_s=0.3)
    h.serve(0)
    h.push_out(0)
    admin = server.client()
    try:
        # A 1.5 s pause of every client (the server answers nothing; a new connection's commands wait too,
        # so the pause cannot be lifted early): far past the 0.3 s operation timeout.
        admin.execute_command("CLIENT", "PAUSE", "1500", "ALL")
        req = h.serve(0)  # the existence check times out: a miss, computed; then the tier backs off
        assert req.is_finished
        assert h.tier.counters.failures.get("timeout", 0) > 0
        assert h.tier.stats().backing_off
        h.drain()  # cascades during the backoff fail at once (no network): CPU copies stay valid
        assert admin.ping()  # returns once the pause is over (the server's own end of the stall)
    finally:
        admin.close()
    h.clock.advance(2 * BACKOFF_S)
    h.push_out(0)
    h.serve(0)
    counts = h.finish("client-pause ALL past the op timeout")
    assert counts["reconnects"] >= 1 and counts["stores_committed"] > 6


# ---------------------------------------------------------------------------------------------- memory

#: Chunks of 64 KiB (4 layers x 8 heads x 16 tokens x 64 dims x K,V x fp16 / 2 ranks x 2 ranks).
BIG = engine_config(
    num_layers=4,
    num_heads=8,
    head_dim=64,
    tokens_per_block=16,
    num_gpu_blocks=24,
    num_cpu_slots=4,
    blocks_per_chunk=1,
    world_size=2,
    max_num_batched_tokens=32,
)


def _limit_memory(srv: RedisServer, extra_bytes: int, policy: str) -> None:
    c = srv.client()
    try:
        used = int(c.info("memory")["used_memory"])
        c.config_set("maxmemory", str(used + extra_bytes))
        c.config_set("maxmemory-policy", policy)
    finally:
        c.close()


def test_writes_past_maxmemory_with_noeviction_fail_as_oom(server: RedisServer) -> None:
    _limit_memory(server, 600 * 1024, "noeviction")
    h = Harness(server.url, cfg=BIG)
    for family in range(4):
        h.serve(family)
    h.drain()
    assert h.tier.counters.failures.get("oom", 0) > 0
    h.push_out(0)
    h.serve(0)  # whatever fit is promoted, the rest recomputed
    counts = h.finish("maxmemory noeviction (OOM)")
    assert counts["stores_committed"] > 0


def test_keys_evicted_between_lookup_and_load_are_misses(server: RedisServer) -> None:
    _limit_memory(server, 2 * 1024 * 1024, "allkeys-lru")
    h = Harness(server.url, cfg=BIG)
    h.serve(0)
    h.push_out(0)
    # Ask for family 0: the existence check says it is there and its promotion is reserved...
    req = h.engine.make_request(f"r{next(_n)}", h.prompt(0), 1)
    h.engine.add_request(req)
    plan = FaultPlan([FaultRule("redis.get", FaultKind.HANG)])
    h.tier.faults = plan
    _hold_until_hanging(h, plan, promotion=True)
    # ...and before the MGET runs, other traffic pushes the server past maxmemory: LRU evicts family 0.
    filler = server.client()
    try:
        for i in range(64):
            filler.set(f"filler:{i}", b"x" * 64 * 1024)
    finally:
        filler.close()
    plan.clear()
    plan.release_hangs()
    for _ in range(500):
        if req.is_finished:
            break
        h.step()
    assert req.is_finished
    counts = h.finish("allkeys-lru eviction between lookup and load")
    assert counts["failures"].get("evicted", 0) > 0


# ---------------------------------------------------------------------------------------------- values


def test_garbage_values_are_never_served(server: RedisServer) -> None:
    """Per family, the value of its first chunk is replaced on the server (garbage, another chunk's valid
    value, a truncated value, one payload bit flipped); the family is asked for again: the damaged chunk is
    refused (its kind counted), recomputed, and never served."""
    from kvfsm.control.types import make_offload_key

    h = Harness(server.url)
    c = server.client()

    try:
        for family, damage in enumerate(VALUE_DAMAGES):
            hashes = h.engine.make_request("probe", h.prompt(family), 1).block_hashes
            first, second = (h.tier.redis_key(make_offload_key(hashes[i])) for i in (0, 1))
            h.serve(family)
            h.push_out(family)
            value, other = c.get(first), c.get(second)
            assert value is not None and other is not None
            c.set(first, damage(value, other))
            h.serve(family)
    finally:
        c.close()
    counts = h.finish("garbage values")
    assert counts["mismatches"] == {"magic": 1, "key": 1, "truncated": 1, "checksum": 1}, counts["mismatches"]
    assert counts["values_rejected"] == 4


def test_two_namespaces_on_one_server_never_read_each_other(server: RedisServer) -> None:
    a = Harness(server.url, model="model-a")
    b = Harness(server.url, model="model-b")
    a.serve(0)
    a.drain()
    b.serve(0)  # the same tokens, another model: nothing of A's is found
    b.drain()
    assert b.tier.counters.hits == 0 and b.tier.counters.loads_completed == 0
    b.push_out(0)
    # Copy A's values under B's keys: B reads them, and refuses every one (another namespace).
    c = server.client()
    try:
        for key in c.keys(f"{a.tier.namespace.tag}:*"):
            chunk = key.decode().rsplit(":", 1)[1]
            c.set(f"{b.tier.namespace.tag}:{chunk}", c.get(key))
    finally:
        c.close()
    b.serve(0)
    counts_b = b.finish("two namespaces (B)")
    counts_a = a.finish("two namespaces (A)")
    assert counts_b["mismatches"].get("namespace", 0) > 0
    assert counts_a["values_rejected"] == 0
