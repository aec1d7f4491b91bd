"""Metrics from transitions: gauges, time in state, bytes and GB/s, failures by cause, the stuck-job
detector, and the Prometheus exposition. Every time comes from a fake clock: nothing sleeps."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import FakeRequest, LoopbackWorkers, tokens

from kvfsm.control.config import OffloadConfig
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines
from kvfsm.control.job import Job
from kvfsm.control.scheduler import OffloadingScheduler, ScheduledRequest, SchedulerOutput
from kvfsm.control.types import GPUBlockSpec, OffloadKey, ReqContext, SlotSpec, make_offload_key
from kvfsm.errors import ConfigError
from kvfsm.machines.compiled import add_tracer, remove_tracer, set_tracer
from kvfsm.machines.names import JobKind, JobState
from kvfsm.observe.metrics import KvfsmMetrics, MetricsUnavailable
from kvfsm.testing.coverage import TransitionLog

BYTES_PER_BLOCK = 1_000_000


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def metrics(clock: FakeClock) -> Iterator[KvfsmMetrics]:
    with KvfsmMetrics(clock=clock, stuck_after=10.0, bytes_per_block=BYTES_PER_BLOCK) as m:
        yield m


def job(job_id: int, kind: JobKind = JobKind.STORE, blocks: int = 4, world_size: int = 2) -> Job:
    gpu = GPUBlockSpec(tuple(range(blocks)))
    keys = (make_offload_key(bytes([job_id]) * 16),)
    return Job(job_id, kind, f"r{job_id}", keys, gpu, SlotSpec(tuple(range(blocks))), world_size)


def test_gauges_follow_jobs_through_their_states(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    a, b = job(0), job(1, JobKind.LOAD)
    metrics.observe_new_jobs([a, b])
    assert metrics.jobs[("store", "submitted")] == 1 and metrics.jobs[("load", "submitted")] == 1
    a.launch(0)
    assert metrics.jobs[("store", "submitted")] == 0 and metrics.jobs[("store", "in_flight")] == 1
    a.launch(1)  # a self-loop: no state change
    assert metrics.jobs[("store", "in_flight")] == 1
    a.ack(0)
    a.ack(1)
    assert a.state is JobState.COMPLETE
    assert metrics.jobs[("store", "in_flight")] == 0 and metrics.finished[("store", "complete")] == 1
    assert metrics.jobs[("load", "submitted")] == 1
    assert metrics.snapshot()["jobs"] == {"load/submitted": 1}


def test_time_in_state_uses_the_injected_clock(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    a = job(0)
    metrics.observe_new_jobs([a])
    clock.advance(0.25)
    a.launch(0)
    clock.advance(1.0)
    a.launch(1)
    clock.advance(2.0)
    a.ack(0)
    a.ack(1)
    assert metrics.time_in_state("job", "store", "submitted") == (1, 0.25)
    assert metrics.time_in_state("job", "store", "in_flight") == (1, 3.0)


def test_jobs_first_seen_at_a_transition_count_from_then(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    a = job(0, world_size=1)
    clock.advance(5.0)
    a.launch(0)  # never observed at creation: its submitted time counts as 0
    assert metrics.time_in_state("job", "store", "submitted") == (1, 0.0)
    assert metrics.jobs[("store", "in_flight")] == 1 and metrics.jobs[("store", "submitted")] == 0


def test_bytes_and_gbps_per_direction(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    store, load = job(0, blocks=4, world_size=1), job(1, JobKind.LOAD, blocks=2, world_size=1)
    store.launch(0)
    load.launch(0)
    clock.advance(0.002)
    store.ack(0)
    clock.advance(0.002)
    load.ack(0)
    assert metrics.transfer_bytes == {"gpu_to_cpu": 4 * BYTES_PER_BLOCK, "cpu_to_gpu": 2 * BYTES_PER_BLOCK}
    assert metrics.transfer_blocks == {"gpu_to_cpu": 4, "cpu_to_gpu": 2}
    n, rate = metrics.gbps("gpu_to_cpu")
    assert n == 1 and rate == pytest.approx(4e6 / 0.002 / 1e9)
    n, rate = metrics.gbps("cpu_to_gpu")
    assert n == 1 and rate == pytest.approx(2e6 / 0.004 / 1e9)
    failed = job(2, blocks=8, world_size=1)
    failed.launch(0)
    failed.fail(0)  # a failed copy moves no committed bytes
    assert metrics.transfer_bytes["gpu_to_cpu"] == 4 * BYTES_PER_BLOCK


def test_failures_and_timeouts_by_cause(metrics: KvfsmMetrics) -> None:
    worker = job(0)
    worker.launch(0)
    worker.launch(1)
    worker.fail(1)
    worker.ack(0)  # the last report after a failure: failed
    refused = job(1, world_size=1)
    refused.fail(0)  # no launch at all
    cancelled = job(2)
    cancelled.cancel()
    stale = job(3)
    stale.launch(0)
    stale.discard()
    timed = job(4, JobKind.LOAD)
    timed.launch(0)
    timed.time_out()
    assert dict(metrics.failures) == {
        ("store", "worker"): 1,
        ("store", "refused"): 1,
        ("store", "cancelled"): 1,
        ("store", "reset"): 1,
        ("load", "timeout"): 1,
    }
    assert metrics.finished[("load", "timed_out")] == 1
    assert not +metrics.jobs  # no job is live any more


def test_stuck_detector_warns_once_per_job_and_state(
    metrics: KvfsmMetrics, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    old, young = job(0), job(1)
    old.launch(0)
    clock.advance(6.0)
    young.launch(0)
    clock.advance(5.0)  # old: 11 s in flight, young: 5 s
    with caplog.at_level(logging.WARNING, logger="kvfsm.observe.metrics"):
        stuck = metrics.check_stuck()
        assert [(s.job_id, s.state, s.age) for s in stuck] == [(0, "in_flight", 11.0)]
        assert len(caplog.records) == 1 and "store job 0" in caplog.records[0].getMessage()
        clock.advance(1.0)
        assert [s.job_id for s in metrics.check_stuck()] == [0]  # still stuck, not warned again
        assert len(caplog.records) == 1
        clock.advance(5.0)  # young: 11 s
        assert [s.job_id for s in metrics.check_stuck()] == [0, 1]
        assert len(caplog.records) == 2
    assert metrics.stuck_total[("store", "in_flight")] == 2
    old.launch(1)  # a self-loop does not reset its time in the state
    assert [s.job_id for s in metrics.check_stuck()] == [0, 1]
    old.ack(0)
    old.ack(1)
    young.launch(1)
    assert [s.job_id for s in metrics.check_stuck()] == [1]  # the committed one is gone
    young.ack(0)
    young.ack(1)
    assert metrics.check_stuck() == []


def test_stuck_check_is_given_an_explicit_time(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    a = job(0)
    a.launch(0)
    assert metrics.check_stuck(now=clock.now + 9.0) == []
    assert [s.job_id for s in metrics.check_stuck(now=clock.now + 10.5)] == [0]


def test_engine_and_request_states_from_a_scheduler(clock: FakeClock) -> None:
    """Tier counters and allocation failures come from the watched manager and scheduler."""
    manager = CPUOffloadingManager(2)
    sched = OffloadingScheduler(OffloadConfig(4), manager)
    workers = LoopbackWorkers(1)
    m = KvfsmMetrics(clock=clock, bytes_per_block=10)
    m.watch_manager(manager)
    m.watch_scheduler(sched)
    with m:
        req = FakeRequest("r", tokens("r", 17), 4)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [0, 1, 2, 3, 4], 0)
        meta = sched.build_connector_meta(SchedulerOutput((ScheduledRequest("r", (0, 1, 2, 3, 4), 17, admitted=True),)))
        workers.deliver(meta)
        clock.advance(1.0)
        sched.update_connector_output(workers.report_all())
    snap = m.snapshot()
    assert snap["tiers"] == {
        "cpu": {"lookups": 1, "hits": 0, "misses": 1, "hit_pending": 0, "lookup_retries": 0, "evictions": 0}
    }
    assert snap["allocation_failures"] == 1  # 4 chunks do not fit in 2 slots
    assert m.time_in_state("request", "request", "tracked")[0] == 1
    with pytest.raises(ConfigError):
        m.watch_manager(object())
    with pytest.raises(ConfigError):
        m.watch_scheduler(object())


def test_metrics_chain_the_previous_tracer(clock: FakeClock) -> None:
    seen: list[str] = []

    def previous(machine: str, model: object, event: str, source: str, dest: str) -> None:
        seen.append(event)

    old = set_tracer(previous)
    try:
        with KvfsmMetrics(clock=clock) as m:
            a = job(0, world_size=1)
            a.launch(0)
            a.ack(0)
        assert seen == ["launch", "ack"] and m.transitions == 2
        assert set_tracer(previous) is previous
    finally:
        set_tracer(old)


def test_tracers_are_removed_in_any_order(clock: FakeClock) -> None:
    """Metrics, a transition log and a plain tracer run side by side; removing the first one installed
    leaves the others running (no chain to break)."""
    seen: list[str] = []
    handle = add_tracer(lambda machine, model, event, source, dest: seen.append(event))
    m = KvfsmMetrics(clock=clock).install()
    log = TransitionLog().install()
    try:
        job(0, world_size=1).launch(0)
        remove_tracer(handle)
        remove_tracer(handle)  # a second removal is a no-op
        job(1, world_size=1).launch(0)
        m.uninstall()
        job(2, world_size=1).launch(0)
        assert seen == ["launch"]
        assert m.transitions == 2
        assert log.counts[("job", "launch")] == 3
    finally:
        log.uninstall()
        m.uninstall()
        remove_tracer(handle)


def test_configuration_is_validated() -> None:
    with pytest.raises(ConfigError):
        KvfsmMetrics(stuck_after=0)
    with pytest.raises(ConfigError):
        KvfsmMetrics(bytes_per_block=-1)


def test_prometheus_exposition(metrics: KvfsmMetrics, clock: FakeClock) -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client.parser import text_string_to_metric_families

    manager = CPUOffloadingManager(4)
    metrics.watch_manager(manager)
    for _ in range(3):  # one request asking three times: one lookup (a miss), two retries
        manager.lookup(OffloadKey(b"k" * 20), ReqContext("r"))
    a, b = job(0, world_size=1), job(1, JobKind.LOAD, world_size=1)
    a.launch(0)
    b.launch(0)
    clock.advance(0.5)
    a.ack(0)
    clock.advance(20.0)
    metrics.check_stuck()
    text = metrics.exposition().decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("kvfsm_jobs", (("kind", "load"), ("state", "in_flight")))] == 1
    assert samples[("kvfsm_jobs_finished_total", (("kind", "store"), ("outcome", "complete")))] == 1
    assert samples[("kvfsm_transfer_bytes_total", (("direction", "gpu_to_cpu"),))] == 4 * BYTES_PER_BLOCK
    key = ("kvfsm_time_in_state_seconds_sum", (("kind", "store"), ("machine", "job"), ("state", "in_flight")))
    assert samples[key] == pytest.approx(0.5)
    assert samples[("kvfsm_stuck_jobs", (("kind", "load"), ("state", "in_flight")))] == 1
    assert samples[("kvfsm_stuck_job_warnings_total", (("kind", "load"), ("state", "in_flight")))] == 1
    assert samples[("kvfsm_tier_lookups_total", (("result", "miss"), ("tier", "cpu")))] == 1
    assert samples[("kvfsm_tier_lookup_retries_total", (("tier", "cpu"),))] == 2
    assert ("kvfsm_engine_state", (("state", "idle"),)) in samples


def test_prometheus_is_optional(metrics: KvfsmMetrics, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    monkeypatch.setitem(sys.modules, "prometheus_client.core", None)
    with pytest.raises(MetricsUnavailable, match=r"kvfsm\[metrics\]"):
        metrics.exposition()
    with pytest.raises(MetricsUnavailable):
        list(metrics.collect())
    assert isinstance(metrics.snapshot(), dict)  # everything else works without it


def test_importing_kvfsm_metrics_does_not_import_prometheus() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "import kvfsm.observe.metrics, kvfsm.observe.trace, kvfsm.bench.workload, kvfsm.bench.control\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_a_quarantined_copy_that_never_reports_is_warned_once_as_stuck(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 10, item 6: a timed-out copy keeps the engine draining until it reports, so the stuck-copy
    detector makes a copy that never reports visible (once), and forgets it once it has reported."""
    manager = CPUOffloadingManager(16)
    sched = OffloadingScheduler(OffloadConfig(4, 1, 2), manager, deadlines=Deadlines(store_s=1.0), clock=clock)
    workers = LoopbackWorkers(2)
    m = KvfsmMetrics(clock=clock, stuck_after=10.0)
    m.watch_scheduler(sched)
    with m, caplog.at_level(logging.WARNING, logger="kvfsm.observe.metrics"):
        req = FakeRequest("r", tokens("r", 17), 4)
        sched.get_num_new_matched_tokens(req, 0)
        sched.update_state_after_alloc(req, [0, 1, 2, 3, 4], 0)
        meta = sched.build_connector_meta(SchedulerOutput((ScheduledRequest("r", (0, 1, 2, 3, 4), 17, admitted=True),)))
        workers.deliver(meta)
        (jid,) = meta.store_jobs
        sched.update_connector_output(workers.report(jid, [0]))  # rank 0 in time; rank 1's copy hangs
        clock.advance(2.0)
        sched.build_connector_meta(SchedulerOutput())  # the deadline passed: timed out, quarantined
        assert sched.is_quarantined(jid) and sched.has_pending_push_work()
        clock.advance(10.0)
        assert m.check_stuck() == []  # exactly stuck_after since the time-out: not yet
        clock.advance(0.5)
        (stuck,) = m.check_stuck()
        assert (stuck.job_id, stuck.kind, stuck.state, stuck.age) == (jid, "store", "quarantined", 10.5)
        assert [s.job_id for s in m.check_stuck()] == [jid]  # still stuck, not warned again
        warnings = [r.getMessage() for r in caplog.records if "stuck copy" in r.getMessage()]
        assert len(warnings) == 1 and f"store job {jid}" in warnings[0]
        assert m.stuck_copies_total == {"store": 1} and m.snapshot()["stuck_copies_total"] == {"store": 1}
        sched.update_connector_output(workers.report(jid, [1]))  # the copy reports at last
        assert not sched.is_quarantined(jid) and not sched.has_pending_push_work()
        assert m.check_stuck() == []
