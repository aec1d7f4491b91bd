"""Route 1 (kvfsm's OffloadingSpec) across vLLM 0.32, 0.33 and 0.34: the version check, the API differences
kvfsm.vllm.compat detects, and vLLM's transfer metrics fed by kvfsm's worker.

The metrics test runs vLLM's own worker-side connector (``OffloadingConnectorWorker``) over kvfsm's spec, reads
the stats object the connector sends to its scheduler (``OffloadingWorkerMetadata.transfer_stats``, summed over
workers by vLLM's ``aggregate``), passes it through the scheduler's own ``update_connector_output`` and vLLM's
Prometheus logger (``OffloadPromMetrics``), and checks the counters it feeds: ``vllm:kv_offload_{store,load}_
{bytes,time}`` and the older ``vllm:kv_offload_total_bytes`` / ``..._total_time``.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM 0.32-0.34 (pip install 'kvfsm[vllm]')")

import torch
from prometheus_client import Counter, Gauge, Histogram
from test_spec_route import ROUTE, device_side, key, kv_caches, offloading_config
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
    OffloadingConnectorMetadata,
    OffloadingWorkerMetadata,
    TransferJob,
)
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats, OffloadPromMetrics
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import OffloadingConnectorWorker
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    OffloadingManager,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory
from vllm.v1.outputs import KVConnectorOutput

import kvfsm.vllm.compat as compat
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.vllm.compat import UnsupportedVllmError, require_supported_vllm
from kvfsm.vllm.spec import KvfsmOffloadingWorker


@pytest.fixture
def fake_version(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Set the version require_supported_vllm sees (its cache is cleared before and after)."""

    def set_version(version: str | None) -> None:
        monkeypatch.setattr(compat, "vllm_version", lambda: version)
        require_supported_vllm.cache_clear()

    yield set_version
    require_supported_vllm.cache_clear()


# -- the version check --


def test_the_installed_vllm_is_supported() -> None:
    version = require_supported_vllm()
    assert version.split(".")[:2] in (["0", "32"], ["0", "33"], ["0", "34"])


@pytest.mark.parametrize("version", ["0.31.2", "0.35.0", "0.40.1.dev3", "1.0.0", "nightly"])
def test_an_unsupported_version_raises_one_error_naming_the_range(fake_version: Any, version: str) -> None:
    fake_version(version)
    # An ImportError too: code probing for kvfsm's vLLM support with ``except ImportError`` sees it missing.
    with pytest.raises(ImportError) as info:
        require_supported_vllm()
    assert isinstance(info.value, UnsupportedVllmError) and isinstance(info.value, ConfigError)
    assert "0.32-0.34" in str(info.value) and version in str(info.value)


@pytest.mark.parametrize("version", ["0.32.0", "0.33.1", "0.34.0", "0.34.2.dev4+gabc"])
def test_each_supported_minor_passes_the_version_check(fake_version: Any, version: str) -> None:
    fake_version(version)
    assert require_supported_vllm() == version


def test_no_vllm_raises_the_same_error(fake_version: Any) -> None:
    fake_version(None)
    with pytest.raises(UnsupportedVllmError, match=r"needs vLLM 0\.32-0\.34; no vLLM is installed"):
        require_supported_vllm()


def test_vllm_loading_route_1_on_an_unsupported_vllm_gets_the_error_at_load_time() -> None:
    """vLLM's factory imports ``spec_module_path`` and reads ``spec_name``: that import raises the one error."""
    code = (
        "import importlib, kvfsm.vllm.compat as c\n"
        "c.vllm_version = lambda: '0.35.0'\n"
        "try:\n"
        "    getattr(importlib.import_module('kvfsm.vllm'), 'KvfsmOffloadingSpec')\n"
        "except c.UnsupportedVllmError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("refused: kvfsm.vllm supports vLLM 0.32-0.34; the installed vLLM is 0.35.0")


# -- the API differences --


def test_manager_offers_touch_exactly_where_vllm_has_it() -> None:
    manager = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE))).get_manager()
    assert hasattr(manager, "touch") == hasattr(OffloadingManager, "touch") == compat.manager_has_touch()
    if compat.manager_has_touch():
        ctx = ReqContext(req_id="r0")
        manager.on_new_request(ctx)
        manager.touch([key(0)], ctx)  # an unknown key is no error, as with vLLM's manager


