"""vLLM 0.33's own CPU manager and request context, for side-by-side measurements (``kvfsm bench``).

The benchmark layer may not import vLLM itself (tests/test_layers.py); it builds vLLM's side here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm.v1.kv_offload.base import ReqContext
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvfsm.control.types import OffloadKey

__all__ = ["native_cpu_manager", "vllm_request_context"]


def native_cpu_manager(num_chunks: int, policy: str) -> Any:
    """vLLM's ``CPUOffloadingManager`` (events off, no store filter), as vLLM's CPU spec builds it."""
    return CPUOffloadingManager(num_chunks=num_chunks, cache_policy=policy, enable_events=False)


def vllm_request_context(req_id: str, positions: Mapping[OffloadKey, int]) -> Any:
    """A vLLM ``ReqContext`` carrying each key's end-token position, as vLLM's scheduler records them."""
    ctx = ReqContext(req_id=req_id)
    for key, position in positions.items():
        ctx.set_offload_key_position(key, position)
    return ctx
