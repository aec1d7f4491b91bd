"""kvfsm's managers behind vLLM's ``OffloadingManager`` interface (vLLM 0.32-0.34): a thin type adapter.

All the bookkeeping is kvfsm's (:class:`kvfsm.control.cpu.CPUOffloadingManager`, or
:class:`kvfsm.control.tiering.TieringManager` with the file-system tier); this module only converts
vLLM's records to kvfsm's and back:

- a vLLM ``ReqContext`` gets one kvfsm ``ReqContext`` of its own (kept in the context's per-request state,
  as vLLM's managers keep theirs), registered with the context's key positions;
- ``Collection`` arguments (vLLM passes sets) become lists; kvfsm orders them itself (reservation order);
- kvfsm's ``SlotSpec`` becomes a ``CPULoadStoreSpec``, its events vLLM's ``OffloadingEvent`` (medium CPU);
- ``get_stats`` reports kvfsm's counts as vLLM's CPU gauges and allocation histogram.

The interface differs between the supported vLLM versions; :mod:`kvfsm.vllm.compat` detects each difference
(``touch`` exists up to 0.33, ``OffloadingEvent.metadata_only`` and ``CPUOffloadingInfo`` from 0.33 on, the
stored event's ``req_context`` from 0.34 on).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import OffloadingManager as KvfsmManager
from kvfsm.control.policies import CachePolicy, RequestARCPolicy
from kvfsm.control.types import LookupResult as KvfsmLookup
from kvfsm.control.types import OffloadKey
from kvfsm.control.types import ReqContext as KvfsmContext
from kvfsm.errors import ConfigKeyError
from kvfsm.vllm.compat import (
    connector_reports_reset_flushed,
    event_carries_request_context,
    event_has_metadata_only,
    manager_has_touch,
    require_supported_vllm,
)

# Before any other vLLM import: an unsupported vLLM gets one error naming the supported range, not an
# ImportError of whichever name it happens to lack first.
require_supported_vllm()

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec, CPUOffloadingMetrics  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.arc import ARCCachePolicy  # noqa: E402
from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy  # noqa: E402
from vllm.v1.metrics.cache_hit_source import CacheHitSource  # noqa: E402

__all__ = [
    "ARCPolicyView",
    "ChunkView",
    "KvfsmCPUOffloadingManager",
    "KvfsmOffloadingManager",
    "LRUPolicyView",
    "vllm_policy_name",
]

_LOOKUP = {
    KvfsmLookup.MISS: LookupResult.MISS,
    KvfsmLookup.HIT: LookupResult.HIT,
    KvfsmLookup.HIT_PENDING: LookupResult.HIT_PENDING,
    KvfsmLookup.RETRY: LookupResult.RETRY,
}
_POLICY_NAMES = {"lru": "request-lru", "arc": "request-arc"}


def vllm_policy_name(cache_policy: str) -> str:
    """kvfsm's policy for vLLM's ``eviction_policy`` name (``lru`` or ``arc``)."""
    name = _POLICY_NAMES.get(cache_policy.strip().lower())
    if name is None:
        raise ConfigKeyError("eviction_policy", f"got {cache_policy!r}; expected 'lru' or 'arc'")
    return name


@dataclass(slots=True, eq=False)
class _KvfsmRequest:
    """kvfsm's context for one vLLM request context, stored in that context's state."""

    owner: object
    ctx: KvfsmContext


class KvfsmOffloadingManager(OffloadingManager):
    """Any kvfsm manager as a vLLM ``OffloadingManager`` (its CPU primary gives the stats)."""

    def __init__(self, manager: KvfsmManager, info: Any = None, keepalive: Any = None) -> None:
        """``info``: vLLM's ``CPUOffloadingInfo`` (vLLM 0.33 on; None reports no config-info facts).

        ``keepalive``: an object that lives as long as this manager. The spec passes its engine's tier-registry
        entry (held weakly by the registry): vLLM's connector scheduler keeps the manager but drops the spec,
        so without it the entry of a scheduler built before its worker is collected and the tiers never bind.
        """
        primary = manager.primary
        if primary is None:
            raise ConfigKeyError("spec_name", "kvfsm's vLLM adapter needs a manager with a CPU primary")
        self.medium = Medium.CPU
        self._manager = manager
        self._keepalive = keepalive
        self._primary: CPUOffloadingManager = primary
        self._num_chunks = primary.num_slots
        self._config_info: dict[str, Any] = dict(info.as_config_info()) if info is not None else {}
        self._contexts = 0
        self._skipped_reported = 0
        self._sizes_reported: dict[int, int] = {}
        #: vLLM 0.34 on: the vLLM request context whose store completed each key, until its stored event is
        #: taken (vLLM's events tracker builds a self-describing event's payload from it).
        self._stored_by: dict[OffloadKey, Any] = {}
        self._events_carry_context = event_carries_request_context() and self._primary.enable_events
        #: CPU slot -> the key it was last handed out for (a load's or a store's), kept only for the seam
        #: check of checked mode (:meth:`track_slot_keys`); None: not kept.
        self._slot_keys: dict[int, OffloadKey] | None = None

    @property
    def kvfsm_manager(self) -> KvfsmManager:
        """The kvfsm manager doing the work."""
        return self._manager

    def track_slot_keys(self) -> None:
        """Keep :meth:`slot_key` answering from now on (checked mode's seam check: it names the key each job's
        CPU slot holds, which vLLM's metadata carries only as slot ids)."""
        if self._slot_keys is None:
            self._slot_keys = {}

    def slot_key(self, slot_id: int) -> OffloadKey | None:
        """The key CPU slot ``slot_id`` was last prepared for (a load or a store), or None."""
        return self._slot_keys.get(slot_id) if self._slot_keys is not None else None

    def _remember_slots(self, keys: Iterable[OffloadKey]) -> None:
        if self._slot_keys is None:
            return
        for key in keys:
            slot_id = self._primary.slot_id(key)
            if slot_id is not None:
                self._slot_keys[slot_id] = key

    def _ctx(self, req_context: Any) -> KvfsmContext:
        state = req_context.get_state(_KvfsmRequest)
        if isinstance(state, _KvfsmRequest) and state.owner is self:
            return state.ctx
        self._contexts += 1
        # A fresh id per vLLM context: two contexts never share kvfsm's per-request state.
        ctx = KvfsmContext(f"{req_context.req_id}#{self._contexts}")
        req_context.set_state(_KvfsmRequest(self, ctx))
        self._primary.on_new_request(ctx, key_position=req_context.get_offload_key_position)
        if self._manager is not self._primary:
            self._manager.on_new_request(ctx)
        return ctx

    # -- vLLM's OffloadingManager --

    @override
    def on_new_request(self, req_context: Any) -> Any:
        self._ctx(req_context)
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: Any) -> Any:
        return _LOOKUP[self._manager.lookup(key, self._ctx(req_context))]

    @override
    def get_load_source(self, key: OffloadKey, req_context: Any) -> Any:
        return CacheHitSource.HOST

    @override
    def prepare_load(self, keys: Collection[OffloadKey], req_context: Any) -> Any:
        spec = self._manager.prepare_load(list(keys), self._ctx(req_context))
        self._remember_slots(keys)
        return CPULoadStoreSpec(list(spec.slot_ids))

    def _prepare_load(self, keys: Collection[OffloadKey], req_context: Any, *, record_access: bool) -> Any:
        """vLLM's tiering primary calls this; a cascade's read (``record_access=False``) is no access."""
        if record_access:
            return self.prepare_load(keys, req_context)
        return CPULoadStoreSpec(list(self._primary.prepare_read(list(keys)).slot_ids))

    @override
    def touch(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        """vLLM 0.32 and 0.33 only (removed below where vLLM's interface has no ``touch``)."""
        self._manager.touch(list(keys), self._ctx(req_context))

    @override
    def complete_load(self, keys: Collection[OffloadKey], req_context: Any) -> None:
        self._manager.complete_load(list(keys), self._ctx(req_context))

    @override
    def prepare_store(self, keys: Collection[OffloadKey], req_context: Any) -> Any:
        out = self._manager.prepare_store(list(keys), self._ctx(req_context))
        if out is None:
            return None
        self._remember_slots(out.keys_to_store)
        return PrepareStoreOutput(
            keys_to_store=list(out.keys_to_store),
            store_spec=CPULoadStoreSpec(list(out.store_spec.slot_ids)),
            evicted_keys=list(out.evicted_keys),
        )

    @override
    def complete_store(self, keys: Collection[OffloadKey], req_context: Any, success: bool = True) -> None:
        self._manager.complete_store(list(keys), self._ctx(req_context), success)
        if success and self._events_carry_context:
            self._stored_by.update(dict.fromkeys(keys, req_context))

    @override
    def on_request_finished(self, req_context: Any) -> None:
        state = req_context.get_state(_KvfsmRequest)
        if isinstance(state, _KvfsmRequest) and state.owner is self:
            self._manager.on_request_finished(state.ctx)

    @override
    def take_events(self) -> Iterator[Any]:
        with_metadata_only = event_has_metadata_only()
        stored_by, self._stored_by = self._stored_by, {}
        for event in self._manager.take_events():
            medium = Medium.CPU if event.medium == "CPU" else Medium.STORAGE
            if self._events_carry_context and not event.removed and medium is Medium.CPU:
                # vLLM 0.34's CPU manager marks its stored events as ones whose removal will be announced
                # (kvfsm announces every eviction too) and names the request that stored them.
                yield OffloadingEvent(
                    keys=list(event.keys),
                    medium=medium,
                    removed=False,
                    removal_expected=True,
                    req_context=stored_by.get(event.keys[0]) if event.keys else None,
                )
            elif with_metadata_only:
                yield OffloadingEvent(
                    keys=list(event.keys), medium=medium, removed=event.removed, metadata_only=event.metadata_only
                )
            elif not event.metadata_only:
                # vLLM 0.32 has no metadata-only removal: it announces nothing for a failed store, whose keys
                # no stored event ever published, so kvfsm drops that removal as 0.32's own manager would.
                yield OffloadingEvent(keys=list(event.keys), medium=medium, removed=event.removed)

    @override
    def on_schedule_end(self, context: Any) -> None:
        self._manager.on_schedule_end()

    @override
    def has_pending_work(self) -> bool:
        return self._manager.has_pending_work()

    @override
    def reset_cache(self) -> None:
        self._manager.reset_cache()
        if not connector_reports_reset_flushed():
            # vLLM before 0.34 never says when the jobs its reset flushed have reported, so kvfsm's reset hold
            # cannot be kept here and is released at once: a promotion may race a discarded store's late copy
            # (spec/README.md, "The reset hold"). vLLM 0.34 calls on_reset_flushed below.
            self._manager.on_reset_flushed()

    def on_reset_flushed(self) -> None:
        """vLLM 0.34: every job the connector's cache reset flushed has been reported."""
        self._manager.on_reset_flushed()

    @override
    def config_info(self) -> Sequence[Any]:
        return [self._config_info]

    @override
    def get_stats(self) -> Any:
        stats = OffloadingConnectorStats()
        primary = self._primary
        # O(1) per step: the slot counts, not ``stats()`` (which also sums the live requests' lookups).
        slots, writing, reading = primary.num_slots, primary.num_writing, primary.num_reading
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, (writing + reading) / slots if slots else 0.0)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, writing / slots if slots else 0.0)
        stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, reading / slots if slots else 0.0)
        reported = self._sizes_reported
        for size, count in self._primary.allocation_sizes().items():
            for _ in range(count - reported.get(size, 0)):
                stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
            reported[size] = count
        if self._primary.store_threshold >= 2:
            skipped = primary.stores_skipped
            stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, skipped - self._skipped_reported)
            self._skipped_reported = skipped
        return stats

    @override
    def shutdown(self) -> None:
        self._manager.shutdown()


