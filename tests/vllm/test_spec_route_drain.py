"""Route 1's drain: kvfsm's terms of ``has_pending_push_work()`` through vLLM's own ``OffloadingConnector``.

On route 1 vLLM's ``OffloadingConnector`` loads kvfsm's spec by config (``spec_module_path="kvfsm.vllm"``). vLLM's
engine core keeps stepping while its scheduler-side connector's ``has_pending_push_work()`` is True; vLLM's
``OffloadingConnectorScheduler`` answers True for its own awaited jobs (and, 0.33 on, a reset fence), and
otherwise asks the spec's manager: kvfsm's ``has_pending_work()`` (kvfsm/vllm/manager.py, delegating to
kvfsm/control/tiering.py). Every kvfsm term of that answer has a test here, driven through vLLM's real
``Scheduler`` with the connector it builds from ``kv_connector="OffloadingConnector"``:

- the tiering manager's transfers, a cascade to the fs tier whose slot read is held
  (:func:`test_a_cascade_in_flight_keeps_it_true_until_the_tier_reports`);
- the tiering manager's quarantine, a timed-out cascade whose slot read still runs
  (:func:`test_a_timed_out_cascade_still_running_keeps_it_true_until_the_tier_reports`);
- the fs tier's own work, a durable block whose fsync is held
  (:func:`test_a_durable_fs_tier_keeps_it_true_until_its_blocks_are_synced`);
- the Redis tier's own work, writes staged and then sent but unacknowledged, on a real redis-server
  (:func:`test_a_redis_tiers_staged_writes_keep_it_true_until_the_server_has_them`);
- the tiering manager's transfers again, a promotion from the fs tier whose slot write is held
  (:func:`test_a_promotion_in_flight_keeps_it_true_until_the_slot_is_written`).

In each, vLLM's own terms are clear and no request is left, so kvfsm's term alone keeps vLLM's loop stepping;
once the work ends the engine goes idle and ``has_pending_push_work()`` is False. The work is held for real
(a thread blocked in a fault hook of the tier's I/O, kvfsm/tiers/faults.py), and judged by the tier's real
I/O: block files on disk, keys on the Redis server, the bytes of a CPU slot.

The rig follows vLLM's engine core: the worker-role connector registers its KV caches before the scheduler
is built. :func:`test_tiers_bind_when_the_scheduler_is_built_first` builds them the other way round: vLLM's
connector scheduler keeps the spec's manager but drops the spec, so the manager must keep the tiers' registry
entry alive (it once did not, and the first cascade raised). The worker role is vLLM's own
``OffloadingConnector`` over CPU tensors, driven per step as vLLM's model runner drives it. Needs vLLM
0.32-0.34; tests/vllm/test_connector_drain.py is route 2's counterpart.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM 0.32-0.34 (pip install 'kvfsm[vllm]')")

import torch
import vllm.distributed.kv_transfer.kv_connector.utils as kv_utils
import vllm.distributed.kv_transfer.kv_connector.v1.base as kv_base
import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as offloading_connector
import vllm.utils.hashing as vllm_hashing
import vllm.v1.core.kv_cache_utils as kv_cache_utils
import vllm.v1.core.sched.scheduler as vllm_scheduler
import vllm.v1.kv_cache_interface as kv_cache_interface
import vllm.v1.outputs as vllm_outputs
import vllm.v1.request as vllm_request
import vllm.v1.structured_output as structured_output
from connector_support import opt_config_dir, token_value
from test_spec_route import ROUTE
from tier_support import block_files

from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import OffloadKey
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.slotio import slot_nbytes
from kvfsm.vllm.drive import make_request, model_runner_output, scheduler_config
from kvfsm.vllm.manager import KvfsmOffloadingManager

BLOCK_SIZE = 16
NUM_GPU_BLOCKS = 32
HEADS = 2
HEAD_DIM = 4
LAYERS = ("layer.0", "layer.1")
#: 64 tokens: 4 full blocks (4 chunks), prefilled in one step of 64 tokens; with one output token the request
#: finishes in that step, so every later step is taken on the connector's word alone.
PROMPT = list(range(1, 65))
CHUNKS = 4
GUARD_S = 30.0  #: deadlock guard of every wait on a thread


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = opt_config_dir(tmp_path_factory.mktemp("model"))
    # vLLM's first config of a process initialises its platform (seconds on 0.32 and 0.34): paid here, once,
    # so that no test's own time includes it.
    _route_config(model, {})
    return model


def _route_config(model_dir: Path, extra: dict[str, Any]) -> Any:
    """vLLM's config of a scheduler-only engine whose ``OffloadingConnector`` loads kvfsm's spec."""
    return scheduler_config(
        model_dir,
        connector="OffloadingConnector",
        module=None,
        extra={**ROUTE, **extra},
        block_size=BLOCK_SIZE,
        world_size=1,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        max_model_len=512,
    )


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    """A real redis-server on loopback for this module (skipped, with the install command, without one)."""
    from redis_support import module_server_url

    with module_server_url() as url:
        yield url


class SpecRouteRig:
    """vLLM's Scheduler with the ``OffloadingConnector`` that loads kvfsm's spec (route 1), one worker-role
    ``OffloadingConnector`` over CPU KV caches, and a stand-in forward that writes each token's KV values."""

    def __init__(self, model_dir: Path, extra: dict[str, Any], *, scheduler_first: bool = False) -> None:
        kv_cache_utils.init_none_hash(vllm_hashing.sha256)
        self.vllm_config = _route_config(model_dir, extra)
        spec = kv_cache_interface.FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.float32
        )
        self.kv_cache_config = kv_cache_interface.KVCacheConfig(
            num_blocks=NUM_GPU_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[kv_cache_interface.KVCacheGroupSpec(list(LAYERS), spec)],
        )
        self.vllm_config.cache_config.num_gpu_blocks = NUM_GPU_BLOCKS
        # Blocks first, as vLLM's connector worker views each layer (one page of a block per row).
        self.kv = {name: torch.zeros((NUM_GPU_BLOCKS, 2, BLOCK_SIZE, HEADS, HEAD_DIM)) for name in LAYERS}
        # vLLM's engine core order: the workers register their KV caches, then the scheduler is built.
        if scheduler_first:
            self.scheduler = self._build_scheduler()
            gc.collect()  # whatever only the dropped spec held is gone before the worker registers
        self.worker = offloading_connector.OffloadingConnector(
            self.vllm_config, kv_base.KVConnectorRole.WORKER, self.kv_cache_config
        )
        self.worker.register_kv_caches(self.kv)
        if not scheduler_first:
            self.scheduler = self._build_scheduler()
        connector = self.scheduler.connector
        assert isinstance(connector, offloading_connector.OffloadingConnector)
        self.connector = connector
        self.aggregator = kv_utils.KVOutputAggregator(1)
        self.requests: dict[str, Any] = {}
        #: request id -> the GPU blocks it was given (read at its forwards, kept after it finishes).
        self.blocks: dict[str, list[int]] = {}

    def _build_scheduler(self) -> Any:
        return vllm_scheduler.Scheduler(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            log_stats=True,
            structured_output_manager=structured_output.StructuredOutputManager(self.vllm_config),
            block_size=BLOCK_SIZE,
        )

    @property
    def manager(self) -> KvfsmOffloadingManager:
        """The spec's manager, as vLLM's connector scheduler holds it."""
        manager = self.connector.scheduler.manager
        assert isinstance(manager, KvfsmOffloadingManager)
        return manager

    @property
    def tiering(self) -> TieringManager:
        tm = self.manager.kvfsm_manager
        assert isinstance(tm, TieringManager)
        return tm

    def vllm_own_terms(self) -> bool:
        """vLLM's own terms of ``has_pending_push_work()``: its awaited jobs, and (0.33 on) a reset fence.
        Read so a test can show that kvfsm's term is the one left."""
        cs = self.connector.scheduler
        return bool(cs._jobs) or bool(getattr(cs, "_reset_fence", None))

    def page(self, block: int, layer: str = LAYERS[0]) -> bytes:
        """The bytes of one GPU block of one layer (what the worker copies into a CPU slot)."""
        return bytes(self.kv[layer][block].numpy().tobytes())

    def add(self, prompt: list[int], req_id: str, max_tokens: int = 1) -> None:
        req = make_request(req_id, prompt, max_tokens, BLOCK_SIZE)
        self.scheduler.add_request(req)
        self.requests[req_id] = req

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, vllm_request.RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        """EngineCore.step's test: it steps while the scheduler has requests or the connector pending work."""
        return bool(self.scheduler.has_requests())

    def step(self) -> dict[str, int]:
        """One engine step as vLLM's engine core and model runner take it; returns the scheduled tokens."""
        out = self.scheduler.schedule()
        meta = out.kv_connector_metadata
        assert meta is not None
        # Called as vLLM's model runner calls them; some of these hooks are untyped in vLLM.
        worker: Any = self.worker
        worker.bind_connector_metadata(meta)
        worker.handle_preemptions(meta)
        worker.start_load_kv(None)  # no forward context: vLLM's offloading worker reads only the bound metadata
        self._forward(out)
        worker.wait_for_save()
        # No test here loads from the CPU tier, so get_finished has all vLLM 0.34's get_transfer_results adds.
        sending, recving = worker.get_finished(out.finished_req_ids)
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        output = model_runner_output(
            req_ids,
            sampled_token_ids=[self._sample(r) for r in req_ids],
            kv_connector_output=vllm_outputs.KVConnectorOutput(
                finished_sending=sending, finished_recving=recving, kv_connector_worker_meta=worker_meta
            ),
        )
        merged = self.aggregator.aggregate([output])
        assert merged is not None
        self.scheduler.update_from_output(out, merged)
        return dict(out.num_scheduled_tokens)

    def _forward(self, out: Any) -> None:
        """Write each scheduled token's KV values (a function of its prefix) into its block."""
        for req_id, n in out.num_scheduled_tokens.items():
            req = self.requests[req_id]
            blocks = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
            self.blocks[req_id] = blocks
            tokens = list(req.all_token_ids)
            start = req.num_computed_tokens - n  # schedule() already advanced it
            for pos in range(start, min(start + n, len(tokens))):
                value = token_value(tokens[: pos + 1], 0)
                for t in self.kv.values():
                    t[blocks[pos // BLOCK_SIZE], :, pos % BLOCK_SIZE].fill_(value)

    def _sample(self, req_id: str) -> list[int]:
        req = self.requests[req_id]
        if req.num_computed_tokens < req.num_tokens:
            return []  # a chunk of the prompt: nothing sampled
        return [100 + (req.num_computed_tokens * 7) % 900]

    def shutdown(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


# ---------------------------------------------------------------------------------------------- helpers


def _step_until(rig: SpecRouteRig, done: Callable[[], bool], what: str) -> None:
    """Step until ``done()`` (checked between steps, where vLLM's engine asks), within GUARD_S. A step that
    scheduled nothing waits a millisecond: a tier's I/O threads answer in their own time."""
    end = time.monotonic() + GUARD_S
    while time.monotonic() < end:
        if done():
            return
        if not rig.step():
            time.sleep(0.001)
    raise AssertionError(f"never reached within {GUARD_S} s: {what}")


def _finish(rig: SpecRouteRig, req_id: str) -> None:
    _step_until(rig, lambda: req_id not in rig.scheduler.requests, f"{req_id} finishing")


def _drain(rig: SpecRouteRig) -> None:
    """Step as vLLM's engine loop does until it goes idle; then nothing is pending."""
    _step_until(rig, lambda: not rig.has_work(), "the engine going idle")
    assert not rig.connector.has_pending_push_work()
    assert not rig.manager.has_pending_work()


def _keeps_stepping(rig: SpecRouteRig, steps: int = 3) -> None:
    """vLLM's loop keeps stepping on kvfsm's word alone: no request left, vLLM's own terms clear, and
    ``has_pending_push_work()`` True."""
    for _ in range(steps):
        assert not rig.scheduler.requests
        assert not rig.vllm_own_terms()
        assert rig.connector.has_pending_push_work()
        assert rig.has_work()
        rig.step()


def _fs_extra(root: Path, *, durable: bool = False) -> dict[str, Any]:
    return {"kvfsm_tier": "fs", "kvfsm_fs_path": str(root), "kvfsm_fs_durable": durable}


def _fs_tier(rig: SpecRouteRig) -> FileSystemTier:
    [tier] = rig.tiering.tiers
    assert isinstance(tier, FileSystemTier)
    assert tier.slot_io is not None, "the fs tier was never bound to the worker's slot pool"
    return tier


def _files_hold_the_pages(rig: SpecRouteRig, files: list[Path], req_id: str) -> None:
    """Every full block of ``req_id`` is in exactly one block file, its bytes as the GPU block holds them."""
    contents = [f.read_bytes() for f in files]
    for block in rig.blocks[req_id][:CHUNKS]:
        page = rig.page(block)
        assert any(page) and sum(page in c for c in contents) == 1, f"GPU block {block} is not in one block file"


def _cascade_held(rig: SpecRouteRig, plan: FaultPlan) -> None:
    """The request stored its chunks and finished; their cascade is held in the tier (a HANG in its I/O)."""
    tm = rig.tiering
    rig.add(PROMPT, "a")
    _finish(rig, "a")
    _step_until(
        rig,
        lambda: tm.num_transfer_jobs > 0 and not rig.vllm_own_terms() and plan.hanging >= 1,
        "a cascade hanging in its tier",
    )


# ---------------------------------------------------------------------------------------------- the terms


def test_a_cascade_in_flight_keeps_it_true_until_the_tier_reports(model_dir: Path, tmp_path: Path) -> None:
    """Term: the tiering manager's transfers. vLLM's store committed (vLLM awaits nothing), the cascade to
    the fs tier is held in its slot read, so no block file exists yet: it alone keeps the engine stepping."""
    root = tmp_path / "fs"
    rig = SpecRouteRig(model_dir, _fs_extra(root))
    plan = FaultPlan([FaultRule(op="slot.read", kind=FaultKind.HANG)])
    try:
        tm = rig.tiering
        tier = _fs_tier(rig)
        tier.faults = plan
        _cascade_held(rig, plan)
        assert tm.num_quarantined == 0 and not tier.has_pending_work()  # the fs tier counts no cascade itself
        assert block_files(root) == []
        _keeps_stepping(rig)
        assert plan.hanging >= 1 and block_files(root) == []
        tier.faults = None
        plan.release_hangs()
        _drain(rig)
        assert tm.num_transfer_jobs == 0 and tm.stats().cascades_completed >= 1
        files = block_files(root)
        assert len(files) == CHUNKS
        _files_hold_the_pages(rig, files, "a")
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_tiers_bind_when_the_scheduler_is_built_first(model_dir: Path, tmp_path: Path) -> None:
    """The scheduler before the worker (vLLM's connector scheduler drops the spec once it has the manager):
    the tiers still bind to the worker's pool, and a request's chunks reach the fs tier's block files."""
    root = tmp_path / "fs"
    rig = SpecRouteRig(model_dir, _fs_extra(root), scheduler_first=True)
    try:
        rig.add(PROMPT, "a")
        _finish(rig, "a")
        _step_until(rig, lambda: len(block_files(root)) == CHUNKS, "the cascade's block files")
        _drain(rig)
        assert rig.tiering.stats().cascades_completed >= 1
        _files_hold_the_pages(rig, block_files(root), "a")
    finally:
        rig.shutdown()


def test_a_timed_out_cascade_still_running_keeps_it_true_until_the_tier_reports(
    model_dir: Path, tmp_path: Path
) -> None:
    """Term: the tiering manager's quarantine. The cascade times out while the fs tier still reads its
    slot: no transfer is awaited any more, but the slot stays pinned, and the engine keeps stepping until
    the tier reports the read finished.

    Route 1 runs kvfsm's default deadlines (a cascade may take 60 s) and has no key to shorten them, so the
    test passes the deadline by handing the manager's expiry (what each step's ``on_schedule_end`` runs) a
    time an hour ahead, rather than sleeping a minute."""
    rig = SpecRouteRig(model_dir, _fs_extra(tmp_path / "fs"))
    plan = FaultPlan([FaultRule(op="slot.read", kind=FaultKind.HANG)])
    try:
        tm = rig.tiering
        tier = _fs_tier(rig)
        tier.faults = plan
        _cascade_held(rig, plan)
        assert tm.expire_transfers(now=time.monotonic() + 3600.0) >= 1
        assert tm.stats().cascades_timed_out >= 1
        assert tm.num_transfer_jobs == 0 and tm.num_quarantined >= 1 and not tier.has_pending_work()
        assert plan.hanging >= 1  # the tier's read really is still running
        _keeps_stepping(rig)
        assert plan.hanging >= 1 and tm.num_quarantined >= 1
        tier.faults = None
        plan.release_hangs()
        _step_until(rig, lambda: tm.num_quarantined == 0, "the tier's late result releasing the quarantine")
        _drain(rig)
        assert tm.stats().late_results >= 1 and plan.hanging == 0
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_a_durable_fs_tier_keeps_it_true_until_its_blocks_are_synced(model_dir: Path, tmp_path: Path) -> None:
    """Term: the fs tier's own work. A durable fs tier acknowledges a cascade once its block file is
    renamed into place and syncs it afterwards; with that fsync held, no transfer is in flight and vLLM
    awaits nothing, and the engine keeps stepping until the block is durable."""
    root = tmp_path / "fs"
    rig = SpecRouteRig(model_dir, _fs_extra(root, durable=True))
    plan = FaultPlan([FaultRule(op="fs.fsync", kind=FaultKind.HANG, times=1)])
    try:
        tm = rig.tiering
        tier = _fs_tier(rig)
        assert tier.durable
        tier.faults = plan
        rig.add(PROMPT, "a")
        _finish(rig, "a")
        _step_until(
            rig,
            lambda: tm.stats().cascades_completed >= 1 and tm.num_transfer_jobs == 0 and plan.hanging >= 1,
            "every cascade acknowledged with one fsync held",
        )
        assert tm.num_quarantined == 0 and tier.durability_pending >= 1
        assert len(block_files(root)) == CHUNKS  # renamed into place: only the sync is outstanding
        _keeps_stepping(rig)
        assert plan.hanging >= 1
        plan.release_hangs()
        _drain(rig)
        # The I/O thread counts a sync done before the next poll applies its stats: judge by the count owed.
        assert tier.durability_pending == 0
        _files_hold_the_pages(rig, block_files(root), "a")
    finally:
        plan.release_hangs()
        rig.shutdown()


def test_a_redis_tiers_staged_writes_keep_it_true_until_the_server_has_them(model_dir: Path, redis_url: str) -> None:
    """Term: the Redis tier's own work. A committed store's cascade is staged in the Redis tier until the
    next step ends (nothing sent: the server has no key), then sent and, with its slot read held, not
    acknowledged; the engine keeps stepping throughout and goes idle once the server holds every chunk.

    On route 1 each staged or unacknowledged write belongs to a cascade the tiering manager also counts, so
    vLLM's answer alone cannot tell the two terms apart; the test asks the tier for its own term too."""
    import redis

    prefix = f"route1drain{time.time_ns()}"
    rig = SpecRouteRig(model_dir, {"kvfsm_tier": "redis", "kvfsm_redis_url": redis_url, "kvfsm_redis_prefix": prefix})
    plan = FaultPlan([FaultRule(op="slot.read", kind=FaultKind.HANG)])
    client = redis.Redis.from_url(redis_url, socket_timeout=GUARD_S)
    try:
        tm = rig.tiering
        [tier] = tm.tiers
        from kvfsm.tiers.redis import RedisTier

        assert isinstance(tier, RedisTier) and tier.slot_io is not None
        tier.faults = plan
        rig.add(PROMPT, "a")
        # Checked between steps, as vLLM's engine asks: the step that committed the store staged its cascade.
        _step_until(rig, lambda: tm.num_transfer_jobs > 0, "a cascade submitted to the Redis tier")
        [job_id] = tier.pending_job_ids()
        keys: tuple[OffloadKey, ...] = tm.transfer_job(job_id).keys
        redis_keys = [tier.redis_key(k) for k in keys]
        assert len(keys) == CHUNKS
        assert not rig.scheduler.requests and not rig.vllm_own_terms()
        assert tier.writes_pending == CHUNKS and tier.writes_sent == 0  # staged, nothing sent
        assert client.exists(*redis_keys) == 0
        assert rig.connector.has_pending_push_work() and rig.has_work()
        assert tier.has_pending_work()
        _keeps_stepping(rig, steps=1)  # its end sends the staged writes to the tier's I/O thread
        assert tier.writes_sent == CHUNKS
        assert plan.wait_for_hangs(1, GUARD_S), "the write never reached its slot read"
        _keeps_stepping(rig)  # sent, held in the slot read: still pending
        assert plan.hanging >= 1 and tier.has_pending_work()
        assert client.exists(*redis_keys) == 0
        tier.faults = None
        plan.release_hangs()
        _drain(rig)
        assert tier.writes_pending == 0 and not tier.has_pending_work()
        assert client.exists(*redis_keys) == CHUNKS
        values = [client.get(k) for k in redis_keys]
        for block in rig.blocks["a"][:CHUNKS]:
            page = rig.page(block)
            assert sum(page in v for v in values if v is not None) == 1, f"GPU block {block} is not in one value"
    finally:
        plan.release_hangs()
        rig.shutdown()
        client.close()


def test_a_promotion_in_flight_keeps_it_true_until_the_slot_is_written(model_dir: Path, tmp_path: Path) -> None:
    """Term: the tiering manager's transfers, for a promotion. The prefix is on the fs tier only (vLLM's GPU
    prefix cache and the CPU tier reset, every KV tensor and CPU slot zeroed); a request for it makes the
    tier promote its chunks into CPU slots, with the slot write held. The request is aborted: the promotion
    alone keeps the engine stepping, its slots still zero, until the tier has written them."""
    root = tmp_path / "fs"
    rig = SpecRouteRig(model_dir, _fs_extra(root))
    plan = FaultPlan([FaultRule(op="slot.write", kind=FaultKind.HANG)])
    try:
        tm = rig.tiering
        tier = _fs_tier(rig)
        rig.add(PROMPT, "a")
        _finish(rig, "a")
        _drain(rig)
        assert tm.stats().cascades_completed >= 1 and len(block_files(root)) == CHUNKS
        pages = [rig.page(b) for b in rig.blocks["a"][:CHUNKS]]
        assert rig.scheduler.reset_prefix_cache()
        assert rig.scheduler.reset_connector_cache()
        assert len(tm.primary) == 0
        for t in rig.kv.values():
            t.zero_()
        pool = tier.slot_io
        assert pool is not None
        nbytes = slot_nbytes(pool)
        assert nbytes is not None
        for slot in range(int(getattr(pool, "num_slots"))):  # noqa: B009 - the SlotIO protocol has no count
            pool.write_slot(slot, bytes(nbytes))
        tier.faults = plan
        rig.add(PROMPT, "b", max_tokens=2)
        _step_until(rig, lambda: tm.num_transfer_jobs > 0 and plan.hanging >= 1, "a promotion hanging in its tier")
        assert tm.stats().promotions_submitted == CHUNKS
        [job_id] = tier.pending_job_ids()
        keys = tm.transfer_job(job_id).keys
        slots = [tm.primary.slot_id(k) for k in keys]
        rig.abort("b")
        _finish(rig, "b")
        _keeps_stepping(rig)
        assert all(s is not None and not any(pool.read_slot(s)) for s in slots)  # nothing written yet
        tier.faults = None
        plan.release_hangs()
        _drain(rig)
        assert tm.stats().promotions_completed == CHUNKS
        written = [pool.read_slot(s) for s in slots if s is not None]
        assert len(written) == CHUNKS
        for page in pages:
            assert sum(page in bytes(w) for w in written) == 1, "a promoted slot does not hold its block's bytes"
    finally:
        plan.release_hangs()
        rig.shutdown()
