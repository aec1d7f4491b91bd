"""Secondary tiers for the ``KvfsmConnector`` route: their ``kv_connector_extra_config`` keys, the tiers those
build, and the per-engine registry that binds each tier's ``slot_io`` to the workers' slot pools.

A tier moves slot bytes in vLLM's scheduler process, while the CPU slot pools live in the workers; with
vLLM's uniproc executor (``distributed_executor_backend="uni"``) they are one process. The scheduler-role
connector registers its tiers under its engine id, and each worker-role connector of that engine adds its
rank's pool at ``register_kv_caches`` (in vLLM's engine core the workers register their KV caches before
the scheduler is built, in kvfsm's test rig after it: either order binds). Once the tiers and every rank's
pool are in, each tier's ``slot_io`` is bound: one rank's pool, or all W ranks' as a
:class:`~kvfsm.tiers.slotio.CompositeSlotIO` (rank 0 first) when W workers share the process. A worker
whose process has no scheduler with its tiers by its first step raises one
:class:`~kvfsm.errors.ConfigError` (:meth:`WorkerTierBinding.check`).

Pure: no torch and no vLLM (the Redis tier's redis-py is imported only when a Redis tier is built).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from kvfsm.control.deadlines import Deadlines
from kvfsm.errors import ConfigError
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.slotio import CompositeSlotIO, SizedSlotIO

if TYPE_CHECKING:
    from kvfsm.control.manager import SecondaryTier
    from kvfsm.tiers.redis_codec import Namespace

__all__ = [
    "TIER_KEYS",
    "TIER_NAMES",
    "EngineTiers",
    "TierSettings",
    "WorkerTierBinding",
    "bind_worker_pool",
    "build_tiers",
    "engine_tiers",
    "namespace_of",
    "parse_tier_settings",
    "register_tiers",
]

#: The tiers the connector can put below its CPU tier, in the order they are searched on a CPU miss.
TIER_NAMES: Final[tuple[str, ...]] = ("fs", "redis")

#: Every tier key, with its meaning (the connector's module docstring lists the same).
TIER_KEYS: Final[dict[str, str]] = {
    "tiers": "a list of 'fs' / 'redis' (or one name): secondary tiers below the CPU tier, searched in order",
    "fs_path": "directory of the fs tier's block files (required with 'fs')",
    "fs_durable": "bool (default false): fsync each block and its directory; the drain waits for the syncs",
    "fs_capacity_bytes": "int >= 1 or null (default null: unbounded): bytes the fs tier may hold",
    "redis_url": "redis://host:port[/db] (or rediss://, unix://) of the Redis/Valkey server (required with 'redis')",
    "redis_prefix": "start of every Redis key (default 'kvfsm'); no braces or spaces",
    "redis_cluster": "bool (default false): the URL is one node of a Redis Cluster",
    "redis_ttl_s": "int >= 1 or null (default null: the server's maxmemory policy): expiry of every value",
}

_FS_KEYS: Final[tuple[str, ...]] = ("fs_path", "fs_durable", "fs_capacity_bytes")
_REDIS_KEYS: Final[tuple[str, ...]] = ("redis_url", "redis_prefix", "redis_cluster", "redis_ttl_s")
_URL_SCHEMES: Final[tuple[str, ...]] = ("redis://", "rediss://", "unix://")


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The tier keys, validated (see :data:`TIER_KEYS`)."""

    tiers: tuple[str, ...] = ()
    fs_path: str | None = None
    fs_durable: bool = False
    fs_capacity_bytes: int | None = None
    redis_url: str | None = None
    redis_prefix: str = "kvfsm"
    redis_cluster: bool = False
    redis_ttl_s: int | None = None


def _bad(key: str, value: object, expected: str) -> ConfigError:
    return ConfigError(f"kv_connector_extra_config[{key!r}] = {value!r}; expected {expected}")


def _bool(extra: Mapping[str, Any], key: str) -> bool:
    value = extra.get(key, False)
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false")
    return value


def _count_or_none(extra: Mapping[str, Any], key: str) -> int | None:
    value = extra.get(key)
    if value is not None and (type(value) is not int or value < 1):
        raise _bad(key, value, "an int >= 1 or null")
    return value


