"""KvfsmConnector's drain with kvfsm's secondary tiers, inside vLLM 0.33's real Scheduler.

Every term of the ``has_pending_push_work()`` that vLLM's engine core calls has a test here that fails when
the term is dropped (tests/vllm/connector_support.py's Rig: vLLM's Scheduler with the connector loaded from
``kv_connector_module_path``, the workers' copies held on their copy threads until released):

- the scheduler's awaited jobs: a store whose copy is held (:func:`test_a_store_in_flight_keeps_the_engine_stepping`);
- the scheduler's quarantine: a timed-out store whose copy still runs
  (:func:`test_a_timed_out_store_whose_copy_still_runs_keeps_it_true_until_the_copy_stops`);
- the tiering manager's transfers: a cascade held in its tier, fs or Redis
  (:func:`test_a_tier_transfer_in_flight_keeps_it_true`);
- the tiering manager's quarantine: a timed-out cascade whose tier still runs it
  (:func:`test_a_timed_out_cascade_still_running_keeps_it_true_until_the_tier_reports`);
- the tiers' own work: a durable fs tier's fsync not yet done
  (:func:`test_a_durable_fs_tier_keeps_it_true_until_its_blocks_are_synced`).

Each ends with the engine idle and ``has_pending_push_work()`` False (never True forever). The tier keys
round-trip the KV bytes: a prefix stored, the GPU prefix cache and the CPU tier reset and every KV tensor
and CPU slot zeroed, comes back from the tier with exactly its bytes (the Rig's ground-truth check).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")

import torch
from connector_support import BLOCK_SIZE, HEAD_DIM, HEADS, Rig, opt_config_dir
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.policies import ARCPolicy, LRUPolicy, RequestARCPolicy, RequestLRUPolicy
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import make_offload_keys
from kvfsm.errors import ConfigError
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.vllm.connector import KvfsmConnector, parse_settings
from kvfsm.vllm.connector_tiers import TIER_KEYS, engine_tiers
from kvfsm.vllm.drive import scheduler_config

PROMPT_A = list(range(1, 70))  # 69 tokens: 4 full blocks of 16
GUARD_S = 30.0  #: deadlock guard of every wait on a thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return opt_config_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real redis-server on loopback for this module (skipped, with the install command, without one)."""
    from redis_support import module_server_url

    with module_server_url() as url:
        yield url


def _tier_extra(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, Any]:
    if kind == "fs":
        return {"tiers": ["fs"], "fs_path": str(tmp_path / "fs")}
    if kind == "fs-durable":
        return {"tiers": ["fs"], "fs_path": str(tmp_path / "fs"), "fs_durable": True}
    url = request.getfixturevalue("redis_url")
    return {"tiers": ["redis"], "redis_url": url, "redis_prefix": f"drain{time.time_ns()}"}


def _sched(rig: Rig) -> OffloadingScheduler:
    sched = rig.connector.scheduler
    assert sched is not None
    return sched


def _tiering(rig: Rig) -> TieringManager:
    manager = _sched(rig).manager
    assert isinstance(manager, TieringManager)
    return manager


def _release_all(rig: Rig) -> None:
    for rank in range(rig.world_size):
        for job_id in rig.held(rank):
            rig.release(job_id, ranks=[rank])


def _step_until(rig: Rig, done: Callable[[], bool], what: str, *, release: bool = True) -> None:
    """Step (letting every GPU copy finish first when ``release``) until ``done()``, within GUARD_S. A step
    that scheduled nothing waits a millisecond: a tier's I/O threads answer in their own time."""
    end = time.monotonic() + GUARD_S
    while time.monotonic() < end:
        if release:
            _release_all(rig)
        if done():
            return
        if not rig.step().scheduled:
            time.sleep(0.001)
    raise AssertionError(f"never reached within {GUARD_S} s: {what}")


def _finish(rig: Rig, req_id: str) -> None:
    """Step until vLLM has finished ``req_id`` (its stores may still be held)."""
    _step_until(rig, lambda: req_id not in rig.scheduler.requests, f"{req_id} finishing", release=False)


def _drain(rig: Rig) -> None:
    """Step as vLLM's engine loop does until it goes idle, every copy let go; then nothing is pending."""
    _step_until(rig, lambda: not rig.has_work(), "the engine going idle")
    assert not rig.connector.has_pending_push_work()


