"""kvfsm's file-system and Redis tiers as vLLM ``SecondaryTierManager``s, for vLLM's own tiering spec.

vLLM 0.33 and 0.34 (0.32 too) load third-party secondary tiers below their CPU primary from the connector
config, with no kvfsm spec or connector in the way::

    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": ...,
        "secondary_tiers": [
            {"type": "KvfsmFsTier", "module_path": "kvfsm.vllm.tiers", "fs_path": "/mnt/kv"},
            {"type": "KvfsmRedisTier", "module_path": "kvfsm.vllm.tiers", "redis_url": "redis://host:6379/0"},
        ],
    }

Each adapter wraps kvfsm's own tier (:class:`~kvfsm.tiers.fs.FileSystemTier`,
:class:`~kvfsm.tiers.redis.RedisTier`), so kvfsm's format, checksums, typed failures and backoff stay in
force. The adapter is the I/O edge between the two protocols: it binds the kvfsm tier's ``slot_io`` to
vLLM's primary memoryview (a cascade reads a primary chunk, a promotion writes one, on the kvfsm tier's
own I/O threads), translates jobs and results, and adds what vLLM's interface asks of a tier and kvfsm's
tiering manager would otherwise do:

- **per-key partial success**: every completed write of a promoted chunk into the primary is recorded, so
  a failed promotion reports the keys that did arrive (``JobResult.successful_keys``);
- **a failed load is a miss**: its keys answer MISS until a store of theirs succeeds (or for
  ``lookup_ttl_steps`` steps), and the kvfsm tier forgets its copy (``invalidate``), as kvfsm's manager does;
- **quarantine in vLLM's terms**: where ``JobResult`` has ``deferred_release`` (vLLM 0.34), a promotion
  past ``promote_timeout_s`` is reported failed at once, and its event is set once the kvfsm tier reports
  the job's I/O finished; until then the slot stays out of vLLM's free pool and ``has_pending_work()`` is
  True. Without the field (0.32, 0.33) a slow promotion is reported when its I/O ends, never earlier,
  because nothing else would keep vLLM from reusing a slot the I/O still writes. Cascades are never
  reported early: vLLM unpins a chunk when its store is reported, and a late read of a reused chunk would
  store the wrong bytes under the key.

Every method vLLM calls runs on the scheduler thread and does no disk or network I/O, except construction
(which checks the fs root is writable, or the Redis server answers), ``drain_jobs`` and ``shutdown`` (which
block by contract). Only ``kvfsm.vllm`` modules import vLLM; ``import kvfsm`` needs neither vLLM nor torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import threading
import time
from abc import abstractmethod
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from typing_extensions import override

from kvfsm.control.deadlines import Deadlines
from kvfsm.control.manager import JobResult as KvfsmJobResult
from kvfsm.control.manager import SecondaryTier, TierJob
from kvfsm.control.types import LookupResult as KvfsmLookup
from kvfsm.control.types import OffloadingEvent as KvfsmEvent
from kvfsm.control.types import OffloadKey
from kvfsm.control.types import ReqContext as KvfsmContext
from kvfsm.errors import ConfigError, ConfigKeyError
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.vllm.compat import require_supported_vllm
from kvfsm.vllm.connector_tiers import TIER_KEYS, TierSettings, parse_tier_settings

# Before any vLLM import: an unsupported vLLM gets one error naming the supported range.
require_supported_vllm()

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics as offload_metrics  # noqa: E402
import vllm.v1.kv_offload.base as offload_base  # noqa: E402
import vllm.v1.kv_offload.tiering.base as tiering_base  # noqa: E402

if TYPE_CHECKING:
    from kvfsm.tiers.redis import RedisTier
    from kvfsm.tiers.redis_codec import Namespace

__all__ = ["ADAPTER_KEYS", "FS_KEYS", "REDIS_KEYS", "KvfsmFsTier", "KvfsmRedisTier", "supports_deferred_release"]

logger = logging.getLogger(__name__)

#: Keys every kvfsm tier accepts besides its own (the factory removes ``type``, ``module_path`` and
#: ``backpressure`` before the constructor sees the rest).
ADAPTER_KEYS: Final[dict[str, str]] = {
    "promote_timeout_s": (
        f"seconds > 0 or null (default {Deadlines().promote_s}, kvfsm's promote deadline): a promotion still "
        "running after this is reported failed with a deferred release (vLLM 0.34's JobResult.deferred_release); "
        "null: never. Ignored where JobResult has no deferred_release (a slow promotion is then reported "
        "when its I/O ends)"
    ),
    "lookup_ttl_steps": "int >= 1 (default 64): steps a failed load's keys answer MISS unless stored again meanwhile",
    "enable_kv_events": "bool (default false): emit the tier's KV events (also needs vLLM's kv_events_config)",
    "locality": "'LOCAL' or 'REMOTE' (default: the tier's own, see KvfsmFsTier / KvfsmRedisTier)",
}
#: The fs tier's own keys (named as on kvfsm's connector route, kvfsm.vllm.connector_tiers.TIER_KEYS).
FS_KEYS: Final[dict[str, str]] = {k: TIER_KEYS[k] for k in ("fs_path", "fs_durable", "fs_capacity_bytes")}
#: The Redis tier's own keys (named as on kvfsm's connector route).
REDIS_KEYS: Final[dict[str, str]] = {
    k: TIER_KEYS[k] for k in ("redis_url", "redis_prefix", "redis_cluster", "redis_ttl_s")
}

_JOB_RESULT_FIELDS: Final[frozenset[str]] = frozenset(f.name for f in dataclasses.fields(tiering_base.JobResult))
_EVENT_FIELDS: Final[frozenset[str]] = frozenset(f.name for f in dataclasses.fields(offload_base.OffloadingEvent))

_LOOKUP: Final[dict[KvfsmLookup, offload_base.LookupResult]] = {
    KvfsmLookup.HIT: offload_base.LookupResult.HIT,
    KvfsmLookup.MISS: offload_base.LookupResult.MISS,
    KvfsmLookup.RETRY: offload_base.LookupResult.RETRY,
    # A kvfsm tier never answers it; if one did, "ask again" is the answer vLLM has for it.
    KvfsmLookup.HIT_PENDING: offload_base.LookupResult.RETRY,
}

#: Metrics of the adapters (labelled by the tier type), see :meth:`_KvfsmTierAdapter.build_metric_definitions`.
METRIC_PROMOTIONS_TIMED_OUT: Final = "kvfsm:tier_promotions_timed_out"
METRIC_LOADS_FAILED: Final = "kvfsm:tier_load_keys_failed"
METRIC_STORES_FAILED: Final = "kvfsm:tier_store_jobs_failed"
METRIC_IO_PENDING: Final = "kvfsm:tier_io_pending"
_LABEL: Final = "tier_type"


def supports_deferred_release() -> bool:
    """Whether the installed vLLM's ``JobResult`` has ``deferred_release`` (0.34): feature detection."""
    return "deferred_release" in _JOB_RESULT_FIELDS


