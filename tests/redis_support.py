"""Real redis-server processes for the Redis tier's tests: standalone servers and a local 3-node cluster.

Every server listens on a free loopback port with its own temporary directory and is stopped (SIGKILL if
need be) at the end. Readiness is the server's own "Ready to accept connections" log line, read from
its stdout (a bounded wait on a real event, never a sleep). Tests skip, with the install command, where
the server binary or redis-py is missing. No mocks: every test here talks to a real server.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvfsm.control.types import OffloadKey, make_offload_key

GUARD_S = 60.0  #: deadlock guard of every wait on a server
INSTALL_HINT = "apt-get install -y redis-server"
PIP_HINT = "pip install 'kvfsm[redis]'"

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
try:
    import redis as _redis_py

    HAVE_REDIS_PY = True
    del _redis_py
except ImportError:  # pragma: no cover - depends on the environment
    HAVE_REDIS_PY = False

#: ``pytestmark = needs_redis`` in a test module: skip it (with the install command) without a server.
needs_redis = [
    pytest.mark.skipif(REDIS_SERVER is None or REDIS_CLI is None, reason=f"redis-server not found: {INSTALL_HINT}"),
    pytest.mark.skipif(not HAVE_REDIS_PY, reason=f"redis-py not installed: {PIP_HINT}"),
]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port(*, cluster: bool = False) -> int:
    """A loopback port nothing listens on; for a cluster node also its bus port (port + 10000), which
    caps the port at 55535."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(1000):
        port = rng.randrange(20000, 45000)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free loopback port pair for a cluster node")


def k(i: int) -> OffloadKey:
    return make_offload_key(b"redis-test" + i.to_bytes(6, "big"))


def _garbage(value: bytes, other: bytes) -> bytes:
    return b"garbage" * 40


def _swap(value: bytes, other: bytes) -> bytes:
    return other


def _truncate(value: bytes, other: bytes) -> bytes:
    return value[:-7]


def _flip(value: bytes, other: bytes) -> bytes:
    raw = bytearray(value)
    raw[-5] ^= 0x10
    return bytes(raw)


#: What a damaged value on the server is made of, from a stored value and another key's valid one: garbage
#: (refused by its magic), another key's value (by its key), cut short (truncated), one payload bit flipped
#: (by its checksum). Each test asserts the kind kvfsm's codec reports for each, in this order.
VALUE_DAMAGES: tuple[Callable[[bytes, bytes], bytes], ...] = (_garbage, _swap, _truncate, _flip)


class RedisServer:
    """One redis-server on 127.0.0.1:``port`` in ``workdir``; ``persistent`` turns on the AOF (fsync
    always), so a restart after SIGKILL finds every acknowledged write; ``extra`` are more flags."""

    def __init__(
        self,
        workdir: Path,
        *,
        port: int | None = None,
        persistent: bool = False,
        extra: Sequence[str] = (),
    ) -> None:
        if REDIS_SERVER is None:
            pytest.skip(f"redis-server not found: {INSTALL_HINT}")
        self.workdir = workdir
        self.port = port if port is not None else free_port()
        self.persistent = persistent
        self.extra = list(extra)
        self.proc: subprocess.Popen[str] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def args(self) -> list[str]:
        assert REDIS_SERVER is not None
        persistence = (
            ["--appendonly", "yes", "--appendfsync", "always", "--save", ""]
            if self.persistent
            else ["--appendonly", "no", "--save", ""]
        )
        return [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.workdir),
            "--logfile",
            "",
            "--daemonize",
            "no",
            "--enable-debug-command",
            "local",
            *persistence,
            *self.extra,
        ]

    def start(self) -> RedisServer:
        assert self.proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        proc = subprocess.Popen(self.args(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.proc = proc
        lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                if len(lines) < 200:
                    lines.append(line)
                if "Ready to accept connections" in line:
                    ready.set()
            ready.set()  # exited: wake the waiter, which then sees the process dead

        threading.Thread(target=read, daemon=True, name=f"redis-log-{self.port}").start()
        if not ready.wait(GUARD_S) or proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"redis-server on port {self.port} did not start:\n{''.join(lines[-20:])}")
        self.starts += 1
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown, no save (what a crash or an OOM killer does)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(GUARD_S)

    def restart(self) -> RedisServer:
        self.kill()
        return self.start()

    def client(self, **kw: Any) -> Any:
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=GUARD_S, **kw)

    def stop(self) -> None:
        self.kill()