if not manager_has_touch():
    # vLLM 0.34 dropped touch() from the interface: the adapter offers no method vLLM does not define.
    del KvfsmOffloadingManager.touch


@dataclass(frozen=True, slots=True)
class ChunkView:
    """One held chunk as vLLM's ``ChunkStatus`` shows it (read-only: assigning ``ref_cnt`` raises)."""

    chunk_id: int
    ref_cnt: int

    @property
    def is_ready(self) -> bool:
        return self.ref_cnt >= 0


class _ReadOnly:
    """vLLM's policy methods that change state: a view refuses them (kvfsm's state changes only through
    the manager's operations, each a spec'd slot transition)."""

    def _refuse(self, *args: object, **kwargs: object) -> Any:
        raise TypeError("a read-only view of kvfsm's policy; change it through the manager")

    insert = remove = touch = evict = clear = mark_evictable = mark_non_evictable = _refuse
    on_store_miss = on_request_access = on_request_finished = _refuse


def _chunks(primary: CPUOffloadingManager, keys: Iterable[OffloadKey]) -> OrderedDict[OffloadKey, ChunkView]:
    out: OrderedDict[OffloadKey, ChunkView] = OrderedDict()
    for key in keys:
        slot_id, ref = primary.slot_id(key), primary.ref_cnt(key)
        if slot_id is not None and ref is not None:
            out[key] = ChunkView(slot_id, ref)
    return out