def _keeps_stepping(rig: Rig, steps: int = 3) -> None:
    """vLLM's loop keeps stepping on the connector's word alone: no request left, the drain says True."""
    for _ in range(steps):
        assert not rig.scheduler.requests
        assert rig.connector.has_pending_push_work()
        assert rig.has_work()
        rig.step()


# ---------------------------------------------------------------------------------------------- the scheduler's terms


def test_a_store_in_flight_keeps_the_engine_stepping(model_dir: Path) -> None:
    """Term: the scheduler's awaited jobs (killed by dropping ``bool(jobs)`` from pending_push_work)."""
    rig = Rig(model_dir)
    try:
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish(rig, "a")
        sched = _sched(rig)
        assert sched.num_jobs >= 1 and rig.held()
        assert sched.num_quarantined == 0 and not sched.manager.has_pending_work()
        _keeps_stepping(rig)
        _drain(rig)
        assert sched.num_jobs == 0 and sched.stats.committed_stores >= 1
    finally:
        rig.shutdown()


def test_a_timed_out_store_whose_copy_still_runs_keeps_it_true_until_the_copy_stops(model_dir: Path) -> None:
    """Term: the scheduler's quarantine. A store times out (``store_deadline_s``) while its copy is held on
    the worker's copy thread: the job is no longer awaited, but its slots are still being written, so the
    engine keeps stepping until the copy stops and its late report releases them."""
    rig = Rig(model_dir, extra={"store_deadline_s": 0.2})
    try:
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish(rig, "a")
        sched = _sched(rig)
        held = rig.held()
        assert held
        time.sleep(0.3)
        rig.step()  # the deadline passes at this step's build_connector_meta
        assert sched.stats.timed_out_stores >= 1
        assert sched.num_jobs == 0, "every store timed out: none is awaited any more"
        assert sched.num_quarantined >= 1 and not sched.manager.has_pending_work()
        assert rig.held() == held, "the copies are still running on the copy thread"
        _keeps_stepping(rig)
        for job_id in held:
            rig.release(job_id)
        _step_until(rig, lambda: sched.num_quarantined == 0, "the late reports releasing the quarantine", release=False)
        assert not rig.connector.has_pending_push_work() and not rig.has_work()
        assert sched.stats.late_reports_ignored >= 1
    finally:
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- the tiers' terms


