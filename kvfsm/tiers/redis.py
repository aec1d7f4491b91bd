"""A shared remote secondary tier on Redis (or Valkey), standalone or Redis Cluster (extra ``kvfsm[redis]``).

One Redis value per offloaded chunk, in the format of :mod:`kvfsm.tiers.redis_codec` (a versioned,
checksummed header naming the chunk and its namespace, then the slot bytes), under a key namespaced by a
prefix and a hash of the model, KV geometry, dtype and world size. Engines configured alike share the
values: a prefix one engine offloaded is a hit for every other.

The split is the file-system tier's. Every method the tiering manager calls runs on the scheduler thread,
does no network I/O and never blocks: it stages work, and the end of each step
(:meth:`RedisTier.on_schedule_end`) hands the step's work to the tier's own
:class:`~kvfsm.tiers.pool.DualQueuePool` as batches: every cascade of the step as one pipelined ``SET``
batch, every promotion as one ``MGET`` (per hash slot, in a cluster), every unknown key's existence check
as one pipelined ``EXISTS``. Lookups answer RETRY until the existence check of the key has returned.

Failures are typed (:class:`RedisFailure`) and bounded. A refused or reset connection, a timeout (every
operation has one), a server restart or loading its data, ``OOM`` under ``maxmemory``, a key evicted by
the server between lookup and load, and a value that does not decode each fail the job: a failed
cascade leaves the CPU copy valid, a failed promotion is a miss and the chunk is recomputed. A value that
does not decode is never served. After a connection failure the tier backs off (exponentially, from
``reconnect_base_s`` up to ``reconnect_max_s``): meanwhile jobs fail at once without touching the network
and lookups answer MISS, then the next operation reconnects. Backpressure: at most ``max_pending_writes``
chunks are staged, queued or being written; a cascade beyond that fails at once (its CPU copy stays),
so a slow server never grows memory without bound.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import partial
from typing import Any

import redis
import redis.exceptions as rex
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry
from typing_extensions import override

from kvfsm.control.deadlines import Clock, Deadlines
from kvfsm.control.manager import JobResult, SecondaryTier, TierJob, validate_tier_job
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.tiers.faults import FaultPlan, InjectedFault
from kvfsm.tiers.pool import DualQueuePool
from kvfsm.tiers.redis_codec import MismatchKind, Namespace, ValueMismatch, decode_value, encode_value
from kvfsm.tiers.slotio import SlotIO, slot_nbytes

__all__ = ["RedisFailure", "RedisTier", "RedisTierCounters", "RedisTierStats", "classify", "ping_server"]

logger = logging.getLogger(__name__)


class RedisFailure(Enum):
    """Why one operation of the tier failed (every kind fails its job; none is ever served)."""

    REFUSED = "refused"  #: the connection was refused (server down)
    RESET = "reset"  #: the connection broke (reset, closed, killed server)
    TIMEOUT = "timeout"  #: no reply within the operation timeout (stalled server)
    LOADING = "loading"  #: the server is (re)loading its data set after a restart
    OOM = "oom"  #: the server refused a write: ``maxmemory`` reached under a no-eviction policy
    CLUSTER = "cluster"  #: the cluster is down, resharding, or a slot is not covered
    EVICTED = "evicted"  #: the key was gone at load time (evicted, expired, flushed, restarted)
    MISMATCH = "mismatch"  #: the value did not decode (garbage, damaged, another namespace)
    BACKOFF = "backoff"  #: failed at once: the tier is backing off after a connection failure
    BACKPRESSURE = "backpressure"  #: a cascade refused: too many writes pending
    CANCELLED = "cancelled"  #: the tier shut down before the operation ran
    OTHER = "other"  #: anything else (logged)


#: Failures that mean the connection (or the server) is gone: the tier backs off and reconnects.
_CONNECTION = frozenset({RedisFailure.REFUSED, RedisFailure.RESET, RedisFailure.TIMEOUT, RedisFailure.LOADING})


def classify(exc: BaseException) -> RedisFailure:
    """The :class:`RedisFailure` an exception raised by redis-py (or by the tier's own I/O) stands for."""
    if isinstance(exc, InjectedFault) and exc.errno == errno.ECANCELED:
        return RedisFailure.CANCELLED
    if isinstance(exc, rex.BusyLoadingError):
        return RedisFailure.LOADING
    if isinstance(exc, rex.TimeoutError):
        return RedisFailure.TIMEOUT
    if isinstance(exc, rex.ConnectionError):
        text = str(exc).lower()
        return RedisFailure.REFUSED if "refused" in text or "error 111" in text else RedisFailure.RESET
    if isinstance(exc, rex.OutOfMemoryError) or (isinstance(exc, rex.ResponseError) and str(exc).startswith("OOM")):
        return RedisFailure.OOM
    if isinstance(exc, rex.ClusterError | rex.ClusterDownError | rex.SlotNotCoveredError | rex.RedisClusterException):
        return RedisFailure.CLUSTER
    if isinstance(exc, rex.ResponseError) and "LOADING" in str(exc):
        return RedisFailure.LOADING
    return RedisFailure.OTHER


@dataclass(slots=True)
class RedisTierCounters:
    """What a Redis tier has counted since it was built (chunks unless named otherwise)."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    retries: int = 0
    exists_checked: int = 0
    stores_submitted: int = 0
    stores_committed: int = 0
    stores_failed: int = 0
    loads_submitted: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    #: values read that did not decode (never served), by kind in ``mismatches``
    values_rejected: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    write_batches: int = 0
    read_batches: int = 0
    exists_batches: int = 0
    #: successful operations right after a connection failure (a reconnect)
    reconnects: int = 0
    invalidations: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    mismatches: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class RedisTierStats:
    """A snapshot of a Redis tier: its counters and its work now."""

    counters: dict[str, Any]
    writes_pending: int
    jobs_in_flight: int
    io_pending: int
    verdicts: int
    backing_off: bool

    def as_dict(self) -> dict[str, Any]:
        return {**self.counters, **{k: v for k, v in asdict(self).items() if k != "counters"}}


@dataclass(frozen=True, slots=True)
class _Item:
    job_id: int
    key: OffloadKey
    slot_id: int


@dataclass(slots=True)
class _JobState:
    job: TierJob
    remaining: int
    ok: bool


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One chunk of a finished batch: ``failure`` None means done."""

    item: _Item
    is_store: bool
    failure: RedisFailure | None
    nbytes: int = 0
    mismatch: MismatchKind | None = None


class _Health:
    """Connection health shared by the I/O threads: consecutive failures and when to try again."""

    def __init__(self, clock: Clock, base_s: float, max_s: float) -> None:
        self._clock = clock
        self._base = base_s
        self._max = max_s
        self._lock = threading.Lock()
        self.failures_in_row = 0
        self.retry_at = 0.0
        self.reconnects = 0  #: successes that ended a run of failures

    def down(self) -> bool:
        with self._lock:
            return self.failures_in_row > 0 and self._clock() < self.retry_at

    def failed(self) -> None:
        with self._lock:
            self.failures_in_row += 1
            delay = min(self._max, self._base * 2 ** (self.failures_in_row - 1))
            self.retry_at = self._clock() + delay

    def succeeded(self) -> None:
        with self._lock:
            if self.failures_in_row > 0:
                self.reconnects += 1
            self.failures_in_row = 0


def ping_server(url: str, *, cluster: bool = False, timeout_s: float = 2.0) -> None:
    """One PING on a client of its own, closed after: a server that is missing or does not answer raises
    :class:`~kvfsm.errors.ConfigKeyError` naming ``redis_url`` (an adapter's start-up check; the tier
    itself never blocks on its server)."""
    from kvfsm.errors import ConfigKeyError

    client: redis.Redis | RedisCluster | None = None
    try:
        if cluster:
            client = RedisCluster.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        else:
            client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        client.ping()
    except (rex.RedisError, OSError) as exc:
        raise ConfigKeyError("redis_url", f"the Redis server at {url!r} did not answer a PING ({exc!r})") from exc
    finally:
        if client is not None:
            client.close()


def _is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


def _is_url(url: object) -> bool:
    return isinstance(url, str) and "://" in url


def _is_namespace(ns: object) -> bool:
    return isinstance(ns, Namespace)


def _positive(name: str, v: object, *, allow_none: bool = False) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, int | float) or v <= 0:
        raise ConfigError(f"redis tier {name}={v!r}; expected a number > 0" + (" or None" if allow_none else ""))