def test_a_failed_store_announces_no_public_removal() -> None:
    """0.33 on: one metadata-only removal; 0.32 (no such field): nothing, as 0.32's own manager does."""
    manager = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE))).get_manager()
    ctx = ReqContext(req_id="r0")
    manager.on_new_request(ctx)
    assert manager.prepare_store([key(0), key(1)], ctx) is not None
    manager.complete_store([key(0), key(1)], ctx, success=False)
    events = list(manager.take_events())
    if compat.event_has_metadata_only():
        assert [(sorted(e.keys), e.removed, e.metadata_only) for e in events] == [([key(0), key(1)], True, True)]
    else:
        assert events == []


def test_a_stored_event_names_its_request_where_vllm_events_carry_one() -> None:
    """0.34 on: the CPU stored event says its removal will be announced and names the storing request, as
    vLLM 0.34's own CPU manager does (its events tracker builds self-describing payloads from that)."""
    manager = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE))).get_manager()
    writer, other = ReqContext(req_id="writer"), ReqContext(req_id="other")
    for ctx, k in ((writer, 0), (other, 1)):
        manager.on_new_request(ctx)
        assert manager.prepare_store([key(k)], ctx) is not None
    manager.complete_store([key(0)], writer)
    manager.complete_store([key(1)], other)
    events = list(manager.take_events())
    assert [(e.keys, e.removed) for e in events] == [([key(0)], False), ([key(1)], False)]
    if compat.event_carries_request_context():
        assert [(e.req_context, e.removal_expected) for e in events] == [(writer, True), (other, True)]
    else:
        assert not any(e.removal_expected for e in events)


def test_config_info_keys_match_what_the_version_has() -> None:
    spec_cls = OffloadingSpecFactory.get_spec_cls(dict(ROUTE))
    keys = spec_cls.config_info_keys(dict(ROUTE))
    assert (len(keys) > 0) == compat.has_offloading_info()


def two_layer_caches() -> tuple[Any, list[torch.Tensor]]:
    """Two layers (tensors) of different page sizes in one KV-cache group."""
    layers = [torch.randint(-128, 127, (16, 256), dtype=torch.int8) for _ in range(2)]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=256) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=256), CanonicalKVCacheRef(1, 256)]],
    )
    return caches, layers


def test_worker_copies_every_layer_of_the_blocks_vllm_names() -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config({**ROUTE, "cpu_bytes_to_use": 1 << 20}))
    caches, layers = two_layer_caches()
    worker = spec.get_worker(caches)
    originals = [t[[1, 6, 11]].clone() for t in layers]
    assert worker.submit_store(1, device_side([1, 6, 11], caches), CPULoadStoreSpec([0, 3, 2]))
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    assert worker.submit_load(2, CPULoadStoreSpec([0, 3, 2]), device_side([12, 13, 15], caches))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    for t, original in zip(layers, originals, strict=True):
        assert torch.equal(t[[12, 13, 15]], original)
    worker.shutdown()