def _cascade_in_flight(rig: Rig, plan: FaultPlan) -> TieringManager:
    """Run a's prompt, let its stores commit, and step until a cascade to the tier hangs at ``plan``."""
    tm = _tiering(rig)
    rig.add(PROMPT_A, max_tokens=2, req_id="a")
    _finish(rig, "a")
    _step_until(
        rig,
        lambda: tm.num_transfer_jobs > 0 and _sched(rig).num_jobs == 0 and plan.hanging >= 1,
        "a cascade hanging in its tier",
    )
    return tm


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_a_tier_transfer_in_flight_keeps_it_true(
    model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest, kind: str
) -> None:
    """Term: the tiering manager's transfers. The stores committed, so the scheduler awaits nothing; the
    cascade to the tier is held (a HANG fault on its slot read) and alone keeps the engine stepping."""
    rig = Rig(model_dir, extra=_tier_extra(kind, tmp_path, request))
    plan = FaultPlan([FaultRule(op="slot.read", kind=FaultKind.HANG)])
    try:
        tm = _tiering(rig)
        tier = tm.tiers[0]
        tier.faults = plan  # type: ignore[attr-defined]
        _cascade_in_flight(rig, plan)
        sched = _sched(rig)
        assert sched.num_quarantined == 0 and tm.num_quarantined == 0
        # The fs tier counts no cascade as its own work (the manager does); the Redis tier also counts its
        # unsent or unacknowledged writes (a term of its own, redundant with the manager's while a job is held).
        assert tier.has_pending_work() is (kind == "redis")
        _keeps_stepping(rig)
        assert tm.num_transfer_jobs > 0
        tier.faults = None  # type: ignore[attr-defined]
        plan.release_hangs()
        _drain(rig)
        assert tm.num_transfer_jobs == 0 and tm.stats().cascades_completed >= 1
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_a_timed_out_cascade_still_running_keeps_it_true_until_the_tier_reports(
    model_dir: Path, tmp_path: Path
) -> None:
    """Term: the tiering manager's quarantine. A cascade times out (``cascade_deadline_s``) while the fs
    tier still reads its slot: no transfer is awaited, but the slot stays pinned, and the engine keeps
    stepping until the tier reports the copy finished."""
    extra = {"tiers": ["fs"], "fs_path": str(tmp_path / "fs"), "cascade_deadline_s": 0.3}
    rig = Rig(model_dir, extra=extra)
    plan = FaultPlan([FaultRule(op="slot.read", kind=FaultKind.HANG)])
    try:
        tm = _tiering(rig)
        tier = tm.tiers[0]
        assert isinstance(tier, FileSystemTier)
        tier.faults = plan
        _cascade_in_flight(rig, plan)
        time.sleep(0.4)
        rig.step()  # on_schedule_end times the cascades out
        assert tm.stats().cascades_timed_out >= 1
        assert tm.num_transfer_jobs == 0 and tm.num_quarantined >= 1
        assert _sched(rig).num_jobs == 0 and _sched(rig).num_quarantined == 0 and not tier.has_pending_work()
        _keeps_stepping(rig)
        tier.faults = None
        plan.release_hangs()
        _step_until(rig, lambda: tm.num_quarantined == 0, "the tier's late results releasing the quarantine")
        _drain(rig)
        assert tm.stats().late_results >= 1
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_a_durable_fs_tier_keeps_it_true_until_its_blocks_are_synced(model_dir: Path, tmp_path: Path) -> None:
    """Term: a tier's own pending work. A durable fs tier acknowledges a cascade once its block file is
    renamed into place and syncs it afterwards; with that fsync held, no transfer is in flight and the
    scheduler awaits nothing, and the engine keeps stepping until the block is durable."""
    extra = {"tiers": ["fs"], "fs_path": str(tmp_path / "fs"), "fs_durable": True}
    rig = Rig(model_dir, extra=extra)
    plan = FaultPlan([FaultRule(op="fs.fsync", kind=FaultKind.HANG, times=1)])
    try:
        tm = _tiering(rig)
        tier = tm.tiers[0]
        assert isinstance(tier, FileSystemTier) and tier.durable
        tier.faults = plan
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish(rig, "a")
        _step_until(
            rig,
            lambda: tm.stats().cascades_completed >= 1 and tm.num_transfer_jobs == 0 and plan.hanging >= 1,
            "every cascade acknowledged with one fsync held",
        )
        assert tier.durability_pending >= 1
        assert _sched(rig).num_jobs == 0 and _sched(rig).num_quarantined == 0 and tm.num_quarantined == 0
        _keeps_stepping(rig)
        plan.release_hangs()
        _drain(rig)
        assert tier.durability_pending == 0
    finally:
        plan.release_hangs()
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- the tier keys


def _zero_kv_and_slots(rig: Rig) -> None:
    """Zero every KV tensor and every CPU slot: what comes back can only come from the tier."""
    for caches in rig.kv:
        for t in caches.values():
            t.zero_()
    entry = engine_tiers(rig.connector.engine_id)
    assert entry is not None and entry.bound
    for pool in entry.pools.values():
        for slot in range(int(getattr(pool, "num_slots"))):  # noqa: B009 - the SizedSlotIO protocol has no count
            pool.write_slot(slot, bytes(pool.nbytes_per_slot))


@pytest.mark.parametrize("kind", ["fs", "fs-durable", "redis"])
@pytest.mark.parametrize("world", [1, 2])
def test_a_tier_round_trips_the_kv_bytes_after_a_reset(
    model_dir: Path, tmp_path: Path, request: pytest.FixtureRequest, kind: str, world: int
) -> None:
    """Store a prefix through the connector, let it cascade to the tier, reset vLLM's GPU prefix cache and
    the connector's CPU tier, zero every KV tensor and CPU slot; the prefix comes back from the tier (a
    promotion, then a load), and every loaded position holds exactly its bytes."""
    rig = Rig(model_dir, world_size=world, extra=_tier_extra(kind, tmp_path, request))
    try:
        tm = _tiering(rig)
        sched = _sched(rig)
        rig.add(PROMPT_A, max_tokens=2, req_id="a")
        _finish(rig, "a")
        _drain(rig)
        assert tm.stats().cascades_completed >= 1  # a's chunks are on the tier (cascades count jobs)
        assert rig.scheduler.reset_prefix_cache()
        assert rig.scheduler.reset_connector_cache()
        assert len(tm.primary) == 0
        _zero_kv_and_slots(rig)
        loads = sched.stats.committed_loads
        rig.add(PROMPT_A, max_tokens=2, req_id="b")
        _step_until(rig, lambda: "b" not in rig.scheduler.requests, "b loading its prefix and finishing")
        _drain(rig)
        assert tm.stats().promotions_completed >= 4
        assert sched.stats.committed_loads == loads + 1
        # The ground truth: before each forward, every computed position of b held its prefix's values.
        assert not rig.mismatches, rig.mismatches[:3]
        loaded = [s for s in rig.steps if s.scheduled.get("b", 0) and s.output.num_scheduled_tokens["b"] < 69]
        assert loaded, "b was meant to skip its loaded prefix"
    finally:
        rig.shutdown()


