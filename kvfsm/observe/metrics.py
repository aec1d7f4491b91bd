"""Metrics from the spec machines' transitions, exported through prometheus-client (an optional extra).

:class:`KvfsmMetrics` is a transition tracer (registered with :func:`kvfsm.machines.compiled.add_tracer`, beside
any other tracer). Every transition costs O(1): it updates plain Python counters, and the
Prometheus families are built from them only when scraped. So the logic runs, and is tested, without
prometheus-client; only :meth:`KvfsmMetrics.registry`, :meth:`~KvfsmMetrics.exposition` and
:meth:`~KvfsmMetrics.serve` need it (``pip install 'kvfsm[metrics]'``).

Exported families:

- ``kvfsm_jobs{kind,state}``: jobs per kind in each live state (gauge);
  ``kvfsm_jobs_finished_total{kind,outcome}``: jobs per terminal state (counter);
- ``kvfsm_time_in_state_seconds{machine,kind,state}``: time spent in a state, observed when a job,
  request or the engine leaves it (histogram; slots are not timed, there are too many);
- ``kvfsm_transfer_bytes_total{direction}``, ``kvfsm_transfer_blocks_total{direction}`` and
  ``kvfsm_transfer_gbps{direction}`` (histogram of per-job GB/s, first launch to commit) for
  gpu_to_cpu (store), cpu_to_gpu (load), cpu_to_tier (cascade), tier_to_cpu (promote);
- ``kvfsm_tier_lookups_total{tier,result}`` (distinct lookups per request, under their latest answer, as
  vLLM counts them), ``kvfsm_tier_lookup_retries_total{tier}`` (a deferred request's repeated lookups) and
  ``kvfsm_tier_evictions_total{tier}`` from the watched managers' counters (:meth:`watch_manager`);
- ``kvfsm_job_failures_total{kind,cause}``: worker (a worker reported a failure), refused (failed before
  any launch), timeout, cancelled, reset (discarded by reset_cache); plus
  ``kvfsm_store_allocation_failures_total`` from watched schedulers;
- ``kvfsm_cpu_cache_usage_ratio{tier,pinned_by}``: the fraction of a watched CPU manager's slots pinned by
  transfers (``pinned_by`` = all, store or load; vLLM's CPU cache-usage gauges) and
  ``kvfsm_cpu_allocation_size{tier}``: new keys per ``prepare_store`` (histogram, vLLM's buckets);
- ``kvfsm_engine_state{state}``: 1 for the engine's current state;
- ``kvfsm_stuck_jobs{kind,state}`` (gauge) and ``kvfsm_stuck_job_warnings_total{kind,state}``: the stuck-job
  detector;
- ``kvfsm_stuck_quarantined_copies{kind}`` (gauge) and ``kvfsm_stuck_copy_warnings_total{kind}``: the
  stuck-copy detector.

Stuck jobs: :meth:`check_stuck` (called by the engine loop, a timer, or each scrape) warns once per job and
state when a job has stayed in a live state longer than ``stuck_after`` seconds. Live jobs are kept in the
order they entered their state, so a check costs O(stuck jobs + 1). Every time comes from the injectable
``clock``; tests pass a fake one and never sleep.

Stuck copies: a timed-out job whose launched copy has not reported stays quarantined, and it is pending
work, so the engine keeps draining until the copy reports (spec/README.md, "Quarantine"). A copy that
never reports would keep the engine stepping silently; :meth:`check_stuck` therefore also warns, once per
copy, when a watched scheduler (:meth:`watch_scheduler`) still holds a quarantined copy more than
``stuck_after`` seconds after its job timed out, and reports it as a :class:`StuckJob` in state
``quarantined``.
"""

from __future__ import annotations

import bisect
import importlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from typing_extensions import override

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.machines.compiled import TracerHandle, add_tracer, remove_tracer
from kvfsm.machines.loader import load_machine

__all__ = [
    "ALLOCATION_SIZE_BUCKETS",
    "DIRECTIONS",
    "GBPS_BUCKETS",
    "SECONDS_BUCKETS",
    "KvfsmMetrics",
    "MetricsUnavailable",
    "StuckJob",
]

logger = logging.getLogger(__name__)

