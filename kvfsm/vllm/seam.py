"""The seam check of kvfsm's vLLM routes: every job copies the block that vLLM's block table holds for
its key (spec/invariants.toml, ``job_copies_engine_block``; the rule itself is :mod:`kvfsm.control.seam`).

The ground truth is vLLM's, read from vLLM's own scheduler: ``Scheduler.requests[req_id].block_hashes``
(the request's chained block hashes) and ``Scheduler.kv_cache_manager.get_block_ids(req_id)`` (its block
table), or, for a request vLLM has finished and freed, the ``block_ids`` vLLM passed to the connector's
``request_finished`` and the request's hashes at that moment. Nothing comes from kvfsm's bookkeeping:
that is what a faulty translation corrupts (vLLM 0.32's ``yield_req_data`` flag read with 0.33's meaning
doubled a request's block list; every copy was faithful, of the wrong block).

vLLM hands a connector no handle on its scheduler. In checked mode the connector finds it once, on its
first step, as the ``self`` of the caller frame that owns ``kv_cache_manager`` and ``requests`` (the
``Scheduler.schedule`` call that builds the connector metadata): :func:`find_vllm_scheduler`. A test may
bind one explicitly (:meth:`VllmEngineView.bind`). The cost (O(request blocks) per job) is checked mode's.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kvfsm.control.seam import SeamViolation, job_seam_violation
from kvfsm.control.types import OffloadKey
from kvfsm.errors import KvfsmError, SeamViolationError

__all__ = ["SeamChecker", "VllmEngineView", "find_caller", "find_vllm_scheduler", "install_offloading_check"]

logger = logging.getLogger(__name__)

#: Frames to walk up looking for vLLM's scheduler (the connector is called from Scheduler.schedule
#: directly, or through vLLM's OffloadingConnector a few frames down).
_MAX_FRAMES = 12


def find_caller(predicate: Callable[[Any], bool], max_frames: int = _MAX_FRAMES) -> Any | None:
    """The ``self`` of the nearest calling frame for which ``predicate`` holds, or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and predicate(owner):
            return owner
        frame = frame.f_back
    return None


def _is_vllm_scheduler(owner: Any) -> bool:
    return hasattr(owner, "kv_cache_manager") and hasattr(owner, "requests")


def find_vllm_scheduler(max_frames: int = _MAX_FRAMES) -> Any | None:
    """vLLM's ``Scheduler`` on the call stack (the ``self`` of a frame owning ``kv_cache_manager`` and
    ``requests``), or None."""
    return find_caller(_is_vllm_scheduler, max_frames)


@dataclass
class VllmEngineView:
    """vLLM's block tables and block hashes, read from its scheduler (and from finished requests' last
    tables, kept until kvfsm stops tracking the request)."""

    scheduler: Any | None = None
    #: req_id -> (block hashes, block table) of a request vLLM finished and freed.
    finished: dict[str, tuple[tuple[bytes, ...], tuple[int, ...]]] = field(default_factory=dict)

    def bind(self, scheduler: Any) -> None:
        self.scheduler = scheduler

    def remember_finished(self, request: Any, block_ids: Sequence[int]) -> None:
        """vLLM is about to free ``request``'s blocks: its stores still to come read this table."""
        self.finished[str(request.request_id)] = (tuple(request.block_hashes), tuple(int(b) for b in block_ids))

    def forget_finished(self, keep: set[str]) -> None:
        for req_id in [r for r in self.finished if r not in keep]:
            del self.finished[req_id]

    def request(self, req_id: str) -> tuple[Sequence[bytes] | None, Sequence[int] | None]:
        """The request's block hashes and group-0 block table, as vLLM holds them now."""
        if self.scheduler is not None:
            live = self.scheduler.requests.get(req_id)
            if live is not None:
                groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
                return live.block_hashes, (groups[0] if groups else ())
        snapshot = self.finished.get(req_id)
        if snapshot is not None:
            return snapshot
        return None, None


