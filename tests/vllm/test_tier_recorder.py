"""kvfsm as the checker of vLLM's own tiering (kvfsm/vllm/tier_recorder.py): vLLM's real connector scheduler over
its ``TieringOffloadingSpec``, with vLLM's fs tier, kvfsm's tiers and vLLM's KVCR tier below it, recorded and
replayed against kvfsm's spec (``kvfsm check --trace``). The workload runs as vLLM's engine loop does: step while
``has_requests()`` (which asks the connector's ``has_pending_push_work()``), then shut down.
"""

from __future__ import annotations

import collections
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

# The real vLLM with its tiering spec (tests/vllm itself is a namespace package named vllm when tests/ is on
# sys.path); an older vLLM without tiering skips this module.
pytest.importorskip("vllm.v1.kv_offload.tiering.manager")

from kvfsm.errors import ConfigError
from kvfsm.observe.trace import TraceRecorder, TraceReport, verify_trace_file
from kvfsm.vllm.drive import SchedulerDriver, WorkloadSpec, opt_config_dir
from kvfsm.vllm.tier_recorder import TieringRecorder

#: Enough CPU chunks for a request's prefix, few enough that prefixes are evicted and promoted back.
CPU_CHUNKS = 12
DRAIN_STEPS = 20000  #: the most empty steps the engine loop runs after the workload (a guard, not a timing)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return opt_config_dir(tmp_path_factory.mktemp("model"))


def _driver(model_dir: Path, tier: dict[str, Any]) -> SchedulerDriver:
    extra = {"spec_name": "TieringOffloadingSpec", "secondary_tiers": [tier]}
    return SchedulerDriver(
        model_dir, "native", num_gpu_blocks=48, cpu_chunks=CPU_CHUNKS, max_num_seqs=6, world_size=1, extra=extra
    )


def _record(driver: SchedulerDriver, path: Path, spec: WorkloadSpec, plant: str | None = None) -> TieringRecorder:
    """Run ``spec`` as vLLM's engine loop does, then the empty steps while it still has work, then shut down."""
    native = driver.connector_scheduler
    if plant == "manager_ignores_tiers":
        # vLLM's tiering manager answering only for the primary: cascades to the tier are no longer pending work.
        native.manager.has_pending_work = lambda: False
    with TraceRecorder(path, process_wide=False) as trace:
        recorder = TieringRecorder(native, trace, 1)
        try:
            driver.run_workload(
                spec,
                on_step=lambda d: recorder.engine_step(d.scheduler.get_num_unfinished_requests()),
                max_steps=DRAIN_STEPS,
            )
        finally:
            recorder.engine_step(0)
            recorder.engine_shutdown()
    return recorder


def _events(path: Path) -> collections.Counter[tuple[str, str, str]]:
    events: collections.Counter[tuple[str, str, str]] = collections.Counter()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "machine" in rec:
            events[(rec["machine"], rec["event"], rec.get("kind", ""))] += 1
    return events


def _tier(name: str, root: Path) -> dict[str, Any]:
    if name == "vllm-fs":
        return {"type": "fs", "root_dir": str(root)}
    return {"type": "KvfsmFsTier", "module_path": "kvfsm.vllm.tiers", "fs_path": str(root)}


@pytest.mark.parametrize("tier", ["vllm-fs", "kvfsm-fs"])
def test_vllms_tiering_over_a_random_workload_is_a_behaviour_of_the_spec(
    model_dir: Path, tmp_path: Path, tier: str
) -> None:
    """Stores cascade to the tier, evicted prefixes are promoted back into the primary and loaded from it, the
    engine drains to idle between waves and stops at the end: every record is a transition of the spec."""
    driver = _driver(model_dir, _tier(tier, tmp_path / "fs"))
    path = tmp_path / "tiering.ndjson"
    _record(driver, path, WorkloadSpec(num_requests=80, seed=3, wave=8))
    events = _events(path)
    for needed in [
        ("job", "launch", "store"),
        ("job", "launch", "cascade"),
        ("job", "launch", "promote"),
        ("job", "launch", "load"),
        ("slot", "commit_write", ""),
        ("slot", "evict", ""),
        ("engine", "stop", ""),
    ]:
        assert events[needed] > 0, f"the workload never reached {needed}: {sorted(events.items())}"
    assert events[("engine", "admit", "")] > 2  # drained to idle and admitted again
    report = verify_trace_file(path)
    assert report.ok, report.summary()


