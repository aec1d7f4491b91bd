"""KvfsmConnector with real CUDA KV caches and kvfsm's CUDA copy backend (skipped without CUDA or vLLM).

The same rig as tests/vllm/test_connector.py, its KV caches on the GPU and no gate: copies run on the CUDA
backend's own streams, and the bytes are checked in GPU memory before every forward.
scripts/gpu_check.sh runs this file (and the CPU suite with ``KVFSM_VLLM_DEVICE=cuda``) on a GPU machine.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

# The real vLLM (tests/vllm itself is a namespace package named vllm when tests/ is on sys.path).
pytest.importorskip("vllm.v1.core.sched.scheduler")
torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from connector_support import Rig, opt_config_dir  # noqa: E402

from kvfsm.data.cuda import CudaCopyBackend  # noqa: E402

PROMPT = list(range(1, 134))  # 133 tokens: 8 full blocks


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    r = Rig(opt_config_dir(tmp_path), device="cuda", gated=False, num_gpu_blocks=32)
    yield r
    r.shutdown()


def _run(rig: Rig, req_id: str, prompt: list[int]) -> None:
    rig.add(prompt, max_tokens=3, req_id=req_id)
    for _ in range(200):
        if not rig.has_work():
            return
        rig.step()
        rig.wait_copies()  # the copies finish; their reports come with the next step
    raise AssertionError("the engine did not go idle")


def test_cuda_backend_is_used_and_a_stored_prefix_loads_back_byte_exact(rig: Rig) -> None:
    worker = rig.workers[0].worker
    assert worker is not None and isinstance(worker.worker.backend, CudaCopyBackend)
    _run(rig, "a", PROMPT)
    sched = rig.connector.scheduler
    assert sched is not None and sched.stats.committed_stores >= 1
    assert rig.scheduler.reset_prefix_cache()
    _run(rig, "b", [*PROMPT, 5])
    assert sched.stats.committed_loads == 1
    assert not rig.mismatches, rig.mismatches[:3]


def test_cuda_fenced_blocks_are_reused_only_after_their_store(rig: Rig) -> None:
    """32 GPU blocks: the second prompt reuses the first one's freed blocks while its stores may still run."""
    rig.add(PROMPT, max_tokens=2, req_id="a")
    while "a" in rig.scheduler.requests:
        rig.step()  # no wait: a's stores are in flight on the GPU when its blocks are freed
    _run(rig, "b", list(range(3000, 3300)))
    assert rig.scheduler.reset_prefix_cache()
    _run(rig, "c", [*PROMPT, 9])
    sched = rig.connector.scheduler
    assert sched is not None and sched.stats.committed_loads >= 1
    assert not rig.mismatches, rig.mismatches[:3]