class ARCPolicyView(_ReadOnly, ARCCachePolicy):
    """kvfsm's ARC state in the shape of vLLM's ``ARCCachePolicy``: T1, T2 (key -> chunk, oldest first),
    the ghost lists and the target, each a snapshot taken when read."""

    def __init__(self, primary: CPUOffloadingManager, policy: RequestARCPolicy) -> None:
        self._primary = primary
        self._arc = policy
        self.cache_capacity = policy.capacity

    @property
    def t1(self) -> OrderedDict[OffloadKey, ChunkView]:
        return _chunks(self._primary, self._arc.t1_keys())

    @property
    def t2(self) -> OrderedDict[OffloadKey, ChunkView]:
        return _chunks(self._primary, self._arc.t2_keys())

    @property
    def b1(self) -> OrderedDict[OffloadKey, None]:
        return OrderedDict.fromkeys(self._arc.b1_keys())

    @property
    def b2(self) -> OrderedDict[OffloadKey, None]:
        return OrderedDict.fromkeys(self._arc.b2_keys())

    @property
    def target_t1_size(self) -> float:
        return self._arc.target_t1_size

    @override
    def get(self, key: OffloadKey) -> ChunkView | None:
        return _chunks(self._primary, [key]).get(key)


class LRUPolicyView(_ReadOnly, LRUCachePolicy):
    """kvfsm's LRU state in the shape of vLLM's ``LRUCachePolicy``: ``chunks`` (key -> chunk, least
    recent first), a snapshot taken when read."""

    def __init__(self, primary: CPUOffloadingManager, policy: CachePolicy) -> None:
        self._primary = primary
        self._lru = policy
        self.cache_capacity = primary.num_slots

    @property
    def chunks(self) -> OrderedDict[OffloadKey, ChunkView]:
        return _chunks(self._primary, self._lru.keys())

    @override
    def get(self, key: OffloadKey) -> ChunkView | None:
        return _chunks(self._primary, [key]).get(key)


