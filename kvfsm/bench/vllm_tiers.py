"""``python -m kvfsm.bench.vllm_tiers``: kvfsm's Redis tier through vLLM's own tiering manager, against
``redis-benchmark`` on the same server, in one run (the measurement is :mod:`kvfsm.vllm.tier_bench`; only
kvfsm.vllm imports vLLM). Without ``--url`` it starts a local ``redis-server`` on a free loopback port.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import asdict

__all__ = ["main"]


@contextlib.contextmanager
def _server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from kvfsm.bench.redis import local_redis

    with local_redis() as local:
        yield local


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfsm.bench.vllm_tiers", description=(__doc__ or "").split("\n")[0].strip("`")
    )
    parser.add_argument("--url", default=None, help="a running Redis server (default: start a local one)")
    parser.add_argument("--chunks", type=int, default=256)
    parser.add_argument("--chunk-bytes", type=int, default=64 * 1024)
    parser.add_argument("--per-step", type=int, default=32)
    parser.add_argument("--benchmark-requests", type=int, default=2000)
    args = parser.parse_args(argv)
    from kvfsm.vllm.tier_bench import bench_vllm_redis_tier, format_vllm_redis_tier

    with _server(args.url) as url:
        result = bench_vllm_redis_tier(
            url,
            chunks=args.chunks,
            chunk_bytes=args.chunk_bytes,
            per_step=args.per_step,
            benchmark_requests=args.benchmark_requests,
        )
    print(format_vllm_redis_tier(result), file=sys.stderr)
    ratios = {
        "store_vs_redis_benchmark": result.store_vs_redis_benchmark,
        "promote_vs_redis_benchmark": result.promote_vs_redis_benchmark,
    }
    print(json.dumps({**asdict(result), **ratios}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
