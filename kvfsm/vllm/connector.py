"""``KvfsmConnector``: kvfsm's whole connector inside vLLM 0.33, as a ``KVConnectorBase_V1``.

Load it with::

    kv_transfer_config={"kv_connector": "KvfsmConnector", "kv_connector_module_path": "kvfsm.vllm",
                        "kv_role": "kv_both", "kv_connector_extra_config": {"num_slots": 4096}}

In vLLM's scheduler process it runs kvfsm's scheduler half (:class:`~kvfsm.control.scheduler.OffloadingScheduler`
over a :class:`~kvfsm.control.cpu.CPUOffloadingManager`): the spec machines, fences, the non-blocking drain
(``has_pending_push_work``), per-rank acks, typed failures and deadlines. In each worker it runs kvfsm's
worker half (:class:`~kvfsm.control.messages.RemoteWorker` over an
:class:`~kvfsm.control.worker.OffloadingWorker` and kvfsm's copy backend over the KV caches vLLM registers).
What crosses between them is plain data (spec/README.md, "The scheduler/worker boundary"): a
:class:`~kvfsm.control.messages.StepMessage` down, one :class:`~kvfsm.control.messages.RankReport` per worker
up (in vLLM's ``kv_connector_worker_meta``, aggregated over the workers by vLLM).

KV cache events: with vLLM's ``kv_events_config.enable_kv_cache_events`` the connector publishes the CPU tier's
stores and evictions as vLLM's ``OffloadingConnector`` does (:class:`VllmEventTranslator`).

``kv_connector_extra_config`` keys (any other key is a :class:`~kvfsm.errors.ConfigError` naming it):

================== ======================================================================================
``num_slots``      CPU slots (one chunk each) per worker; required, int >= 1
``blocks_per_chunk`` GPU blocks per chunk (the unit of lookups, stores, loads); int >= 1, default 1
``policy``         ``"lru"`` (default) or ``"arc"``: vLLM's eviction order (kvfsm's request-scoped
                   ``request-lru`` / ``request-arc``, as the spec route); ``"commit-lru"`` /
                   ``"commit-arc"``: kvfsm's plain commit-order LRU / ARC
``copy_threads``   copy threads per worker (CPU KV caches); int >= 1, default 2
``offload_prompt_only`` offload only prompt tokens, as vLLM's connector does (default false: generated
                   tokens too, once they fill a chunk)
``store_deadline_s`` / ``load_deadline_s``  seconds a store / load job may take (default 30; ``null``: none)
``lookup_wait_s``  seconds a request waits on a chunk not readable yet (default 5; ``null``: none)
``shutdown_s``     bound on ``shutdown()`` in seconds (default 20)
``cascade_deadline_s`` / ``promote_deadline_s``  seconds a CPU -> tier cascade / tier -> CPU promotion may
                   take (default 60 / 30; ``null``: none); a timed-out transfer stays quarantined (pending
                   work) until its tier reports
``tiers``          secondary tiers below the CPU tier, searched in this order on a CPU miss (kvfsm's
                   :class:`~kvfsm.control.tiering.TieringManager`): a list of ``"fs"`` / ``"redis"``, or one
                   name (default ``[]``: none). They move slot bytes in the scheduler process, so they need
                   vLLM's uniproc executor (:mod:`kvfsm.vllm.connector_tiers`); a worker that finds no tier in
                   its process raises :class:`~kvfsm.errors.ConfigError` at its first step
``fs_path``        directory of the fs tier's block files (:class:`~kvfsm.tiers.fs.FileSystemTier`);
                   required with ``"fs"``
``fs_durable``     fsync each block and its directory (default false); the drain waits for the syncs
``fs_capacity_bytes`` bytes the fs tier may hold, int >= 1 (default ``null``: unbounded)
``redis_url``      ``redis://host:port[/db]`` (or ``rediss://``, ``unix://``) of the Redis / Valkey server
                   (:class:`~kvfsm.tiers.redis.RedisTier`, extra ``kvfsm[redis]``); required with ``"redis"``
``redis_prefix``   start of every Redis key (default ``"kvfsm"``); engines with the same model, KV geometry,
                   dtype, world size and prefix share chunks
``redis_cluster``  the URL is one node of a Redis Cluster (default false)
``redis_ttl_s``    expiry of every value in seconds, int >= 1 (default ``null``: the server's eviction)
``checked``        check every step's jobs against vLLM's block table (spec/invariants.toml,
                   ``job_copies_engine_block``; :mod:`kvfsm.vllm.seam`): a job whose GPU blocks are not the
                   ones vLLM holds for its keys raises :class:`~kvfsm.errors.SeamViolationError` before it is
                   handed to a worker (default: the ``KVFSM_CHECKED`` environment variable)
================== ======================================================================================
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from typing_extensions import override
from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored, KVCacheEvent
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines, run_bounded
from kvfsm.control.messages import RankReport, RemoteWorker, StepMessage, StepResult
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import OffloadingEvent, OffloadKey
from kvfsm.control.worker import OffloadingWorker
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.machines.compiled import checked_mode_default
from kvfsm.machines.names import RequestState
from kvfsm.vllm.connector_tiers import (
    TIER_KEYS,
    EngineTiers,
    TierSettings,
    WorkerTierBinding,
    bind_worker_pool,
    build_tiers,
    namespace_of,
    parse_tier_settings,
    register_tiers,
)
from kvfsm.vllm.seam import SeamChecker, find_vllm_scheduler

RUNNING = RequestState.RUNNING
_GROUP_0 = (0,)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput as VllmSchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvfsm.control.manager import SecondaryTier
    from kvfsm.data.worker import BackendFactory

__all__ = [
    "KvfsmConnector",
    "KvfsmConnectorMetadata",
    "KvfsmSettings",
    "KvfsmWorkerMetadata",
    "VllmEventTranslator",
    "parse_settings",
]

logger = logging.getLogger(__name__)

#: vLLM's ``ExternalBlockHash``: the hash bytes, or an int with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``.
ExternalHash = bytes | int


# ---------------------------------------------------------------------------------------------- settings


@dataclass(frozen=True, slots=True)
class KvfsmSettings:
    """``kv_connector_extra_config``, validated (see the module docstring for each key)."""

    num_slots: int
    blocks_per_chunk: int = 1
    #: kvfsm's policy name (``request-lru`` for the key's default ``"lru"``: vLLM's eviction order).
    policy: str = "request-lru"
    copy_threads: int = 2
    offload_prompt_only: bool = False
    #: The secondary tiers and their keys.
    tiers: TierSettings = field(default_factory=TierSettings)
    deadlines: Deadlines = field(default_factory=Deadlines)
    #: Check every job against vLLM's block table (the seam check); None: ``KVFSM_CHECKED`` decides.
    checked: bool | None = None


_DEADLINE_KEYS = {
    "store_deadline_s": "store_s",
    "load_deadline_s": "load_s",
    "lookup_wait_s": "lookup_wait_s",
    "shutdown_s": "shutdown_s",
    "cascade_deadline_s": "cascade_s",
    "promote_deadline_s": "promote_s",
}
#: The ``policy`` key -> kvfsm's policy: vLLM's order by default (as the spec route), kvfsm's plain ones by name.
_POLICIES = {
    "lru": "request-lru",
    "arc": "request-arc",
    "request-lru": "request-lru",
    "request-arc": "request-arc",
    "commit-lru": "lru",
    "commit-arc": "arc",
}
_KEYS = {"num_slots", "blocks_per_chunk", "policy", "copy_threads", "offload_prompt_only", "checked", *_DEADLINE_KEYS}
_KEYS.update(TIER_KEYS)


def _positive_int(key: str, value: object) -> int:
    if type(value) is not int or value < 1:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}; expected an int >= 1")
    return value


def parse_settings(extra: Mapping[str, Any]) -> KvfsmSettings:
    """Validate ``kv_connector_extra_config``; a bad or unknown key raises :class:`ConfigError` naming it."""
    unknown = sorted(set(extra) - _KEYS)
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config has unknown key(s) {unknown} for KvfsmConnector; "
            f"expected some of {sorted(_KEYS)}"
        )
    if "num_slots" not in extra:
        raise ConfigError("kv_connector_extra_config lacks 'num_slots' (CPU slots per worker); expected an int >= 1")
    policy_key = extra.get("policy", "lru")
    policy = _POLICIES.get(policy_key) if isinstance(policy_key, str) else None
    if policy is None:
        raise ConfigError(
            f"kv_connector_extra_config['policy'] = {policy_key!r}; expected one of {', '.join(map(repr, _POLICIES))}"
        )
    prompt_only = extra.get("offload_prompt_only", False)
    if not isinstance(prompt_only, bool):
        raise ConfigError(f"kv_connector_extra_config['offload_prompt_only'] = {prompt_only!r}; expected true or false")
    checked = extra.get("checked")
    if checked is not None and not isinstance(checked, bool):
        raise ConfigError(f"kv_connector_extra_config['checked'] = {checked!r}; expected true, false or null")
    limits: dict[str, float | None] = {}
    for key, name in _DEADLINE_KEYS.items():
        if key in extra:
            value = extra[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}; expected seconds > 0 or null")
            limits[name] = None if value is None else float(value)
    defaults = Deadlines()
    deadlines = Deadlines(
        store_s=limits.get("store_s", defaults.store_s),
        load_s=limits.get("load_s", defaults.load_s),
        cascade_s=limits.get("cascade_s", defaults.cascade_s),
        promote_s=limits.get("promote_s", defaults.promote_s),
        lookup_wait_s=limits.get("lookup_wait_s", defaults.lookup_wait_s),
        shutdown_s=limits.get("shutdown_s", defaults.shutdown_s),
    )
    return KvfsmSettings(
        num_slots=_positive_int("num_slots", extra["num_slots"]),
        blocks_per_chunk=_positive_int("blocks_per_chunk", extra.get("blocks_per_chunk", 1)),
        policy=policy,
        copy_threads=_positive_int("copy_threads", extra.get("copy_threads", 2)),
        offload_prompt_only=prompt_only,
        tiers=parse_tier_settings(extra),
        deadlines=deadlines,
        checked=checked,
    )


# ---------------------------------------------------------------------------------------------- messages


@dataclass
class KvfsmConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> workers: this step's plain :class:`StepMessage` (nothing live crosses)."""

    message: StepMessage


