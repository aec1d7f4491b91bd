"""kvfsm's OffloadingSpec as vLLM 0.32-0.34 loads it (``spec_module_path="kvfsm.vllm"``), on vLLM's own classes.

The spec is built by vLLM's ``OffloadingSpecFactory`` from a ``kv_connector_extra_config``; its manager is
driven through vLLM's ``OffloadingManager`` interface and its worker through vLLM's ``OffloadingWorker``
interface, with real bytes in CPU KV-cache tensors (the ground truth is the tensors, not bookkeeping).

Needs vLLM 0.32, 0.33 or 0.34 (the ``vllm`` and ``vllm034`` tox envs run it on CPU); skipped where vLLM is not
installed. Where the versions differ (0.34's workers take device pointers), the helpers below build what the
installed version's connector would pass. No
conftest.py here: one would clash with tests/conftest.py under mypy, and ``tests/vllm`` itself must not be
taken for vLLM (``importorskip`` asks for ``vllm.v1``, which only the real package has).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm.v1.kv_offload.base", reason="needs vLLM 0.32-0.34 (pip install 'kvfsm[vllm]')")


import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    LookupResult,
    OffloadingManager,
    ReqContext,
    make_offload_key,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

from kvfsm.control.tiering import TieringManager
from kvfsm.errors import ConfigKeyError
from kvfsm.vllm.compat import worker_takes_device_pointers
from kvfsm.vllm.drive import single_worker_offloading_config
from kvfsm.vllm.manager import KvfsmOffloadingManager
from kvfsm.vllm.spec import KvfsmOffloadingSpec

ROUTE = {"spec_name": "KvfsmOffloadingSpec", "spec_module_path": "kvfsm.vllm", "cpu_bytes_to_use": 1 << 20}
PAGE = 256  # bytes of one KV block in the test's canonical tensor
NUM_BLOCKS = 16


def offloading_config(extra: dict[str, Any], engine_id: str = "kvfsm-test", blocks_per_chunk: int = 1) -> Any:
    return single_worker_offloading_config(
        extra, bytes_per_block=PAGE, blocks_per_chunk=blocks_per_chunk, events=True, engine_id=engine_id
    )


def device_side(block_ids: list[int], caches: Any, first_index: int = 0) -> Any:
    """The GPU side of a job as the installed vLLM's connector passes it to the worker: a GPULoadStoreSpec
    (0.32, 0.33) or the device pointers vLLM 0.34 resolves from one. ``first_index``: the logical index of
    the first block in its request (vLLM's ``block_indices``)."""
    spec = GPULoadStoreSpec(block_ids, group_sizes=[len(block_ids)], block_indices=[first_index])
    if not worker_takes_device_pointers():
        return spec
    from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers

    return resolve_device_pointers(spec, caches)


def key(i: int) -> Any:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def kv_caches() -> tuple[Any, torch.Tensor]:
    tensor = torch.randint(-128, 127, (NUM_BLOCKS, PAGE), dtype=torch.int8)
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=tensor, page_size_bytes=PAGE)],
        group_data_refs=[[CanonicalKVCacheRef(tensor_idx=0, page_size_bytes=PAGE)]],
    )
    return caches, tensor


def test_vllm_loads_kvfsm_spec_and_manager_by_module_path() -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    assert isinstance(spec, KvfsmOffloadingSpec)
    manager = spec.get_manager()
    assert isinstance(manager, OffloadingManager) and isinstance(manager, KvfsmOffloadingManager)
    ctx = ReqContext(req_id="r0")
    manager.on_new_request(ctx)
    out = manager.prepare_store([key(0), key(1)], ctx)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    assert manager.lookup(key(0), ctx) is LookupResult.HIT_PENDING
    manager.complete_store({key(0), key(1)}, ctx)
    assert manager.lookup(key(1), ctx) is LookupResult.HIT
    events = list(manager.take_events())
    assert [(sorted(e.keys), e.removed) for e in events] == [([key(0), key(1)], False)]
    manager.on_request_finished(ctx)


