"""A CPU primary with secondary tiers below it (vLLM's ``TieringOffloadingManager``).

Data always passes through the primary. A committed GPU store is cascaded (written through) to every
tier; a secondary hit is promoted into a primary slot before the GPU can load it. Each primary <-> tier
transfer is a :class:`~kvfsm.control.job.Job` (kind CASCADE or PROMOTE, one "worker": the tier) held in
``_transfer_jobs`` from submission until a poll sees its result, so ``has_pending_work()`` tells the
engine to keep stepping exactly while a later poll can still complete something.

Failure semantics (spec/README.md, "Failures, deadlines and shutdown"): a failed cascade only unpins its
slot (the CPU copy stays valid); a failed promotion frees its slot and invalidates the tier's copy, so the
next lookup answers MISS. With :class:`~kvfsm.control.deadlines.Deadlines`, a transfer past its deadline times out
through the job machine; its slot stays quarantined until the tier reports the copy finished (a late
result is absorbed, never an UnknownJobError). A :class:`CascadeBackpressure` per tier drops cascades to a
tier whose latency is too high (with hysteresis), never promotions. Time comes from an injected clock.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from functools import partial

from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager, CPUStats
from kvfsm.control.deadlines import Clock, DeadlineQueue, Deadlines, run_bounded, with_timeout
from kvfsm.control.job import Job, Quarantined
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
from kvfsm.errors import ConfigError, KvfsmError, UnknownJobError
from kvfsm.machines import job_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import JobEffect, JobEvent, JobKind, JobState, SlotState

__all__ = ["BackpressureConfig", "CascadeBackpressure", "TieringCounters", "TieringManager", "TieringStats"]

logger = logging.getLogger(__name__)

_NO_GPU = GPUBlockSpec(())


@dataclass(slots=True)
class TieringCounters:
    """What a tiering manager has counted (promotions in keys, cascades in jobs)."""

    secondary_hits: int = 0
    promotions_reserved: int = 0
    promotions_submitted: int = 0
    promotions_completed: int = 0
    promotions_failed: int = 0
    promotions_dropped: int = 0
    #: Secondary hits computed instead of promoted: no slot was free without evicting one of this step's hits.
    promotions_refused: int = 0
    #: Primary misses answered MISS without asking the tiers: a reset's discarded copies had not all reported.
    promotions_held: int = 0
    cascades_submitted: int = 0
    cascades_completed: int = 0
    cascades_failed: int = 0
    cascades_dropped: int = 0
    cascade_probes: int = 0
    cascades_timed_out: int = 0
    promotions_timed_out: int = 0
    late_results: int = 0
    transfers_abandoned: int = 0


@dataclass(frozen=True, slots=True)
class TieringStats:
    """A snapshot of a tiering manager: its counters, its transfers now, and its primary's stats."""

    primary: CPUStats
    secondary_hits: int
    promotions_reserved: int
    promotions_submitted: int
    promotions_completed: int
    promotions_failed: int
    promotions_dropped: int
    promotions_refused: int
    promotions_held: int
    cascades_submitted: int
    cascades_completed: int
    cascades_failed: int
    cascades_dropped: int
    cascade_probes: int
    cascades_timed_out: int
    promotions_timed_out: int
    late_results: int
    transfers_abandoned: int
    transfer_jobs_in_flight: int
    transfers_quarantined: int

    def as_dict(self) -> dict[str, int]:
        """Every number by name, the primary's first (logs, JSON, metrics)."""
        own = {k: v for k, v in asdict(self).items() if k != "primary"}
        return {**self.primary.as_dict(), **own}


@dataclass(frozen=True, slots=True)
class _Transfer:
    """An in-flight primary <-> tier job, the index of the tier running it, and when it was submitted."""

    job: Job
    tier: int
    submitted_at: float = 0.0