@dataclass
class KvfsmWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker(s) -> scheduler: one :class:`RankReport` per worker that reported this step."""

    reports: tuple[RankReport, ...] = ()

    @override
    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, KvfsmWorkerMetadata):
            raise KvfsmError(f"cannot aggregate a {type(other).__name__} into kvfsm's worker metadata")
        return KvfsmWorkerMetadata(self.reports + other.reports)


class _RequestView:
    """kvfsm's :class:`~kvfsm.control.scheduler.OffloadRequest` over a live vLLM ``Request``."""

    __slots__ = ("_request",)

    def __init__(self, request: Request) -> None:
        self._request = request

    @property
    def req_id(self) -> str:
        rid: str = self._request.request_id
        return rid

    @property
    def block_hashes(self) -> Sequence[bytes]:
        hashes: Sequence[bytes] = self._request.block_hashes
        return hashes

    @property
    def num_tokens(self) -> int:
        n: int = self._request.num_tokens
        return n

    @property
    def num_prompt_tokens(self) -> int:
        n: int = self._request.num_prompt_tokens
        return n

    @property
    def num_computed_tokens(self) -> int:
        n: int = self._request.num_computed_tokens
        return n

    @property
    def is_aborted(self) -> bool:
        return bool(self._request.status == RequestStatus.FINISHED_ABORTED)