class RedisTier(SecondaryTier):
    """Chunks as Redis values on a standalone server or a Redis Cluster, moved through ``slot_io``.

    Every parameter after ``url`` and ``namespace`` is keyword-only. The equivalent named is LMCache's
    remote backend (``remote_url``, ``remote_serde``); "none" where it has none.

    - ``url`` (str; required): ``redis://host:port/db`` (or ``rediss://``, ``unix://``). A cluster is
      reached through any one node's URL with ``cluster=True``. LMCache ``remote_url``
      (``"redis://host:port"``).
    - ``namespace`` (:class:`~kvfsm.tiers.redis_codec.Namespace`; required): the model, KV geometry, dtype,
      world size and key prefix. Engines share chunks exactly when their namespaces are equal. None.
    - ``cluster`` (bool; default False): talk to a Redis Cluster through redis-py's ``RedisCluster``:
      reads are ``MGET`` per hash slot (pipelined per node), writes and existence checks pipelined per
      node. LMCache: none (a separate ``redis-sentinel`` URL).
    - ``slot_io`` (:class:`~kvfsm.tiers.slotio.SlotIO`; default None): the CPU primary's slot bytes; the
      reference engine binds its pools. It must be set before the first submission. None.
    - ``name`` (str; default ``"redis"``): the tier's name in logs, metrics and thread names. None.
    - ``deadlines`` (:class:`~kvfsm.control.deadlines.Deadlines`; default None: ``Deadlines()``): the
      operation timeout, when ``op_timeout_s`` is None, is the shorter of its ``cascade_s`` and
      ``promote_s`` (a network operation never outlives its job's deadline). None.
    - ``op_timeout_s`` (seconds > 0, or None; default None: from ``deadlines``): connect and socket
      timeout of every operation. None (LMCache waits without a bound).
    - ``reconnect_base_s`` (seconds > 0; default 0.1) and ``reconnect_max_s`` (seconds > 0; default 5.0):
      after a connection failure, operations fail at once (and lookups answer MISS) for
      ``reconnect_base_s`` doubling per consecutive failure up to ``reconnect_max_s``; then the next
      operation reconnects. None.
    - ``max_pending_writes`` (int >= 1; default 4096): chunks staged, queued or being written at most;
      a cascade beyond that fails at once (backpressure; the CPU copy stays valid). None.
    - ``max_batch`` (int >= 1; default 256): chunks per pipelined batch (a step's work is split into
      batches of at most this many). None.
    - ``read_threads`` (int >= 0; default 2) and ``write_threads`` (int >= 1; default 1): the tier's I/O
      pool (:class:`~kvfsm.tiers.pool.DualQueuePool`): reads (promotions, existence checks) are never
      starved by writes. None.
    - ``ttl_s`` (int seconds >= 1, or None; default None): an expiry set on every value (``SET EX``);
      None relies on the server's ``maxmemory`` eviction policy (recommended: ``allkeys-lru``). None.
    - ``lookup_ttl_steps`` (int >= 1; default 64): steps an existence verdict is cached before the key is
      checked again (another engine may have written it meanwhile). None.
    - ``faults`` (:class:`~kvfsm.tiers.faults.FaultPlan`; default None): consulted at ``redis.set``,
      ``redis.get``, ``redis.exists`` (once per batch, key ``b""``), ``slot.read`` and ``slot.write``
      (per chunk); tests hold I/O in flight with HANG faults. None.
    - ``clock`` (callable; default ``time.monotonic``): times the reconnect backoff. None.
    """

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        cluster: bool = False,
        slot_io: SlotIO | None = None,
        name: str = "redis",
        deadlines: Deadlines | None = None,
        op_timeout_s: float | None = None,
        reconnect_base_s: float = 0.1,
        reconnect_max_s: float = 5.0,
        max_pending_writes: int = 4096,
        max_batch: int = 256,
        read_threads: int = 2,
        write_threads: int = 1,
        ttl_s: int | None = None,
        lookup_ttl_steps: int = 64,
        faults: FaultPlan | None = None,
        clock: Clock | None = None,
    ) -> None:
        if not _is_url(url):
            raise ConfigError(f"redis tier url={url!r}; expected redis://host:port[/db]")
        if not _is_namespace(namespace):
            raise ConfigError(f"redis tier namespace={namespace!r}; expected a kvfsm.tiers.redis_codec.Namespace")
        if op_timeout_s is None:
            d = deadlines if deadlines is not None else Deadlines()
            limits = [v for v in (d.cascade_s, d.promote_s) if v is not None]
            op_timeout_s = min(limits) if limits else 30.0
        _positive("op_timeout_s", op_timeout_s)
        _positive("reconnect_base_s", reconnect_base_s)
        _positive("reconnect_max_s", reconnect_max_s)
        for what, n in (("max_pending_writes", max_pending_writes), ("max_batch", max_batch)):
            if not _is_count(n):
                raise ConfigError(f"redis tier {what}={n!r}; expected an int >= 1")
        if ttl_s is not None and not _is_count(ttl_s):
            raise ConfigError(f"redis tier ttl_s={ttl_s!r}; expected an int >= 1 or None")
        if not _is_count(lookup_ttl_steps):
            raise ConfigError(f"redis tier lookup_ttl_steps={lookup_ttl_steps!r}; expected an int >= 1")
        self.name = name
        self.url = url
        self.namespace = namespace
        self.cluster = cluster
        self.slot_io = slot_io
        self.faults = faults
        self.op_timeout_s = float(op_timeout_s)
        self.max_pending_writes = max_pending_writes
        self.max_batch = max_batch
        self.ttl_s = ttl_s
        self._ns_digest = namespace.digest()
        self._lookup_ttl = lookup_ttl_steps
        self._clock: Clock = clock if clock is not None else time.monotonic
        self._health = _Health(self._clock, reconnect_base_s, reconnect_max_s)
        self._client: redis.Redis | RedisCluster | None = None
        self._client_lock = threading.Lock()
        self._cancel = threading.Event()
        self._pool = DualQueuePool(read_threads, write_threads, name=f"kvfsm-{name}")
        self._read_threads = read_threads + write_threads  # write threads help with reads
        self._write_threads = write_threads
        # -- scheduler-thread state --
        self._jobs: dict[int, _JobState] = {}
        self._staged_writes: list[_Item] = []
        self._staged_reads: list[_Item] = []
        self._staged_probes: list[OffloadKey] = []
        self._writes_pending = 0  # chunks staged, queued or being written whose outcome is not applied yet
        self._writes_sent = 0  # of those, chunks handed to the I/O pool (no longer staged)
        self._verdicts: dict[OffloadKey, tuple[bool, int]] = {}  # key -> (exists, step resolved)
        self._probing: dict[OffloadKey, int] = {}  # key -> generation of the check in flight
        self._generation = 0
        self._step = 0
        self._finished: list[JobResult] = []
        # -- filled by I/O threads, drained by the scheduler thread --
        self._done: deque[list[_Outcome]] = deque()
        self._probed: deque[tuple[dict[OffloadKey, int], dict[OffloadKey, bool] | None]] = deque()
        self._closed = False
        self._stats = RedisTierCounters()

    # ------------------------------------------------------------------ introspection

    @property
    def counters(self) -> RedisTierCounters:
        return self._stats

    @property
    def writes_pending(self) -> int:
        """Chunks whose write is staged, queued or running (or finished, not yet applied by a poll)."""
        return self._writes_pending

    @property
    def writes_sent(self) -> int:
        """Chunks whose write batch is on the I/O pool (queued, running, or done and not yet applied)."""
        return self._writes_sent

    @property
    def closed(self) -> bool:
        return self._closed

    def pending_job_ids(self) -> list[int]:
        return list(self._jobs)

    def stats(self) -> RedisTierStats:
        self._stats.reconnects = self._health.reconnects
        s = asdict(self._stats)
        s["failures"] = dict(self._stats.failures)
        s["mismatches"] = dict(self._stats.mismatches)
        return RedisTierStats(
            counters=s,
            writes_pending=self._writes_pending,
            jobs_in_flight=len(self._jobs),
            io_pending=self._pool.pending,
            verdicts=len(self._verdicts),
            backing_off=self._health.down(),
        )

    def redis_key(self, key: OffloadKey) -> str:
        return self.namespace.redis_key(key)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the I/O pool is idle (tests; a real engine polls instead). Staged work is not sent
        until the step ends."""
        return self._pool.wait_idle(timeout)

    def threads_alive(self) -> int:
        return self._pool.threads_alive()

    # ------------------------------------------------------------------ SecondaryTier (scheduler thread)

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._stats.lookups += 1
        verdict = self._verdicts.get(key)
        if verdict is not None:
            if verdict[0]:
                self._stats.hits += 1
                return LookupResult.HIT
            self._stats.misses += 1
            return LookupResult.MISS
        if self._closed or self._health.down():
            self._stats.misses += 1  # no network now: compute it rather than wait
            return LookupResult.MISS
        if key not in self._probing:
            self._generation += 1
            self._probing[key] = self._generation
            self._staged_probes.append(key)
        self._stats.retries += 1
        return LookupResult.RETRY

    @override
    def submit_store(self, job: TierJob) -> None:
        self._check_submission(job, promotion=False)
        items = [_Item(job.job_id, k, s) for k, s in dict(zip(job.keys, job.slot_ids, strict=True)).items()]
        if self._writes_pending + len(items) > self.max_pending_writes or self._health.down():
            why = RedisFailure.BACKPRESSURE if not self._health.down() else RedisFailure.BACKOFF
            self._stats.failures[why.value] += len(items)
            self._stats.stores_failed += len(items)
            self._finished.append(JobResult(job.job_id, False))
            return
        self._jobs[job.job_id] = _JobState(job, len(items), True)
        self._writes_pending += len(items)
        self._staged_writes.extend(items)
        self._stats.stores_submitted += len(items)

    @override
    def submit_load(self, job: TierJob) -> None:
        self._check_submission(job, promotion=True)
        items = [_Item(job.job_id, k, s) for k, s in zip(job.keys, job.slot_ids, strict=True)]
        self._jobs[job.job_id] = _JobState(job, len(items), True)
        self._staged_reads.extend(items)
        self._stats.loads_submitted += len(items)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._apply_done()
        finished, self._finished = self._finished, []
        return finished

    @override
    def has_pending_work(self) -> bool:
        """True while a write is staged, queued or running (and until a poll applies its outcome), so the
        engine keeps stepping until every cascade has reached the server; False after :meth:`shutdown`.
        Promotions and existence checks are not counted: the manager counts promotions as jobs, and a
        check matters only to a request waiting for it (which keeps the engine running anyway)."""
        return not self._closed and self._writes_pending > 0

    @override
    def drain_jobs(self) -> None:
        """Send what is staged and block until every batch has finished (reset_cache, shutdown)."""
        self._flush()
        self._pool.wait_idle()

    @override
    def on_schedule_end(self) -> None:
        self._step += 1
        self._apply_probes()
        if self._closed:
            return
        self._flush()
        expired = [k for k, (_e, step) in self._verdicts.items() if self._step - step >= self._lookup_ttl]
        for k in expired:
            del self._verdicts[k]

    @override
    def invalidate(self, key: OffloadKey) -> None:
        """A promotion of ``key`` failed: the key answers MISS until its verdict expires (a check in flight
        for it is ignored); the value itself, if damaged, was already deleted by the I/O thread."""
        self._stats.invalidations += 1
        self._probing.pop(key, None)
        self._verdicts[key] = (False, self._step)

    @override
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: cancel queued batches (their jobs report failure), wake injected hangs, join the threads
        within about ``timeout`` seconds, close the connections. Results still come from
        :meth:`get_finished_jobs`."""
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        if self.faults is not None:
            self.faults.notify()
        self._writes_sent += len(self._staged_writes)  # reported below as if sent, and cancelled
        for items, is_store in ((self._staged_writes, True), (self._staged_reads, False)):
            if items:
                self._done.append([_Outcome(i, is_store, RedisFailure.CANCELLED) for i in items])
        self._staged_writes, self._staged_reads, self._staged_probes = [], [], []
        self._pool.shutdown(timeout)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a broken connection must not fail the shutdown
                logger.debug("tier %r: closing the client failed", self.name, exc_info=True)

    # ------------------------------------------------------------------ scheduler-thread bookkeeping

    def _check_submission(self, job: TierJob, *, promotion: bool) -> None:
        what = "submit_load" if promotion else "submit_store"
        if self._closed:
            raise KvfsmError(f"tier {self.name!r} is shut down; {what} of job {job.job_id} expected an open tier")
        validate_tier_job(self.name, job, promotion=promotion, running=self._jobs)
        if self.slot_io is None:
            raise ConfigError(f"tier {self.name!r} has no slot_io; bind the CPU primary's slots before submitting")

    def _flush(self) -> None:
        """Hand the staged work to the pool: each direction's chunks of this step split evenly over the
        threads that serve it, in pipelined batches of at most ``max_batch`` chunks."""
        writes, self._staged_writes = self._staged_writes, []
        self._writes_sent += len(writes)
        for batch in self._batches(writes, self._write_threads):
            self._stats.write_batches += 1
            fut = self._pool.submit_write(self._write_batch, batch)
            fut.add_done_callback(partial(self._batch_done, batch, True))
        reads, self._staged_reads = self._staged_reads, []
        for batch in self._batches(reads, self._read_threads):
            self._stats.read_batches += 1
            fut = self._pool.submit_read(self._read_batch, batch)
            fut.add_done_callback(partial(self._batch_done, batch, False))
        probes, self._staged_probes = self._staged_probes, []
        probes = [k for k in probes if k in self._probing]
        for i in range(0, len(probes), self.max_batch):
            gens = {k: self._probing[k] for k in probes[i : i + self.max_batch]}
            self._stats.exists_batches += 1
            pfut = self._pool.submit_read(self._exists_batch, list(gens))
            pfut.add_done_callback(partial(self._probe_done, gens))

    def _batches(self, items: list[_Item], threads: int) -> list[list[_Item]]:
        if not items:
            return []
        size = min(self.max_batch, max(1, -(-len(items) // threads)))
        return [items[i : i + size] for i in range(0, len(items), size)]

    def _apply_probes(self) -> None:
        while self._probed:
            gens, answer = self._probed.popleft()
            for key, gen in gens.items():
                if self._probing.get(key) != gen:
                    continue  # invalidated (or re-asked) meanwhile: this answer is stale
                del self._probing[key]
                self._stats.exists_checked += 1
                if answer is None:
                    # The check failed: a miss for this step only (computed now, checked again later).
                    self._verdicts[key] = (False, self._step - self._lookup_ttl + 1)
                else:
                    self._verdicts[key] = (answer.get(key, False), self._step)

    def _apply_done(self) -> None:
        while self._done:
            for out in self._done.popleft():
                st = self._jobs.get(out.item.job_id)
                if out.is_store:
                    self._writes_pending -= 1
                    self._writes_sent -= 1
                if out.failure is None:
                    if out.is_store:
                        self._stats.stores_committed += 1
                        self._stats.bytes_written += out.nbytes
                        self._verdicts[out.item.key] = (True, self._step)  # the server holds it now
                    else:
                        self._stats.loads_completed += 1
                        self._stats.bytes_read += out.nbytes
                else:
                    self._stats.failures[out.failure.value] += 1
                    if out.mismatch is not None:
                        self._stats.values_rejected += 1
                        self._stats.mismatches[out.mismatch.value] += 1
                    if out.is_store:
                        self._stats.stores_failed += 1
                    else:
                        self._stats.loads_failed += 1
                        self._verdicts[out.item.key] = (False, self._step)
                if st is None:
                    continue
                st.remaining -= 1
                st.ok = st.ok and out.failure is None
                if st.remaining == 0:
                    del self._jobs[out.item.job_id]
                    self._finished.append(JobResult(out.item.job_id, st.ok))

    # ------------------------------------------------------------------ I/O threads

    def _connect(self) -> redis.Redis | RedisCluster:
        with self._client_lock:
            if self._client is None:
                t = self.op_timeout_s
                if self.cluster:
                    self._client = RedisCluster.from_url(
                        self.url,
                        socket_timeout=t,
                        socket_connect_timeout=t,
                        retry=Retry(NoBackoff(), 1),
                    )
                else:
                    self._client = redis.Redis.from_url(
                        self.url,
                        socket_timeout=t,
                        socket_connect_timeout=t,
                        retry=Retry(NoBackoff(), 0),
                    )
            return self._client

    def _drop_client(self) -> None:
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                logger.debug("tier %r: closing a broken client failed", self.name, exc_info=True)

    def _fault(self, op: str, key: bytes = b"") -> None:
        if self.faults is not None:
            self.faults.apply(op, key, cancel=self._cancel)

    def _failed(self, exc: BaseException, what: str) -> RedisFailure:
        kind = classify(exc)
        if kind in _CONNECTION or kind is RedisFailure.CLUSTER:
            self._health.failed()
            self._drop_client()
        if kind is RedisFailure.OTHER:
            logger.warning("tier %r: %s failed: %r", self.name, what, exc)
        else:
            logger.debug("tier %r: %s failed (%s): %r", self.name, what, kind.value, exc)
        return kind

    def _write_batch(self, batch: list[_Item]) -> list[_Outcome]:
        if self._health.down():
            return [_Outcome(i, True, RedisFailure.BACKOFF) for i in batch]
        io = self.slot_io
        assert io is not None  # checked at submission
        outcomes: list[_Outcome | None] = [None] * len(batch)
        values: list[tuple[int, str, bytes]] = []
        for n, item in enumerate(batch):
            try:
                self._fault("slot.read", item.key)
                payload = io.read_slot(item.slot_id)
            except Exception as exc:
                outcomes[n] = _Outcome(item, True, classify(exc))
                continue
            values.append((n, self.namespace.redis_key(item.key), encode_value(self._ns_digest, item.key, payload)))
        if values:
            try:
                self._fault("redis.set")
                client = self._connect()
                pipe = client.pipeline(transaction=False)
                for _n, rkey, value in values:
                    pipe.set(rkey, value, ex=self.ttl_s)
                replies = pipe.execute(raise_on_error=False)
            except Exception as exc:
                kind = self._failed(exc, f"SET batch of {len(values)}")
                replies = [kind] * len(values)
            else:
                self._health.succeeded()
            for (n, _rkey, value), reply in zip(values, replies, strict=True):
                if isinstance(reply, RedisFailure):
                    outcomes[n] = _Outcome(batch[n], True, reply)
                elif isinstance(reply, BaseException):
                    outcomes[n] = _Outcome(batch[n], True, self._failed(reply, "SET"))
                else:
                    outcomes[n] = _Outcome(batch[n], True, None, nbytes=len(value))
        return [o for o in outcomes if o is not None]

    def _read_batch(self, batch: list[_Item]) -> list[_Outcome]:
        if self._health.down():
            return [_Outcome(i, False, RedisFailure.BACKOFF) for i in batch]
        io = self.slot_io
        assert io is not None
        rkeys = [self.namespace.redis_key(i.key) for i in batch]
        try:
            self._fault("redis.get")
            client = self._connect()
            if isinstance(client, RedisCluster):
                raw: list[Any] = client.mget_nonatomic(rkeys)
            else:
                raw = client.mget(rkeys)
        except Exception as exc:
            kind = self._failed(exc, f"MGET of {len(rkeys)}")
            return [_Outcome(i, False, kind) for i in batch]
        self._health.succeeded()
        expected = slot_nbytes(io)
        outcomes: list[_Outcome] = []
        bad: list[str] = []
        for item, rkey, value in zip(batch, rkeys, raw, strict=True):
            if value is None:
                outcomes.append(_Outcome(item, False, RedisFailure.EVICTED))
                continue
            try:
                payload = decode_value(bytes(value), self._ns_digest, item.key, expected)
            except ValueMismatch as exc:
                outcomes.append(_Outcome(item, False, RedisFailure.MISMATCH, mismatch=exc.kind))
                if exc.kind is not MismatchKind.NAMESPACE:
                    bad.append(rkey)  # damaged under our own key: nobody can use it
                continue
            try:
                self._fault("slot.write", item.key)
                io.write_slot(item.slot_id, payload)
            except Exception as exc:
                outcomes.append(_Outcome(item, False, classify(exc)))
                continue
            outcomes.append(_Outcome(item, False, None, nbytes=len(value)))
        if bad:
            try:
                client.delete(*bad)  # a cluster client splits it by slot
            except Exception as exc:  # best effort: the value is refused at every read anyway
                self._failed(exc, "DEL of damaged values")
        return outcomes

    def _exists_batch(self, keys: list[OffloadKey]) -> dict[OffloadKey, bool] | None:
        if self._health.down():
            return None
        try:
            self._fault("redis.exists")
            client = self._connect()
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self.namespace.redis_key(key))
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            self._failed(exc, f"EXISTS of {len(keys)}")
            return None
        self._health.succeeded()
        return {k: isinstance(r, int) and r > 0 for k, r in zip(keys, replies, strict=True)}

    def _batch_done(self, batch: list[_Item], is_store: bool, fut: Future[list[_Outcome]]) -> None:
        """Done-callback of a batch (I/O thread, or the cancelling one): report every chunk of it."""
        if fut.cancelled():
            self._done.append([_Outcome(i, is_store, RedisFailure.CANCELLED) for i in batch])
            return
        exc = fut.exception()
        if exc is not None:
            logger.warning("tier %r: a batch failed unexpectedly: %r", self.name, exc)
            self._done.append([_Outcome(i, is_store, classify(exc)) for i in batch])
            return
        self._done.append(fut.result())

    def _probe_done(self, gens: dict[OffloadKey, int], fut: Future[dict[OffloadKey, bool] | None]) -> None:
        answer = None if fut.cancelled() or fut.exception() is not None else fut.result()
        self._probed.append((gens, answer))