# ---------------------------------------------------------------------------------------------- slot bytes


class PrimarySlots:
    """kvfsm's :class:`~kvfsm.tiers.slotio.SizedSlotIO` over vLLM's primary memoryview (one row per chunk).

    Runs on the kvfsm tier's I/O threads. Every completed promotion write is recorded by chunk id, so the
    adapter can tell which keys of a failed promotion did arrive: vLLM pins a chunk to one promotion at a
    time, so a chunk id names its job while the job runs.
    """

    __slots__ = ("_flat", "_lock", "_row", "_rows", "_written")

    def __init__(self, view: memoryview) -> None:
        strides = view.strides
        if view.ndim < 1 or not strides or strides[0] <= 0 or not view.c_contiguous:
            raise ConfigError(
                f"vLLM's primary memoryview has shape {view.shape} and strides {strides}; expected a C-contiguous "
                "view with one row per chunk"
            )
        self._row = strides[0]
        self._rows = view.shape[0] if view.shape else 0
        self._flat = view.cast("B")
        self._lock = threading.Lock()
        self._written: set[int] = set()

    @property
    def nbytes_per_slot(self) -> int:
        return self._row

    def _offset(self, slot_id: int) -> int:
        if not 0 <= slot_id < self._rows:
            raise ConfigError(f"chunk id {slot_id} is outside vLLM's primary tier (0..{self._rows - 1})")
        return slot_id * self._row

    def read_slot(self, slot_id: int) -> bytes:
        off = self._offset(slot_id)
        return bytes(self._flat[off : off + self._row])

    def write_slot(self, slot_id: int, data: bytes) -> None:
        off = self._offset(slot_id)
        if len(data) != self._row:
            raise ConfigError(f"chunk data has {len(data)} bytes; expected {self._row} (one primary chunk)")
        self._flat[off : off + self._row] = data
        with self._lock:
            self._written.add(slot_id)

    def forget(self, slot_ids: Iterable[int]) -> None:
        """A promotion into these chunks starts: no write of theirs has happened yet."""
        with self._lock:
            self._written.difference_update(slot_ids)

    def written_among(self, slot_ids: Iterable[int]) -> set[int]:
        with self._lock:
            return self._written.intersection(slot_ids)

    def take_written(self, slot_ids: Iterable[int]) -> set[int]:
        """The chunks among ``slot_ids`` written since :meth:`forget`, and stop tracking them."""
        with self._lock:
            done = self._written.intersection(slot_ids)
            self._written.difference_update(done)
            return done


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """The keys of :data:`ADAPTER_KEYS`, validated."""

    promote_timeout_s: float | None
    lookup_ttl_steps: int
    enable_kv_events: bool
    locality: offload_base.Locality | None


