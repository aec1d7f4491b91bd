"""The Redis tier with the reference engine: wiring, cross-process sharing, and the ``redis`` bench section.

- :func:`engine_namespace` / :func:`redis_engine`: a reference engine whose secondary tier is a
  :class:`~kvfsm.tiers.redis.RedisTier` namespaced by the engine's geometry.
- :func:`run_instance` (also ``python -m kvfsm.bench.redis --url ... --role a|b``): one engine instance
  serving a shared-prefix workload, reporting as JSON what it loaded from the server and what it computed.
  :func:`run_shared` runs instance A, then instance B, in two separate processes on one server: B finds
  A's prefixes on the server (``kvfsm demo --shared``).
- :func:`bench_redis`: the ``kvfsm bench`` section: tier write/read throughput against
  ``redis-benchmark`` for the same value size, pipelined against one chunk per round trip, against the
  file-system tier, promotion latency percentiles, and the cross-instance hit rate. It starts its own
  ``redis-server`` on a loopback port in a temporary directory.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.manager import SecondaryTier
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvfsm.engine.core import EngineConfig, ReferenceEngine
from kvfsm.engine.loop import KVMemory
from kvfsm.errors import ConfigError
from kvfsm.machines.names import SlotState
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.redis import RedisTier
from kvfsm.tiers.redis_codec import Namespace
from kvfsm.tiers.slotio import DictSlotIO

__all__ = [
    "SHARED_CONFIG",
    "InstanceResult",
    "SharedResult",
    "bench_redis",
    "engine_namespace",
    "local_redis",
    "redis_engine",
    "run_instance",
    "run_shared",
]

#: The shared-prefix workload's engine: the CPU primary is smaller than the prefixes, so they live on the server.
SHARED_CONFIG = EngineConfig(
    num_layers=4,
    num_heads=4,
    head_dim=16,
    tokens_per_block=16,
    blocks_per_chunk=2,
    num_gpu_blocks=64,
    num_cpu_slots=8,
    world_size=2,
    device="cpu",
)


def engine_namespace(config: EngineConfig, model: str = "kvfsm-reference", prefix: str = "kvfsm") -> Namespace:
    """The namespace of an engine's chunks: its model name, KV geometry, dtype and world size."""
    return Namespace(
        model=model,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        head_dim=config.head_dim,
        tokens_per_block=config.tokens_per_block,
        blocks_per_chunk=config.blocks_per_chunk,
        dtype=str(config.dtype).removeprefix("torch."),
        world_size=config.world_size,
        prefix=prefix,
    )


def redis_engine(
    url: str,
    config: EngineConfig,
    *,
    model: str = "kvfsm-reference",
    prefix: str = "kvfsm",
    cluster: bool = False,
    **tier_kw: Any,
) -> tuple[ReferenceEngine, RedisTier]:
    """A reference engine with one Redis tier behind its CPU primary (the engine binds the tier's slots)."""
    tier = RedisTier(url, engine_namespace(config, model, prefix), cluster=cluster, **tier_kw)
    engine = ReferenceEngine(config, tiers=[tier])
    return engine, tier


class CountingMemory:
    """The engine's KV memory, counting the forward's writes of watched blocks (the data plane's own
    record of what an engine computed, as opposed to loaded)."""

    def __init__(self, inner: KVMemory, watched: set[bytes]) -> None:
        self.inner = inner
        self.watched = watched
        self.computed = 0

    def write(self, block_id: int, key: bytes) -> None:
        if key in self.watched:
            self.computed += 1
        self.inner.write(block_id, key)

    def verify(self, block_id: int, block_hash: bytes) -> tuple[int, int]:
        return self.inner.verify(block_id, block_hash)


def shared_prompts(config: EngineConfig, role: str, families: int = 3, prefix_chunks: int = 4) -> list[list[int]]:
    """Prompts of ``families`` shared prefixes (``prefix_chunks`` chunks each, the same for every role),
    each followed by a suffix of the role's own."""
    tpc = config.tokens_per_block * config.blocks_per_chunk
    out = []
    for f in range(families):
        rng = random.Random(f"family{f}")
        prefix = [rng.randrange(1, 30000) for _ in range(prefix_chunks * tpc)]
        own = random.Random(f"{role}{f}")
        out.append(prefix + [own.randrange(1, 30000) for _ in range(tpc + 3)])
    return out


