"""The manager and secondary-tier protocols (vLLM's ``kv_offload/base.py`` and ``tiering/base.py``).

Both run in the scheduler process: every method must be cheap and must never block on a transfer.
``has_pending_work()`` defaults to False; a manager or tier returns True only while it needs the engine
to keep stepping (it has jobs that a later poll will complete). Every optional hook is declared here
with its default, so callers never probe for one by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvfsm.control.types import (
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
)
from kvfsm.errors import ConfigError, DuplicateJobError

if TYPE_CHECKING:
    from kvfsm.control.cpu import CPUOffloadingManager

__all__ = ["JobResult", "OffloadingManager", "SecondaryTier", "TierJob", "validate_tier_job"]


class OffloadingManager(ABC):
    """Bookkeeping of what is offloaded, where, and whether it is readable."""

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult: ...

    @abstractmethod
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> SlotSpec:
        """Pin ready keys for reading until ``complete_load``; raise KeyNotReadyError otherwise."""

    @abstractmethod
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None: ...

    @abstractmethod
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        """Reserve slots (writing) for keys not yet held; None when they cannot fit now."""

    @abstractmethod
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None: ...

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """Mark keys recently used."""

    def on_new_request(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """A request starts; the manager may keep per-request state."""

    def on_request_finished(self, ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """No more prepare_store/prepare_load for this request; completions may still follow."""

    def on_schedule_end(self) -> None:  # noqa: B027 - optional hook
        """Called once per step, after scheduling: poll tiers and flush deferred work."""

    def has_pending_work(self) -> bool:
        """True while the manager needs the engine to keep stepping. Default: never."""
        return False

    def on_reset_flushed(self) -> None:  # noqa: B027 - optional hook
        """Every copy that the last ``reset_cache`` discarded has reported: none can still write a primary
        slot the reset freed. A tiering manager holds its promotions until then (spec/README.md, "The
        reset hold"); vLLM 0.34's connector calls this too."""

    @abstractmethod
    def take_events(self) -> list[OffloadingEvent]: ...

    @abstractmethod
    def reset_cache(self) -> None: ...

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""

    def drain_pending_work(self) -> None:  # noqa: B027 - optional hook
        """Block until the manager's own transfers (a tiering manager's cascades and promotions) have
        finished, so that the next step can apply them. Shutdown's ``flush_all`` calls it once no GPU job
        is left but ``has_pending_work()`` is still True: on the caller's thread when the shutdown is
        unbounded, on a helper thread it stops waiting for at the deadline otherwise. Default: nothing
        (a manager with no transfers of its own)."""

    def abandon_transfers(self) -> int:
        """Bounded shutdown gives up on the manager's own transfers (a tiering manager's cascades and
        promotions); returns how many timed out. Default: the manager has none, 0."""
        return 0

    @property
    def primary(self) -> CPUOffloadingManager | None:
        """The CPU primary that holds the slots GPU jobs copy to and from: the manager itself for a CPU
        manager, the front tier for a tiering manager. Default: None (a manager with no CPU slots)."""
        return None

    @property
    def num_transfer_jobs(self) -> int:
        """Transfers of the manager's own (primary <-> tier) still in flight. Default: 0."""
        return 0

    def transfer_in_flight(self, job_id: int) -> bool:
        """Whether the manager's own transfer ``job_id`` is submitted and neither applied nor timed out.
        Default: False (no transfers of its own)."""
        return False


@dataclass(frozen=True, slots=True)
class TierJob:
    """A primary <-> secondary transfer: a cascade (primary -> tier) or a promotion (tier -> primary)."""

    job_id: int
    keys: tuple[OffloadKey, ...]
    slot_ids: tuple[int, ...]
    is_promotion: bool
    req_id: str


def validate_tier_job(tier: str, job: TierJob, *, promotion: bool, running: Container[int]) -> None:
    """The checks every tier makes on a submission, before it changes anything.

    ConfigError if the job is of the other kind (``is_promotion`` is not ``promotion``) or its keys and
    slots differ in number; DuplicateJobError if ``running`` (the ids the tier has in flight) holds it.
    """
    what = "submit_load" if promotion else "submit_store"
    if job.is_promotion is not promotion:
        raise ConfigError(
            f"tier {tier!r}: {what} got job {job.job_id} with is_promotion={job.is_promotion}; "
            f"expected is_promotion={promotion}"
        )
    if len(job.keys) != len(job.slot_ids):
        raise ConfigError(
            f"tier {tier!r}: job {job.job_id} has {len(job.keys)} keys but {len(job.slot_ids)} slots; "
            "expected one slot per key"
        )
    if job.job_id in running:
        raise DuplicateJobError(f"tier {tier!r} already runs job {job.job_id}; expected a new id for {what}")


@dataclass(frozen=True, slots=True)
class JobResult:
    job_id: int
    success: bool


class SecondaryTier(ABC):
    """A tier below the CPU primary. Data always passes through the primary."""

    name: str = "secondary"

    @abstractmethod
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        """HIT, MISS or RETRY (answer not known yet); never blocks."""

    @abstractmethod
    def submit_store(self, job: TierJob) -> None:
        """Start copying the job's primary slots (pinned until it finishes) into the tier."""

    @abstractmethod
    def submit_load(self, job: TierJob) -> None:
        """Start copying the keys into the job's primary slots (reserved, writing)."""

    @abstractmethod
    def get_finished_jobs(self) -> Iterable[JobResult]:
        """Jobs that finished since the last call, each reported exactly once."""

    def has_pending_work(self) -> bool:
        """True while the tier has work of its own (beyond submitted jobs) that needs steps."""
        return False

    @abstractmethod
    def drain_jobs(self) -> None:
        """Block until every submitted job has finished; used only by reset_cache and shutdown."""

    def on_schedule_end(self) -> None:  # noqa: B027 - optional hook
        """Once per step."""

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:  # noqa: B027 - optional hook
        """Recency hint."""

    def take_events(self) -> list[OffloadingEvent]:
        return []

    def invalidate(self, key: OffloadKey) -> None:  # noqa: B027 - optional hook
        """A promotion of ``key`` failed, so the tier's copy (or its cached verdict) is bad: forget it, so
        that the next lookup answers MISS and the key is not promoted again forever. The manager calls it
        for every key of a failed promotion. Default: nothing (a tier that never caches a verdict and
        evicts copies whose read failed needs no more)."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release resources."""