def test_a_worker_without_its_tiers_in_its_process_is_a_config_error(model_dir: Path, tmp_path: Path) -> None:
    """The tiers move slot bytes in the scheduler's process: a worker whose process has no scheduler with
    its engine's tiers (vLLM's multiprocess executor) fails its first step with one ConfigError."""
    extra = {"num_slots": 4, "tiers": ["fs"], "fs_path": str(tmp_path / "fs")}
    config, kv_cache_config = _configs(model_dir, extra)
    worker = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(_caches(kv_cache_config))
    try:
        with pytest.raises(ConfigError, match=r"found no tier .*uniproc"):
            worker.wait_for_save()
    finally:
        worker.shutdown()


def test_workers_registered_before_the_scheduler_are_bound_as_in_vllms_engine_core(
    model_dir: Path, tmp_path: Path
) -> None:
    """vLLM's engine core registers the workers' KV caches before it builds the scheduler: the tiers the
    scheduler builds later are bound to the pool the worker registered."""
    extra = {"num_slots": 4, "tiers": ["fs"], "fs_path": str(tmp_path / "fs")}
    config, kv_cache_config = _configs(model_dir, extra)
    worker = KvfsmConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    worker.register_kv_caches(_caches(kv_cache_config))
    entry = engine_tiers(worker.engine_id)
    assert entry is not None and not entry.bound
    scheduler = KvfsmConnector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    try:
        bound = engine_tiers(worker.engine_id)
        assert bound is entry and bound.bound
        tier = _tiering_of(scheduler).tiers[0]
        assert isinstance(tier, FileSystemTier) and tier.slot_io is entry.pools[0]
        worker.wait_for_save()  # the first step's check passes (no jobs: nothing else happens)
    finally:
        scheduler.shutdown()
        worker.shutdown()


def _tiering_of(connector: KvfsmConnector) -> TieringManager:
    assert connector.scheduler is not None
    manager = connector.scheduler.manager
    assert isinstance(manager, TieringManager)
    return manager