@dataclass(frozen=True, slots=True)
class InstanceResult:
    """What one engine instance did: chunks promoted from the server and their bytes, prefix blocks it
    computed itself, the blocks its loads verified and the mismatches found, and its tier's counters."""

    role: str
    pid: int
    prefix_blocks: int
    prefix_blocks_computed: int
    chunks_loaded_from_server: int
    bytes_loaded_from_server: int
    chunks_written_to_server: int
    bytes_written_to_server: int
    blocks_verified: int
    mismatches: int
    lookups: int
    hits: int
    idle: bool
    seconds: float
    #: sha256 of the CPU slot bytes of every prefix chunk still held at the end, by offload key (hex): the
    #: bytes A computed, and the bytes B promoted from the server, compared by the sharing test
    chunk_digests: dict[str, str]


def run_instance(url: str, role: str, *, prefix: str = "kvfsm-shared", cluster: bool = False) -> InstanceResult:
    """One engine instance: serve the shared-prefix prompts one after the other, then drain (every write
    reaches the server before it stops)."""
    cfg = SHARED_CONFIG
    engine, tier = redis_engine(url, cfg, prefix=prefix, cluster=cluster, op_timeout_s=10.0)
    t0 = time.perf_counter()
    try:
        prompts = shared_prompts(cfg, role)
        tpb = cfg.tokens_per_block
        watched: set[bytes] = set()
        prefix_keys: list[OffloadKey] = []
        counting: CountingMemory | None = None
        for i, prompt in enumerate(prompts):
            req = engine.make_request(f"{role}{i}", prompt, 2)
            n_prefix = (len(prompt) - (tpb * cfg.blocks_per_chunk + 3)) // tpb
            watched.update(req.block_hashes[:n_prefix])
            bpc = cfg.blocks_per_chunk
            prefix_keys += [make_offload_key(req.block_hashes[c * bpc + bpc - 1]) for c in range(n_prefix // bpc)]
            if counting is None:
                counting = CountingMemory(engine.memory, watched)
                engine.memory = counting
            engine.add_request(req)
            for _ in range(10_000):
                if engine.step() is None:
                    break
            engine.reset_prefix_cache()  # later prompts find nothing on the GPU
        assert counting is not None
        primary = engine.manager.primary
        assert primary is not None and tier.slot_io is not None
        digests = {}
        for key in prefix_keys:
            sid = primary.slot_id(key)
            if sid is not None and primary.slot_state(key) is SlotState.READY:
                digests[key.hex()] = hashlib.sha256(tier.slot_io.read_slot(sid)).hexdigest()
        idle = engine.state.value == "idle" and not engine.has_pending_push_work()
        c = tier.counters
        return InstanceResult(
            role=role,
            pid=os.getpid(),
            prefix_blocks=len(watched),
            prefix_blocks_computed=counting.computed,
            chunks_loaded_from_server=c.loads_completed,
            bytes_loaded_from_server=c.bytes_read,
            chunks_written_to_server=c.stores_committed,
            bytes_written_to_server=c.bytes_written,
            blocks_verified=engine.integrity.blocks_verified,
            mismatches=engine.integrity.mismatches,
            lookups=c.lookups,
            hits=c.hits,
            idle=idle,
            seconds=time.perf_counter() - t0,
            chunk_digests=digests,
        )
    finally:
        engine.shutdown(timeout=10.0)


@dataclass(frozen=True, slots=True)
class SharedResult:
    a: InstanceResult
    b: InstanceResult

    @property
    def blocks_reused(self) -> int:
        """Blocks B loaded from the server that A had computed (chunks x blocks per chunk)."""
        return self.b.chunks_loaded_from_server * SHARED_CONFIG.blocks_per_chunk

    @property
    def hit_rate(self) -> float:
        """B's prefix blocks served from the server rather than computed."""
        return 1.0 - self.b.prefix_blocks_computed / self.b.prefix_blocks if self.b.prefix_blocks else 0.0


def ping(url: str, *, cluster: bool = False, timeout_s: float = 5.0) -> None:
    """ConfigError unless a Redis server (or cluster) answers at ``url`` within ``timeout_s``."""
    from redis import Redis, RedisError
    from redis.cluster import RedisCluster

    try:
        client = (
            RedisCluster.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
            if cluster
            else Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s)
        )
        try:
            client.ping()
        finally:
            client.close()
    except (RedisError, ValueError, OSError) as exc:
        raise ConfigError(f"no Redis server answers at {url}: {exc}") from None


def _spawn(url: str, role: str, prefix: str, cluster: bool) -> InstanceResult:
    cmd = [sys.executable, "-m", "kvfsm.bench.redis", "--url", url, "--role", role, "--prefix", prefix]
    if cluster:
        cmd.append("--cluster")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise ConfigError(f"engine instance {role} failed (exit {out.returncode}): {out.stderr.strip()[-400:]}")
    return InstanceResult(**json.loads(out.stdout.strip().splitlines()[-1]))


def run_shared(url: str, *, prefix: str | None = None, cluster: bool = False) -> SharedResult:
    """Engine A, then engine B, each in a process of its own, alike but for their prompts' suffixes, on one
    server. ``prefix`` (default: a fresh one per call) namespaces the run's keys."""
    prefix = prefix if prefix is not None else f"kvfsm-shared-{os.getpid()}-{time.time_ns()}"
    a = _spawn(url, "a", prefix, cluster)
    b = _spawn(url, "b", prefix, cluster)
    return SharedResult(a, b)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvfsm.bench.redis", description="one shared-prefix engine instance")
    p.add_argument("--url", required=True)
    p.add_argument("--role", required=True)
    p.add_argument("--prefix", default="kvfsm-shared")
    p.add_argument("--cluster", action="store_true")
    args = p.parse_args(argv)
    result = run_instance(args.url, args.role, prefix=args.prefix, cluster=args.cluster)
    print(json.dumps(asdict(result)))
    return 0


# ---------------------------------------------------------------------------------------------- the bench


@contextlib.contextmanager
def local_redis(extra: Sequence[str] = ()) -> Iterator[str]:
    """A redis-server on a free loopback port in a temporary directory (no persistence); its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise ConfigError("redis-server not found; install it: apt-get install -y redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workdir = tempfile.mkdtemp(prefix="kvfsm-bench-redis-")
    args = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", workdir, "--save", ""]
    proc = subprocess.Popen([*args, "--appendonly", "no", "--logfile", "", *extra], stdout=subprocess.PIPE, text=True)
    ready = threading.Event()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if "Ready to accept connections" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    try:
        if not ready.wait(30) or proc.poll() is not None:
            raise ConfigError(f"redis-server on port {port} did not start")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)


def _key(i: int, tag: str) -> OffloadKey:
    return make_offload_key(f"{tag}:{i}".encode().ljust(16, b"\0")[:16] + i.to_bytes(4, "big"))


_CTX = ReqContext("bench")


def _tier_throughput(tier: SecondaryTier, n: int, value: int, per_step: int) -> tuple[float, float, list[float]]:
    """Seconds to cascade ``n`` chunks of ``value`` bytes (``per_step`` committed per scheduler step), seconds
    to promote them all back into an empty primary, and the latency of each single-chunk promotion (s)."""
    io = DictSlotIO(value)
    setattr(tier, "slot_io", io)  # noqa: B010 - both tiers have the attribute; SecondaryTier does not declare it
    primary = CPUOffloadingManager(n + 1)
    tm = TieringManager(primary, [tier])
    wait = getattr(tier, "wait_idle")  # noqa: B009 - both tiers have it
    keys = [_key(i, f"{tier.name}{value}") for i in range(n)]
    blob = os.urandom(value)
    t0 = time.perf_counter()
    for start in range(0, n, per_step):
        chunk = keys[start : start + per_step]
        out = tm.prepare_store(chunk, _CTX)
        assert out is not None
        for sid in out.store_spec.slot_ids:
            io.data[sid] = blob
        tm.complete_store(out.keys_to_store, _CTX)
        tm.on_schedule_end()
    while tm.has_pending_work():
        wait(60)
        tm.on_schedule_end()
    write_s = time.perf_counter() - t0
    tm.reset_cache()
    tm.on_reset_flushed()  # no GPU copy was discarded: nothing holds the promotions
    t0 = time.perf_counter()
    pending = list(keys)
    while pending:
        pending = [k for k in pending if tm.lookup(k, _CTX) is LookupResult.RETRY]
        tm.on_schedule_end()
        wait(60)
    while tm.has_pending_work():
        wait(60)
        tm.on_schedule_end()
    read_s = time.perf_counter() - t0
    missing = [k for k in keys if primary.slot_state(k) is not SlotState.READY]
    if missing:
        raise ConfigError(f"tier {tier.name!r}: {len(missing)} of {n} chunks were not promoted back")
    latencies = []
    tm.reset_cache()
    tm.on_reset_flushed()  # no GPU copy was discarded: nothing holds the promotions
    for k in keys[: min(n, 50)]:
        while tm.lookup(k, _CTX) is LookupResult.RETRY:  # an existence check first (not timed)
            tm.on_schedule_end()
            wait(60)
        t1 = time.perf_counter()
        tm.on_schedule_end()  # submits the promotion
        while tm.has_pending_work():
            wait(60)
            tm.on_schedule_end()
        latencies.append(time.perf_counter() - t1)
    tm.shutdown(timeout=10)
    return write_s, read_s, latencies


def _redis_benchmark(url: str, value: int, n: int) -> dict[str, float]:
    """redis-benchmark's SET and GET requests/s for ``value``-byte values (pipelined 16 deep)."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return {}
    port = url.rsplit(":", 1)[1].split("/")[0]
    cmd = [binary, "-h", "127.0.0.1", "-p", port, "-t", "set,get", "-d", str(value), "-n", str(n), "-P", "16", "--csv"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    rps: dict[str, float] = {}
    for line in out.stdout.splitlines():
        cells = [c.strip('"') for c in line.split(",")]
        if len(cells) >= 2 and cells[0] in ("SET", "GET"):
            with contextlib.suppress(ValueError):
                rps[cells[0]] = float(cells[1])
    return rps


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


def bench_redis(quick: bool = False) -> dict[str, Any]:
    """The ``redis`` section's numbers (see the module docs); needs redis-server and redis-py."""
    value = 64 * 1024 if quick else 256 * 1024
    n = 64 if quick else 256
    out: dict[str, Any] = {"value_bytes": value, "chunks": n}
    with local_redis() as url:
        ns = Namespace("bench", 1, 1, 1, 1, 1, "uint8", 1, prefix=f"bench{time.time_ns()}")
        piped = RedisTier(url, ns, op_timeout_s=30.0, max_batch=256)
        w, r, lat = _tier_throughput(piped, n, value, per_step=32)
        ns1 = Namespace("bench", 1, 1, 1, 1, 1, "uint8", 1, prefix=f"bench1-{time.time_ns()}")
        single = RedisTier(url, ns1, op_timeout_s=30.0, max_batch=1)
        w1, r1, _ = _tier_throughput(single, n, value, per_step=32)
        # Small values, where round trips rather than bytes dominate: what pipelining is for.
        small, n_small = 4096, 256 if quick else 1024
        nss = Namespace("bench", 1, 1, 1, 1, 1, "uint8", 1, prefix=f"bench-s-{time.time_ns()}")
        ws, rs, _ = _tier_throughput(RedisTier(url, nss, op_timeout_s=30.0), n_small, small, per_step=64)
        nss1 = Namespace("bench", 1, 1, 1, 1, 1, "uint8", 1, prefix=f"bench-s1-{time.time_ns()}")
        ws1, rs1, _ = _tier_throughput(RedisTier(url, nss1, op_timeout_s=30.0, max_batch=1), n_small, small, 64)
        rps = _redis_benchmark(url, value, 2000 if quick else 10000)
        shared = run_shared(url)
    root = tempfile.mkdtemp(prefix="kvfsm-bench-fs-")
    try:
        fs = FileSystemTier(root, scan=False)
        fw, fr, flat = _tier_throughput(fs, n, value, per_step=32)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    gb = n * value / 1e9
    out.update(
        redis_write_gbps=gb / w,
        redis_read_gbps=gb / r,
        unpipelined_write_gbps=gb / w1,
        unpipelined_read_gbps=gb / r1,
        fs_write_gbps=gb / fw,
        fs_read_gbps=gb / fr,
        promote_p50_ms=1e3 * statistics.median(lat),
        promote_p90_ms=1e3 * _pct(lat, 0.9),
        promote_p99_ms=1e3 * _pct(lat, 0.99),
        fs_promote_p50_ms=1e3 * statistics.median(flat),
        cross_instance_hit_rate=shared.hit_rate,
        cross_instance_blocks_reused=shared.blocks_reused,
        cross_instance_bytes_reused=shared.b.bytes_loaded_from_server,
        cross_instance_mismatches=shared.b.mismatches,
    )
    if "SET" in rps and "GET" in rps:
        out["redis_benchmark_set_gbps"] = rps["SET"] * value / 1e9
        out["redis_benchmark_get_gbps"] = rps["GET"] * value / 1e9
        out["write_vs_redis_benchmark"] = out["redis_write_gbps"] / out["redis_benchmark_set_gbps"]
        out["read_vs_redis_benchmark"] = out["redis_read_gbps"] / out["redis_benchmark_get_gbps"]
    out["pipelined_vs_unpipelined_write"] = out["redis_write_gbps"] / out["unpipelined_write_gbps"]
    out["pipelined_vs_unpipelined_read"] = out["redis_read_gbps"] / out["unpipelined_read_gbps"]
    out["small_value_bytes"] = small
    out["pipelined_vs_unpipelined_write_small"] = ws1 / ws
    out["pipelined_vs_unpipelined_read_small"] = rs1 / rs
    out["redis_vs_fs_write"] = out["redis_write_gbps"] / out["fs_write_gbps"]
    out["redis_vs_fs_read"] = out["redis_read_gbps"] / out["fs_read_gbps"]
    return out


def format_redis(n: dict[str, Any]) -> str:
    """The section's table: each comparison as a ratio measured in this run."""
    from kvfsm.bench.suite import format_table

    def gbps(key: str) -> str:
        return f"{n[key]:.3f}" if key in n else "-"

    rows: list[tuple[object, ...]] = [
        (
            "write (cascade)",
            gbps("redis_write_gbps"),
            gbps("redis_benchmark_set_gbps"),
            gbps("unpipelined_write_gbps"),
            gbps("fs_write_gbps"),
        ),
        (
            "read (promote)",
            gbps("redis_read_gbps"),
            gbps("redis_benchmark_get_gbps"),
            gbps("unpipelined_read_gbps"),
            gbps("fs_read_gbps"),
        ),
    ]
    table = format_table(("GB/s", "redis tier", "redis-benchmark", "1 chunk/round trip", "fs tier"), rows)
    ratios = [
        ("tier / redis-benchmark, write", n.get("write_vs_redis_benchmark")),
        ("tier / redis-benchmark, read", n.get("read_vs_redis_benchmark")),
        ("pipelined / unpipelined, write", n.get("pipelined_vs_unpipelined_write")),
        ("pipelined / unpipelined, read", n.get("pipelined_vs_unpipelined_read")),
        (
            f"pipelined / unpipelined, write, {n.get('small_value_bytes', 0) // 1024} KiB values",
            n.get("pipelined_vs_unpipelined_write_small"),
        ),
        (
            f"pipelined / unpipelined, read, {n.get('small_value_bytes', 0) // 1024} KiB values",
            n.get("pipelined_vs_unpipelined_read_small"),
        ),
        ("redis tier / fs tier, write", n.get("redis_vs_fs_write")),
        ("redis tier / fs tier, read", n.get("redis_vs_fs_read")),
    ]
    lines = [f"  {name}: {v:.2f}x" for name, v in ratios if isinstance(v, float)]
    return (
        f"  {n['chunks']} chunks of {n['value_bytes'] // 1024} KiB\n{table}\n" + "\n".join(lines) + "\n"
        f"  promotion latency: p50 {n['promote_p50_ms']:.2f} ms, p90 {n['promote_p90_ms']:.2f} ms, "
        f"p99 {n['promote_p99_ms']:.2f} ms (fs tier p50 {n['fs_promote_p50_ms']:.2f} ms)\n"
        f"  two engine processes, one server: B served {n['cross_instance_hit_rate']:.0%} of its shared-prefix "
        f"blocks from A's values ({n['cross_instance_blocks_reused']} blocks, "
        f"{n['cross_instance_bytes_reused']:,} bytes), {n['cross_instance_mismatches']} mismatches"
    )


if __name__ == "__main__":
    raise SystemExit(main())