def _adapter_settings(config: Mapping[str, Any]) -> AdapterSettings:
    default = Deadlines().promote_s
    timeout = config.get("promote_timeout_s", default)
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0):
        raise ConfigKeyError("promote_timeout_s", f"got {timeout!r}; expected seconds > 0 or null")
    ttl = config.get("lookup_ttl_steps", 64)
    if isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1:
        raise ConfigKeyError("lookup_ttl_steps", f"got {ttl!r}; expected an int >= 1")
    events = config.get("enable_kv_events", False)
    if not isinstance(events, bool):
        raise ConfigKeyError("enable_kv_events", f"got {events!r}; expected true or false")
    raw_locality = config.get("locality")
    locality = None
    if raw_locality is not None:
        names = [m.value for m in offload_base.Locality]
        if not isinstance(raw_locality, str) or raw_locality.upper() not in names:
            raise ConfigKeyError("locality", f"got {raw_locality!r}; expected one of {names}")
        locality = offload_base.Locality(raw_locality.upper())
    return AdapterSettings(None if timeout is None else float(timeout), ttl, events, locality)


def _tier_settings(tier: str, own_keys: Mapping[str, str], config: Mapping[str, Any]) -> TierSettings:
    """Check the keys of one tier's config: unknown keys first, then kvfsm's own parsing of the tier keys."""
    known = {**ADAPTER_KEYS, **own_keys}
    for key in config:
        if key not in known:
            raise ConfigKeyError(str(key), f"unknown key of a kvfsm {tier} tier; expected one of {', '.join(known)}")
    try:
        return parse_tier_settings({"tiers": [tier], **{k: v for k, v in config.items() if k in own_keys}})
    except ConfigKeyError:
        raise
    except ConfigError as exc:
        bad = next((k for k in own_keys if f"[{k!r}]" in str(exc)), next(iter(own_keys)))
        raise ConfigKeyError(bad, str(exc).replace("kv_connector_extra_config", "secondary_tiers[]")) from None


