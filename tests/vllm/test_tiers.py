"""kvfsm's fs and Redis tiers inside vLLM's own tiering spec (``kvfsm.vllm.tiers``), loaded by vLLM's factory from
``secondary_tiers`` entries with ``module_path``: real bytes stored from vLLM's primary memory, the primary emptied,
the bytes promoted back and compared; ``has_pending_work`` term by term; failures (a Redis server killed mid-run, a
bad block, a promotion past its deadline with vLLM 0.34's deferred release); construction errors.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

# The real vLLM with its tiering spec (tests/vllm itself is a namespace package named vllm when tests/ is on
# sys.path); an older vLLM without tiering skips this module.
pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
pytest.importorskip("vllm.v1.kv_offload.tiering.factory")

import vllm.v1.kv_offload.base as offload_base
import vllm.v1.kv_offload.tiering.factory as tier_factory
from redis_support import HAVE_REDIS_PY, INSTALL_HINT, PIP_HINT, REDIS_SERVER, RedisServer, free_port
from tiers_support import (
    MISS,
    ROW,
    build,
    empty_primary,
    fs_entry,
    key,
    load,
    payload,
    redis_entry,
    settle,
    step,
    step_until,
    store,
)

from kvfsm.errors import ConfigError, ConfigKeyError
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.vllm.tiers import KvfsmFsTier, KvfsmRedisTier, supports_deferred_release

needs_deferred_release = pytest.mark.skipif(
    not supports_deferred_release(), reason="this vLLM's JobResult has no deferred_release (vLLM 0.34 has)"
)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A fresh redis-server on loopback (a test may kill it)."""
    if REDIS_SERVER is None:
        pytest.skip(f"redis-server not found: {INSTALL_HINT}")
    if not HAVE_REDIS_PY:
        pytest.skip(f"redis-py not installed: {PIP_HINT}")
    server = RedisServer(tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


def _only_tier(manager: Any) -> Any:
    (tier,) = manager.secondary_tiers
    return tier


# ---------------------------------------------------------------------------------------------- round trips


def test_fs_tier_round_trip_through_vllm(tmp_path: Path) -> None:
    manager = build([fs_entry(tmp_path / "fs", enable_kv_events=True)], events=True)
    try:
        tier = _only_tier(manager)
        assert isinstance(tier, KvfsmFsTier)
        assert tier.medium is offload_base.Medium.STORAGE and tier.locality is offload_base.Locality.LOCAL
        store(manager, range(4), "writer")
        settle(manager)
        assert sorted(tier.tier.keys()) == sorted(key(i) for i in range(4))
        stored = [e for e in manager.take_events() if e.medium is offload_base.Medium.STORAGE]
        assert {k for e in stored if not e.removed for k in e.keys} == {key(i) for i in range(4)}
        assert all(e.locality is offload_base.Locality.LOCAL for e in stored)
        if "req_context" in {f.name for f in dataclasses.fields(offload_base.OffloadingEvent)}:
            # vLLM 0.34's self-describing events read the stored block's tokens from its request.
            assert {e.req_context.req_id for e in stored if not e.removed} == {"writer"}
        empty_primary(manager)
        assert load(manager, range(5), "reader") == {**{i: payload(i) for i in range(4)}, 4: None}
        assert not manager.has_pending_work() and not tier.has_pending_work()
    finally:
        manager.shutdown()


def test_redis_tier_round_trip_through_vllm(redis_server: RedisServer) -> None:
    manager = build([redis_entry(redis_server.url, redis_prefix="rt")])
    try:
        tier = _only_tier(manager)
        assert isinstance(tier, KvfsmRedisTier)
        assert tier.medium is offload_base.Medium.STORAGE and tier.locality is offload_base.Locality.REMOTE
        store(manager, range(3), "writer")
        settle(manager)
        assert redis_server.client().dbsize() == 3  # one value per chunk, on the real server
        empty_primary(manager)
        assert load(manager, range(3), "reader") == {i: payload(i) for i in range(3)}
        stats = tier.get_stats()
        assert stats is not None and not stats.is_empty()
    finally:
        manager.shutdown()


def test_a_second_engine_finds_the_fs_tiers_blocks(tmp_path: Path) -> None:
    """kvfsm's format persists: a new engine on the same directory serves what the first stored."""
    first = build([fs_entry(tmp_path / "fs")])
    try:
        store(first, range(2), "writer")
        settle(first)
    finally:
        first.shutdown()
    second = build([fs_entry(tmp_path / "fs")])
    try:
        assert load(second, range(2), "reader") == {i: payload(i) for i in range(2)}
    finally:
        second.shutdown()


# ---------------------------------------------------------------------------------------------- failures


def test_fs_promotion_reports_the_keys_that_arrived(tmp_path: Path) -> None:
    """One bad block of three: the job fails, the two good chunks are kept (per-key partial success), the bad
    key answers MISS after and its bytes are never served."""
    manager = build([fs_entry(tmp_path / "fs")])
    try:
        tier = _only_tier(manager)
        store(manager, range(3), "writer")
        settle(manager)
        empty_primary(manager)
        tier.tier.faults = FaultPlan([FaultRule(op="fs.read", kind=FaultKind.CORRUPT, keys=frozenset({key(1)}))])
        results: list[Any] = []
        original = tier.get_finished_jobs

        def spy() -> list[Any]:
            out = list(original())
            results.extend(out)
            return out

        tier.get_finished_jobs = spy
        assert load(manager, range(3), "reader") == {0: payload(0), 1: None, 2: payload(2)}
        (failed,) = [r for r in results if not r.success]
        assert set(failed.successful_keys) == {key(0), key(2)}
        ctx = offload_base.ReqContext(req_id="again")
        assert tier.lookup(key(1), ctx) is MISS
    finally:
        manager.shutdown()


def test_redis_server_killed_mid_run(redis_server: RedisServer) -> None:
    """Stored chunks, then the server dies: the promotion fails (nothing wrong is served, the keys turn MISS),
    new cascades fail, and the tier goes idle."""
    manager = build([redis_entry(redis_server.url, promote_timeout_s=2.0)])
    try:
        tier = _only_tier(manager)
        store(manager, range(3), "writer")
        settle(manager)
        empty_primary(manager)
        redis_server.kill()
        assert load(manager, range(3), "reader") == {0: None, 1: None, 2: None}
        assert all(tier.lookup(key(i), offload_base.ReqContext(req_id="x")) is MISS for i in range(3))
        store(manager, [7], "late-writer")  # its cascade fails; the primary copy stays valid
        settle(manager)
        assert tier.tier.counters.stores_failed >= 1
        assert not tier.has_pending_work() and not manager.has_pending_work()
        assert load(manager, [7], "late-reader") == {7: payload(7)}  # served from the primary
    finally:
        manager.shutdown()


@needs_deferred_release
def test_timed_out_promotion_defers_its_release_until_the_io_stops(redis_server: RedisServer) -> None:
    """vLLM 0.34: a promotion held past promote_timeout_s is reported failed with a deferred release; its
    chunks stay out of the free pool, and the tier has pending work, until the held I/O stops (here: released
    into a killed server), when the event is set and the chunks return."""
    manager = build([redis_entry(redis_server.url, promote_timeout_s=0.2)])
    try:
        tier = _only_tier(manager)
        store(manager, range(2), "writer")
        settle(manager)
        empty_primary(manager)
        plan = FaultPlan([FaultRule(op="redis.get", kind=FaultKind.HANG)])
        tier.tier.faults = plan
        released: list[threading.Event] = []
        original = tier.get_finished_jobs

        def spy() -> list[Any]:
            out = list(original())
            released.extend(r.deferred_release for r in out if r.deferred_release is not None)
            return out

        tier.get_finished_jobs = spy
        assert load(manager, range(2), "reader") == {0: None, 1: None}  # failed at the deadline, I/O still held
        assert plan.hanging >= 1  # its MGET batches are held
        (event,) = released
        assert not event.is_set()
        assert manager.primary_tier.num_deferred_release_chunks == 2
        assert tier.has_pending_work() and tier.deferred_releases_pending == 1
        redis_server.kill()
        plan.release_hangs()  # the held MGET now runs into a dead server and fails
        settle(manager, until=event.is_set)
        assert manager.primary_tier.num_deferred_release_chunks == 0
        assert not tier.has_pending_work()
        assert all(tier.lookup(key(i), offload_base.ReqContext(req_id="x")) is MISS for i in range(2))
    finally:
        manager.shutdown()


def test_drain_never_cuts_a_copy_short(tmp_path: Path) -> None:
    """vLLM's reset drains the tier: it blocks until the held promotion finishes, which then lands whole."""
    manager = build([fs_entry(tmp_path / "fs")])
    try:
        tier = _only_tier(manager)
        store(manager, range(2), "writer")
        settle(manager)
        empty_primary(manager)
        plan = FaultPlan([FaultRule(op="slot.write", kind=FaultKind.HANG, times=1)])
        tier.tier.faults = plan
        ctx = offload_base.ReqContext(req_id="reader")
        manager.on_new_request(ctx)
        assert manager.lookup(key(0), ctx) is offload_base.LookupResult.HIT_PENDING
        step(manager)  # submits the promotion
        assert plan.wait_for_hangs(1, timeout=10)
        threading.Timer(0.2, plan.release_hangs).start()
        tier.drain_jobs()  # returns only once the held write has finished
        assert tier.jobs_in_flight == 0 and tier.has_pending_work()  # the result waits for the next poll
        view = manager.primary_tier.get_kv_memoryview().cast("B")
        (job,) = list(tier.get_finished_jobs())
        assert job.success
        assert payload(0) in bytes(view)
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------------------------- has_pending_work


def test_pending_work_while_a_promotion_is_in_flight(tmp_path: Path) -> None:
    manager = build([fs_entry(tmp_path / "fs")])
    try:
        tier = _only_tier(manager)
        store(manager, [0], "writer")
        settle(manager)
        empty_primary(manager)
        plan = FaultPlan([FaultRule(op="slot.write", kind=FaultKind.HANG, times=1)])
        tier.tier.faults = plan
        ctx = offload_base.ReqContext(req_id="reader")
        manager.on_new_request(ctx)
        manager.lookup(key(0), ctx)
        step(manager)
        assert plan.wait_for_hangs(1, timeout=10)
        assert tier.has_pending_work()  # the copy is running: a later poll completes it
        plan.release_hangs()
        settle(manager)
        assert not tier.has_pending_work()
        manager.on_request_finished(ctx)
    finally:
        manager.shutdown()


def test_pending_work_while_redis_writes_are_staged(redis_server: RedisServer) -> None:
    manager = build([redis_entry(redis_server.url)])
    try:
        tier = _only_tier(manager)
        store(manager, range(2), "writer")  # the cascade is staged until the step ends
        assert tier.tier.writes_pending == 2 and tier.tier.writes_sent == 0
        # The kvfsm tier's own term, asked directly: at the adapter the cascade's job term covers it too.
        assert tier.tier.has_pending_work()
        assert tier.has_pending_work()
        settle(manager)
        assert tier.tier.writes_pending == 0 and not tier.has_pending_work()
        assert redis_server.client().dbsize() == 2
    finally:
        manager.shutdown()


def test_pending_work_until_durable_fs_blocks_are_synced(tmp_path: Path) -> None:
    """fs_durable: the cascade is acknowledged once the file is in place, but the tier has pending work until
    its fsync has run (held here), so the engine keeps stepping until the data is durable."""
    manager = build([fs_entry(tmp_path / "fs", fs_durable=True)])
    try:
        tier = _only_tier(manager)
        plan = FaultPlan([FaultRule(op="fs.fsync", kind=FaultKind.HANG, times=1)])
        tier.tier.faults = plan
        store(manager, [0], "writer")
        step_until(manager, lambda: tier.jobs_in_flight == 0 and plan.hanging == 1)
        assert tier.tier.durability_pending == 1
        assert tier.has_pending_work() and manager.has_pending_work()
        plan.release_hangs()
        settle(manager)
        assert tier.tier.durability_pending == 0 and not tier.has_pending_work()
    finally:
        manager.shutdown()


def test_pending_work_while_drained_results_await_delivery(tmp_path: Path) -> None:
    manager = build([fs_entry(tmp_path / "fs")])
    try:
        tier = _only_tier(manager)
        store(manager, range(2), "writer")
        tier.drain_jobs()  # the I/O is done and its results taken from kvfsm's tier, not yet given to vLLM
        assert tier.jobs_in_flight == 0 and not tier.tier.has_pending_work()
        assert tier.has_pending_work()
        settle(manager)
        assert not tier.has_pending_work()
    finally:
        manager.shutdown()


# ---------------------------------------------------------------------------------------------- construction


def _create(entry: dict[str, Any]) -> Any:
    """The tier as vLLM's spec creates it (its factory), over a small primary view."""
    from tiers_support import offloading_config

    view = memoryview(bytearray(4 * ROW)).cast("B", (4, ROW))
    spec: Any = type("Spec", (), {})()
    spec.config = offloading_config([entry])
    spec.kv_events_config = offload_base.OffloadingKVEventsConfig(
        enable_kv_cache_events=False, self_describing_kv_events=False
    )
    return tier_factory.SecondaryTierFactory.create_secondary_tier(entry, view, spec)


def test_unknown_key_is_one_typed_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigKeyError) as exc:
        _create(fs_entry(tmp_path, fs_capacity=5))
    assert exc.value.key == "fs_capacity"
    with pytest.raises(ConfigKeyError) as exc:
        _create(fs_entry(tmp_path, fs_capacity_bytes=0))
    assert exc.value.key == "fs_capacity_bytes"
    with pytest.raises(ConfigKeyError) as exc:
        _create(fs_entry(tmp_path, promote_timeout_s=-1))
    assert exc.value.key == "promote_timeout_s"