#: Transfer direction of each job kind.
DIRECTIONS: dict[str, str] = {
    "store": "gpu_to_cpu",
    "load": "cpu_to_gpu",
    "cascade": "cpu_to_tier",
    "promote": "tier_to_cpu",
}
SECONDS_BUCKETS: tuple[float, ...] = (1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0)
GBPS_BUCKETS: tuple[float, ...] = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 75.0, 100.0, 200.0)
_TIMED = ("job", "request", "engine")
#: vLLM 0.33's buckets of its CPU allocation-size histogram (new keys per prepare_store).
ALLOCATION_SIZE_BUCKETS: tuple[float, ...] = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class MetricsUnavailable(KvfsmError, RuntimeError):
    """prometheus-client is not installed; the message says how to install the extra."""


@dataclass(frozen=True, slots=True)
class StuckJob:
    job_id: int
    kind: str
    req_id: str
    state: str
    since: float
    age: float

    @override
    def __str__(self) -> str:
        return f"{self.kind} job {self.job_id} (request {self.req_id!r}) has been {self.state} for {self.age:.3g} s"


class _Histogram:
    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


@dataclass(slots=True)
class _Tracked:
    model: object
    machine: str
    kind: str
    state: str
    entered: float
    first_launch: float | None = None


def _kind(machine: str, model: object) -> str:
    if machine != "job":
        return machine
    kind = getattr(model, "kind", "")
    return str(getattr(kind, "value", kind))


def _as_mapping(stats: Callable[[], object]) -> Callable[[], Mapping[str, int]]:
    """A ``stats()`` that returns a stats dataclass (``as_dict()``) or a mapping, read as a mapping."""

    def read() -> Mapping[str, int]:
        s = stats()
        as_dict = getattr(s, "as_dict", None)
        if callable(as_dict):
            out: Mapping[str, int] = as_dict()
            return out
        return s if isinstance(s, Mapping) else {}

    return read