def _check_writable(root: str) -> None:
    """One clear error at construction for a root that cannot hold block files (not at the first store)."""
    try:
        os.makedirs(root, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".kvfsm-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ConfigKeyError("fs_path", f"{root!r} cannot hold the fs tier's block files ({exc})") from exc


def _namespace(spec: Any, prefix: str) -> Namespace:
    """The Redis namespace of an engine, from vLLM's normalized offloading config.

    That config has no head count or head size; the bytes of one block per worker
    (``worker_kv_bytes_per_block``) stand in for heads x head size, so engines share values exactly when the
    model, dtype, layers, block and chunk geometry, world size and per-block bytes all agree.
    """
    from kvfsm.tiers.redis_codec import Namespace

    config = spec.config
    groups = list(config.groups)
    if not groups:
        raise ConfigError("vLLM's offloading config has no KV-cache group; the Redis tier needs the KV geometry")
    return Namespace(
        model=str(config.model.name) or "unknown",
        num_layers=max(1, sum(len(g.layer_names) for g in groups)),
        num_heads=1,
        head_dim=max(1, int(config.worker_kv_bytes_per_block)),
        tokens_per_block=int(groups[0].tokens_per_block),
        blocks_per_chunk=int(config.cache.blocks_per_chunk),
        dtype=str(config.model.dtype),
        world_size=int(config.parallel.world_size),
        prefix=prefix,
    )


# ---------------------------------------------------------------------------------------------- the adapter


@dataclass(slots=True, eq=False)
class _Job:
    """One vLLM job handed to the kvfsm tier, until the kvfsm tier reports it."""

    transfer: tiering_base.TransferJob
    keys: tuple[OffloadKey, ...]
    #: The same keys as vLLM's type (what its results name).
    vllm_keys: tuple[offload_base.OffloadKey, ...]
    chunk_ids: tuple[int, ...]
    submitted_at: float
    #: Set once the job timed out and was reported to vLLM with this deferred release.
    released: threading.Event | None = None


class _KvfsmTierAdapter(tiering_base.SecondaryTierManager):
    """What both adapters share: job translation, partial success, deadlines, events, stats."""

    medium: ClassVar[offload_base.Medium | None] = offload_base.Medium.STORAGE
    #: The tier's locality (vLLM's enum); the ``locality`` key overrides it per instance.
    locality = offload_base.Locality.LOCAL
    #: Whether the kvfsm tier emits its own stored/removed events (the fs tier does; Redis does not).
    _INNER_OWNS_EVENTS: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: offload_base.OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        settings = _adapter_settings(tier_config)
        self.locality = settings.locality if settings.locality is not None else type(self).locality
        self._settings = settings
        self._slots = PrimarySlots(primary_kv_view)
        kv_events = getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False)
        self._events: list[offload_base.OffloadingEvent] | None = (
            [] if settings.enable_kv_events and kv_events is True else None
        )
        self._deadline = settings.promote_timeout_s if supports_deferred_release() else None
        self._jobs: dict[int, _Job] = {}
        self._promotions: deque[int] = deque()  # promotion ids in submission order: their deadlines' order
        self._ready: list[tiering_base.JobResult] = []  # results taken from the kvfsm tier, not yet delivered
        self._failed_loads: OrderedDict[OffloadKey, int] = OrderedDict()  # key -> step it failed at
        # Events on and the kvfsm tier announcing its own stores: each key's store request until its stored
        # event is translated (vLLM's self-describing events read a stored block's tokens from it).
        self._store_contexts: dict[OffloadKey, offload_base.ReqContext] = {}
        self._step = 0
        self._counts = {METRIC_PROMOTIONS_TIMED_OUT: 0, METRIC_LOADS_FAILED: 0, METRIC_STORES_FAILED: 0}
        self._closed = False

    # -- the wrapped tier (subclasses) --

    @property
    @abstractmethod
    def tier(self) -> SecondaryTier:
        """The wrapped kvfsm tier."""

    @abstractmethod
    def _io_pending(self) -> int:
        """The wrapped tier's I/O tasks queued or running (a gauge of :meth:`get_stats`)."""

    # -- introspection --

    @property
    def settings(self) -> AdapterSettings:
        return self._settings

    @property
    def jobs_in_flight(self) -> int:
        """Jobs handed to the kvfsm tier and not yet reported by it (timed-out promotions included)."""
        return len(self._jobs)

    @property
    def deferred_releases_pending(self) -> int:
        """Timed-out promotions reported to vLLM whose I/O has not finished (their event is unset)."""
        return sum(1 for j in self._jobs.values() if j.released is not None)

    # -- SecondaryTierManager --

    @override
    def lookup(self, key: offload_base.OffloadKey, req_context: offload_base.ReqContext) -> offload_base.LookupResult:
        k = OffloadKey(key)
        if k in self._failed_loads:
            return offload_base.LookupResult.MISS
        return _LOOKUP[self.tier.lookup(k, KvfsmContext(req_context.req_id))]

    def _submit(self, job: tiering_base.TransferJob, promotion: bool) -> None:
        if self._closed:
            raise ConfigError(f"tier {self.tier_type!r} is shut down; expected no more jobs")
        vllm_keys = tuple(job.keys)
        keys = tuple(OffloadKey(k) for k in vllm_keys)
        rec = _Job(job, keys, vllm_keys, tuple(int(c) for c in job.chunk_ids.tolist()), time.monotonic())
        if promotion:
            self._slots.forget(rec.chunk_ids)
        tier_job = TierJob(job.job_id, rec.keys, rec.chunk_ids, promotion, job.req_context.req_id)
        submit = self.tier.submit_load if promotion else self.tier.submit_store
        if not promotion and self._events is not None and self._INNER_OWNS_EVENTS:
            for k in keys:
                self._store_contexts[k] = job.req_context
        self._jobs[job.job_id] = rec
        try:
            submit(tier_job)
        except BaseException:
            del self._jobs[job.job_id]
            raise
        if promotion and self._deadline is not None:
            self._promotions.append(job.job_id)

    @override
    def submit_store(self, job_metadata: tiering_base.TransferJob) -> None:
        self._submit(job_metadata, promotion=False)

    @override
    def submit_load(self, job_metadata: tiering_base.TransferJob) -> None:
        self._submit(job_metadata, promotion=True)

    @override
    def get_finished_jobs(self) -> Iterable[tiering_base.JobResult]:
        self._collect()
        self._expire(time.monotonic())
        ready, self._ready = self._ready, []
        return ready

    @override
    def has_pending_work(self) -> bool:
        """True while a job is in the kvfsm tier (a timed-out promotion's I/O included), a result waits to be
        delivered, or the kvfsm tier has work of its own (Redis: writes staged, queued or running; fs durable
        mode: blocks not yet synced). Each ends: a job's I/O finishes or fails (Redis operations have a
        timeout), delivery is the next poll, and a sync ends or fails."""
        if self._closed:
            return False
        return bool(self._jobs) or bool(self._ready) or self.tier.has_pending_work()

    @override
    def take_events(self) -> Iterable[offload_base.OffloadingEvent]:
        self._translate_events()
        if not self._events:
            return []
        events, self._events = self._events, []
        return events

    @override
    def on_new_request(self, req_context: offload_base.ReqContext) -> offload_base.RequestOffloadingContext:
        return offload_base.RequestOffloadingContext()

    @override
    def on_schedule_end(self, context: offload_base.ScheduleEndContext) -> None:
        self._step += 1
        ttl = self._settings.lookup_ttl_steps
        failed = self._failed_loads
        while failed and self._step - next(iter(failed.values())) >= ttl:
            failed.popitem(last=False)
        if not self._closed:
            self.tier.on_schedule_end()
        self._translate_events()

    @override
    def drain_jobs(self) -> None:
        """Block until the kvfsm tier's I/O is idle (a copy is never cut short), then take every result, so
        each job's result is queued for the next poll and every deferred release is set."""
        self.tier.drain_jobs()
        self._collect()
        if self._jobs:
            logger.warning(
                "tier %r: %d job(s) still unreported after the kvfsm tier drained: %s",
                self.tier_type,
                len(self._jobs),
                sorted(self._jobs),
            )

    @override
    def shutdown(self) -> None:
        """Shut the kvfsm tier down (queued I/O is cancelled and reported failed; running I/O finishes), then
        take what it reported: every deferred release whose I/O stopped is set."""
        if self._closed:
            return
        self.tier.shutdown()
        self._collect()
        self._closed = True

    @classmethod
    @override
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, offload_base.OffloadingMetricMetadata]:
        labels = (_LABEL,)
        return {
            METRIC_PROMOTIONS_TIMED_OUT: offload_base.OffloadingCounterMetadata(
                documentation="Promotions a kvfsm tier reported failed at their deadline (deferred release).",
                labelnames=labels,
            ),
            METRIC_LOADS_FAILED: offload_base.OffloadingCounterMetadata(
                documentation="Keys of promotions from a kvfsm tier that failed (they answer MISS after).",
                labelnames=labels,
            ),
            METRIC_STORES_FAILED: offload_base.OffloadingCounterMetadata(
                documentation="Cascades to a kvfsm tier that failed (the CPU copy stays valid).",
                labelnames=labels,
            ),
            METRIC_IO_PENDING: offload_base.OffloadingGaugeMetadata(
                documentation="I/O tasks of a kvfsm tier queued or running.",
                labelnames=labels,
            ),
        }

    @override
    def get_stats(self) -> offload_metrics.OffloadingConnectorStats | None:
        stats = offload_metrics.OffloadingConnectorStats()
        label = (self.tier_type,)
        for name, n in self._counts.items():
            if n:
                stats.increase_counter(name, n, label)
                self._counts[name] = 0
        stats.set_gauge(METRIC_IO_PENDING, self._io_pending(), label)
        return stats

    # -- internals --

    def _mark_failed(self, keys: Iterable[OffloadKey]) -> None:
        for key in keys:
            self._failed_loads[key] = self._step
            self._failed_loads.move_to_end(key)
            self.tier.invalidate(key)
            self._counts[METRIC_LOADS_FAILED] += 1

    def _collect(self) -> None:
        """Turn what the kvfsm tier reported into vLLM results (each job exactly once)."""
        reported: list[KvfsmJobResult] = list(self.tier.get_finished_jobs())
        now = time.monotonic()
        for res in reported:
            rec = self._jobs.pop(res.job_id, None)
            if rec is None:
                logger.warning(
                    "tier %r: the kvfsm tier reported job %d, which it was not given", self.tier_type, res.job_id
                )
                continue
            if rec.transfer.is_promotion:
                written = self._slots.take_written(rec.chunk_ids)
                if rec.released is not None:
                    # Reported at its deadline already; its I/O has stopped now, so the chunks may go.
                    self._mark_failed(k for k, c in zip(rec.keys, rec.chunk_ids, strict=True) if c not in written)
                    rec.released.set()
                    continue
                self._ready.append(self._promotion_result(rec, res.success, written, now))
            else:
                if not res.success and self._store_contexts:
                    # The blocks that did commit announced themselves before the job's report: translate
                    # their events with their request now, then forget the keys that never will.
                    self._translate_events()
                    for k in rec.keys:
                        self._store_contexts.pop(k, None)
                self._ready.append(self._store_result(rec, res.success, now))

    def _promotion_result(self, rec: _Job, success: bool, written: set[int], now: float) -> tiering_base.JobResult:
        elapsed = now - rec.submitted_at
        if success:
            return tiering_base.JobResult(
                job_id=rec.transfer.job_id,
                success=True,
                transfer_time=elapsed,
                transfer_bytes=len(rec.keys) * self._slots.nbytes_per_slot,
            )
        arrived = tuple(k for k, c in zip(rec.vllm_keys, rec.chunk_ids, strict=True) if c in written)
        self._mark_failed(k for k, c in zip(rec.keys, rec.chunk_ids, strict=True) if c not in written)
        return tiering_base.JobResult(
            job_id=rec.transfer.job_id,
            success=False,
            successful_keys=arrived or None,
            transfer_time=elapsed,
            transfer_bytes=len(arrived) * self._slots.nbytes_per_slot or None,
        )

    def _store_result(self, rec: _Job, success: bool, now: float) -> tiering_base.JobResult:
        if success:
            for key in rec.keys:
                self._failed_loads.pop(key, None)  # a fresh copy: the failed load's verdict is stale
            if self._events is not None and not self._INNER_OWNS_EVENTS and rec.keys:
                self._events.append(self._event(rec.keys, removed=False, req_context=rec.transfer.req_context))
        else:
            self._counts[METRIC_STORES_FAILED] += 1
        return tiering_base.JobResult(
            job_id=rec.transfer.job_id,
            success=success,
            transfer_time=now - rec.submitted_at,
            transfer_bytes=len(rec.keys) * self._slots.nbytes_per_slot if success else None,
        )

    def _expire(self, now: float) -> None:
        """Report promotions past their deadline failed, with a deferred release (0.34 only)."""
        limit = self._deadline
        if limit is None:
            return
        while self._promotions:
            rec = self._jobs.get(self._promotions[0])
            if rec is None or rec.released is not None:
                self._promotions.popleft()
                continue
            if now - rec.submitted_at < limit:
                return
            self._promotions.popleft()
            written = self._slots.written_among(rec.chunk_ids)
            if len(written) == len(set(rec.chunk_ids)):
                continue  # every chunk arrived: the kvfsm tier reports it at the next poll
            arrived = tuple(k for k, c in zip(rec.vllm_keys, rec.chunk_ids, strict=True) if c in written)
            self._slots.take_written(written)
            rec.released = threading.Event()
            self._mark_failed(k for k, c in zip(rec.keys, rec.chunk_ids, strict=True) if c not in written)
            self._counts[METRIC_PROMOTIONS_TIMED_OUT] += 1
            extra: dict[str, Any] = {"deferred_release": rec.released}
            self._ready.append(
                tiering_base.JobResult(
                    job_id=rec.transfer.job_id,
                    success=False,
                    successful_keys=arrived or None,
                    transfer_time=now - rec.submitted_at,
                    **extra,
                )
            )

    def _event(
        self, keys: Iterable[OffloadKey], *, removed: bool, req_context: offload_base.ReqContext | None = None
    ) -> offload_base.OffloadingEvent:
        extra: dict[str, Any] = {}
        if req_context is not None and "req_context" in _EVENT_FIELDS:
            extra["req_context"] = req_context
        medium = self.medium
        assert medium is not None  # both adapters are STORAGE
        return offload_base.OffloadingEvent(
            keys=[offload_base.OffloadKey(k) for k in keys],
            medium=medium,
            removed=removed,
            locality=self.locality,
            **extra,
        )

    def _translate_events(self) -> None:
        """The kvfsm tier's own events, as vLLM's (dropped when events are off, so they never pile up)."""
        inner: list[KvfsmEvent] = self.tier.take_events()
        if self._events is None:
            return
        for ev in inner:
            if ev.removed or not self._store_contexts:
                self._events.append(self._event(ev.keys, removed=ev.removed))
                continue
            # A stored event names its store's request, one event per request (vLLM's events tracker reads
            # the request's tokens for self-describing events).
            by_request: dict[int, tuple[offload_base.ReqContext | None, list[OffloadKey]]] = {}
            for k in ev.keys:
                ctx = self._store_contexts.pop(k, None)
                by_request.setdefault(id(ctx), (ctx, []))[1].append(k)
            for ctx, keys in by_request.values():
                self._events.append(self._event(keys, removed=False, req_context=ctx))


