"""kvfsm as an oracle for vLLM 0.33's native OffloadingConnector: record what vLLM's own scheduler does
(kvfsm/vllm/recorder.py) over long seeded workloads and validate the trace against kvfsm's spec."""

from __future__ import annotations

import collections
import json
import subprocess
import sys
from pathlib import Path

import pytest

# The real vLLM (tests/vllm itself is a namespace package named vllm when tests/ is on sys.path).
pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfsm.observe.trace import TraceRecorder, verify_trace_file
from kvfsm.vllm.drive import SchedulerDriver, WorkloadSpec, opt_config_dir
from kvfsm.vllm.recorder import NativeRecorder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return opt_config_dir(tmp_path_factory.mktemp("model"))


def _record(
    model_dir: Path, path: Path, world: int, spec: WorkloadSpec, plant: str | None = None
) -> collections.Counter[tuple[str, str]]:
    driver = SchedulerDriver(model_dir, "native", num_gpu_blocks=48, cpu_chunks=64, max_num_seqs=6, world_size=world)
    native = driver.connector_scheduler
    if plant == "idle_with_jobs":
        # #42611's class of bug: the connector stops asking the engine to step while jobs are in flight.
        native.has_pending_push_work = lambda: False
    with TraceRecorder(path) as trace:
        recorder = NativeRecorder(native, trace, world)
        driver.run_workload(spec, on_step=lambda d: recorder.engine_step(d.scheduler.get_num_unfinished_requests()))
        recorder.engine_step(0)
        recorder.engine_shutdown()
    events: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if "machine" in rec:
            events[(rec["machine"], rec["event"])] += 1
    return events


@pytest.mark.parametrize(("world", "seed"), [(1, 1), (2, 2), (2, 3)])
def test_native_connector_over_a_long_random_workload_is_a_behaviour_of_the_spec(
    model_dir: Path, tmp_path: Path, world: int, seed: int
) -> None:
    spec = WorkloadSpec(
        num_requests=300, seed=seed, wave=10, gpu_cache_reset_rate=0.3, connector_reset_rate=0.02, abort_rate=0.05
    )
    path = tmp_path / "native.ndjson"
    events = _record(model_dir, path, world, spec)
    # The workload reaches every part of the connector the spec covers.
    for needed in [
        ("job", "launch"),
        ("job", "ack"),
        ("job", "discard"),
        ("request", "start_load"),
        ("request", "load_done"),
        ("request", "defer"),
        ("request", "preempt"),
        ("request", "reset"),
        ("slot", "commit_write"),
        ("slot", "end_read"),
        ("slot", "evict"),
        ("engine", "settle"),
    ]:
        assert events[needed] > 0, f"the workload never reached {needed}"
    assert events[("engine", "admit")] > 5  # drained to idle and admitted again, many times
    report = verify_trace_file(path)
    assert report.ok, report.summary()


@pytest.mark.parametrize("plant", [None, "idle_with_jobs"])
def test_the_oracle_catches_a_planted_drain_bug_in_vllm(model_dir: Path, tmp_path: Path, plant: str | None) -> None:
    """One request whose stores report late, stepped while vLLM's engine loop would step: valid as vLLM
    ships; with its has_pending_push_work() planted to answer False (the engine goes idle with the stores
    in flight, the bug class #42611 and #45595 were about) the trace is rejected."""
    driver = SchedulerDriver(model_dir, "native", min_report_delay=6, max_report_delay=6)
    native = driver.connector_scheduler
    if plant == "idle_with_jobs":
        native.has_pending_push_work = lambda: False
    path = tmp_path / "drain.ndjson"
    with TraceRecorder(path) as trace:
        recorder = NativeRecorder(native, trace, 1)
        driver.add(list(range(3, 70)), max_tokens=2)
        for _ in range(40):  # vLLM's engine loop: step while has_requests()
            recorder.engine_step(driver.scheduler.get_num_unfinished_requests())
            if not driver.has_work():
                break
            driver.step()
        recorder.engine_step(0)
        recorder.engine_shutdown()
    report = verify_trace_file(path)
    if plant is None:
        assert report.ok, report.summary()
    else:
        assert not report.ok
        rules = {v.rule for v in report.violations}
        assert rules & {"idle_only_when_nothing_pending", "pending_work_covers_jobs"}, rules


def test_kvfsm_check_trace_accepts_the_recording(model_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "native.ndjson"
    _record(model_dir, path, 2, WorkloadSpec(num_requests=60, seed=7, wave=10, gpu_cache_reset_rate=0.3))
    done = subprocess.run(
        [sys.executable, "-m", "kvfsm", "check", "--trace", str(path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "a valid behaviour of the spec" in done.stdout