@dataclass(frozen=True, slots=True)
class BackpressureConfig:
    """vLLM's EMA detector: ``alpha`` weight of a new sample, pressure above ``high_water_s``, released
    below ``low_water_s``, no decision before ``warmup`` completions."""

    alpha: float = 0.3
    high_water_s: float = 1.0
    low_water_s: float = 0.5
    warmup: int = 3

    def __post_init__(self) -> None:
        if not 0.0 < self.alpha <= 1.0:
            raise ConfigError(f"backpressure alpha={self.alpha!r}; expected 0 < alpha <= 1")
        if not 0.0 < self.low_water_s <= self.high_water_s:
            raise ConfigError(
                f"backpressure low_water_s={self.low_water_s!r}, high_water_s={self.high_water_s!r}; "
                "expected 0 < low_water_s <= high_water_s"
            )
        if self.warmup < 0:
            raise ConfigError(f"backpressure warmup={self.warmup!r}; expected >= 0")


class CascadeBackpressure:
    """The cascade latency of one tier as an EMA, with hysteresis (pure: the caller passes the times)."""

    __slots__ = ("completions", "config", "ema_s", "transitions", "under_pressure")

    def __init__(self, config: BackpressureConfig | None = None) -> None:
        self.config = config or BackpressureConfig()
        self.ema_s: float | None = None
        self.completions = 0
        self.under_pressure = False
        self.transitions = 0

    def on_completed(self, elapsed_s: float) -> None:
        """A cascade finished (or timed out) after ``elapsed_s`` seconds."""
        cfg = self.config
        self.ema_s = elapsed_s if self.ema_s is None else cfg.alpha * elapsed_s + (1 - cfg.alpha) * self.ema_s
        self.completions += 1
        if self.completions < cfg.warmup:
            return  # warm-up: no decision yet
        if not self.under_pressure and self.ema_s > cfg.high_water_s:
            self._set(True)
        elif self.under_pressure and self.ema_s < cfg.low_water_s:
            self._set(False)

    def on_outstanding(self, oldest_age_s: float) -> None:
        """The oldest cascade still running is ``oldest_age_s`` old: past the high-water mark is pressure."""
        if not self.under_pressure and oldest_age_s > self.config.high_water_s:
            self._set(True)

    def _set(self, value: bool) -> None:
        self.under_pressure = value
        self.transitions += 1
        logger.info("tier cascade backpressure %s (EMA %s s)", "on" if value else "off", self.ema_s)

    def reset(self) -> None:
        self.ema_s = None
        self.completions = 0
        self.under_pressure = False