def test_unwritable_fs_root_is_one_typed_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(ConfigKeyError) as exc:
        _create(fs_entry(blocker / "below"))
    assert exc.value.key == "fs_path"


def test_missing_redis_server_is_one_typed_error() -> None:
    if not HAVE_REDIS_PY:
        pytest.skip(f"redis-py not installed: {PIP_HINT}")
    with pytest.raises(ConfigError) as exc:
        _create(redis_entry(f"redis://127.0.0.1:{free_port()}/0", promote_timeout_s=1.0))
    assert isinstance(exc.value, ConfigKeyError) and exc.value.key == "redis_url"


def test_backpressure_detector_is_accepted(tmp_path: Path) -> None:
    entry = fs_entry(tmp_path, backpressure={"backpressure_cls": "EMABackpressureDetector"})
    tier = _create(entry)
    try:
        assert tier.bp_detector is not None
    finally:
        tier.shutdown()


def test_import_kvfsm_needs_no_vllm() -> None:
    import subprocess
    import sys

    code = "import sys, kvfsm, kvfsm.tiers, kvfsm.vllm; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=str(Path(__file__).parents[2]))


# ---------------------------------------------------------------------------------------------- the README


README = Path(__file__).resolve().parents[2] / "README.md"
_EXAMPLE_MARK = "<!-- kvfsm:route3-example"


