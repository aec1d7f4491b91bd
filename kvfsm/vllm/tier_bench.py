"""kvfsm's Redis tier inside vLLM's own tiering manager: throughput against ``redis-benchmark`` on the same server.

:func:`bench_vllm_redis_tier` builds vLLM's ``TieringOffloadingManager`` with vLLM's spec factory and one
``KvfsmRedisTier`` (:mod:`kvfsm.vllm.tiers`) from a ``secondary_tiers`` entry, then plays vLLM's scheduler:

- **store**: ``chunks`` chunks of ``chunk_bytes`` random bytes are written into vLLM's primary memory and
  their stores completed, ``per_step`` chunks a scheduler step, which cascades them to the server; timed until
  vLLM's manager has no pending work (every write acknowledged by the server and reported to vLLM);
- **promote**: vLLM's primary is reset and zeroed, every chunk is looked up (vLLM promotes each secondary hit
  into the primary); timed until every lookup answers HIT and the manager is idle. Every promoted chunk is
  then compared byte for byte with what was stored (``wrong_chunks`` must be 0: a throughput of wrong bytes
  is no throughput).

On the same server, in the same run, ``redis-benchmark -t set,get -d <chunk_bytes> -n <benchmark_requests>``
gives the server's own ceiling for that value size, unpipelined (``-P 1``: one request per round trip) and
pipelined 16 deep (``-P 16``; the tier pipelines its batches). MB/s are 10^6 bytes of payload per second.

Only this module's functions import vLLM (lazily): ``import kvfsm.vllm.tier_bench`` needs neither vLLM nor
redis-py. Runs where vLLM 0.32-0.34 with its tiering spec, redis-py and ``redis-server`` are installed (on a
CPU-only machine with ``CUDA_VISIBLE_DEVICES="" VLLM_TARGET_DEVICE=cpu``). Also
``python -m kvfsm.bench.vllm_tiers [--url redis://...] [--chunks N] [--chunk-bytes B]`` (JSON out), which
starts a local server when no URL is given.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from kvfsm.errors import ConfigError
from kvfsm.validation import is_int

__all__ = ["VllmRedisTierThroughput", "bench_vllm_redis_tier", "format_vllm_redis_tier", "redis_benchmark_mb_s"]

GUARD_S = 120.0  #: deadlock guard of every wait (never a timing assertion)


@dataclass(frozen=True, slots=True)
class VllmRedisTierThroughput:
    """One run of :func:`bench_vllm_redis_tier`."""

    chunks: int
    chunk_bytes: int
    per_step: int
    store_s: float
    promote_s: float
    store_mb_s: float
    promote_mb_s: float
    #: chunks promoted back and compared with what was stored, and how many of those differed (must be 0)
    chunks_verified: int
    wrong_chunks: int
    #: redis-benchmark on the same server: MB/s of SET and GET (``-P 1``), and ``SET_P16`` / ``GET_P16``
    redis_benchmark_mb_s: dict[str, float] = field(default_factory=dict)
    vllm_version: str = ""

    @property
    def store_vs_redis_benchmark(self) -> float | None:
        """Store MB/s over redis-benchmark's unpipelined SET MB/s (None without redis-benchmark)."""
        ref = self.redis_benchmark_mb_s.get("SET")
        return self.store_mb_s / ref if ref else None

    @property
    def promote_vs_redis_benchmark(self) -> float | None:
        """Promote MB/s over redis-benchmark's unpipelined GET MB/s (None without redis-benchmark)."""
        ref = self.redis_benchmark_mb_s.get("GET")
        return self.promote_mb_s / ref if ref else None