class TieringManager(OffloadingManager):
    """``primary`` (CPU) in front of ``tiers`` (searched in order on a primary miss)."""

    __slots__ = (
        "_abandoned",
        "_backpressure",
        "_cascades_inflight",
        "_clock",
        "_deadlines",
        "_expiry",
        "_job_machine",
        "_next_job_id",
        "_polled",
        "_primary",
        "_protected",
        "_quarantine",
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
        deadlines: Deadlines | None = None,
        clock: Clock | None = None,
        backpressure: BackpressureConfig | None = None,
    ) -> None:
        """``deadlines.cascade_s`` / ``promote_s`` bound transfers; ``backpressure`` (None: off) drops
        cascades to slow tiers; ``clock`` (default ``time.monotonic``) times both."""
        self._primary = primary
        self._tiers: tuple[SecondaryTier, ...] = tuple(tiers)
        self._job_machine: SpecMachine[JobState, JobEvent, JobEffect] = job_machine(checked)
        self._next_job_id = 0
        self._transfer_jobs: dict[int, _Transfer] = {}
        # Promotions reserved by lookups this step, per tier: req_id -> keys (slots are already writing).
        self._queued: list[dict[str, list[OffloadKey]]] = [{} for _ in self._tiers]
        self._polled = False  # the once-per-step poll gate, reopened by on_schedule_end
        # Keys the primary answered HIT this step: a promotion's reservation never evicts one, so a scan
        # never loses an earlier hit to its own promotion (no livelock; emptied by on_schedule_end).
        self._protected: set[OffloadKey] = set()
        self._stale_ids: set[int] = set()  # jobs a reset gave up on; their late results are ignored
        self._promotions_held = False  # set by reset_cache until on_reset_flushed (the reset hold)
        self._deadlines = deadlines if deadlines is not None else Deadlines()
        self._clock: Clock = clock if clock is not None else time.monotonic
        self._expiry = DeadlineQueue()
        # Timed-out transfers whose tier has not reported yet: their slots stay pinned/reserved until it does.
        self._quarantine: dict[int, Quarantined] = {}
        self._backpressure: tuple[CascadeBackpressure | None, ...] = tuple(
            None if backpressure is None else CascadeBackpressure(backpressure) for _ in self._tiers
        )
        # Per tier: cascades in flight, job id -> submission time (oldest first).
        self._cascades_inflight: list[dict[int, float]] = [{} for _ in self._tiers]
        self._abandoned = False  # shutdown gave up on every transfer: nothing is pending any more
        self._stats = TieringCounters()

    # -- introspection --

    @override
    @property
    def primary(self) -> CPUOffloadingManager:
        """The CPU primary in front of the tiers."""
        return self._primary

    @property
    def tiers(self) -> tuple[SecondaryTier, ...]:
        return self._tiers

    @override
    @property
    def num_transfer_jobs(self) -> int:
        """Primary <-> tier jobs submitted and not yet applied (timed-out ones are quarantined instead)."""
        return len(self._transfer_jobs)

    @override
    def transfer_in_flight(self, job_id: int) -> bool:
        return job_id in self._transfer_jobs

    def transfer_job(self, job_id: int) -> Job:
        rec = self._transfer_jobs.get(job_id)
        if rec is None:
            raise UnknownJobError(f"no primary<->tier job {job_id} is in flight; expected a submitted id")
        return rec.job

    @property
    def num_quarantined(self) -> int:
        """Timed-out transfers whose tier has not reported yet (their slots are still held)."""
        return len(self._quarantine)

    def quarantined_job_ids(self) -> list[int]:
        return list(self._quarantine)

    def backpressure(self, tier_idx: int) -> CascadeBackpressure | None:
        return self._backpressure[tier_idx]

    def num_queued_promotions(self) -> int:
        """Keys reserved for promotion and not yet submitted (O(tiers x requests queued this step))."""
        return sum(len(keys) for per_req in self._queued for keys in per_req.values())

    def queued_promotions(self) -> list[tuple[int, str, tuple[OffloadKey, ...]]]:
        """Promotions reserved by this step's lookups and not yet submitted, as (tier index, request id,
        keys), in submission order (a query for verifiers: the model-based replay reads it back)."""
        return [(i, req_id, tuple(keys)) for i, per_req in enumerate(self._queued) for req_id, keys in per_req.items()]

    def stats(self) -> TieringStats:
        return TieringStats(
            primary=self._primary.stats(),
            **asdict(self._stats),
            transfer_jobs_in_flight=len(self._transfer_jobs),
            transfers_quarantined=len(self._quarantine),
        )

    # -- OffloadingManager --

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._maybe_poll()
        result = self._primary.lookup(key, ctx)
        if result is LookupResult.HIT:
            self._protected.add(key)
            return result
        if result is not LookupResult.MISS:
            return result  # HIT_PENDING (a store or a promotion already under way)
        if self._promotions_held:
            # After a reset, a discarded store copy may still write any freed slot: no promotion may fill
            # one until on_reset_flushed (spec/README.md, "The reset hold"). A miss: the chunk is computed.
            self._stats.promotions_held += 1
            return LookupResult.MISS
        retry = False
        for i, tier in enumerate(self._tiers):
            answer = tier.lookup(key, ctx)
            if answer is LookupResult.HIT:
                self._stats.secondary_hits += 1
                # Reserve now so later lookups see HIT_PENDING and never promote the key twice.
                if self._primary.prepare_write([key], self._protected) is None:
                    # Promote what fits: the primary is full of this step's hits (or pinned slots), so
                    # this chunk is computed instead. A miss, never a retry loop.
                    self._stats.promotions_refused += 1
                    return LookupResult.MISS
                self._queued[i].setdefault(ctx.req_id, []).append(key)
                self._stats.promotions_reserved += 1
                return LookupResult.HIT_PENDING
            if answer is LookupResult.RETRY:
                retry = True
        return LookupResult.RETRY if retry else LookupResult.MISS

    @override
    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> SlotSpec:
        self._maybe_poll()
        return self._primary.prepare_load(keys, ctx)

    @override
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._primary.complete_load(keys, ctx)

    @override
    def prepare_store(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> PrepareStoreOutput | None:
        # Poll first: finished cascades unpin slots that this eviction decision may then take.
        self._maybe_poll()
        return self._primary.prepare_store(keys, ctx)

    @override
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        primary = self._primary
        # Only keys this call commits are cascaded (a repeated or post-reset completion cascades nothing).
        committed = [k for k in dict.fromkeys(keys) if primary.slot_state(k) is SlotState.WRITING]
        primary.complete_store(keys, ctx, success)
        if not success or not committed:
            return
        keys_t = tuple(committed)
        now = self._clock()
        for i, tier in enumerate(self._tiers):
            if not self._admit_cascade(i, now):
                self._stats.cascades_dropped += 1  # never a job: nothing pinned, the CPU copy stays
                continue
            spec = primary.prepare_read(keys_t)  # pinned until the cascade finishes
            job = self._new_job(JobKind.CASCADE, ctx.req_id, keys_t, spec)
            self._submit(i, job, tier.submit_store, partial(primary.complete_read, keys_t))
            self._stats.cascades_submitted += 1

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._primary.touch(keys, ctx)
        for tier in self._tiers:
            tier.touch(keys, ctx)

    @override
    def on_new_request(self, ctx: ReqContext) -> None:
        self._primary.on_new_request(ctx)

    @override
    def on_request_finished(self, ctx: ReqContext) -> None:
        self._primary.on_request_finished(ctx)

    @override
    def on_schedule_end(self) -> None:
        self._poll()
        self.expire_transfers()
        self._flush_promotions()
        for tier in self._tiers:
            tier.on_schedule_end()
        self._polled = False
        self._protected.clear()
        self._primary.on_schedule_end()

    @override
    def has_pending_work(self) -> bool:
        """In-flight transfers, quarantined ones, or a tier's own work. O(tiers): never walks the jobs.

        Promotions reserved but not yet submitted need no term: ``on_schedule_end`` submits them in the
        same step, after which they are in ``_transfer_jobs``. A timed-out (quarantined) transfer whose tier
        has not reported is pending work until it does (spec/README.md, "Quarantine"): the tier may still
        read or write its slot, and only a poll hands the slot back. A shutdown that gives up
        (``abandon_transfers``) ends all of it.
        """
        if self._abandoned:
            return False
        if self._transfer_jobs or self._quarantine:
            return True
        return any(tier.has_pending_work() for tier in self._tiers)

    @override
    def take_events(self) -> list[OffloadingEvent]:
        events = self._primary.take_events()
        for tier in self._tiers:
            events.extend(tier.take_events())
        return events

    @override
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
        self._stale_ids.update(self._quarantine)  # timed out already; the reset frees their slots wholesale
        self._quarantine.clear()
        self._expiry.clear()
        for inflight in self._cascades_inflight:
            inflight.clear()
        self._primary.reset_cache()
        self._protected.clear()
        self._polled = False
        # Until the caller says every discarded copy has reported (on_reset_flushed), none is promoted.
        self._promotions_held = bool(self._tiers)

    @override
    def on_reset_flushed(self) -> None:
        self._promotions_held = False

    @property
    def promotions_held(self) -> bool:
        """Promotions are held since the last reset_cache, until on_reset_flushed."""
        return self._promotions_held

    def expire_transfers(self, now: float | None = None) -> int:
        """Time out every transfer past its deadline (``on_schedule_end`` calls this); returns how many."""
        if not (self._deadlines.cascade_s or self._deadlines.promote_s) or not self._expiry:
            return 0
        now = self._clock() if now is None else now
        n = 0
        for job_id in self._expiry.pop_expired(now):
            rec = self._transfer_jobs.get(job_id)
            if rec is not None:
                self._time_out(rec, now)
                n += 1
        self._expiry.compact(self._transfer_jobs, len(self._transfer_jobs))
        return n

    @override
    def drain_pending_work(self) -> None:
        """Block until every tier has finished its submitted jobs (``SecondaryTier.drain_jobs``); the
        results are applied by the next poll."""
        for tier in self._tiers:
            tier.drain_jobs()

    @override
    def abandon_transfers(self) -> int:
        """Shutdown gives up: every transfer times out, queued promotions are dropped, and from now on
        nothing is pending work. Slots stay quarantined until the tiers report (or shutdown releases
        them). Returns the number of transfers timed out."""
        now = self._clock()
        recs = list(self._transfer_jobs.values())
        for rec in recs:
            self._time_out(rec, now)
        self._drop_queued()
        self._abandoned = True
        return len(recs)

    @override
    def shutdown(self, timeout: float | None = None) -> None:
        """Shut the tiers down (each within the time left, on a helper thread when bounded), apply what
        they reported, time out the rest, and release every slot a transfer still held: afterwards no
        transfer is in flight and nothing is pinned. Then the primary."""
        end = None if timeout is None else self._clock() + timeout
        stuck: set[int] = set()
        for i, tier in enumerate(self._tiers):
            left = None if end is None else max(0.0, end - self._clock())
            if left is None:
                tier.shutdown()
            elif not run_bounded(with_timeout(tier.shutdown, left), left + 0.05, f"tier {tier.name}"):
                stuck.add(i)
        try:
            self._poll(skip=stuck)
        except KvfsmError:
            logger.exception("results reported at shutdown were malformed; giving up on them")
        self.abandon_transfers()
        primary = self._primary
        for q in self._quarantine.values():
            self._release(q.job, q.tier, invalidate=False)
            self._stats.transfers_abandoned += 1
        self._quarantine.clear()
        for inflight in self._cascades_inflight:
            inflight.clear()
        primary.shutdown()

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
        now = self._clock()
        self._transfer_jobs[job.job_id] = _Transfer(job, tier_idx, now)
        try:
            submit(tier_job)
        except BaseException:
            del self._transfer_jobs[job.job_id]
            if job.fail() is JobEffect.RELEASE:  # the tier's one report: a refusal releases the job
                rollback()
            raise
        if job.kind is JobKind.CASCADE:
            self._cascades_inflight[tier_idx][job.job_id] = now
        limit = self._deadlines.for_kind(job.kind)
        if limit is not None:
            self._expiry.push(job.job_id, now + limit)

    def _admit_cascade(self, tier_idx: int, now: float) -> bool:
        """Backpressure: under pressure only one probe cascade at a time goes to the tier."""
        bp = self._backpressure[tier_idx]
        if bp is None:
            return True
        inflight = self._cascades_inflight[tier_idx]
        if inflight:
            bp.on_outstanding(now - next(iter(inflight.values())))
        if not bp.under_pressure:
            return True
        if not inflight:
            self._stats.cascade_probes += 1
            return True
        return False

    def _time_out(self, rec: _Transfer, now: float) -> None:
        """The transfer's deadline passed: it ends timed_out; its slots wait in quarantine for the tier."""
        job = rec.job
        match job.time_out():
            case JobEffect.RELEASE:  # carried out once the tier reports the copy finished (see _apply)
                self._quarantine[job.job_id] = Quarantined(job, ReqContext(job.req_id), 1, rec.tier)
            case effect:
                raise AssertionError(f"time_out of {job!r} gave {effect!r}; spec/job.toml says release")
        del self._transfer_jobs[job.job_id]
        if job.kind is JobKind.CASCADE:
            self._cascades_inflight[rec.tier].pop(job.job_id, None)
            bp = self._backpressure[rec.tier]
            if bp is not None:
                bp.on_completed(now - rec.submitted_at)  # a timeout is a latency at least this long
            self._stats.cascades_timed_out += 1
        else:
            self._stats.promotions_timed_out += len(job.keys)

    def _release(self, job: Job, tier_idx: int, *, invalidate: bool) -> None:
        """The RELEASE effect: a promotion frees its slot (and, with ``invalidate``, the tier forgets its
        copy); a cascade unpins its slot, whose CPU copy stays valid."""
        if job.kind is JobKind.PROMOTE:
            self._primary.complete_write(job.keys, False)
            if invalidate:
                self._invalidate(self._tiers[tier_idx], job.keys)
        else:
            self._primary.complete_read(job.keys)

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
                self._stats.promotions_submitted += len(keys_t)

    def _slot_id(self, key: OffloadKey) -> int:
        sid = self._primary.slot_id(key)
        if sid is None:  # a reserved promotion always holds its slot until completed or dropped
            raise AssertionError(f"queued promotion of {key.hex()} lost its primary slot")
        return sid

    def _drop_queued(self) -> None:
        for per_req in self._queued:
            for keys in per_req.values():
                self._primary.complete_write(keys, False)
                self._stats.promotions_dropped += len(keys)
            per_req.clear()

    def _maybe_poll(self) -> None:
        if not self._polled:
            self._poll()

    def _poll(self, skip: frozenset[int] | set[int] = frozenset()) -> None:
        """Apply every finished tier job. A tier's batch is validated whole before any of it is applied."""
        self._polled = True
        for i, tier in enumerate(self._tiers):
            if i in skip:
                continue
            results = list(tier.get_finished_jobs())
            if results:
                self._apply(i, tier, self._validate(i, tier, results))

    def _validate(self, tier_idx: int, tier: SecondaryTier, results: list[JobResult]) -> list[JobResult]:
        seen: set[int] = set()
        live: list[JobResult] = []
        for res in results:
            if res.job_id in self._stale_ids:
                continue
            rec: _Transfer | Quarantined | None = self._transfer_jobs.get(res.job_id)
            if rec is None:
                rec = self._quarantine.get(res.job_id)  # a late result of a timed-out transfer
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
        """Report each result to its job and carry out the effect the job machine returns."""
        now = self._clock()
        for res in results:
            late = self._quarantine.pop(res.job_id, None)
            if late is not None:
                # Timed out already (its RELEASE is pending): a late success never commits.
                late.report()
                self._stats.late_results += 1
                self._release(late.job, late.tier, invalidate=not res.success)
                continue
            rec = self._transfer_jobs.pop(res.job_id)
            job = rec.job
            effect = job.ack(0) if res.success else job.fail(0)
            match effect:
                case JobEffect.COMMIT:
                    self._commit(rec, now)
                case JobEffect.RELEASE:
                    if job.kind is JobKind.CASCADE:
                        self._cascades_inflight[tier_idx].pop(job.job_id, None)
                        self._stats.cascades_failed += 1
                    else:
                        # The tier's copy (or its cached verdict) is bad: forget it, or the next lookup
                        # would promote it again forever.
                        self._stats.promotions_failed += len(job.keys)
                    self._release(job, tier_idx, invalidate=True)
                case _:
                    raise AssertionError(f"the one report of {job!r} gave {effect!r}; expected commit or release")

    def _commit(self, rec: _Transfer, now: float) -> None:
        """The COMMIT effect: a promotion's slots become readable; a cascade's slots are unpinned."""
        job = rec.job
        if job.kind is JobKind.PROMOTE:
            self._primary.complete_write(job.keys, True)
            self._stats.promotions_completed += len(job.keys)
            return
        self._cascades_inflight[rec.tier].pop(job.job_id, None)
        bp = self._backpressure[rec.tier]
        if bp is not None:
            bp.on_completed(now - rec.submitted_at)  # only successful latencies, as vLLM
        self._primary.complete_read(job.keys)
        self._stats.cascades_completed += 1

    @staticmethod
    def _invalidate(tier: SecondaryTier, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            tier.invalidate(key)