class KvfsmFsTier(_KvfsmTierAdapter):
    """kvfsm's file-system tier (:class:`~kvfsm.tiers.fs.FileSystemTier`): STORAGE, LOCAL.

    Keys (``secondary_tiers`` entry): ``fs_path`` (required), ``fs_durable``, ``fs_capacity_bytes`` (see
    :data:`FS_KEYS`), and :data:`ADAPTER_KEYS`. An unknown or bad key, or an ``fs_path`` that cannot hold
    files, raises :class:`~kvfsm.errors.ConfigKeyError` naming the key.
    """

    medium: ClassVar[offload_base.Medium | None] = offload_base.Medium.STORAGE
    locality = offload_base.Locality.LOCAL
    _INNER_OWNS_EVENTS: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: offload_base.OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: Any,
    ) -> None:
        settings = _tier_settings("fs", FS_KEYS, tier_config)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **tier_config)
        assert settings.fs_path is not None  # parse_tier_settings requires it
        _check_writable(settings.fs_path)
        self._fs = FileSystemTier(
            settings.fs_path,
            slot_io=self._slots,
            name=tier_type,
            capacity_bytes=settings.fs_capacity_bytes,
            durable=settings.fs_durable,
            lookup_ttl_steps=self.settings.lookup_ttl_steps,
        )

    @property
    @override
    def tier(self) -> FileSystemTier:
        return self._fs

    @override
    def _io_pending(self) -> int:
        return self._fs.stats().io_pending