@pytest.mark.parametrize("faults", ["bad-reads", "slow-reads"])
def test_failed_and_timed_out_promotions_are_a_behaviour_of_the_spec(
    model_dir: Path, tmp_path: Path, faults: str
) -> None:
    """kvfsm's fs tier with faults in its reads. Bad reads (a corrupt block, EIO): vLLM commits the keys that
    arrived and drops the rest, recorded as ``fail``. Reads slower than ``promote_timeout_s``: on 0.34 the
    promotion is reported at its deadline with a deferred release, recorded as the spec's ``time_out`` (its
    I/O may still run; the chunk stays held until the read ends); before 0.34 it is reported when the read
    ends. Every record is still a transition of the spec, and every job ends."""
    from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
    from kvfsm.vllm.tiers import supports_deferred_release

    driver = _driver(model_dir, {**_tier("kvfsm-fs", tmp_path / "fs"), "promote_timeout_s": 0.05})
    (tier,) = driver.connector_scheduler.manager.secondary_tiers
    if faults == "bad-reads":
        rules = [
            FaultRule(op="fs.read", kind=FaultKind.CORRUPT, probability=0.3),
            FaultRule(op="fs.read", kind=FaultKind.EIO, probability=0.3),
        ]
    else:
        rules = [FaultRule(op="fs.read", kind=FaultKind.DELAY, delay_s=0.2, probability=0.3)]
    tier.tier.faults = FaultPlan(rules, seed=11)
    path = tmp_path / "faults.ndjson"
    _record(driver, path, WorkloadSpec(num_requests=40, seed=3, wave=8))
    events = _events(path)
    jobs = sorted((k, v) for k, v in events.items() if k[0] == "job")
    assert events[("job", "ack", "")] > 0, jobs
    if faults == "bad-reads":
        assert events[("job", "fail", "")] > 0, jobs
    elif supports_deferred_release():
        assert events[("job", "time_out", "")] > 0, jobs
    report = verify_trace_file(path)
    assert report.ok, report.summary()