def _readme_route3() -> tuple[dict[str, Any], str]:
    """The README's route-3 ``kv_transfer_config`` (its code block, run as a user would paste it), and the
    README text of that section."""
    text = README.read_text(encoding="utf-8")
    start = text.index(_EXAMPLE_MARK)
    block = text[text.index("```python\n", start) + len("```python\n") :]
    block = block[: block.index("```")]
    scope: dict[str, Any] = {}
    exec(compile(block, "README.md (route 3)", "exec"), scope)  # the README's own example, as a user pastes it
    section = text[text.rindex("### ", 0, start) :]
    return scope["kv_transfer_config"], section[: section.index("\n### ", 1)]


def test_the_readmes_route3_example_serves_through_both_tiers(tmp_path: Path, redis_server: RedisServer) -> None:
    """The README's example, with its fs path and Redis URL pointed at this test's: vLLM's factory loads both of
    kvfsm's tiers from it, every chunk reaches both (block files, server keys), and comes back byte for byte."""
    config, _ = _readme_route3()
    assert config["kv_connector"] == "OffloadingConnector"
    extra = config["kv_connector_extra_config"]
    assert extra["spec_name"] == "TieringOffloadingSpec"
    entries = [dict(e) for e in extra["secondary_tiers"]]
    by_type = {e["type"]: e for e in entries}
    assert set(by_type) == {"KvfsmFsTier", "KvfsmRedisTier"}
    by_type["KvfsmFsTier"]["fs_path"] = str(tmp_path / "fs")
    by_type["KvfsmRedisTier"]["redis_url"] = redis_server.url
    manager = build(entries)
    try:
        fs, redis = manager.secondary_tiers
        assert isinstance(fs, KvfsmFsTier) and isinstance(redis, KvfsmRedisTier)
        assert fs.tier.durable  # the example's fs_durable
        store(manager, range(3), "writer")
        settle(manager)
        assert sorted(fs.tier.keys()) == sorted(key(i) for i in range(3))
        assert redis_server.client().dbsize() == 3
        empty_primary(manager)
        assert load(manager, range(3), "reader") == {i: payload(i) for i in range(3)}
        assert not manager.has_pending_work()
    finally:
        manager.shutdown()


def test_the_readme_documents_every_key_of_the_tiers() -> None:
    """The README's key table names exactly the keys the adapters accept."""
    from kvfsm.vllm.tiers import ADAPTER_KEYS, FS_KEYS, REDIS_KEYS

    _, section = _readme_route3()
    documented = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert documented == set(FS_KEYS) | set(REDIS_KEYS) | set(ADAPTER_KEYS)