class KvfsmRedisTier(_KvfsmTierAdapter):
    """kvfsm's Redis/Valkey tier (:class:`~kvfsm.tiers.redis.RedisTier`, standalone or Cluster): STORAGE, REMOTE.

    Keys: ``redis_url`` (required), ``redis_prefix``, ``redis_cluster``, ``redis_ttl_s`` (see
    :data:`REDIS_KEYS`), and :data:`ADAPTER_KEYS`; every Redis operation times out after the shorter of
    ``promote_timeout_s`` and kvfsm's cascade deadline. An unknown or bad key, a missing redis-py, or a
    server that does not answer a PING at construction raises :class:`~kvfsm.errors.ConfigError` (a
    :class:`~kvfsm.errors.ConfigKeyError` naming the key where one is at fault).
    """

    medium: ClassVar[offload_base.Medium | None] = offload_base.Medium.STORAGE
    locality = offload_base.Locality.REMOTE
    _INNER_OWNS_EVENTS: ClassVar[bool] = False

    def __init__(
        self,
        offloading_spec: offload_base.OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        **tier_config: Any,
    ) -> None:
        settings = _tier_settings("redis", REDIS_KEYS, tier_config)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector, **tier_config)
        try:
            from kvfsm.tiers.redis import RedisTier, ping_server
        except ImportError as exc:
            raise ConfigError(
                f"secondary tier {tier_type!r} is a Redis tier but redis-py is not installed ({exc}); "
                "expected pip install 'kvfsm[redis]'"
            ) from exc
        assert settings.redis_url is not None  # parse_tier_settings requires it
        deadlines = Deadlines(promote_s=self.settings.promote_timeout_s)
        self._redis: RedisTier = RedisTier(
            settings.redis_url,
            _namespace(offloading_spec, settings.redis_prefix),
            cluster=settings.redis_cluster,
            slot_io=self._slots,
            name=tier_type,
            deadlines=deadlines,
            ttl_s=settings.redis_ttl_s,
            lookup_ttl_steps=self.settings.lookup_ttl_steps,
        )
        try:
            ping_server(settings.redis_url, cluster=settings.redis_cluster, timeout_s=self._redis.op_timeout_s)
        except BaseException:
            self._redis.shutdown(0.0)
            raise

    @property
    @override
    def tier(self) -> RedisTier:
        return self._redis

    @override
    def _io_pending(self) -> int:
        return self._redis.stats().io_pending