def test_kvfsm_check_trace_accepts_the_recording(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "tiering.ndjson"
    _record(_driver(model_dir, _tier("vllm-fs", tmp_path / "fs")), path, WorkloadSpec(num_requests=24, seed=5, wave=6))
    done = subprocess.run(
        [sys.executable, "-m", "kvfsm", "check", "--trace", str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a valid behaviour of the spec" in done.stdout


def test_the_checker_catches_a_tiering_manager_that_ignores_its_tiers(model_dir: Path, tmp_path: Path) -> None:
    """With vLLM's manager planted to answer has_pending_work() False, the engine goes idle while cascades to the
    fs tier are still in flight (the bug class #45595 fixed for cascades): the trace is rejected."""
    path = tmp_path / "planted.ndjson"
    _record(_driver(model_dir, _tier("vllm-fs", tmp_path / "fs")), path, WorkloadSpec(num_requests=16, seed=3, wave=8),
            plant="manager_ignores_tiers")  # fmt: skip
    report = verify_trace_file(path)
    assert not report.ok
    rules = {v.rule for v in report.violations}
    assert "pending_work_covers_jobs" in rules, report.summary()
    assert any("cascade job" in v.detail for v in report.violations if v.rule == "pending_work_covers_jobs")


def test_a_process_wide_trace_is_refused(model_dir: Path, tmp_path: Path) -> None:
    driver = _driver(model_dir, _tier("kvfsm-fs", tmp_path / "fs"))
    with TraceRecorder(tmp_path / "t.ndjson") as trace, pytest.raises(ConfigError, match="process_wide=False"):
        TieringRecorder(driver.connector_scheduler, trace, 1)


# ---------------------------------------------------------------------------------------------- vLLM's KVCR tier


def _kvcr_tier() -> dict[str, Any]:
    """vLLM 0.34's KVCR tier entry, with nothing but local sockets (no peers, no KVCR service, no GPU)."""
    kvcr = pytest.importorskip("kvcr", reason="kvcr (pip install kvcr) is not installed")
    control = pytest.importorskip("kvcr.control_channels")
    pytest.importorskip("vllm.v1.kv_offload.tiering.kvcr", reason="this vLLM has no KVCR tier")
    if not hasattr(kvcr, "ZmqPeerControlChannel"):
        # vLLM 0.34's adapter imports ZmqPeerControlChannel from kvcr's top level, which kvcr 0.1.1 (the newest on
        # PyPI) does not export; the class itself is kvcr.control_channels'. Export it, nothing else.
        kvcr.ZmqPeerControlChannel = control.ZmqPeerControlChannel
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return {
        "type": "KVCRSecondaryTierManager",
        "module_path": "vllm.v1.kv_offload.tiering.kvcr.manager",
        "router_capabilities": sorted(kvcr.ROUTER_HINT_CAPABILITIES),
        "control_ports": [port],
        "control_host": "127.0.0.1",
        "control_advertise_host": "127.0.0.1",
        "eager_ctrl_connect": False,
    }


def test_vllms_kvcr_tier_never_lets_the_engine_go_idle(model_dir: Path, tmp_path: Path) -> None:
    """vLLM's real KVCR tier, constructed locally: after the last request ends and every job has ended, the
    connector still asks for steps (the tier's has_pending_work() is True unconditionally), so vLLM's engine loop
    runs empty steps for as long as it lives and a shutdown cannot stop. The recorded trace says so: the engine
    settles to ``draining`` step after step with no job live, and the scope ends with it not stopped."""
    driver = _driver(model_dir, _kvcr_tier())
    try:
        path = tmp_path / "kvcr.ndjson"
        with TraceRecorder(path, process_wide=False) as trace:
            recorder = TieringRecorder(driver.connector_scheduler, trace, 1)
            for i in range(3):
                driver.add(list(range(3 + 100 * i, 70 + 100 * i)), max_tokens=2)
            steps = 0
            while driver.scheduler.get_num_unfinished_requests() and steps < DRAIN_STEPS:
                recorder.engine_step(driver.scheduler.get_num_unfinished_requests())
                driver.step()
                steps += 1
            assert driver.scheduler.get_num_unfinished_requests() == 0
            for _ in range(50):  # vLLM's engine loop: has_requests() is still True, so it steps again
                recorder.engine_step(0)
                assert driver.has_work()
                driver.step()
            assert not driver.connector_scheduler._jobs  # vLLM's own job map is empty: nothing to advance
            recorder.engine_shutdown()
        report: TraceReport = verify_trace_file(path)
    finally:
        driver.connector_scheduler.manager.shutdown()
    assert not report.ok
    assert {v.rule for v in report.violations} == {"engine_stops"}, report.summary()
    # After the last job of the scope ended, every settle still reported pending push work, with no job live.
    records = [json.loads(line) for line in path.read_text().splitlines()]
    machine = [r for r in records if "machine" in r]
    last_job = max(i for i, r in enumerate(machine) if r["machine"] == "job")
    idle_settles = [r for r in machine[last_job + 1 :] if r["machine"] == "engine" and r["event"] == "settle"]
    assert len(idle_settles) >= 40
    assert all(r["pending"] is True and r["to"] == "draining" for r in idle_settles)