def _resumed_req_ids(cached: Any) -> frozenset[str]:
    """The cached requests vLLM resumed from preemption this step, carrying their whole table, from whichever
    field this vLLM has: ``resumed_req_ids`` (a set: 0.32, 0.33) or ``resumed_from_preemption`` (one bool per
    request: older). vLLM 0.34 has neither: it sends a resumed request again in ``scheduled_new_reqs``, whole."""
    resumed = getattr(cached, "resumed_req_ids", None)
    if resumed is not None:
        return frozenset(resumed)
    flags = getattr(cached, "resumed_from_preemption", None)
    if flags is None:
        return frozenset()
    return frozenset(req_id for req_id, flag in zip(cached.req_ids, flags, strict=True) if flag)


def scheduler_output_of(output: VllmSchedulerOutput) -> SchedulerOutput:
    """vLLM's scheduler output as kvfsm's: scheduled requests, preemptions, every block handed out.

    Whether a request's blocks are its whole table or blocks to append comes from vLLM's structures, never
    from a flag: a request in ``scheduled_new_reqs`` carries its whole table, and so does a cached request
    in the resumed set; every other cached request carries only its new blocks. (vLLM's ``yield_req_data``
    flags a new request ``False`` in 0.32 and ``True`` in 0.33; reading that flag with one meaning doubled a
    request's block list on the other version, and later stores copied the wrong GPU block.)
    """
    scheduled: list[ScheduledRequest] = []
    allocated: set[int] = set()
    num_tokens: Mapping[str, int] = output.num_scheduled_tokens
    for new in output.scheduled_new_reqs:
        groups = new.block_ids
        blocks = tuple(groups[0]) if groups else ()
        scheduled.append(ScheduledRequest(new.req_id, blocks, num_tokens.get(new.req_id, 0), True))
    cached = output.scheduled_cached_reqs
    resumed = _resumed_req_ids(cached)
    for req_id, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
        blocks = tuple(groups[0]) if groups else ()
        scheduled.append(ScheduledRequest(req_id, blocks, num_tokens.get(req_id, 0), req_id in resumed))
    for copy in getattr(output, "kv_cache_block_copies", None) or ():
        allocated.add(int(copy.dst_block_id))
    return SchedulerOutput(
        scheduled=tuple(scheduled),
        preempted_req_ids=frozenset(output.preempted_req_ids or ()),
        allocated_block_ids=frozenset(allocated),
    )