def test_a_load_starting_inside_a_chunk_copies_from_the_block_vllm_names() -> None:
    """vLLM's block index is the first block's logical index in its request: with 2 blocks per chunk, a load
    from index 5 starts at the second block of its first chunk (vLLM skips ``index % blocks_per_chunk``)."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE), blocks_per_chunk=2))
    caches, tensor = kv_caches()
    worker = spec.get_worker(caches)
    original = tensor[[2, 3, 4, 5]].clone()  # logical blocks 4..7 of a request: chunks 2 and 3
    assert worker.submit_store(1, device_side([2, 3, 4, 5], caches, first_index=4), CPULoadStoreSpec([6, 1]))
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    assert worker.submit_load(2, CPULoadStoreSpec([6, 1]), device_side([12, 13, 14], caches, first_index=5))
    worker.wait({2})
    assert [r.success for r in worker.get_finished()] == [True]
    assert torch.equal(tensor[[12, 13, 14]], original[1:])
    worker.shutdown()


def test_the_fs_tier_binds_to_the_pool_when_the_worker_comes_first(tmp_path: Path) -> None:
    """vLLM's engine core builds its workers before its scheduler: the pool waits for its engine's tier."""
    extra = {**ROUTE, "kvfsm_tier": "fs", "kvfsm_fs_path": str(tmp_path / "kv")}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, engine_id="worker-first"))
    caches, _ = kv_caches()
    worker = spec.get_worker(caches)
    manager = spec.get_manager()
    [tier] = manager.kvfsm_manager.tiers
    assert tier.slot_io is worker.backend.pool
    worker.shutdown()
    manager.shutdown()


@pytest.mark.skipif(not compat.worker_takes_device_pointers(), reason="vLLM 0.34's DevicePointers only")
def test_device_pointers_off_a_block_start_are_refused() -> None:
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    caches, _ = two_layer_caches()
    worker = spec.get_worker(caches)
    ptrs = resolve_device_pointers(GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0]), caches)
    ptrs.ptrs[0] += 8  # inside block 2 of layer 0
    with pytest.raises(ConfigError, match="not block starts"):
        worker.submit_store(1, ptrs, CPULoadStoreSpec([0]))
    ptrs = resolve_device_pointers(GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0]), caches)
    ptrs.ptrs[1] += 256  # layer 1 names block 3
    with pytest.raises(ConfigError, match="other blocks"):
        worker.submit_store(1, ptrs, CPULoadStoreSpec([0]))
    worker.shutdown()


# -- vLLM's transfer metrics --


def test_vllm_connector_worker_reports_kvfsm_transfer_bytes_and_time() -> None:
    """vLLM's own connector worker over kvfsm's spec: its transfer stats count every byte kvfsm copied."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    caches, tensor = kv_caches()
    connector_worker = OffloadingConnectorWorker(spec, None, None)
    connector_worker._init_worker(caches)  # what register_kv_caches ends with, minus the model's layer walk
    gpu = GPULoadStoreSpec([2, 3, 5], group_sizes=[3], block_indices=[0])
    store = OffloadingConnectorMetadata(
        load_jobs={}, store_jobs={1: TransferJob("r0", gpu, CPULoadStoreSpec([0, 1, 2]))}
    )
    connector_worker.prepare_store_kv(store)  # vLLM defers a step's stores to the next step's start
    connector_worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={}, store_jobs={}))
    assert connector_worker.worker is not None
    connector_worker.worker.wait({1})
    connector_worker.get_finished(set())
    stored = connector_worker.build_connector_worker_meta()
    assert stored is not None and stored.completed_jobs == {1: 1}

    load_gpu = GPULoadStoreSpec([8, 9], group_sizes=[2], block_indices=[0])
    load = OffloadingConnectorMetadata(
        load_jobs={2: TransferJob("r1", CPULoadStoreSpec([0, 2]), load_gpu)}, store_jobs={}
    )
    connector_worker.start_kv_transfers(load)
    connector_worker.worker.wait({2})
    assert connector_worker.get_finished(set()) == (set(), {"r1"})
    loaded = connector_worker.build_connector_worker_meta()
    assert loaded is not None
    assert torch.equal(tensor[[8, 9]], tensor[[2, 5]])

    # Summed as the scheduler sums the workers' outputs.
    total = stored.aggregate(loaded).transfer_stats
    block_bytes = tensor[0].numel() * tensor.element_size()
    assert total.store.bytes == 3 * block_bytes and total.store.sizes == [3 * block_bytes]
    assert total.load.bytes == 2 * block_bytes and total.load.sizes == [2 * block_bytes]
    assert total.store.time > 0 and total.load.time > 0
    connector_worker.shutdown()

    # The scheduler side turns the workers' stats into its connector stats, and the Prometheus logger turns
    # those into counters: the flat per-direction ones and, kvfsm's spec being a CPU spec, the older
    # kv_offload_total_bytes / kv_offload_total_time per transfer type.
    scheduler = SimpleNamespace(_connector_stats=OffloadingConnectorStats(), _stale_job_threshold=0, _jobs={})
    update = getattr(
        OffloadingConnectorScheduler, "_update_connector_output", OffloadingConnectorScheduler.update_connector_output
    )
    update(scheduler, KVConnectorOutput(kv_connector_worker_meta=OffloadingWorkerMetadata(transfer_stats=total)))
    prom = OffloadPromMetrics(
        vllm_config=SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector_extra_config=dict(ROUTE))),
        metric_types={Gauge: FakeMetric, Counter: FakeMetric, Histogram: FakeMetric},
        labelnames=["model_name", "engine"],
        per_engine_labelvalues={0: ["model", "0"]},
    )
    prom.observe(scheduler._connector_stats.data)
    flat = {name: metric for (_, name, _), metric in prom.offloading_metrics.items()}
    assert flat["vllm:kv_offload_store_bytes"].increments == [3 * block_bytes]
    assert flat["vllm:kv_offload_load_bytes"].increments == [2 * block_bytes]
    assert flat["vllm:kv_offload_store_time"].increments[0] > 0 and flat["vllm:kv_offload_load_time"].increments[0] > 0
    assert prom.counter_kv_bytes[(0, "GPU_to_CPU")].increments == [3 * block_bytes]
    assert prom.counter_kv_bytes[(0, "CPU_to_GPU")].increments == [2 * block_bytes]
    assert prom.counter_kv_transfer_time[(0, "GPU_to_CPU")].increments[0] > 0
    assert prom.counter_kv_transfer_time[(0, "CPU_to_GPU")].increments[0] > 0


