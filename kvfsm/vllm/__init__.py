"""kvfsm inside vLLM 0.33 (the optional ``kvfsm[vllm]`` extra): ``spec_module_path="kvfsm.vllm"`` (the offloading
spec route) or ``kv_connector_module_path="kvfsm.vllm"`` (the KvfsmConnector route).

Names load on first use, so ``import kvfsm.vllm`` itself needs no vLLM and each route imports only its
own module. The README's "Use with vLLM" section has the ``kv_transfer_config`` of each route.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Exported name -> the kvfsm.vllm module that defines it.
_EXPORTS: dict[str, str] = {
    "KvfsmOffloadingSpec": "kvfsm.vllm.spec",
    "KvfsmOffloadingWorker": "kvfsm.vllm.spec",
    "KvfsmCPUOffloadingManager": "kvfsm.vllm.manager",
    "KvfsmOffloadingManager": "kvfsm.vllm.manager",
    "KvfsmConnector": "kvfsm.vllm.connector",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvfsm.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
