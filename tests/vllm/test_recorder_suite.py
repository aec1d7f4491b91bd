"""vLLM 0.33's own offloading-connector suite, recorded by kvfsm (``-p kvfsm.vllm.recorder``) and checked
against kvfsm's spec. Runs where vLLM's sdist tests are unpacked: ``KVFSM_VLLM_SRC`` names the tree (the
``vllm`` tox env's runner fetches it); skipped otherwise.

Every violation is either a known finding, listed in ``FINDINGS`` with its reason, or fails the test.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The real vLLM (tests/vllm itself is a namespace package named vllm when tests/ is on sys.path).
pytest.importorskip("vllm.v1.core.sched.scheduler")

from kvfsm.observe.trace import TraceViolation, verify_trace_file
from kvfsm.vllm.drive import opt_config_dir
from kvfsm.vllm.recorder import TRACE_ENV

SUITE = "tests/v1/kv_connector/unit/offloading_connector"

#: (rule, test name prefix, what the violation says) -> why it is not a defect of the recorder.
FINDINGS = {
    "job_terminates": (
        "the test ends with a store still in flight: vLLM's unit tests stop mid-transfer (an artifact of the "
        "test's scope, not of vLLM's connector)"
    ),
    "transition:running --start_load--> loading": (
        "FINDING: reset_prefix_cache(reset_running_requests=True) preempts a running request, and vLLM looks it "
        "up and plans its load in the same step, before build_connector_meta tells the connector of the "
        "preemption; kvfsm's request machine has no running -> loading row (preempt must come first). KvfsmConnector "
        "takes such a lookup as the preemption (OffloadingScheduler.preempt_unannounced)"
    ),
}


def _hf_home(root: Path) -> Path:
    """An offline hub cache with facebook/opt-125m's config.json (the model vLLM's test helpers hard-code)."""
    model = opt_config_dir(root / "src")
    snapshot = root / "hub" / "models--facebook--opt-125m" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text((model / "config.json").read_text())
    (root / "hub" / "models--facebook--opt-125m" / "refs").mkdir()
    (root / "hub" / "models--facebook--opt-125m" / "refs" / "main").write_text("0" * 40)
    return root


def _finding(v: TraceViolation) -> str:
    if v.rule == "transition":
        return "transition:" + v.detail.split(": ", 1)[-1].split(" is not")[0]
    return v.rule


def test_vllm_connector_suite_recorded_and_checked(tmp_path: Path) -> None:
    src = os.environ.get("KVFSM_VLLM_SRC")
    if not src or not (Path(src) / SUITE).is_dir():
        pytest.skip(f"KVFSM_VLLM_SRC does not name vLLM's sdist tree with {SUITE}")
    trace = tmp_path / "suite.ndjson"
    env = {
        **os.environ,
        TRACE_ENV: str(trace),
        "HF_HOME": str(_hf_home(tmp_path / "hf")),
        "HF_HUB_OFFLINE": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "VLLM_TARGET_DEVICE": "cpu",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    # The tree's own ini makes it pytest's rootdir, not kvfsm's pyproject.toml above it (tox unpacks the tree
    # inside kvfsm's checkout), whose --strict-markers rejects vLLM's own markers.
    ini = Path(src) / "pytest.ini"
    ini.write_text("[pytest]\n")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(ini), "--rootdir", src]
    cmd += ["--confcutdir", "tests/v1"]
    cmd += ["-p", "kvfsm.vllm.recorder", SUITE]
    done = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = verify_trace_file(trace)
    scopes = sum(1 for line in trace.read_text().splitlines() if '"scope"' in line and json.loads(line).get("scope"))
    assert scopes > 600 and report.records > 1000
    found = collections.Counter(_finding(v) for v in report.violations)
    unknown = {k: n for k, n in found.items() if k not in FINDINGS}
    assert not unknown, f"violations that are no known finding: {unknown}\n{report.summary()}"
