"""``kvfsm bench --only e2e``: what a vLLM user sees, on a serving vLLM engine with kvfsm (where vLLM runs).

A random-weight Llama sized so that prefill costs something on CPU (8 layers, hidden 512, built here by
:func:`kvfsm.vllm.serving.build_tiny_model`), a 2,048-token prompt. For each engine (no connector, then
kvfsm's connector with its CPU tier alone, with the fs tier and with the Redis tier, and kvfsm's offloading
spec in vLLM's own connector with its CPU tier alone and with the fs tier), one engine per setup,
:func:`kvfsm.vllm.serving.measure_ttft` alternates on that engine a prompt it never saw (recompute) with the
same prompt after ``reset_prefix_cache()`` (the hit). In a secondary tier's row a filler prompt is served
between the two, so that most of the prompt's chunks have left the CPU tier and the hit promotes them back
from the tier (:data:`TIER_ROW_CPU_CHUNKS`). Medians on the CPU clock of this process
(vLLM's engine runs in it, kvfsm's copy threads too). The ratios are the figures LMCache and vLLM users
quote: time to first token of a hit against a recompute; also the decode step's cost with the connector
against without it, and the prefix bytes a hit moves per second of its time to first token.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path
from typing import Any

__all__ = ["PREFIX_TOKENS", "available", "run_e2e"]

PREFIX_TOKENS = 2048


def _bench_model() -> Any:
    from kvfsm.vllm.serving import TinyModel

    return TinyModel(layers=8, hidden=512, heads=8, kv_heads=8, intermediate=1376, vocab=512)


def available() -> str | None:
    """None where a vLLM that computes tokens is importable, else why not (only kvfsm.vllm imports vLLM)."""
    from kvfsm.vllm.serving import serving_vllm_missing

    return serving_vllm_missing()


#: kvfsm's CPU tier in the secondary-tier rows: holds one prompt's 64 chunks (a hit loads into the GPU from the
#: CPU tier, so the whole hit must fit) but not two, so the filler prompt served between the recompute and the
#: hit pushes most of the prompt's chunks out, and the hit promotes them back from the tier below.
TIER_ROW_CPU_CHUNKS = 80


def _setups(root: Path, redis_url: str | None, quick: bool) -> Iterator[tuple[str, Any, int]]:
    """(row name, engine setup, tokens of the filler prompt served between recompute and hit)."""
    from kvfsm.vllm.serving import EngineSetup

    base = EngineSetup(
        route="none", gpu_blocks=160, cpu_chunks=256, max_model_len=4096, max_num_batched_tokens=2048, checked=False
    )
    yield "no connector (recompute)", base, 0
    yield "KvfsmConnector, CPU tier", replace(base, route="connector"), 0
    if not quick:
        tiered = replace(base, cpu_chunks=TIER_ROW_CPU_CHUNKS)
        yield (
            "KvfsmConnector, fs tier",
            replace(tiered, route="connector", tier="fs", fs_path=str(root / "fs")),
            PREFIX_TOKENS,
        )
        if redis_url is not None:
            yield (
                "KvfsmConnector, Redis tier",
                replace(tiered, route="connector", tier="redis", redis_url=redis_url, redis_prefix="kvfsm-bench-e2e"),
                PREFIX_TOKENS,
            )
    yield "kvfsm spec in vLLM's OffloadingConnector, CPU tier", replace(base, route="spec"), 0
    if not quick:
        yield (
            "kvfsm spec in vLLM's OffloadingConnector, fs tier",
            replace(tiered, route="spec", tier="fs", fs_path=str(root / "fs-spec")),
            PREFIX_TOKENS,
        )


def run_e2e(*, quick: bool = False, repeats: int = 5) -> list[dict[str, Any]]:
    """One row per engine: medians of time to first token (miss, hit), their ratio, decode step, bytes/s."""
    from kvfsm.vllm.serving import build_tiny_model, measure_ttft

    model = _bench_model()
    rows: list[dict[str, Any]] = []
    root = Path(tempfile.mkdtemp(prefix="kvfsm-bench-e2e-"))
    try:
        with ExitStack() as stack:
            redis_url: str | None = None
            if not quick and shutil.which("redis-server"):
                from kvfsm.bench.redis import local_redis

                redis_url = stack.enter_context(local_redis())
            model_dir = build_tiny_model(root / "models", model)
            reference_step = None
            for name, setup, evict_tokens in _setups(root, redis_url, quick):
                r = measure_ttft(
                    model_dir,
                    setup,
                    model,
                    prefix_tokens=PREFIX_TOKENS,
                    iterations=2 if quick else repeats,
                    evict_tokens=evict_tokens,
                )
                if reference_step is None:
                    reference_step = r.decode_step_cpu_s
                rows.append(
                    {
                        "engine": name,
                        "ttft_miss_ms": r.miss_cpu * 1e3,
                        "ttft_hit_ms": r.hit_cpu * 1e3,
                        "hit_over_miss": r.hit_cpu / r.miss_cpu,
                        "ttft_hit_wall_ms": r.hit_wall * 1e3,
                        "decode_step_ms": r.decode_step_cpu_s * 1e3,
                        "decode_step_ratio": r.decode_step_cpu_s / reference_step if reference_step else float("nan"),
                        "hit_bytes_per_s": r.prefix_bytes / r.hit_wall if r.hit_wall > 0 else float("nan"),
                        "external_hit_tokens": r.external_hit_tokens,
                        "tokens_equal": r.tokens_equal,
                    }
                )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows
