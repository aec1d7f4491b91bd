"""The keys kvfsm's offloading spec reads from vLLM's ``kv_connector_extra_config``, and their checks.

Pure parsing: no vLLM, no torch. :func:`parse_extra_config` returns a :class:`SpecConfig` or raises
:class:`~kvfsm.errors.ConfigKeyError` naming the first bad key. vLLM's own keys (``spec_name``,
``offload_prompt_only``, ...) belong to vLLM's connector and pass through unchecked; every other key that
starts with ``kvfsm_`` must be one of :data:`KEYS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from kvfsm.errors import ConfigError, ConfigKeyError
from kvfsm.vllm.connector_tiers import TierSettings, parse_tier_settings

__all__ = ["KEYS", "VLLM_KEYS", "SpecConfig", "parse_extra_config"]

#: Every key kvfsm's spec reads, with its meaning (README "Use with vLLM" lists the same).
KEYS: Final[dict[str, str]] = {
    "cpu_bytes_to_use": "required, int > 0: bytes of host memory for the CPU tier (as vLLM's CPU spec)",
    "eviction_policy": "'lru' (default) or 'arc': kvfsm's request-scoped policy with vLLM 0.33's rules",
    "store_threshold": "int >= 0 (default 0): offers a new chunk needs before it is stored; 0 or 1: no filter",
    "max_tracker_size": "int >= 1 (default 64000): chunks whose offers the store filter remembers",
    "kvfsm_tier": "'none' (default), 'fs' or 'redis': a secondary tier below the CPU tier (kvfsm's tiering manager)",
    "kvfsm_fs_path": "path (required with kvfsm_tier='fs'): directory of the fs tier's block files",
    "kvfsm_fs_capacity_bytes": "int > 0 or absent (default: unbounded): bytes the fs tier may hold",
    "kvfsm_fs_durable": "bool (default false): the fs tier fsyncs each block and its directory",
    "kvfsm_redis_url": "redis://host:port[/db] (required with kvfsm_tier='redis'): the Redis/Valkey server",
    "kvfsm_redis_prefix": "string (default 'kvfsm'): start of every Redis key; engines alike with one prefix share",
    "kvfsm_redis_cluster": "bool (default false): kvfsm_redis_url is one node of a Redis Cluster",
    "kvfsm_redis_ttl_s": "int >= 1 or absent (default: the server's eviction): expiry of every Redis value",
    "kvfsm_copy_threads": "int >= 1 (default 2): copy threads of each worker's kvfsm copy backend",
    "kvfsm_checked": "bool (default false): run every spec-machine transition through transitions as well",
}

#: Keys of vLLM's own connector and spec base class, read by vLLM, passed through by kvfsm.
VLLM_KEYS: Final[frozenset[str]] = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "offload_prompt_only",
        "self_describing_kv_events",
        "block_size",
        "canonical_layout",
        "retention_interval",
    }
)

_POLICIES: Final[dict[str, str]] = {"lru": "request-lru", "arc": "request-arc"}
_TIERS: Final[tuple[str, ...]] = ("none", "fs", "redis")
#: Route 1's tier keys -> the connector route's (kvfsm.vllm.connector_tiers parses both the same way).
_TIER_KEY_NAMES: Final[dict[str, str]] = {
    "kvfsm_fs_path": "fs_path",
    "kvfsm_fs_capacity_bytes": "fs_capacity_bytes",
    "kvfsm_fs_durable": "fs_durable",
    "kvfsm_redis_url": "redis_url",
    "kvfsm_redis_prefix": "redis_prefix",
    "kvfsm_redis_cluster": "redis_cluster",
    "kvfsm_redis_ttl_s": "redis_ttl_s",
}


@dataclass(frozen=True, slots=True)
class SpecConfig:
    """The parsed keys (see :data:`KEYS`)."""

    cpu_bytes_to_use: int
    #: kvfsm's policy name (``request-lru`` or ``request-arc``).
    policy: str
    store_threshold: int = 0
    max_tracker_size: int = 64_000
    tier: str = "none"
    fs_path: str | None = None
    fs_capacity_bytes: int | None = None
    copy_threads: int = 2
    checked: bool = False
    #: The tier keys, as the connector route parses them (``tiers`` is ``()`` or the one tier).
    tier_settings: TierSettings = field(default_factory=TierSettings)


def _int(extra: Mapping[str, object], key: str, default: int | None, minimum: int) -> int | None:
    value = extra.get(key, default)
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        value = int(value)  # vLLM's CLI passes JSON, but a string of digits is a common slip
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigKeyError(key, f"got {value!r}; expected an int >= {minimum}")
    if value < minimum:
        raise ConfigKeyError(key, f"got {value}; expected an int >= {minimum}")
    return value


def _choice(extra: Mapping[str, object], key: str, default: str, choices: tuple[str, ...]) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or value.strip().lower() not in choices:
        raise ConfigKeyError(key, f"got {value!r}; expected one of {', '.join(repr(c) for c in choices)}")
    return value.strip().lower()


def parse_extra_config(extra: Mapping[str, object]) -> SpecConfig:
    """Check every key kvfsm reads; raise ConfigKeyError (naming the key) on the first bad one."""
    for key in extra:
        if not isinstance(key, str):
            raise ConfigKeyError(repr(key), "keys of kv_connector_extra_config must be strings")
        if key.startswith("kvfsm_") and key not in KEYS:
            known = ", ".join(k for k in KEYS if k.startswith("kvfsm_"))
            raise ConfigKeyError(key, f"unknown kvfsm key; expected one of {known}")
    if "cache_policy_module_path" in extra:
        raise ConfigKeyError(
            "cache_policy_module_path", "kvfsm's spec uses kvfsm's own policies; expected the key to be absent"
        )
    cpu_bytes = _int(extra, "cpu_bytes_to_use", None, 1)
    if cpu_bytes is None:
        raise ConfigKeyError("cpu_bytes_to_use", "missing; expected the bytes of host memory for the CPU tier")
    policy = _POLICIES[_choice(extra, "eviction_policy", "lru", tuple(_POLICIES))]
    threshold = _int(extra, "store_threshold", 0, 0)
    tracker = _int(extra, "max_tracker_size", 64_000, 1)
    tier = _choice(extra, "kvfsm_tier", "none", _TIERS)
    fs_path = extra.get("kvfsm_fs_path")
    if fs_path is not None and (not isinstance(fs_path, str) or not fs_path):
        raise ConfigKeyError("kvfsm_fs_path", f"got {fs_path!r}; expected a directory path")
    if tier == "fs" and fs_path is None:
        raise ConfigKeyError("kvfsm_fs_path", "missing; kvfsm_tier='fs' needs the directory of its block files")
    if tier != "fs" and fs_path is not None:
        raise ConfigKeyError("kvfsm_fs_path", f"set, but kvfsm_tier is {tier!r}; expected kvfsm_tier='fs'")
    fs_capacity = _int(extra, "kvfsm_fs_capacity_bytes", None, 1)
    tier_extra: dict[str, object] = {"tiers": [] if tier == "none" else [tier]}
    tier_extra.update({_TIER_KEY_NAMES[k]: v for k, v in extra.items() if k in _TIER_KEY_NAMES})
    try:
        tier_settings = parse_tier_settings(tier_extra)
    except ConfigError as exc:
        # The connector route's message names its own key: name route 1's instead.
        message = str(exc)
        bad = next((k for k, v in _TIER_KEY_NAMES.items() if f"[{v!r}]" in message), "kvfsm_tier")
        for route1, route2 in _TIER_KEY_NAMES.items():
            message = message.replace(f"kv_connector_extra_config[{route2!r}]", route1)
        message = message.replace(f"'tiers' = {tier_extra['tiers']!r}", f"kvfsm_tier = {tier!r}")
        raise ConfigKeyError(bad, message.replace("in 'tiers'", "as kvfsm_tier")) from None
    copy_threads = _int(extra, "kvfsm_copy_threads", 2, 1)
    checked = extra.get("kvfsm_checked", False)
    if not isinstance(checked, bool):
        raise ConfigKeyError("kvfsm_checked", f"got {checked!r}; expected true or false")
    assert threshold is not None and tracker is not None and copy_threads is not None
    return SpecConfig(
        cpu_bytes_to_use=cpu_bytes,
        policy=policy,
        store_threshold=threshold,
        max_tracker_size=tracker,
        tier=tier,
        fs_path=fs_path,
        fs_capacity_bytes=fs_capacity,
        copy_threads=copy_threads,
        checked=checked,
        tier_settings=tier_settings,
    )