def _tier_list(value: object) -> tuple[str, ...]:
    expected = f"a list of {', '.join(repr(n) for n in TIER_NAMES)} (or one of them)"
    if isinstance(value, str):
        names: list[object] = [value]
    elif isinstance(value, list | tuple):
        names = list(value)
    else:
        raise _bad("tiers", value, expected)
    if not all(isinstance(n, str) and n in TIER_NAMES for n in names):
        raise _bad("tiers", value, expected)
    out = tuple(str(n) for n in names)
    if len(set(out)) != len(out):
        raise _bad("tiers", value, "each tier at most once")
    return out


def parse_tier_settings(extra: Mapping[str, Any]) -> TierSettings:
    """Validate the tier keys of ``kv_connector_extra_config`` (other keys are the caller's); a bad key, or a
    tier's key without its tier, raises :class:`ConfigError` naming it."""
    tiers = _tier_list(extra.get("tiers", []))
    for name, keys in (("fs", _FS_KEYS), ("redis", _REDIS_KEYS)):
        if name not in tiers:
            for key in keys:
                if key in extra:
                    raise ConfigError(
                        f"kv_connector_extra_config[{key!r}] is set but 'tiers' = {list(tiers)} has no {name!r}; "
                        f"expected {name!r} in 'tiers' (or the key left out)"
                    )
    fs_path = extra.get("fs_path")
    if "fs" in tiers and (not isinstance(fs_path, str) or not fs_path):
        raise _bad("fs_path", fs_path, "the directory of the fs tier's block files (a non-empty path)")
    redis_url = extra.get("redis_url")
    if "redis" in tiers and (not isinstance(redis_url, str) or not redis_url.startswith(_URL_SCHEMES)):
        raise _bad("redis_url", redis_url, "a URL redis://host:port[/db] (or rediss://, unix://)")
    prefix = extra.get("redis_prefix", "kvfsm")
    if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{} \r\n\t"):
        raise _bad("redis_prefix", prefix, "a non-empty string without braces or spaces")
    return TierSettings(
        tiers=tiers,
        fs_path=fs_path if "fs" in tiers else None,
        fs_durable=_bool(extra, "fs_durable"),
        fs_capacity_bytes=_count_or_none(extra, "fs_capacity_bytes"),
        redis_url=redis_url if "redis" in tiers else None,
        redis_prefix=prefix,
        redis_cluster=_bool(extra, "redis_cluster"),
        redis_ttl_s=_count_or_none(extra, "redis_ttl_s"),
    )


def namespace_of(
    model: str, kv_cache_config: Any, tokens_per_block: int, blocks_per_chunk: int, world_size: int, prefix: str
) -> Namespace:
    """The Redis namespace of an engine: its model, the first KV-cache group's geometry and dtype (as vLLM's
    ``KVCacheConfig`` gives them to the scheduler), ``blocks_per_chunk``, the world size and the key prefix.
    Engines configured alike share chunks; any difference keeps their values apart."""
    from kvfsm.tiers.redis_codec import Namespace

    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or ())
    if not groups:
        raise ConfigError("vLLM's KV cache config has no KV-cache group; the Redis tier needs the KV geometry")
    spec = groups[0].kv_cache_spec
    return Namespace(
        model=str(model) or "unknown",
        num_layers=len(groups[0].layer_names),
        num_heads=int(getattr(spec, "num_kv_heads", 1)),
        head_dim=int(getattr(spec, "head_size", 1)),
        tokens_per_block=tokens_per_block,
        blocks_per_chunk=blocks_per_chunk,
        dtype=str(getattr(spec, "dtype", "unknown")).removeprefix("torch."),
        world_size=world_size,
        prefix=prefix,
    )


def build_tiers(
    settings: TierSettings, deadlines: Deadlines, namespace: Namespace | None = None
) -> list[SecondaryTier]:
    """The configured tiers, in search order, with no ``slot_io`` yet (:func:`register_tiers` binds it).
    The Redis tier needs ``namespace`` (:func:`namespace_of`)."""
    tiers: list[SecondaryTier] = []
    for name in settings.tiers:
        if name == "fs":
            assert settings.fs_path is not None  # parse_tier_settings requires it with 'fs'
            tiers.append(
                FileSystemTier(settings.fs_path, capacity_bytes=settings.fs_capacity_bytes, durable=settings.fs_durable)
            )
        else:
            try:
                from kvfsm.tiers.redis import RedisTier
            except ImportError as exc:
                raise ConfigError(
                    f"kv_connector_extra_config['tiers'] has 'redis' but redis-py is not installed ({exc}); "
                    "expected pip install 'kvfsm[redis]'"
                ) from exc
            if namespace is None:
                raise ConfigError("the Redis tier needs its namespace (the engine's model and KV geometry)")
            assert settings.redis_url is not None  # parse_tier_settings requires it with 'redis'
            tiers.append(
                RedisTier(
                    settings.redis_url,
                    namespace,
                    cluster=settings.redis_cluster,
                    deadlines=deadlines,
                    ttl_s=settings.redis_ttl_s,
                )
            )
    return tiers