class KvfsmCPUOffloadingManager(KvfsmOffloadingManager):
    """kvfsm's CPU manager with vLLM's ``CPUOffloadingManager`` constructor (a drop-in for it)."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
        *,
        checked: bool = False,
    ) -> None:
        if cache_policy_module_path is not None:
            raise ConfigKeyError("cache_policy_module_path", "kvfsm's manager uses kvfsm's own policies; expected None")
        manager = CPUOffloadingManager(
            num_chunks,
            vllm_policy_name(cache_policy),
            enable_events=enable_events,
            store_threshold=store_threshold,
            max_tracker_size=max_tracker_size,
            checked=checked,
        )
        super().__init__(manager, info)

    def keys_by_recency(self) -> Iterable[OffloadKey]:
        """Held keys, least recent first (a read-only view of kvfsm's policy)."""
        return self._primary.policy.keys()

    @property
    def counts(self) -> Mapping[OffloadKey, int] | None:
        """The store filter's offer counts (vLLM's ``counts``), read-only."""
        return self._primary.offer_counts()

    @property
    def stores_skipped_in_current_batch(self) -> int:
        """Offers the store filter turned away since the last ``get_stats``."""
        return self._primary.stores_skipped - self._skipped_reported

    @property
    def _num_evictable_cache_chunks(self) -> int:
        """Ready chunks nobody reads (vLLM's evictable count)."""
        return self._primary.num_evictable

    @property
    def _policy(self) -> ARCPolicyView | LRUPolicyView:
        """kvfsm's policy state where vLLM's tests look for vLLM's (``manager._policy``), read-only."""
        policy = self._primary.policy
        if isinstance(policy, RequestARCPolicy):
            return ARCPolicyView(self._primary, policy)
        return LRUPolicyView(self._primary, policy)
