"""Two reference engines in separate processes share one real Redis server (and a 3-node cluster): a prefix
engine A computed and offloaded is a hit for engine B, loaded byte for byte, and B computes none of it.

The figures come from the data plane: B's forward writes (what it computed) are counted at its KV memory,
every loaded block is verified against the value the forward wrote, and the CPU slot bytes of every chunk
both engines hold at the end are compared by digest.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_support import GUARD_S, RedisServer, needs_redis, running_server, session_cluster, stop_session_servers

pytestmark = needs_redis

pytest.importorskip("torch")
pytest.importorskip("kvfsm.tiers.redis", reason="redis-py not installed: pip install 'kvfsm[redis]'")
from kvfsm.bench.redis import SHARED_CONFIG, SharedResult, run_shared  # noqa: E402


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    with running_server(tmp_path / "redis") as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def _module_servers() -> Iterator[None]:
    yield
    stop_session_servers()


def _check(result: SharedResult) -> None:
    a, b = result.a, result.b
    print(f"\nsharing: A {a}\nsharing: B {b}\nblocks reused {result.blocks_reused}, hit rate {result.hit_rate:.0%}")
    assert a.pid != b.pid  # two processes
    assert a.idle and b.idle
    assert a.prefix_blocks_computed == a.prefix_blocks > 0  # A computed every shared block
    assert a.chunks_written_to_server > 0 and a.chunks_loaded_from_server == 0
    assert b.prefix_blocks_computed == 0, f"B recomputed {b.prefix_blocks_computed} shared blocks"
    assert result.blocks_reused == b.prefix_blocks  # every shared block came from A's values
    assert b.bytes_loaded_from_server > 0
    assert b.blocks_verified == b.prefix_blocks * SHARED_CONFIG.num_layers and b.mismatches == 0
    same = set(a.chunk_digests) & set(b.chunk_digests)
    assert same, "no chunk is held by both at the end"
    assert all(a.chunk_digests[key] == b.chunk_digests[key] for key in same), "a shared chunk differs"


def test_two_engine_processes_share_prefixes_through_one_server(server: RedisServer) -> None:
    _check(run_shared(server.url))


def test_two_engine_processes_share_prefixes_through_a_redis_cluster() -> None:
    _check(run_shared(session_cluster().url, cluster=True))


def test_the_demo_prints_the_reuse(server: RedisServer) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvfsm", "demo", "--shared", server.url],
        capture_output=True,
        text=True,
        timeout=GUARD_S * 5,
    )
    assert out.returncode == 0, out.stderr
    assert "blocks reused across instances: 24 (" in out.stdout and "result: OK" in out.stdout, out.stdout


def test_the_bench_section_reports_its_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    """``kvfsm bench --only redis``: structure only, never timing (the numbers are the bench's to quote)."""
    import json

    from kvfsm.cli import main

    assert main(["bench", "--quick", "--quiet", "--json", "--only", "redis"]) == 0
    data = json.loads(capsys.readouterr().out)["redis"]
    assert data["available"] is True, data
    compared = ("write_vs_redis_benchmark", "read_vs_redis_benchmark") if shutil.which("redis-benchmark") else ()
    for key in (
        *compared,
        "pipelined_vs_unpipelined_write",
        "pipelined_vs_unpipelined_read",
        "redis_vs_fs_write",
        "redis_vs_fs_read",
        "promote_p50_ms",
        "promote_p99_ms",
    ):
        assert isinstance(data[key], float) and data[key] > 0, key
    assert data["cross_instance_hit_rate"] == 1.0 and data["cross_instance_mismatches"] == 0


def test_the_demo_is_one_line_and_exit_2_when_no_server_answers(capsys: pytest.CaptureFixture[str]) -> None:
    from redis_support import free_port

    from kvfsm.cli import main

    assert main(["demo", "--shared", f"redis://127.0.0.1:{free_port()}/0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no Redis server answers" in err
    assert main(["demo", "--shared", "localhost:6379"]) == 2
