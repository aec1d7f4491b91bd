"""A CPU primary with secondary tiers below it (vLLM's ``TieringOffloadingManager``).

Data always passes through the primary. A committed GPU store is cascaded (written through) to every
tier; a secondary hit is promoted into a primary slot before the GPU can load it. Each primary <-> tier
transfer is a :class:`~kvfsm.control.job.Job` (kind CASCADE or PROMOTE, one "worker": the tier) held in
``_transfer_jobs`` from submission until a poll sees its result, so ``has_pending_work()`` tells the
engine to keep stepping exactly while a later poll can still complete something.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.manager import JobResult, OffloadingManager, SecondaryTier, TierJob
from kvfsm.control.types import (
    GPUBlockSpec,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    SlotSpec,
)
from kvfsm.errors import UnknownJobError
from kvfsm.fsm import SpecMachine
from kvfsm.machines import job_machine
from kvfsm.states import JobEvent, JobKind, JobState, SlotState

__all__ = ["TieringManager"]

_NO_GPU = GPUBlockSpec(())


@dataclass(frozen=True, slots=True)
class _Transfer:
    """An in-flight primary <-> tier job and the index of the tier running it."""

    job: Job
    tier: int


class TieringManager(OffloadingManager):
    """``primary`` (CPU) in front of ``tiers`` (searched in order on a primary miss)."""

    __slots__ = (
        "_job_machine",
        "_next_job_id",
        "_polled",
        "_primary",
        "_queued",
        "_stale_ids",
        "_stats",
        "_tiers",
        "_transfer_jobs",
    )

    def __init__(
        self,
        primary: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        *,
        checked: bool | None = None,
    ) -> None:
        self._primary = primary
        self._tiers: tuple[SecondaryTier, ...] = tuple(tiers)
        self._job_machine: SpecMachine[JobState, JobEvent] = job_machine(checked)
        self._next_job_id = 0
        self._transfer_jobs: dict[int, _Transfer] = {}
        # Promotions reserved by lookups this step, per tier: req_id -> keys (slots are already writing).
        self._queued: list[dict[str, list[OffloadKey]]] = [{} for _ in self._tiers]
        self._polled = False  # the once-per-step poll gate, reopened by on_schedule_end
        self._stale_ids: set[int] = set()  # jobs a reset gave up on; their late results are ignored
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "secondary_hits",
                "promotions_reserved",
                "promotions_submitted",
                "promotions_completed",
                "promotions_failed",
                "promotions_dropped",
                "cascades_submitted",
                "cascades_completed",
                "cascades_failed",
            ),
            0,
        )

    # -- introspection --

    @property
    def primary(self) -> CPUOffloadingManager:
        return self._primary

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        return self._tiers

    @property
    def num_transfer_jobs(self) -> int:
        return len(self._transfer_jobs)

    def transfer_job(self, job_id: int) -> Job:
        rec = self._transfer_jobs.get(job_id)
        if rec is None:
            raise UnknownJobError(f"no primary<->tier job {job_id} is in flight; expected a submitted id")
        return rec.job

    def num_queued_promotions(self) -> int:
        """Keys reserved for promotion and not yet submitted (O(tiers x requests queued this step))."""
        return sum(len(keys) for per_req in self._queued for keys in per_req.values())

    def stats(self) -> dict[str, int]:
        return {
            **self._primary.stats(),
            **self._stats,
            "transfer_jobs_in_flight": len(self._transfer_jobs),
        }

    # -- OffloadingManager --

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._maybe_poll()
        result = self._primary.lookup(key, ctx)
        if result is not LookupResult.MISS:
            return result  # HIT, or HIT_PENDING (a store or a promotion already under way)
        retry = False
        for i, tier in enumerate(self._tiers):
            answer = tier.lookup(key, ctx)
            if answer is LookupResult.HIT:
                self._stats["secondary_hits"] += 1
                # Reserve now so later lookups see HIT_PENDING and never promote the key twice.
                if self._primary.prepare_write([key]) is None:
                    return LookupResult.MISS  # primary full: a miss, not a retry loop
                self._queued[i].setdefault(ctx.req_id, []).append(key)
                self._stats["promotions_reserved"] += 1
                return LookupResult.HIT_PENDING
            if answer is LookupResult.RETRY:
                retry = True
        return LookupResult.RETRY if retry else LookupResult.MISS

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> SlotSpec:
        self._maybe_poll()
        return self._primary.prepare_load(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._primary.complete_load(keys, ctx)

    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        # Poll first: finished cascades unpin slots that this eviction decision may then take.
        self._maybe_poll()
        return self._primary.prepare_store(keys, ctx)

    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        primary = self._primary
        # Only keys this call commits are cascaded (a repeated or post-reset completion cascades nothing).
        committed = [k for k in dict.fromkeys(keys) if primary.slot_state(k) is SlotState.WRITING]
        primary.complete_store(keys, ctx, success)
        if not success or not committed:
            return
        keys_t = tuple(committed)
        for i, tier in enumerate(self._tiers):
            spec = primary.prepare_read(keys_t)  # pinned until the cascade finishes
            job = self._new_job(JobKind.CASCADE, ctx.req_id, keys_t, spec)
            self._submit(i, job, tier.submit_store, partial(primary.complete_read, keys_t))
            self._stats["cascades_submitted"] += 1

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._primary.touch(keys, ctx)
        for tier in self._tiers:
            tier.touch(keys, ctx)

    def on_new_request(self, ctx: ReqContext) -> None:
        self._primary.on_new_request(ctx)

    def on_request_finished(self, ctx: ReqContext) -> None:
        self._primary.on_request_finished(ctx)

    def on_schedule_end(self) -> None:
        self._poll()
        self._flush_promotions()
        for tier in self._tiers:
            tier.on_schedule_end()
        self._polled = False
        self._primary.on_schedule_end()

    def has_pending_work(self) -> bool:
        """In-flight transfers, or a tier's own work. O(tiers): never walks the jobs.

        Promotions reserved but not yet submitted need no term: ``on_schedule_end`` submits them in the
        same step, after which they are in ``_transfer_jobs``.
        """
        if self._transfer_jobs:
            return True
        return any(tier.has_pending_work() for tier in self._tiers)

    def take_events(self) -> list[OffloadingEvent]:
        events = self._primary.take_events()
        for tier in self._tiers:
            events.extend(tier.take_events())
        return events

    def reset_cache(self) -> None:
        """Drain every tier (blocking), apply the results, drop queued promotions, reset the primary.

        Tiers keep their data; only primary slots and in-flight bookkeeping go.
        """
        for tier in self._tiers:
            tier.drain_jobs()
        self._poll()
        self._drop_queued()
        # A tier that broke the drain contract leaves jobs behind: give up on them so the engine can
        # settle, and ignore their results if they ever come.
        for job_id, rec in self._transfer_jobs.items():
            rec.job.discard()
            self._stale_ids.add(job_id)
        self._transfer_jobs.clear()
        self._primary.reset_cache()
        self._polled = False

    def shutdown(self) -> None:
        for tier in self._tiers:
            tier.shutdown()
        self._primary.shutdown()

    # -- internals --

    def _new_job(self, kind: JobKind, req_id: str, keys: tuple[OffloadKey, ...], slots: SlotSpec) -> Job:
        job_id = self._next_job_id
        self._next_job_id += 1
        return Job(job_id, kind, req_id, keys, _NO_GPU, slots, world_size=1, machine=self._job_machine)

    def _submit(
        self,
        tier_idx: int,
        job: Job,
        submit: Callable[[TierJob], None],
        rollback: Callable[[], None],
    ) -> None:
        """Launch ``job`` and hand it to its tier; if the tier refuses (raises), undo the reservation."""
        tier_job = TierJob(job.job_id, job.keys, job.slots.slot_ids, job.kind is JobKind.PROMOTE, job.req_id)
        job.launch(0)
        self._transfer_jobs[job.job_id] = _Transfer(job, tier_idx)
        try:
            submit(tier_job)
        except BaseException:
            del self._transfer_jobs[job.job_id]
            job.fail()
            rollback()
            raise

    def _flush_promotions(self) -> None:
        primary = self._primary
        for i, tier in enumerate(self._tiers):
            per_req = self._queued[i]
            while per_req:
                req_id, keys = next(iter(per_req.items()))
                del per_req[req_id]  # dequeued first: a refused submit must not be retried with freed slots
                keys_t = tuple(keys)
                slots = SlotSpec(tuple(self._slot_id(k) for k in keys_t))
                job = self._new_job(JobKind.PROMOTE, req_id, keys_t, slots)
                self._submit(i, job, tier.submit_load, partial(primary.complete_write, keys_t, False))
                self._stats["promotions_submitted"] += len(keys_t)

    def _slot_id(self, key: OffloadKey) -> int:
        sid = self._primary.slot_id(key)
        if sid is None:  # a reserved promotion always holds its slot until completed or dropped
            raise AssertionError(f"queued promotion of {key.hex()} lost its primary slot")
        return sid

    def _drop_queued(self) -> None:
        for per_req in self._queued:
            for keys in per_req.values():
                self._primary.complete_write(keys, False)
                self._stats["promotions_dropped"] += len(keys)
            per_req.clear()

    def _maybe_poll(self) -> None:
        if not self._polled:
            self._poll()

    def _poll(self) -> None:
        """Apply every finished tier job. A tier's batch is validated whole before any of it is applied."""
        self._polled = True
        for i, tier in enumerate(self._tiers):
            results = list(tier.get_finished_jobs())
            if results:
                self._apply(i, tier, self._validate(i, tier, results))

    def _validate(self, tier_idx: int, tier: SecondaryTier, results: list[JobResult]) -> list[JobResult]:
        seen: set[int] = set()
        live: list[JobResult] = []
        for res in results:
            if res.job_id in self._stale_ids:
                continue
            rec = self._transfer_jobs.get(res.job_id)
            if rec is None or rec.tier != tier_idx or res.job_id in seen:
                why = (
                    "reported twice in one batch"
                    if res.job_id in seen
                    else "not in flight"
                    if rec is None
                    else f"submitted to tier {self._tiers[rec.tier].name!r}"
                )
                raise UnknownJobError(
                    f"tier {tier.name!r} reported job {res.job_id}, which is {why}; "
                    "expected ids of jobs submitted to this tier and not yet reported"
                )
            seen.add(res.job_id)
            live.append(res)
        for res in results:
            self._stale_ids.discard(res.job_id)
        return live

    def _apply(self, tier_idx: int, tier: SecondaryTier, results: list[JobResult]) -> None:
        primary = self._primary
        for res in results:
            job = self._transfer_jobs.pop(res.job_id).job
            if res.success:
                job.ack(1)
            else:
                job.fail()
            if job.kind is JobKind.PROMOTE:
                primary.complete_write(job.keys, res.success)
                if res.success:
                    self._stats["promotions_completed"] += len(job.keys)
                else:
                    self._stats["promotions_failed"] += len(job.keys)
                    # The tier's copy (or its cached verdict) is bad: forget it, or the next lookup
                    # would promote it again forever.
                    invalidate = getattr(tier, "invalidate", None)
                    if callable(invalidate):
                        for key in job.keys:
                            invalidate(key)
            else:
                # Either way the primary copy stays valid: unpin it.
                primary.complete_read(job.keys)
                self._stats["cascades_completed" if res.success else "cascades_failed"] += 1