def redis_benchmark_mb_s(url: str, value_bytes: int, requests: int, *, pipeline: int = 1) -> dict[str, float]:
    """``redis-benchmark -t set,get -d value_bytes -n requests -P pipeline`` on ``url``'s server: MB/s of each
    command (requests/s x value bytes); empty where redis-benchmark is not installed."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {}
    host_port = url.split("://", 1)[-1].split("/", 1)[0]
    host, _, port = host_port.rpartition(":")
    cmd = [binary, "-h", host or "127.0.0.1", "-p", port, "-t", "set,get", "-d", str(value_bytes)]
    cmd += ["-n", str(requests), "-P", str(pipeline), "--csv"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=GUARD_S, check=False)
    mb_s: dict[str, float] = {}
    for line in out.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            with contextlib.suppress(ValueError):
                mb_s[cells[0]] = float(cells[1]) * value_bytes / 1e6
    return mb_s


def _offloading_config(url: str, chunks: int, chunk_bytes: int) -> Any:
    """vLLM's normalized offloading config: one worker, one block per chunk of ``chunk_bytes``, a primary of
    ``chunks`` chunks, and the Redis tier as its one secondary tier."""
    from kvfsm.vllm.drive import single_worker_offloading_config

    tier = {
        "type": "KvfsmRedisTier",
        "module_path": "kvfsm.vllm.tiers",
        "redis_url": url,
        "redis_prefix": f"kvfsm-bench-vllm-{uuid.uuid4().hex[:12]}",
    }
    return single_worker_offloading_config(
        {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * chunk_bytes, "secondary_tiers": [tier]},
        bytes_per_block=chunk_bytes,
        layer_names=("l0",),
        engine_id=f"kvfsm-bench-{uuid.uuid4().hex[:12]}",
        model_name="kvfsm-bench",
    )


def bench_vllm_redis_tier(
    url: str,
    *,
    chunks: int = 256,
    chunk_bytes: int = 64 * 1024,
    per_step: int = 32,
    benchmark_requests: int = 2000,
) -> VllmRedisTierThroughput:
    """Store and promote throughput of ``KvfsmRedisTier`` through vLLM's manager, and redis-benchmark's on the
    same server (see the module docs). ``url``: a running server (``kvfsm.bench.vllm_tiers`` starts a local
    one)."""
    for name, n in (("chunks", chunks), ("chunk_bytes", chunk_bytes), ("per_step", per_step)):
        if not is_int(n) or n < 1:
            raise ConfigError(f"bench_vllm_redis_tier {name}={n!r}; expected an int >= 1")
    try:
        import vllm
        import vllm.v1.kv_offload.base as offload_base
        import vllm.v1.kv_offload.factory as offload_factory
    except ImportError as exc:
        raise ConfigError(
            f"vLLM with its tiering spec is not installed ({exc}); expected pip install 'kvfsm[vllm]'"
        ) from exc

    def step() -> None:
        manager.on_schedule_end(offload_base.ScheduleEndContext(new_req_ids=[], preempted_req_ids=[]))

    def run_until_idle(what: str) -> None:
        end = time.monotonic() + GUARD_S
        while manager.has_pending_work():
            if time.monotonic() > end:
                raise ConfigError(f"vLLM's manager did not go idle {what} within {GUARD_S} s")
            step()
            tier.wait_idle(GUARD_S)

    with contextlib.nullcontext(url) as server_url:
        spec = offload_factory.OffloadingSpecFactory.create_spec(_offloading_config(server_url, chunks, chunk_bytes))
        manager = spec.get_manager()
        (adapter,) = manager.secondary_tiers
        tier = adapter.tier
        try:
            view = manager.primary_tier.get_kv_memoryview().cast("B")
            keys = [offload_base.make_offload_key(b"kvfsm-bench" + i.to_bytes(8, "big"), 0) for i in range(chunks)]
            data = {k: os.urandom(chunk_bytes) for k in keys}
            ctx = offload_base.ReqContext(req_id="bench-writer")
            manager.on_new_request(ctx)
            t0 = time.perf_counter()
            for start in range(0, chunks, per_step):
                batch = keys[start : start + per_step]
                out = manager.prepare_store(batch, ctx)
                if out is None:
                    raise ConfigError("vLLM's primary had no room for a store batch")
                for k, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids.tolist(), strict=True):
                    view[int(chunk) * chunk_bytes : (int(chunk) + 1) * chunk_bytes] = data[k]
                manager.complete_store(list(out.keys_to_store), ctx)
                step()
            run_until_idle("after the stores")
            store_s = time.perf_counter() - t0
            manager.on_request_finished(ctx)
            manager.reset_cache()
            if hasattr(manager, "on_reset_flushed"):
                manager.on_reset_flushed()
            view[:] = bytes(len(view))
            reader = offload_base.ReqContext(req_id="bench-reader")
            manager.on_new_request(reader)
            t0 = time.perf_counter()
            end = time.monotonic() + GUARD_S
            pending = list(keys)
            while pending:
                answers = {k: manager.lookup(k, reader) for k in pending}
                missed = [k for k, a in answers.items() if a is offload_base.LookupResult.MISS]
                if missed:
                    raise ConfigError(f"{len(missed)} of {chunks} stored chunks answered MISS after the reset")
                pending = [k for k, a in answers.items() if a is not offload_base.LookupResult.HIT]
                if time.monotonic() > end:
                    raise ConfigError(f"{len(pending)} promotions did not finish within {GUARD_S} s")
                if pending:
                    step()
                    tier.wait_idle(GUARD_S)
            run_until_idle("after the promotions")
            promote_s = time.perf_counter() - t0
            load = manager.prepare_load(keys, reader)
            wrong = sum(
                1
                for k, chunk in zip(keys, load.chunk_ids.tolist(), strict=True)
                if bytes(view[int(chunk) * chunk_bytes : (int(chunk) + 1) * chunk_bytes]) != data[k]
            )
            manager.complete_load(keys, reader)
            manager.on_request_finished(reader)
        finally:
            manager.shutdown()
        requests = max(1, benchmark_requests)
        reference = redis_benchmark_mb_s(server_url, chunk_bytes, requests)
        reference.update(
            {f"{k}_P16": v for k, v in redis_benchmark_mb_s(server_url, chunk_bytes, requests, pipeline=16).items()}
        )
    mb = chunks * chunk_bytes / 1e6
    return VllmRedisTierThroughput(
        chunks=chunks,
        chunk_bytes=chunk_bytes,
        per_step=per_step,
        store_s=store_s,
        promote_s=promote_s,
        store_mb_s=mb / store_s,
        promote_mb_s=mb / promote_s,
        chunks_verified=chunks,
        wrong_chunks=wrong,
        redis_benchmark_mb_s=reference,
        vllm_version=str(getattr(vllm, "__version__", "")),
    )


def format_vllm_redis_tier(r: VllmRedisTierThroughput) -> str:
    """A few lines for a terminal."""
    ref = r.redis_benchmark_mb_s

    def mb(v: float | None) -> str:
        return "n/a" if v is None else f"{v:,.0f}"

    ratio_w, ratio_r = r.store_vs_redis_benchmark, r.promote_vs_redis_benchmark
    lines = [
        f"KvfsmRedisTier through vLLM {r.vllm_version}'s TieringOffloadingManager: "
        f"{r.chunks} chunks x {r.chunk_bytes // 1024} KiB, {r.per_step} per step",
        f"  store:   {mb(r.store_mb_s)} MB/s   redis-benchmark SET {mb(ref.get('SET'))} MB/s (-P 16: "
        f"{mb(ref.get('SET_P16'))})   ratio {'n/a' if ratio_w is None else f'{ratio_w:.2f}'}",
        f"  promote: {mb(r.promote_mb_s)} MB/s   redis-benchmark GET {mb(ref.get('GET'))} MB/s (-P 16: "
        f"{mb(ref.get('GET_P16'))})   ratio {'n/a' if ratio_r is None else f'{ratio_r:.2f}'}",
        f"  verified {r.chunks_verified} promoted chunks byte for byte: {r.wrong_chunks} wrong",
    ]
    return "\n".join(lines)