class RedisClusterNodes:
    """Three redis-server processes in cluster mode on loopback, joined by ``redis-cli --cluster create``
    (no replicas): 16384 slots over three masters."""

    def __init__(self, workdir: Path, n: int = 3) -> None:
        if REDIS_CLI is None:
            pytest.skip(f"redis-cli not found: {INSTALL_HINT}")
        self.nodes = [
            RedisServer(
                workdir / f"node{i}",
                port=free_port(cluster=True),
                extra=[
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "5000",
                ],
            )
            for i in range(n)
        ]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> RedisClusterNodes:
        for node in self.nodes:
            node.start()
        assert REDIS_CLI is not None
        addrs = [f"127.0.0.1:{node.port}" for node in self.nodes]
        out = subprocess.run(
            [REDIS_CLI, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            text=True,
            timeout=GUARD_S,
        )
        if out.returncode != 0 or "All 16384 slots covered" not in out.stdout:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{out.stdout}\n{out.stderr}")
        # The create command waits until every node agrees on the configuration; each node then reports
        # cluster_state:ok once it has seen the others' slots. `--cluster check` is the same agreement
        # test redis-cli makes; it is repeated (a bounded number of real checks, no sleeping) until it holds.
        for _ in range(200):
            if all(self._state_ok(node) for node in self.nodes):
                break
            subprocess.run([REDIS_CLI, "--cluster", "check", addrs[0]], capture_output=True, timeout=GUARD_S)
        else:
            self.stop()
            raise RuntimeError("the cluster never reached cluster_state:ok")
        return self

    @staticmethod
    def _state_ok(node: RedisServer) -> bool:
        c = node.client()
        try:
            info = c.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            return "cluster_state:ok" in text
        finally:
            c.close()

    def cluster_client(self) -> Any:
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.nodes[0].port, socket_timeout=GUARD_S)

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


# ---------------------------------------------------------------------------------------------- servers


@contextmanager
def running_server(workdir: Path, **kw: Any) -> Iterator[RedisServer]:
    """A fresh standalone server (no persistence unless asked) for one test; a test module wraps it in a
    fixture of its own."""
    server = RedisServer(workdir, **kw).start()
    try:
        yield server
    finally:
        server.stop()


class _Shared:
    """Servers started once per test module (the conformance machines build a tier per example)."""

    server: RedisServer | None = None
    cluster: RedisClusterNodes | None = None
    root: Path | None = None


def _root() -> Path:
    if _Shared.root is None:
        _Shared.root = Path(tempfile.mkdtemp(prefix="kvfsm-redis-"))
    return _Shared.root


def session_server() -> RedisServer:
    if _Shared.server is None:
        _Shared.server = RedisServer(_root() / "shared").start()
    return _Shared.server


def session_cluster() -> RedisClusterNodes:
    if _Shared.cluster is None:
        _Shared.cluster = RedisClusterNodes(_root() / "cluster").start()
    return _Shared.cluster


def stop_session_servers() -> None:
    """Stop what :func:`session_server` / :func:`session_cluster` started (a module fixture's finalizer)."""
    if _Shared.server is not None:
        _Shared.server.stop()
        _Shared.server = None
    if _Shared.cluster is not None:
        _Shared.cluster.stop()
        _Shared.cluster = None
    if _Shared.root is not None:
        shutil.rmtree(_Shared.root, ignore_errors=True)
        _Shared.root = None


@contextmanager
def module_server_url() -> Iterator[str]:
    """The session's redis-server for one test module, by URL (skips the module, with the install command,
    without redis-server or redis-py); the session's servers are stopped when the module is done."""
    if REDIS_SERVER is None:
        pytest.skip(f"redis-server not found: {INSTALL_HINT}")
    if not HAVE_REDIS_PY:
        pytest.skip(f"redis-py not installed: {PIP_HINT}")
    server = session_server()
    try:
        yield server.url
    finally:
        stop_session_servers()