# ---------------------------------------------------------------------------------------------- KV events


def _block_hash(key: OffloadKey) -> ExternalHash:
    """The block hash inside an offload key (kvfsm's keys are vLLM's: hash bytes + 4-byte group index)."""
    converted: ExternalHash = maybe_convert_block_hash(BlockHash(key[:-4]))
    return converted


def _group_idx(key: OffloadKey) -> int:
    return int.from_bytes(key[-4:], "big", signed=False)


class VllmEventTranslator:
    """kvfsm's :class:`~kvfsm.control.types.OffloadingEvent` stream as vLLM's KV cache events, as vLLM 0.33's
    ``OffloadingConnector`` emits them without self-describing events: one placeholder ``BlockStored`` per
    stored key (its block hash, ``medium="CPU"``, its group, no tokens), one ``BlockRemoved`` per group of an
    eviction, and nothing for a ``metadata_only`` removal (a failed store's keys, never announced as stored).

    It remembers which keys it announced, so that :meth:`clear` can withdraw them all: vLLM's connector
    emits nothing on ``reset_cache`` and leaves subscribers believing the CPU tier still holds them;
    kvfsm emits a ``BlockRemoved`` for each announced key instead (``AllBlocksCleared`` carries no medium, so
    a subscriber would drop its GPU-tier entries too).
    """

    __slots__ = ("_announced", "_medium")

    def __init__(self, medium: str = MEDIUM_CPU) -> None:
        self._medium = medium
        self._announced: dict[OffloadKey, None] = {}

    @property
    def announced(self) -> frozenset[OffloadKey]:
        """Keys announced as stored and not removed since."""
        return frozenset(self._announced)

    def translate(self, events: Iterable[OffloadingEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in events:
            if not event.removed:
                for key in event.keys:
                    self._announced[key] = None
                    out.append(
                        BlockStored(
                            block_hashes=[_block_hash(key)],
                            parent_block_hash=None,
                            token_ids=[],
                            block_size=0,
                            lora_id=None,
                            medium=self._medium,
                            lora_name=None,
                            group_idx=_group_idx(key),
                        )
                    )
            elif not event.metadata_only:
                for key in event.keys:
                    self._announced.pop(key, None)
                out.extend(self._removed(event.keys))
        return out

    def clear(self) -> list[KVCacheEvent]:
        """Withdraw every announced key (the manager dropped them all)."""
        keys, self._announced = tuple(self._announced), {}
        return self._removed(keys)

    def _removed(self, keys: Iterable[OffloadKey]) -> list[KVCacheEvent]:
        by_group: dict[int, list[ExternalHash]] = {}
        for key in keys:
            by_group.setdefault(_group_idx(key), []).append(_block_hash(key))
        return [BlockRemoved(block_hashes=hashes, medium=self._medium, group_idx=g) for g, hashes in by_group.items()]


# ---------------------------------------------------------------------------------------------- the connector


class KvfsmConnector(KVConnectorBase_V1):
    """kvfsm's scheduler half in vLLM's scheduler process, kvfsm's worker half in each worker."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra: Mapping[str, Any] = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        self.settings = parse_settings(extra)
        parallel = vllm_config.parallel_config
        self.world_size = int(parallel.tensor_parallel_size) * int(parallel.pipeline_parallel_size)
        self.config = OffloadConfig(
            tokens_per_block=int(vllm_config.cache_config.block_size),
            blocks_per_chunk=self.settings.blocks_per_chunk,
            world_size=self.world_size,
            offload_prompt_only=self.settings.offload_prompt_only,
        )
        self.num_gpu_blocks = int(kv_cache_config.num_blocks)
        self.scheduler: OffloadingScheduler | None = None
        self.worker: RemoteWorker | None = None
        self._rank: int | None = None
        #: Builds this worker's copy backend at ``register_kv_caches``: ``(layers, pool, blocks_per_chunk,
        #: copy threads)``; kvfsm's default picks the CUDA backend for CUDA caches, else the thread pool.
        self.backend_factory: BackendFactory | None = None
        self._result: StepResult | None = None
        # KV cache events, as vLLM's connector: on when vLLM's kv_events_config enables them.
        events_config = vllm_config.kv_events_config
        self.events_enabled = events_config is not None and bool(events_config.enable_kv_cache_events)
        self._events = VllmEventTranslator()
        self._pending_events: list[KVCacheEvent] = []
        #: This engine's tiers and pools in this process (kvfsm.vllm.connector_tiers); None without tiers.
        self.engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", None))
        self._tier_entry: EngineTiers | None = None
        self._tier_binding: WorkerTierBinding | None = None
        if role == KVConnectorRole.SCHEDULER:
            primary = CPUOffloadingManager(
                self.settings.num_slots, self.settings.policy, enable_events=self.events_enabled
            )
            manager: CPUOffloadingManager | TieringManager = primary
            if self.settings.tiers.tiers:
                manager = TieringManager(primary, self._build_tiers(vllm_config), deadlines=self.settings.deadlines)
            self.scheduler = OffloadingScheduler(self.config, manager, deadlines=self.settings.deadlines)
        checked = self.settings.checked if self.settings.checked is not None else checked_mode_default()
        #: The seam check (checked mode): every job against vLLM's block table, on the scheduler side.
        self.seam: SeamChecker | None = (
            SeamChecker(self.settings.blocks_per_chunk) if checked and role == KVConnectorRole.SCHEDULER else None
        )

    # ------------------------------------------------------------------ scheduler side

    def _sched(self) -> OffloadingScheduler:
        if self.scheduler is None:
            raise KvfsmError("a scheduler-side KvfsmConnector method was called on the worker-role connector")
        return self.scheduler

    def _build_tiers(self, vllm_config: VllmConfig) -> list[SecondaryTier]:
        """The configured tiers, registered under this engine's id for the workers' pools to bind."""
        tiers = self.settings.tiers
        namespace = None
        if "redis" in tiers.tiers:
            model_config = getattr(vllm_config, "model_config", None)
            namespace = namespace_of(
                str(getattr(model_config, "model", "") or "unknown"),
                self._kv_cache_config,
                self.config.tokens_per_block,
                self.settings.blocks_per_chunk,
                self.world_size,
                tiers.redis_prefix,
            )
        built = build_tiers(tiers, self.settings.deadlines, namespace)
        self._tier_entry = register_tiers(self.engine_id, built, self.world_size)
        return built

    @override
    def on_new_request(self, request: Request) -> None:
        self._sched().on_new_request(_RequestView(request))

    @override
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        sched, view = self._sched(), _RequestView(request)
        if sched.state_or_none(request.request_id) is RUNNING:
            # vLLM preempted it (reset_prefix_cache(reset_running_requests=True)) and looks it up again before
            # this step's preempted_req_ids tells the connector.
            sched.preempt_unannounced(view)
        return sched.get_num_new_matched_tokens(view, num_computed_tokens)

    @override
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        block_ids = [b.block_id for b in blocks.blocks[0]] if blocks.blocks else []
        sched, view = self._sched(), _RequestView(request)
        if num_external_tokens == 0 and sched.state_or_none(request.request_id) is RUNNING:
            # vLLM's second call, once the request's asynchronous load finished and it is rescheduled.
            sched.extend_running_blocks(view, block_ids)
            return
        sched.update_state_after_alloc(view, block_ids, num_external_tokens)

    @override
    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """kvfsm offloads the one attention group (vLLM's hybrid allocator is off with this connector)."""
        return _GROUP_0

    @override
    def build_connector_meta(self, scheduler_output: VllmSchedulerOutput) -> KVConnectorMetadata:
        sched = self._sched()
        message = sched.build_step_message(scheduler_output_of(scheduler_output))
        if self.seam is not None:
            self._check_seam(sched, message)
        return KvfsmConnectorMetadata(message)

    def _check_seam(self, sched: OffloadingScheduler, message: StepMessage) -> None:
        """Checked mode: each job of this step against vLLM's block table, before any worker sees it."""
        seam = self.seam
        assert seam is not None
        if seam.view.scheduler is None:
            scheduler = find_vllm_scheduler()
            if scheduler is None:
                raise KvfsmError(
                    "KvfsmConnector checked mode: vLLM's Scheduler is not on the call stack of "
                    "build_connector_meta; expected vLLM's engine to call it (or bind one: connector.seam.view.bind)"
                )
            seam.view.bind(scheduler)
        for spec in (*message.load_jobs, *message.store_jobs):
            job = sched.job(spec.job_id)
            keys = job.keys if job is not None else ()
            seam.check(spec.job_id, spec.kind.value, spec.req_id, keys, spec.gpu_block_ids, spec.first_block_offset)
        seam.view.forget_finished({r for r in seam.view.finished if sched.is_tracked(r)})

    @override
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, KvfsmWorkerMetadata):
            raise KvfsmError(f"worker metadata is a {type(meta).__name__}; expected KvfsmWorkerMetadata")
        self._sched().apply_reports(meta.reports)

    @override
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Never delays the free: a store still reading a freed block is fenced and flushed before reuse.
        if self.seam is not None:
            self.seam.view.remember_finished(request, block_ids)
        self._sched().request_finished(_RequestView(request))
        return False, None

    @override
    def has_pending_push_work(self) -> bool:
        """vLLM's engine core keeps stepping while this is True (the non-blocking drain)."""
        return self._sched().has_pending_push_work()

    @override
    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM's KV cache events since the last call (see :class:`VllmEventTranslator`)."""
        sched = self._sched()
        if not self.events_enabled:
            return ()
        events, self._pending_events = self._pending_events, []
        events.extend(self._events.translate(sched.take_events()))
        return events

    @override
    def reset_cache(self) -> bool | None:
        sched = self._sched()
        if self.events_enabled:
            # The reset discards undrained events: translate them first, then withdraw every announced key.
            self._pending_events.extend(self._events.translate(sched.take_events()))
        sched.reset_cache()
        if self.events_enabled:
            self._pending_events.extend(self._events.clear())
        return True

    # ------------------------------------------------------------------ worker side

    def bind_rank(self, rank: int) -> None:
        """Set this worker's rank (vLLM: its tensor-parallel rank, read at registration when not set)."""
        if type(rank) is not int or not 0 <= rank < self.world_size:
            raise ConfigError(f"rank={rank!r}; expected an int in 0..{self.world_size - 1}")
        self._rank = rank

    def _worker_rank(self) -> int:
        if self._rank is not None:
            return self._rank
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank, model_parallel_is_initialized

        return int(get_tensor_model_parallel_rank()) if model_parallel_is_initialized() else 0

    @override
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from kvfsm.data.pool import CPUSlotPool
        from kvfsm.data.worker import default_backend

        layers = block_major_layers(kv_caches, self.num_gpu_blocks)
        block_shape = tuple(int(d) for d in layers[0].shape[1:])
        pool = CPUSlotPool(
            self.settings.num_slots, self.settings.blocks_per_chunk, block_shape, len(layers), layers[0].dtype
        )
        factory = default_backend if self.backend_factory is None else self.backend_factory
        backend = factory(layers, pool, self.settings.blocks_per_chunk, self.settings.copy_threads)
        rank = self._worker_rank()
        self.worker = RemoteWorker(OffloadingWorker(rank, self.world_size, backend))
        tiers = self.settings.tiers.tiers
        if tiers:
            # The tiers (in the scheduler, in this process with vLLM's uniproc executor) move this pool's bytes;
            # checked at the first step, when the scheduler has registered its tiers whatever the order.
            self._tier_binding = bind_worker_pool(self.engine_id, rank, self.world_size, pool, tiers)
            self._tier_entry = self._tier_binding.entry

    def _remote(self) -> RemoteWorker:
        if self.worker is None:
            raise KvfsmError("KvfsmConnector worker: register_kv_caches was not called before the first step")
        if self._tier_binding is not None:
            self._tier_binding.check()  # ConfigError: no scheduler with this engine's tiers in this process
            self._tier_binding = None
        return self.worker

    def _message(self) -> StepMessage:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvfsmConnectorMetadata):
            raise KvfsmError(f"connector metadata is a {type(meta).__name__}; expected KvfsmConnectorMetadata")
        return meta.message

    @override
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the forward, every step: flush the fenced stores (wait for them), then start the loads."""
        if not isinstance(kv_connector_metadata, KvfsmConnectorMetadata):
            raise KvfsmError(
                f"connector metadata is a {type(kv_connector_metadata).__name__}; expected KvfsmConnectorMetadata"
            )
        remote = self._remote()
        remote.bind(kv_connector_metadata.message)
        remote.before_forward()

    @override
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Loads already started in :meth:`handle_preemptions` (they write blocks this forward never reads)."""

    @override
    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    @override
    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        pass

    @override
    def wait_for_save(self) -> None:
        """After the forward: start this step's stores (they read the blocks it has just written)."""
        self._remote().after_forward()

    @override
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._result = self._remote().poll()
        return None, set(self._result.finished_loads)

    @override
    def get_block_ids_with_load_errors(self) -> set[int]:
        return set(self._result.failed_load_blocks) if self._result is not None else set()

    @override
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        result, self._result = self._result, None
        if result is None or result.report.is_empty():
            return None
        return KvfsmWorkerMetadata((result.report,))

    @override
    def shutdown(self) -> None:
        """Bounded: the scheduler gives up on unreported jobs, a worker waits for its copies at most
        ``shutdown_s``."""
        limit = self.settings.deadlines.shutdown_s
        if self.scheduler is not None:
            self.scheduler.abandon_jobs()
            self.scheduler.shutdown(limit)
        if self.worker is not None:
            worker = self.worker
            if not run_bounded(worker.shutdown, limit, "kvfsm worker"):
                logger.warning("kvfsm worker rank %d: copies still running after %s s at shutdown", worker.rank, limit)


def block_major_layers(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[torch.Tensor]:
    """vLLM's per-layer KV caches as kvfsm's block-major tensors, ``(num_blocks, *block shape)`` each: a
    block-first layer as it is, a ``(2, num_blocks, ...)`` layer (K and V) as two views."""
    if not kv_caches:
        raise ConfigError("register_kv_caches got no KV caches; expected one tensor per attention layer")
    layers: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if t.dim() >= 2 and t.shape[0] == num_blocks:
            layers.append(t)
        elif t.dim() >= 3 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            layers.extend((t[0], t[1]))
        else:
            raise ConfigError(
                f"KV cache {name!r} has shape {tuple(t.shape)}; expected (num_blocks={num_blocks}, ...) "
                f"or (2, num_blocks={num_blocks}, ...)"
            )
    shape = tuple(layers[0].shape)
    for t in layers:
        if tuple(t.shape) != shape or t.dtype != layers[0].dtype:
            raise ConfigError(
                f"KV caches differ: {tuple(t.shape)} {t.dtype} vs {shape} {layers[0].dtype}; expected one shape"
            )
    return layers