def _configs(model_dir: Path, extra: dict[str, Any]) -> tuple[Any, KVCacheConfig]:
    config = scheduler_config(
        model_dir,
        connector="KvfsmConnector",
        module="kvfsm.vllm",
        extra=extra,
        block_size=BLOCK_SIZE,
        world_size=1,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
    )
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32)
    kv_cache_config = KVCacheConfig(
        num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    return config, kv_cache_config


def _caches(kv_cache_config: KVCacheConfig) -> dict[str, torch.Tensor]:
    return {"layer.0": torch.zeros((2, kv_cache_config.num_blocks, BLOCK_SIZE, HEADS, HEAD_DIM))}


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"tiers": ["tape"]}, "tiers"),
        ({"tiers": 3}, "tiers"),
        ({"tiers": ["fs", "fs"], "fs_path": "/tmp/x"}, "tiers"),
        ({"tiers": ["fs"]}, "fs_path"),
        ({"tiers": ["fs"], "fs_path": ""}, "fs_path"),
        ({"fs_path": "/tmp/x"}, "fs_path"),
        ({"tiers": ["fs"], "fs_path": "/tmp/x", "fs_durable": "yes"}, "fs_durable"),
        ({"tiers": ["fs"], "fs_path": "/tmp/x", "fs_capacity_bytes": 0}, "fs_capacity_bytes"),
        ({"fs_durable": True}, "fs_durable"),
        ({"tiers": ["redis"]}, "redis_url"),
        ({"tiers": ["redis"], "redis_url": "http://localhost"}, "redis_url"),
        ({"tiers": ["redis"], "redis_url": "redis://h:1", "redis_prefix": "a b"}, "redis_prefix"),
        ({"tiers": ["redis"], "redis_url": "redis://h:1", "redis_cluster": 1}, "redis_cluster"),
        ({"tiers": ["redis"], "redis_url": "redis://h:1", "redis_ttl_s": 0}, "redis_ttl_s"),
        ({"redis_url": "redis://h:1"}, "redis_url"),
        ({"cascade_deadline_s": 0}, "cascade_deadline_s"),
        ({"promote_deadline_s": "1"}, "promote_deadline_s"),
        ({"policy": "fifo"}, "policy"),
        ({"tier": "fs"}, "tier"),
    ],
)
def test_a_bad_tier_key_is_a_config_error_naming_it(extra: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        parse_settings({"num_slots": 4, **extra})


def test_the_tier_keys_parse() -> None:
    s = parse_settings(
        {
            "num_slots": 4,
            "tiers": ["fs", "redis"],
            "fs_path": "/tmp/x",
            "fs_durable": True,
            "fs_capacity_bytes": 1 << 20,
            "redis_url": "redis://127.0.0.1:6379/0",
            "redis_prefix": "p",
            "redis_cluster": False,
            "redis_ttl_s": 60,
            "cascade_deadline_s": 5,
            "promote_deadline_s": None,
        }
    )
    assert s.tiers.tiers == ("fs", "redis") and s.tiers.fs_durable and s.tiers.fs_capacity_bytes == 1 << 20
    assert s.tiers.redis_url == "redis://127.0.0.1:6379/0" and s.tiers.redis_ttl_s == 60
    assert s.deadlines.cascade_s == 5.0 and s.deadlines.promote_s is None
    assert parse_settings({"num_slots": 4, "tiers": "fs", "fs_path": "/x"}).tiers.tiers == ("fs",)
    assert parse_settings({"num_slots": 4}).tiers.tiers == ()


# ---------------------------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("policy", "kvfsm_name", "cls"),
    [
        (None, "request-lru", RequestLRUPolicy),
        ("lru", "request-lru", RequestLRUPolicy),
        ("arc", "request-arc", RequestARCPolicy),
        ("request-lru", "request-lru", RequestLRUPolicy),
        ("commit-lru", "lru", LRUPolicy),
        ("commit-arc", "arc", ARCPolicy),
    ],
)
def test_the_policy_defaults_to_vllms_order_as_the_spec_route(
    model_dir: Path, policy: str | None, kvfsm_name: str, cls: type
) -> None:
    extra = {} if policy is None else {"policy": policy}
    assert parse_settings({"num_slots": 4, **extra}).policy == kvfsm_name
    rig = Rig(model_dir, extra=extra, gated=False)
    try:
        primary = _sched(rig).manager
        assert isinstance(primary, CPUOffloadingManager) and isinstance(primary.policy, cls)
    finally:
        rig.shutdown()


def test_vllms_order_evicts_a_running_requests_tail_first(model_dir: Path) -> None:
    """vLLM's LRU ranks a live request's keys by their token positions (its scheduler records each key's
    end token): the tail is older than the head, so a store that needs a slot evicts the tail. The scheduler
    passes those positions on this route too (without them the head, stored first, would go first)."""
    rig = Rig(model_dir, num_slots=4)
    try:
        a = rig.add(list(range(1, 65)), max_tokens=14, req_id="a")  # 4 full blocks; 78 tokens: no 5th
        keys = make_offload_keys(list(a.block_hashes)[:4])
        primary = _sched(rig).manager.primary
        assert primary is not None
        _step_until(rig, lambda: all(k in primary and primary.policy.is_evictable(k) for k in keys), "a's 4 chunks")
        assert "a" in rig.scheduler.requests, "a is meant to be running still"
        b = rig.add(list(range(3000, 3020)), max_tokens=1, req_id="b")  # 1 full block: needs one slot
        b_key = make_offload_keys(list(b.block_hashes)[:1])[0]
        _step_until(rig, lambda: b_key in primary, "b's chunk stored")
        assert "a" in rig.scheduler.requests
        kept = [k in primary for k in keys]
        assert kept == [True, True, True, False], f"expected a's tail evicted first, kept {kept}"
        _drain(rig)
    finally:
        rig.shutdown()


def test_every_key_is_in_the_module_docstring_table() -> None:
    """The connector's module docstring documents every key parse_settings accepts."""
    import kvfsm.vllm.connector as connector

    doc = connector.__doc__ or ""
    for key in (*TIER_KEYS, "cascade_deadline_s", "promote_deadline_s", "policy", "commit-lru", "commit-arc"):
        assert f"``{key}``" in doc or f'``"{key}"``' in doc, f"{key!r} is not documented in kvfsm.vllm.connector"