@dataclass
class SeamChecker:
    """Checks jobs against :class:`VllmEngineView`; raises :class:`SeamViolationError` on the first
    violation when ``strict`` (checked mode), else records it."""

    blocks_per_chunk: int
    view: VllmEngineView = field(default_factory=VllmEngineView)
    strict: bool = True
    jobs_checked: int = 0
    #: Jobs checked per kind (``load``, ``store``).
    checked_by_kind: dict[str, int] = field(default_factory=dict)
    violations: list[SeamViolation] = field(default_factory=list)

    def check(
        self,
        job_id: int,
        kind: str,
        req_id: str,
        keys: Sequence[OffloadKey],
        job_blocks: Sequence[int],
        first_block_offset: int,
    ) -> None:
        hashes, table = self.view.request(req_id)
        violation = job_seam_violation(
            job_id, kind, req_id, keys, job_blocks, first_block_offset, hashes, table, self.blocks_per_chunk
        )
        self.jobs_checked += 1
        self.checked_by_kind[kind] = self.checked_by_kind.get(kind, 0) + 1
        if violation is None:
            return
        self.violations.append(violation)
        logger.error("kvfsm seam violation: %s", violation.describe())
        if self.strict:
            raise SeamViolationError(violation.describe())


def install_offloading_check(
    connector_scheduler: Any, seam: SeamChecker, slot_key: Callable[[int], OffloadKey | None]
) -> None:
    """Route 1 (vLLM's ``OffloadingConnector`` with kvfsm's spec): check every step's metadata that vLLM's
    connector scheduler builds (its ``TransferJob`` records: request id, GPU spec, CPU spec) before the
    engine hands it to the workers. ``slot_key`` names the key a CPU slot holds or is reserved for (kvfsm's
    manager knows it). Wraps the instance's ``build_connector_meta`` and ``request_finished``, once."""
    if getattr(connector_scheduler, "kvfsm_seam", None) is not None:
        return
    build, finished = connector_scheduler.build_connector_meta, connector_scheduler.request_finished

    def checked_build(scheduler_output: Any) -> Any:
        if seam.view.scheduler is None:
            scheduler = find_vllm_scheduler()
            if scheduler is None:
                raise KvfsmError(
                    "kvfsm checked mode: vLLM's Scheduler is not on the call stack of build_connector_meta"
                )
            seam.view.bind(scheduler)
        meta = build(scheduler_output)
        check_offloading_metadata(seam, meta, slot_key)
        live = seam.view.scheduler.requests if seam.view.scheduler is not None else {}
        seam.view.forget_finished(set(live))
        return meta

    def remembering_finished(request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM's OffloadingConnectorScheduler.request_finished takes the request only: its table is read
        # from vLLM's block table before vLLM frees the blocks.
        scheduler = seam.view.scheduler
        if scheduler is not None:
            groups = scheduler.kv_cache_manager.get_block_ids(request.request_id)
            seam.view.remember_finished(request, groups[0] if groups else ())
        return finished(request, *args, **kwargs)

    connector_scheduler.build_connector_meta = checked_build
    connector_scheduler.request_finished = remembering_finished
    connector_scheduler.kvfsm_seam = seam


def check_offloading_metadata(seam: SeamChecker, meta: Any, slot_key: Callable[[int], OffloadKey | None]) -> None:
    """Each load and store job of vLLM's ``OffloadingConnectorMetadata`` against vLLM's block table."""
    k = seam.blocks_per_chunk
    for kind, jobs, gpu_side in (("load", meta.load_jobs, "dst_spec"), ("store", meta.store_jobs, "src_spec")):
        for job_id, job in jobs.items():
            gpu = getattr(job, gpu_side)
            cpu = job.src_spec if gpu_side == "dst_spec" else job.dst_spec
            keys: list[OffloadKey] = []
            for slot in cpu.block_ids:
                key = slot_key(int(slot))
                if key is None:
                    raise SeamViolationError(f"{kind} job {job_id}: CPU slot {int(slot)} holds no key kvfsm knows")
                keys.append(key)
            indices = list(getattr(gpu, "block_indices", None) or [0])
            gpu_blocks = [int(b) for b in gpu.block_ids]
            seam.check(int(job_id), kind, str(job.req_id), keys, gpu_blocks, int(indices[0]) % k)