@pytest.mark.parametrize(
    ("extra", "bad_key"),
    [
        ({"spec_name": "KvfsmOffloadingSpec", "spec_module_path": "kvfsm.vllm"}, "cpu_bytes_to_use"),
        ({**ROUTE, "cpu_bytes_to_use": -5}, "cpu_bytes_to_use"),
        ({**ROUTE, "eviction_policy": "mru"}, "eviction_policy"),
        ({**ROUTE, "store_threshold": "often"}, "store_threshold"),
        ({**ROUTE, "max_tracker_size": 0}, "max_tracker_size"),
        ({**ROUTE, "kvfsm_tier": "tape"}, "kvfsm_tier"),
        ({**ROUTE, "kvfsm_tier": "fs"}, "kvfsm_fs_path"),
        ({**ROUTE, "kvfsm_fs_path": "/tmp/x"}, "kvfsm_fs_path"),
        ({**ROUTE, "kvfsm_copy_threads": 0}, "kvfsm_copy_threads"),
        ({**ROUTE, "kvfsm_checked": "yes"}, "kvfsm_checked"),
        ({**ROUTE, "kvfsm_tiers": "fs"}, "kvfsm_tiers"),
        ({**ROUTE, "cache_policy_module_path": "my.policies"}, "cache_policy_module_path"),
    ],
)
def test_a_bad_key_raises_config_key_error_naming_it(extra: dict[str, Any], bad_key: str) -> None:
    with pytest.raises(ConfigKeyError) as info:
        OffloadingSpecFactory.create_spec(offloading_config(extra))
    assert info.value.key == bad_key
    assert str(info.value).startswith(bad_key)


def test_worker_stores_and_loads_real_bytes_through_kvfsm_copy_backend() -> None:
    spec = OffloadingSpecFactory.create_spec(offloading_config(dict(ROUTE)))
    caches, tensor = kv_caches()
    worker = spec.get_worker(caches)
    original = tensor[[2, 3]].clone()
    assert worker.submit_store(1, device_side([2, 3], caches), CPULoadStoreSpec([5, 0]))
    worker.wait({1})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, True)]
    tensor[[2, 3]] = 0  # the GPU blocks are reused: only the CPU copy holds the bytes now
    assert worker.submit_load(2, CPULoadStoreSpec([5, 0]), device_side([7, 9], caches))
    worker.wait({2})
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(2, True)]
    assert torch.equal(tensor[[7, 9]], original)
    worker.shutdown()


def test_fs_tier_route_writes_cascaded_blocks_under_its_path(tmp_path: Path) -> None:
    extra = {**ROUTE, "kvfsm_tier": "fs", "kvfsm_fs_path": str(tmp_path / "kv")}
    spec = OffloadingSpecFactory.create_spec(offloading_config(extra, engine_id="fs-engine"))
    manager = spec.get_manager()
    assert isinstance(manager.kvfsm_manager, TieringManager)
    caches, tensor = kv_caches()
    worker = spec.get_worker(caches)  # binds the fs tier to this worker's slot pool (same process)
    ctx = ReqContext(req_id="r0")
    manager.on_new_request(ctx)
    out = manager.prepare_store([key(0)], ctx)
    assert out is not None
    assert worker.submit_store(1, device_side([4], caches), out.store_spec)
    worker.wait({1})
    assert [r.success for r in worker.get_finished()] == [True]
    manager.complete_store([key(0)], ctx)
    manager.on_request_finished(ctx)
    for _ in range(1000):  # the cascade runs on the tier's threads; steps apply it once finished
        manager.on_schedule_end(None)
        if not manager.has_pending_work():
            break
        manager.kvfsm_manager.drain_pending_work()
    assert not manager.has_pending_work()
    files = list((tmp_path / "kv").rglob("*.kvb"))
    assert len(files) == 1
    assert tensor[4].numpy().tobytes() in files[0].read_bytes()
    worker.shutdown()
    manager.shutdown()
