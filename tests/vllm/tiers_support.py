"""vLLM's own ``TieringOffloadingSpec`` (scheduler side, CPU) with kvfsm's tiers loaded by its factory, and the
moves a test drives it through: store chunks of real bytes into the primary, step until idle, empty the primary,
and load them back through a promotion. Ground truth is the bytes in the primary's shared memory.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Sequence
from typing import Any

import vllm.v1.kv_offload.base as offload_base
import vllm.v1.kv_offload.factory as offload_factory
import vllm.v1.kv_offload.tiering.manager as tiering_manager

from kvfsm.vllm.drive import single_worker_offloading_config

GUARD_S = 30.0  #: deadlock guard of every wait (never a timing assertion)
ROW = 4096  #: bytes of one primary chunk (one block per chunk, one worker)
HIT, MISS = offload_base.LookupResult.HIT, offload_base.LookupResult.MISS
WAITING = (offload_base.LookupResult.HIT_PENDING, offload_base.LookupResult.RETRY)


def fs_entry(path: os.PathLike[str] | str, **keys: Any) -> dict[str, Any]:
    return {"type": "KvfsmFsTier", "module_path": "kvfsm.vllm.tiers", "fs_path": str(path), **keys}


def redis_entry(url: str, **keys: Any) -> dict[str, Any]:
    return {"type": "KvfsmRedisTier", "module_path": "kvfsm.vllm.tiers", "redis_url": url, **keys}


def offloading_config(tiers: list[dict[str, Any]], *, num_chunks: int = 16, events: bool = False) -> Any:
    return single_worker_offloading_config(
        {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": num_chunks * ROW, "secondary_tiers": tiers},
        bytes_per_block=ROW,
        layer_names=("l0", "l1"),
        events=events,
        engine_id=f"kvfsm-tiers-{uuid.uuid4().hex[:12]}",
        model_name="kvfsm-tier-test",
    )


def build(tiers: list[dict[str, Any]], *, num_chunks: int = 16, events: bool = False) -> Any:
    """vLLM's spec factory -> TieringOffloadingSpec -> its manager, with ``tiers`` built by vLLM's tier factory."""
    spec = offload_factory.OffloadingSpecFactory.create_spec(
        offloading_config(tiers, num_chunks=num_chunks, events=events)
    )
    manager = spec.get_manager()
    assert isinstance(manager, tiering_manager.TieringOffloadingManager)
    return manager


def key(i: int) -> Any:
    return offload_base.make_offload_key(b"kvfsm-tier" + i.to_bytes(6, "big"), 0)


def payload(i: int) -> bytes:
    return bytes((i * 31 + j * 7) % 251 for j in range(ROW))


def flat(manager: Any) -> memoryview:
    view: memoryview = manager.primary_tier.get_kv_memoryview()
    return view.cast("B")


def step(manager: Any) -> None:
    manager.on_schedule_end(offload_base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))


def settle(manager: Any, until: Any = None) -> None:
    """Step until the manager has no pending work (and ``until()``, if given, holds)."""
    end = time.monotonic() + GUARD_S
    while manager.has_pending_work() or (until is not None and not until()):
        if time.monotonic() > end:
            raise AssertionError("the manager did not settle within the guard")
        step(manager)
        time.sleep(0.002)


def step_until(manager: Any, until: Any) -> None:
    """Step until ``until()`` holds, pending work or not."""
    end = time.monotonic() + GUARD_S
    while not until():
        if time.monotonic() > end:
            raise AssertionError("the condition did not hold within the guard")
        step(manager)
        time.sleep(0.002)


def store(manager: Any, ids: Sequence[int], req_id: str) -> None:
    """A request stores chunks ``ids``: their bytes are written into the primary (as vLLM's GPU->CPU copy
    would), then the store completes, which cascades them to every secondary tier."""
    ctx = offload_base.ReqContext(req_id=req_id)
    manager.on_new_request(ctx)
    keys = [key(i) for i in ids]
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    view = flat(manager)
    by_key = dict(zip(keys, ids, strict=True))
    for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
        view[chunk * ROW : (chunk + 1) * ROW] = payload(by_key[k])
    manager.complete_store(keys, ctx)
    manager.on_request_finished(ctx)


def empty_primary(manager: Any) -> None:
    """vLLM's reset: drain the tiers, forget the primary; then zero its memory, so only a promotion can refill it."""
    manager.reset_cache()
    if hasattr(manager, "on_reset_flushed"):
        manager.on_reset_flushed()
    view = flat(manager)
    view[:] = bytes(len(view))


def load(manager: Any, ids: Sequence[int], req_id: str) -> dict[int, bytes | None]:
    """Look the chunks up until each is HIT or MISS (promotions run meanwhile); the bytes of every HIT, read
    from the primary's memory, None for a MISS."""
    ctx = offload_base.ReqContext(req_id=req_id)
    manager.on_new_request(ctx)
    end = time.monotonic() + GUARD_S
    while True:
        results = {i: manager.lookup(key(i), ctx) for i in ids}
        if not any(r in WAITING for r in results.values()):
            break
        if time.monotonic() > end:
            raise AssertionError(f"lookups still waiting after the guard: {results}")
        step(manager)
        time.sleep(0.002)
    hits = [i for i in ids if results[i] is HIT]
    out: dict[int, bytes | None] = {i: None for i in ids}
    if hits:
        spec = manager.prepare_load([key(i) for i in hits], ctx)
        view = flat(manager)
        for i, chunk in zip(hits, spec.chunk_ids.tolist(), strict=True):
            out[i] = bytes(view[chunk * ROW : (chunk + 1) * ROW])
        manager.complete_load([key(i) for i in hits], ctx)
    manager.on_request_finished(ctx)
    return out
