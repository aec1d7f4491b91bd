"""kvfsm inside vLLM 0.33 (the optional ``kvfsm[vllm]`` extra): ``kv_connector_module_path="kvfsm.vllm"``."""

from kvfsm.vllm.connector import KvfsmConnector as KvfsmConnector