class FakeMetric:
    """A Prometheus metric class that records what vLLM's logger does to it (as vLLM's own metrics test does)."""

    def __init__(self, **kwargs: Any) -> None:
        self.increments: list[float] = []
        self.observed: list[float] = []

    def labels(self, *labelvalues: object) -> FakeMetric:
        return FakeMetric()

    def inc(self, value: float) -> None:
        self.increments.append(value)

    def observe(self, value: float) -> None:
        self.observed.append(value)

    def set(self, value: float) -> None:
        return None


class FailingBackend:
    """A copy backend whose every copy fails (as a torn-down pool or a device error would)."""

    def __init__(self) -> None:
        self.futures: dict[int, Future[None]] = {}

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        return None

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        future: Future[None] = Future()
        future.set_exception(OSError("injected copy failure"))
        self.futures[job_id] = future
        return future

    def poll(self) -> list[tuple[int, bool]]:
        done, self.futures = self.futures, {}
        return [(job_id, f.exception() is None) for job_id, f in done.items()]

    def wait(self, job_ids: Iterable[int]) -> None:
        return None

    def shutdown(self) -> None:
        return None


def test_a_failed_copy_reports_no_transfer_size_or_stops_where_vllm_cannot_take_it() -> None:
    caches, _ = kv_caches()
    worker = KvfsmOffloadingWorker(FailingBackend(), caches, bytes_per_block=256)
    assert worker.submit_store(7, device_side([1], caches), CPULoadStoreSpec([0]))
    if not compat.connector_handles_failed_jobs():
        # vLLM 0.32/0.33 assert success: kvfsm stops with its reason instead of reporting bytes that never moved.
        with pytest.raises(KvfsmError, match=r"job 7 failed.*cannot take a failed transfer"):
            worker.get_finished()
        return
    results = worker.get_finished()
    assert [(r.job_id, r.success, r.transfer_size, r.transfer_time) for r in results] == [(7, False, None, None)]


def _connector_worker(spec: Any, caches: Any) -> Any:
    connector_worker = OffloadingConnectorWorker(spec, None, None)
    connector_worker._init_worker(caches)  # what register_kv_caches ends with, minus the model's layer walk
    return connector_worker


@pytest.mark.skipif(
    "sync" not in {f.name for f in dataclasses.fields(TransferJob)}, reason="vLLM 0.34's synchronous loads only"
)
def test_a_synchronous_load_lands_before_vllms_step_goes_on() -> None:
    """vLLM 0.34 (``sync_load_budget_bytes``): an expedited load is waited on inside ``start_kv_transfers``, so the
    blocks are in place when it returns, and it never shows up as a finished receive."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    caches, tensor = kv_caches()
    connector_worker = _connector_worker(spec, caches)
    worker = connector_worker.worker
    assert worker.submit_store(1, device_side([4, 6], caches), CPULoadStoreSpec([3, 1]))
    worker.wait({1})
    expected = tensor[[4, 6]].clone()
    gpu = GPULoadStoreSpec([10, 11], group_sizes=[2], block_indices=[0])
    load = TransferJob("r0", CPULoadStoreSpec([3, 1]), gpu, sync=True)
    connector_worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={}))
    assert torch.equal(tensor[[10, 11]], expected)
    assert connector_worker.get_finished(set()) == (set(), set())
    connector_worker.shutdown()


@pytest.mark.skipif(not compat.connector_handles_failed_jobs(), reason="vLLM 0.34's failed transfers only")
def test_a_failed_load_is_reported_to_vllm_as_a_failed_receive() -> None:
    """A copy that fails reports success=False; vLLM's connector worker marks the job failed and the request's
    receive failed, so its scheduler never loads that request from offload again."""
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    caches, _ = kv_caches()
    spec._worker = KvfsmOffloadingWorker(FailingBackend(), caches, bytes_per_block=256)
    connector_worker = _connector_worker(spec, caches)
    gpu = GPULoadStoreSpec([10], group_sizes=[1], block_indices=[0])
    load = TransferJob("r0", CPULoadStoreSpec([3]), gpu)
    connector_worker.start_kv_transfers(OffloadingConnectorMetadata(load_jobs={2: load}, store_jobs={}))
    assert connector_worker.get_finished(set()) == (set(), {"r0"})
    meta = connector_worker.build_connector_worker_meta()
    assert meta is not None and meta.transfer_stats.is_empty() and meta.failed_jobs == {2}
    assert connector_worker.take_failed_recving() == {"r0"}
