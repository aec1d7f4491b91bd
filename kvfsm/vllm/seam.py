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
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from kvfsm.control.seam import SeamViolation, job_seam_violation
from kvfsm.control.types import OffloadKey
from kvfsm.errors import SeamViolationError

__all__ = ["SeamChecker", "VllmEngineView", "find_vllm_scheduler"]

logger = logging.getLogger(__name__)

#: Frames to walk up looking for vLLM's scheduler (the connector is called from Scheduler.schedule
#: directly, or through vLLM's OffloadingConnector a few frames down).
_MAX_FRAMES = 12


def find_vllm_scheduler(max_frames: int = _MAX_FRAMES) -> Any | None:
    """vLLM's ``Scheduler`` on the call stack (the ``self`` of a frame owning ``kv_cache_manager`` and
    ``requests``), or None."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(max_frames):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and hasattr(owner, "kv_cache_manager") and hasattr(owner, "requests"):
            return owner
        frame = frame.f_back
    return None


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
        if violation is None:
            return
        self.violations.append(violation)
        logger.error("kvfsm seam violation: %s", violation.describe())
        if self.strict:
            raise SeamViolationError(violation.describe())