class KvfsmMetrics:
    """Transition-driven metrics and the stuck-job detector (see the module docs)."""

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        stuck_after: float = 30.0,
        bytes_per_block: int = 0,
        blocks_per_chunk: int = 1,
        log: logging.Logger | None = None,
    ) -> None:
        if not stuck_after > 0:
            raise ConfigError(f"stuck_after must be > 0 seconds, got {stuck_after!r}")
        if bytes_per_block < 0 or blocks_per_chunk < 1:
            raise ConfigError(
                f"bytes_per_block must be >= 0 and blocks_per_chunk >= 1, got {bytes_per_block}, {blocks_per_chunk}"
            )
        self.clock = clock
        self.stuck_after = float(stuck_after)
        self.bytes_per_block = bytes_per_block
        self.blocks_per_chunk = blocks_per_chunk
        self.log = log or logger
        self._lock = threading.RLock()
        self._terminal = {m: load_machine(m).terminal for m in _TIMED}
        self._tracked: dict[int, _Tracked] = {}
        #: Live jobs in the order they entered their current state (the stuck detector's queue).
        self._job_queue: OrderedDict[int, None] = OrderedDict()
        self._warned: dict[int, str] = {}  # job -> the state it was reported stuck in
        self.jobs: Counter[tuple[str, str]] = Counter()  # (kind, live state) -> jobs
        self.finished: Counter[tuple[str, str]] = Counter()  # (kind, terminal state) -> jobs
        self.failures: Counter[tuple[str, str]] = Counter()  # (kind, cause) -> jobs
        self.transfer_bytes: Counter[str] = Counter()
        self.transfer_blocks: Counter[str] = Counter()
        self.stuck_total: Counter[tuple[str, str]] = Counter()
        self.transitions = 0
        self.engine_state: str | None = None
        self._time_in_state: dict[tuple[str, str, str], _Histogram] = {}
        self._gbps: dict[str, _Histogram] = {}
        self._tiers: dict[str, Callable[[], Mapping[str, int]]] = {}
        self._cpu: dict[str, CPUOffloadingManager] = {}  # watched CPU managers (usage, allocation sizes)
        self._schedulers: list[Any] = []
        #: Jobs that entered timed_out while a scheduler is watched: id -> (job, when), pruned at each check.
        self._timed_out_at: dict[int, tuple[object, float]] = {}
        self._copy_warned: set[int] = set()  # ids of quarantined copies already warned about
        self.stuck_copies_total: Counter[str] = Counter()  # kind -> stuck-copy warnings
        self._handle: TracerHandle | None = None  # set while installed

    # ------------------------------------------------------------------ install

    def install(self) -> KvfsmMetrics:
        if self._handle is None:
            self._handle = add_tracer(self)
        return self

    def uninstall(self) -> None:
        if self._handle is not None:
            remove_tracer(self._handle)
            self._handle = None

    def __enter__(self) -> KvfsmMetrics:
        return self.install()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.uninstall()

    def watch_tier(self, name: str, stats: Callable[[], Mapping[str, int]]) -> None:
        """Export a tier's ``lookups/hits/misses/hit_pending/lookup_retries/evictions`` counters, read at
        scrape time."""
        self._tiers[name] = stats

    def watch_manager(self, manager: object, name: str = "cpu") -> None:
        """Watch a CPU manager, or a tiering manager's primary and every secondary tier with ``stats()``."""
        primary = getattr(manager, "primary", None)
        if isinstance(primary, CPUOffloadingManager):
            self._cpu[name] = primary
        if primary is not None and callable(getattr(primary, "stats", None)):
            self.watch_tier(name, _as_mapping(primary.stats))
            for i, tier in enumerate(getattr(manager, "tiers", ())):
                if callable(getattr(tier, "stats", None)):
                    self.watch_tier(f"{getattr(tier, 'name', 'tier')}{i}", _as_mapping(tier.stats))
        elif callable(getattr(manager, "stats", None)):
            self.watch_tier(name, _as_mapping(manager.stats))  # type: ignore[attr-defined]
        else:
            raise ConfigError(f"{type(manager).__name__} has no stats(); expected an offloading manager")

    def watch_scheduler(self, scheduler: object) -> None:
        """Export a scheduler's allocation failures (stores refused for lack of CPU space)."""
        if not hasattr(getattr(scheduler, "stats", None), "allocation_failures"):
            raise ConfigError(f"{type(scheduler).__name__} has no stats.allocation_failures; expected a scheduler")
        self._schedulers.append(scheduler)

    # ------------------------------------------------------------------ the tracer

    def observe_new_jobs(self, jobs: Iterable[object], now: float | None = None) -> None:
        """Start timing jobs from their creation (an engine calls it with each step's new jobs).

        Without it, a job is first seen at its first transition and its submitted time counts as 0.
        """
        t = self.clock() if now is None else now
        with self._lock:
            for job in jobs:
                key = id(job)
                if key in self._tracked:
                    continue
                state = str(getattr(getattr(job, "state", ""), "value", getattr(job, "state", "")))
                kind = _kind("job", job)
                self._tracked[key] = _Tracked(job, "job", kind, state, t)
                self.jobs[(kind, state)] += 1
                self._job_queue[key] = None

    def __call__(self, machine: str, model: object, event: str, source: str, dest: str) -> None:
        with self._lock:
            self._on_transition(machine, model, event, source, dest, self.clock())

    def _on_transition(self, machine: str, model: object, event: str, source: str, dest: str, now: float) -> None:
        self.transitions += 1
        if machine not in _TIMED:
            return
        key = id(model)
        tracked = self._tracked.get(key)
        if tracked is not None and tracked.model is not model:
            tracked = None  # a dead object's id was reused
        kind = _kind(machine, model)
        if tracked is None:
            # First seen: it entered ``source`` no earlier than now (creation is not a transition).
            tracked = _Tracked(model, machine, kind, source, now)
            self._tracked[key] = tracked
            if machine == "job":
                self.jobs[(kind, source)] += 1
                self._job_queue[key] = None
        hist_key = (machine, kind, tracked.state)
        hist = self._time_in_state.get(hist_key)
        if hist is None:
            hist = self._time_in_state[hist_key] = _Histogram(SECONDS_BUCKETS)
        if dest != tracked.state:
            hist.observe(max(0.0, now - tracked.entered))
        if machine == "engine":
            self.engine_state = dest
        elif machine == "job":
            self._on_job(key, tracked, event, dest, now)
        if dest != tracked.state:
            tracked.state = dest
            tracked.entered = now
        if dest in self._terminal[machine]:
            del self._tracked[key]
        if machine == "job" and dest == "timed_out" and self._schedulers:
            self._timed_out_at[key] = (model, now)

    def _on_job(self, key: int, tracked: _Tracked, event: str, dest: str, now: float) -> None:
        kind, source = tracked.kind, tracked.state
        if event == "launch" and tracked.first_launch is None:
            tracked.first_launch = now
        if dest == source:
            return
        self.jobs[(kind, source)] -= 1
        self._warned.pop(key, None)
        if dest in self._terminal["job"]:
            self._job_queue.pop(key, None)
            self.finished[(kind, dest)] += 1
            cause = self._cause(event, source, dest)
            if cause is not None:
                self.failures[(kind, cause)] += 1
            if dest == "complete":
                self._count_transfer(tracked, kind, now)
        else:
            self.jobs[(kind, dest)] += 1
            self._job_queue[key] = None
            self._job_queue.move_to_end(key)

    @staticmethod
    def _cause(event: str, source: str, dest: str) -> str | None:
        if dest == "failed":
            return "refused" if source == "submitted" else "worker"
        return {"timed_out": "timeout", "cancelled": "cancelled", "stale": "reset"}.get(dest)

    def _count_transfer(self, tracked: _Tracked, kind: str, now: float) -> None:
        job = tracked.model
        if kind in ("store", "load"):
            blocks = len(getattr(getattr(job, "gpu", None), "block_ids", ()))
        else:
            blocks = len(getattr(job, "keys", ())) * self.blocks_per_chunk
        direction = DIRECTIONS.get(kind, kind)
        self.transfer_blocks[direction] += blocks
        nbytes = blocks * self.bytes_per_block
        self.transfer_bytes[direction] += nbytes
        if nbytes and tracked.first_launch is not None and now > tracked.first_launch:
            hist = self._gbps.get(direction)
            if hist is None:
                hist = self._gbps[direction] = _Histogram(GBPS_BUCKETS)
            hist.observe(nbytes / (now - tracked.first_launch) / 1e9)

    # ------------------------------------------------------------------ stuck jobs

    def check_stuck(self, now: float | None = None) -> list[StuckJob]:
        """Jobs in one live state for longer than ``stuck_after``; each (job, state) is warned once. Then
        the quarantined copies of watched schedulers that have not reported ``stuck_after`` seconds after
        their job timed out (state ``quarantined``); each copy is warned once."""
        t = self.clock() if now is None else now
        found: list[StuckJob] = []
        with self._lock:
            self._check_stuck_jobs(t, found)
            self._check_stuck_copies(t, found)
        return found

    def _check_stuck_copies(self, t: float, found: list[StuckJob]) -> None:
        quarantined: dict[int, object] = {}
        for sched in self._schedulers:
            for job in sched.quarantined_jobs().values():
                quarantined[id(job)] = job
        for key in [k for k, (job, _) in self._timed_out_at.items() if quarantined.get(k) is not job]:
            del self._timed_out_at[key]  # its copies reported: the memory was handed back
        self._copy_warned &= self._timed_out_at.keys()
        for key, job in quarantined.items():
            since = self._timed_out_at.setdefault(key, (job, t))[1]  # timed out before it was watched: now
            age = t - since
            if age <= self.stuck_after:
                continue
            kind = _kind("job", job)
            stuck = StuckJob(
                int(getattr(job, "job_id", -1)), kind, str(getattr(job, "req_id", "")), "quarantined", since, age
            )
            found.append(stuck)
            if key not in self._copy_warned:
                self._copy_warned.add(key)
                self.stuck_copies_total[kind] += 1
                self.log.warning(
                    "stuck copy: %s has not reported since its time-out; the engine keeps draining until it "
                    "does (threshold %.3g s)",
                    stuck,
                    self.stuck_after,
                )

    def _check_stuck_jobs(self, t: float, found: list[StuckJob]) -> None:
        for key in self._job_queue:
            tracked = self._tracked.get(key)
            if tracked is None:
                continue
            age = t - tracked.entered
            if age <= self.stuck_after:
                break  # the queue is in entry order: every later job entered its state later
            job = tracked.model
            stuck = StuckJob(
                int(getattr(job, "job_id", -1)),
                tracked.kind,
                str(getattr(job, "req_id", "")),
                tracked.state,
                tracked.entered,
                age,
            )
            found.append(stuck)
            if self._warned.get(key) != tracked.state:
                self._warned[key] = tracked.state
                self.stuck_total[(tracked.kind, tracked.state)] += 1
                self.log.warning("stuck job: %s (threshold %.3g s)", stuck, self.stuck_after)

    # ------------------------------------------------------------------ reading

    def time_in_state(self, machine: str, kind: str, state: str) -> tuple[int, float]:
        """(observations, total seconds) of the time-in-state histogram."""
        hist = self._time_in_state.get((machine, kind, state))
        return (0, 0.0) if hist is None else (hist.count, hist.total)

    def gbps(self, direction: str) -> tuple[int, float]:
        """(jobs observed, mean GB/s) per direction."""
        hist = self._gbps.get(direction)
        return (0, 0.0) if hist is None or not hist.count else (hist.count, hist.total / hist.count)

    def tier_counts(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for name, stats in self._tiers.items():
            s = stats()
            fields = ("lookups", "hits", "misses", "hit_pending", "lookup_retries", "evictions")
            out[name] = {k: int(s.get(k, 0)) for k in fields}
        return out

    def cpu_usage(self) -> dict[str, dict[str, float]]:
        """Per watched CPU manager: the fraction of its slots pinned by transfers (all, store, load)."""
        out: dict[str, dict[str, float]] = {}
        for name, cpu in self._cpu.items():
            st = cpu.stats()
            out[name] = {"all": st.usage, "store": st.write_usage, "load": st.read_usage}
        return out

    def allocation_histograms(self) -> dict[str, _Histogram]:
        """Per watched CPU manager: its allocation sizes in vLLM's buckets, built from its cumulative counts."""
        out: dict[str, _Histogram] = {}
        for name, cpu in self._cpu.items():
            h = _Histogram(ALLOCATION_SIZE_BUCKETS)
            for size, n in cpu.allocation_sizes().items():
                h.counts[bisect.bisect_left(h.bounds, size)] += n
                h.total += size * n
                h.count += n
            out[name] = h
        return out

    def snapshot(self) -> dict[str, object]:
        """Everything as plain data (for JSON, logs and tests)."""
        with self._lock:
            stuck = self.check_stuck()
            return {
                "transitions": self.transitions,
                "jobs": {f"{k}/{s}": n for (k, s), n in sorted(self.jobs.items()) if n},
                "finished": {f"{k}/{s}": n for (k, s), n in sorted(self.finished.items())},
                "failures": {f"{k}/{c}": n for (k, c), n in sorted(self.failures.items())},
                "transfer_bytes": dict(self.transfer_bytes),
                "transfer_blocks": dict(self.transfer_blocks),
                "gbps_mean": {d: self.gbps(d)[1] for d in self._gbps},
                "time_in_state": {
                    f"{m}/{k}/{s}": {"count": h.count, "seconds": h.total}
                    for (m, k, s), h in sorted(self._time_in_state.items())
                },
                "engine_state": self.engine_state,
                "tiers": self.tier_counts(),
                "cpu_usage": self.cpu_usage(),
                "allocation_sizes": {
                    n: {"count": h.count, "keys": h.total} for n, h in self.allocation_histograms().items()
                },
                "allocation_failures": sum(s.stats.allocation_failures for s in self._schedulers),
                "stuck": [str(s) for s in stuck],
                "stuck_total": {f"{k}/{s}": n for (k, s), n in sorted(self.stuck_total.items())},
                "stuck_copies_total": dict(sorted(self.stuck_copies_total.items())),
            }

    # ------------------------------------------------------------------ prometheus

    def collect(self) -> Iterator[Any]:
        """Prometheus metric families (the Collector protocol); needs prometheus-client."""
        core = _prometheus()
        gauge, counter, histogram = core.GaugeMetricFamily, core.CounterMetricFamily, core.HistogramMetricFamily
        with self._lock:
            self.check_stuck()
            jobs = gauge("kvfsm_jobs", "Jobs per kind in each live state", labels=["kind", "state"])
            for (kind, state), n in sorted(self.jobs.items()):
                jobs.add_metric([kind, state], n)
            yield jobs
            fin = counter("kvfsm_jobs_finished", "Jobs per kind and terminal state", labels=["kind", "outcome"])
            for (kind, state), n in sorted(self.finished.items()):
                fin.add_metric([kind, state], n)
            yield fin
            fail = counter("kvfsm_job_failures", "Jobs that did not commit, by cause", labels=["kind", "cause"])
            for (kind, cause), n in sorted(self.failures.items()):
                fail.add_metric([kind, cause], n)
            yield fail
            tis = histogram("kvfsm_time_in_state_seconds", "Time spent in a state", labels=["machine", "kind", "state"])
            for (machine, kind, state), h in sorted(self._time_in_state.items()):
                tis.add_metric([machine, kind, state], h.cumulative(), h.total)
            yield tis
            nbytes = counter("kvfsm_transfer_bytes", "Bytes of committed transfers", labels=["direction"])
            blocks = counter("kvfsm_transfer_blocks", "Blocks of committed transfers", labels=["direction"])
            for direction in sorted(set(self.transfer_bytes) | set(self.transfer_blocks)):
                nbytes.add_metric([direction], self.transfer_bytes[direction])
                blocks.add_metric([direction], self.transfer_blocks[direction])
            yield nbytes
            yield blocks
            rate = histogram("kvfsm_transfer_gbps", "Per-job transfer rate, launch to commit", labels=["direction"])
            for direction, h in sorted(self._gbps.items()):
                rate.add_metric([direction], h.cumulative(), h.total)
            yield rate
            lookups = counter("kvfsm_tier_lookups", "Lookups per tier and result", labels=["tier", "result"])
            retries = counter(
                "kvfsm_tier_lookup_retries", "Repeated lookups of a key by a deferred request", labels=["tier"]
            )
            evictions = counter("kvfsm_tier_evictions", "Evictions per tier", labels=["tier"])
            for tier, c in sorted(self.tier_counts().items()):
                for result, field in (("hit", "hits"), ("miss", "misses"), ("hit_pending", "hit_pending")):
                    lookups.add_metric([tier, result], c[field])
                retries.add_metric([tier], c["lookup_retries"])
                evictions.add_metric([tier], c["evictions"])
            yield lookups
            yield retries
            yield evictions
            usage = gauge(
                "kvfsm_cpu_cache_usage_ratio",
                "Fraction of the CPU slots pinned by transfers (all, store or load)",
                labels=["tier", "pinned_by"],
            )
            for tier, by in sorted(self.cpu_usage().items()):
                for pinned_by, value in by.items():
                    usage.add_metric([tier, pinned_by], value)
            yield usage
            sizes = histogram("kvfsm_cpu_allocation_size", "New keys per prepare_store", labels=["tier"])
            for tier, h in sorted(self.allocation_histograms().items()):
                sizes.add_metric([tier], h.cumulative(), h.total)
            yield sizes
            alloc = counter("kvfsm_store_allocation_failures", "Stores refused for lack of CPU space")
            alloc.add_metric([], sum(s.stats.allocation_failures for s in self._schedulers))
            yield alloc
            engine = gauge("kvfsm_engine_state", "1 for the engine's current state", labels=["state"])
            for state in load_machine("engine").states:
                engine.add_metric([state], 1.0 if state == self.engine_state else 0.0)
            yield engine
            stuck_now: Counter[tuple[str, str]] = Counter()
            for key, state in self._warned.items():
                tracked = self._tracked.get(key)
                if tracked is not None and tracked.state == state:
                    stuck_now[(tracked.kind, state)] += 1
            stuck = gauge("kvfsm_stuck_jobs", "Jobs over the stuck threshold in their state", labels=["kind", "state"])
            for (kind, state), n in sorted(stuck_now.items()):
                stuck.add_metric([kind, state], n)
            yield stuck
            warnings = counter("kvfsm_stuck_job_warnings", "Stuck-job warnings", labels=["kind", "state"])
            for (kind, state), n in sorted(self.stuck_total.items()):
                warnings.add_metric([kind, state], n)
            yield warnings
            copies_now: Counter[str] = Counter()
            for key in self._copy_warned:
                copies_now[_kind("job", self._timed_out_at[key][0])] += 1
            copies = gauge(
                "kvfsm_stuck_quarantined_copies",
                "Timed-out copies over the stuck threshold that have not reported (the engine keeps draining)",
                labels=["kind"],
            )
            for kind, n in sorted(copies_now.items()):
                copies.add_metric([kind], n)
            yield copies
            copy_warnings = counter("kvfsm_stuck_copy_warnings", "Stuck-copy warnings", labels=["kind"])
            for kind, n in sorted(self.stuck_copies_total.items()):
                copy_warnings.add_metric([kind], n)
            yield copy_warnings

    def registry(self) -> Any:
        """A new prometheus ``CollectorRegistry`` holding these metrics."""
        reg = _prometheus("prometheus_client").CollectorRegistry(auto_describe=True)
        reg.register(self)
        return reg

    def exposition(self) -> bytes:
        """The metrics in the Prometheus text format."""
        return bytes(_prometheus("prometheus_client").generate_latest(self.registry()))

    def serve(self, port: int, addr: str = "127.0.0.1") -> Any:
        """Serve /metrics over HTTP on a background thread (prometheus_client.start_http_server)."""
        return _prometheus("prometheus_client").start_http_server(port, addr=addr, registry=self.registry())


def _prometheus(module: str = "prometheus_client.core") -> Any:
    """The optional dependency, imported by name so that type checking never needs it installed."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MetricsUnavailable(
            "prometheus-client is not installed; install the extra with: pip install 'kvfsm[metrics]'"
        ) from exc