# ---------------------------------------------------------------------------------------------- the registry


@dataclass(eq=False)
class EngineTiers:
    """One engine's tiers and its workers' pools, in this process; binds the tiers once both are in."""

    engine_id: str
    world_size: int
    tiers: tuple[Any, ...] = ()
    pools: dict[int, SizedSlotIO] = field(default_factory=dict)
    bound: bool = False

    def _maybe_bind(self) -> None:
        if self.bound or not self.tiers or len(self.pools) < self.world_size:
            return
        pools = [self.pools[rank] for rank in range(self.world_size)]
        io: SizedSlotIO = pools[0] if len(pools) == 1 else CompositeSlotIO(pools)
        for tier in self.tiers:
            tier.slot_io = io
        self.bound = True


# Held weakly: each connector of the engine (scheduler and workers) holds its entry, so an engine that is
# gone leaves nothing behind.
_ENGINES: weakref.WeakValueDictionary[str, EngineTiers] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def _entry(engine_id: str, world_size: int) -> EngineTiers:
    entry = _ENGINES.get(engine_id)
    if entry is None:
        entry = _ENGINES[engine_id] = EngineTiers(engine_id, world_size)
    elif entry.world_size != world_size:
        raise ConfigError(
            f"engine {engine_id!r} registers tiers for {world_size} worker(s) and {entry.world_size}; expected one "
            "world size per engine id"
        )
    return entry


def engine_tiers(engine_id: str) -> EngineTiers | None:
    """The registry entry of ``engine_id`` in this process (its tiers and workers' pools), if any."""
    with _LOCK:
        return _ENGINES.get(engine_id)


def register_tiers(engine_id: str, tiers: Sequence[Any], world_size: int) -> EngineTiers:
    """The scheduler-role connector's tiers for ``engine_id`` (the caller keeps the entry alive)."""
    with _LOCK:
        entry = _entry(engine_id, world_size)
        if entry.tiers:
            raise ConfigError(
                f"engine {engine_id!r} already has a KvfsmConnector scheduler with tiers in this process; expected "
                "one scheduler per engine id"
            )
        entry.tiers = tuple(tiers)
        entry._maybe_bind()
        return entry


@dataclass(eq=False)
class WorkerTierBinding:
    """A worker's pool in its engine's registry entry; :meth:`check` raises if no tier was ever bound."""

    entry: EngineTiers
    rank: int
    tiers: tuple[str, ...]

    def check(self) -> None:
        """Raise :class:`ConfigError` unless this engine's tiers are bound to the workers' pools (call it
        at the worker's first step: by then a scheduler in this process has registered its tiers)."""
        if self.entry.bound:
            return
        if self.entry.tiers:
            missing = sorted(set(range(self.entry.world_size)) - set(self.entry.pools))
            raise ConfigError(
                f"kv_connector_extra_config['tiers'] = {list(self.tiers)}: the tiers of engine "
                f"{self.entry.engine_id!r} have the pools of ranks {sorted(self.entry.pools)} but not of {missing}; "
                "expected every worker in the scheduler's process (vLLM's uniproc executor)"
            )
        raise ConfigError(
            f"kv_connector_extra_config['tiers'] = {list(self.tiers)}: worker rank {self.rank} found no tier of "
            f"engine {self.entry.engine_id!r} in its process. kvfsm's tiers move slot bytes in vLLM's scheduler "
            "process and need the workers' pools there; expected vLLM's uniproc executor "
            "(distributed_executor_backend='uni'), or no 'tiers' with another executor"
        )


def bind_worker_pool(
    engine_id: str, rank: int, world_size: int, pool: SizedSlotIO, tiers: Sequence[str]
) -> WorkerTierBinding:
    """Add worker ``rank``'s pool to its engine's entry (binding the tiers if they are all in)."""
    with _LOCK:
        entry = _entry(engine_id, world_size)
        if rank in entry.pools and entry.pools[rank] is not pool:
            raise ConfigError(f"engine {engine_id!r} already has a pool for rank {rank}; expected one worker per rank")
        entry.pools[rank] = pool
        entry._maybe_bind()
        return WorkerTierBinding(entry, rank, tuple(tiers))
