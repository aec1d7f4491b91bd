"""kvfsm inside a serving vLLM engine (kvfsm/vllm/serving.py): real forward passes over a tiny Llama, real KV
bytes moved by kvfsm, judged on what the engine computed and on vLLM's own block table.

Runs where a vLLM that computes tokens on this machine is installed and ``KVFSM_E2E=1`` (tox env ``e2e``:
vLLM's CPU build). Each engine runs the same workload as a reference engine with no connector: shared
prefixes across ``reset_prefix_cache()``, a 40-block GPU cache (prefixes evicted and reloaded, requests
preempted), prefills of several chunks. A run passes when:

- its tokens equal the reference's and every logprob is within 1e-4 of the reference's;
- vLLM counted external prefix-cache hits in the round after the reset (the tokens came from kvfsm);
- the seam check ran on every step, on every job, with no violation (in-process engines);
- vLLM's engine core, stepped as its busy loop steps it, ends with nothing pending, and kvfsm logged no
  warning, shutdown included.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, replace
from pathlib import Path

import pytest

if os.environ.get("KVFSM_E2E") != "1":
    pytest.skip("needs a vLLM that computes tokens here: tox -e e2e (sets KVFSM_E2E=1)", allow_module_level=True)
pytest.importorskip("vllm.v1.core.sched.scheduler")
pytest.importorskip("transformers")

from redis_support import REDIS_SERVER, RedisServer

import kvfsm.vllm.connector as connector_module
from kvfsm.control.scheduler import ScheduledRequest, SchedulerOutput
from kvfsm.errors import SeamViolationError
from kvfsm.vllm.serving import EngineSetup, RunResult, TinyModel, Workload, build_tiny_model, run_workload

LOGPROB_TOLERANCE = 1e-4
WORKLOAD = Workload()
ROUTES = ("connector", "spec")


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cached = os.environ.get("KVFSM_E2E_MODELS")
    return Path(cached) if cached else tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def model_dir(model_root: Path) -> Path:
    return build_tiny_model(model_root)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> RunResult:
    ref = run_workload(model_dir, EngineSetup(route="none"), WORKLOAD)
    assert ref.preemptions > 0, "the workload must preempt requests on the reference engine too"
    return ref


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip("redis-server not found: apt-get install -y redis-server")
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    try:
        yield server.url
    finally:
        server.stop()


def assert_served_right(run: RunResult, reference: RunResult, *, in_process: bool = True) -> None:
    assert run.seam_violations == []
    if in_process:
        assert run.seam_jobs_checked > 0, "checked mode must have checked every job against vLLM's block table"
        assert run.seam_loads_checked > 0, "no load job was checked against vLLM's allocation"
        assert run.ended_idle, "vLLM's engine core must go idle with nothing pending"
    assert run.tokens == reference.tokens, "tokens differ from the engine with no connector"
    assert run.max_logprob_diff(reference) <= LOGPROB_TOLERANCE
    assert run.external_hit_tokens[-1] > 0, "vLLM counted no prefix tokens loaded from kvfsm after the reset"
    assert run.preemptions > 0
    assert run.warnings == []


def _setup(route: str, tier: str, tmp_path: Path, redis: str | None = None, **kw: object) -> EngineSetup:
    setup = EngineSetup(route=route, tier=tier, **kw)  # type: ignore[arg-type]
    if tier.startswith("fs"):
        setup = replace(setup, fs_path=str(tmp_path / "fs-tier"))
    if tier == "redis":
        setup = replace(setup, redis_url=redis, redis_prefix=f"e2e-{tmp_path.name}")
    return setup


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(("blocks_per_chunk", "policy"), [(1, "lru"), (2, "lru"), (1, "arc"), (2, "arc")])
def test_cpu_tier(route: str, blocks_per_chunk: int, policy: str, model_dir: Path, reference: RunResult) -> None:
    run = run_workload(model_dir, EngineSetup(route=route, blocks_per_chunk=blocks_per_chunk, policy=policy), WORKLOAD)
    assert_served_right(run, reference)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("tier", ["fs", "fs-durable"])
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_fs_tier(
    route: str, tier: str, blocks_per_chunk: int, model_dir: Path, reference: RunResult, tmp_path: Path
) -> None:
    """A CPU tier too small for the prefixes: they come back through the fs tier below it."""
    setup = _setup(route, tier, tmp_path, blocks_per_chunk=blocks_per_chunk, cpu_chunks=16 // blocks_per_chunk)
    run = run_workload(model_dir, setup, WORKLOAD)
    assert_served_right(run, reference)
    assert any((tmp_path / "fs-tier").rglob("*")), "the fs tier wrote no file"


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("blocks_per_chunk", [1, 2])
def test_redis_tier(
    route: str, blocks_per_chunk: int, model_dir: Path, reference: RunResult, redis_url: str, tmp_path: Path
) -> None:
    setup = _setup(
        route, "redis", tmp_path, redis_url, blocks_per_chunk=blocks_per_chunk, cpu_chunks=16 // blocks_per_chunk
    )
    run = run_workload(model_dir, setup, WORKLOAD)
    assert_served_right(run, reference)


def _engine_process(setup: EngineSetup, workload: Workload, model_root: Path, out: Path) -> RunResult:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvfsm.vllm.serving",
            json.dumps(asdict(setup)),
            json.dumps(asdict(workload)),
            str(model_root),
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())
    data["setup"] = setup
    return RunResult(**data)


@pytest.mark.parametrize("route", ROUTES)
def test_redis_shares_prefixes_between_engines_in_two_processes(
    route: str, model_root: Path, model_dir: Path, reference: RunResult, redis_url: str, tmp_path: Path
) -> None:
    """Engine A computes the prefixes (round 0) and exits; engine B, another process with an empty CPU
    tier, serves round 1 with the prefixes engine A put in Redis."""
    setup = _setup(route, "redis", tmp_path, redis_url)
    a = _engine_process(setup, replace(WORKLOAD, rounds=1), model_root, tmp_path / "a.json")
    assert a.tokens == reference.tokens[:1]
    b = _engine_process(setup, replace(WORKLOAD, first_round=1), model_root, tmp_path / "b.json")
    assert b.external_hit_tokens[0] > 0, "engine B loaded nothing that engine A stored"
    assert b.tokens == reference.tokens[1:]
    assert b.seam_violations == [] and b.seam_jobs_checked > 0 and b.warnings == []


@pytest.mark.parametrize("route", ROUTES)
def test_multiprocess_engine(route: str, model_dir: Path, reference: RunResult) -> None:
    """vLLM's own engine-core process steps the engine (its busy loop drains kvfsm); checked mode runs
    there, where a seam violation would kill the engine and fail the generate call."""
    run = run_workload(model_dir, EngineSetup(route=route, multiprocess=True), WORKLOAD)
    assert_served_right(run, reference, in_process=False)


@pytest.mark.parametrize("route", ROUTES)
def test_corrupted_cpu_pool_is_detected(route: str, model_dir: Path, reference: RunResult) -> None:
    """The negative control: noise in kvfsm's CPU pool after round 0. The loads serve it, and the forward
    pass shows it: the judge above would have caught a wrong copy."""
    run = run_workload(model_dir, EngineSetup(route=route), WORKLOAD, corrupt_cpu_pool=True)
    assert run.external_hit_tokens[-1] > 0
    assert run.tokens[0] == reference.tokens[0]
    assert run.tokens != reference.tokens or run.max_logprob_diff(reference) > 100 * LOGPROB_TOLERANCE


def _translation_before_the_fix(output: object) -> SchedulerOutput:
    """kvfsm's translation as it was: vLLM's ``yield_req_data`` flag read as "whole table" (0.33's meaning)."""
    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

    num_tokens = output.num_scheduled_tokens  # type: ignore[attr-defined]
    scheduled = tuple(
        ScheduledRequest(req_id, tuple(groups[0]) if groups else (), num_tokens.get(req_id, 0), bool(flag))
        for req_id, groups, flag in yield_req_data(output)
    )
    return SchedulerOutput(scheduled=scheduled, preempted_req_ids=frozenset(output.preempted_req_ids or ()))  # type: ignore[attr-defined]


def _new_request_flag() -> bool:
    """What this vLLM's ``yield_req_data`` says of a new request (0.32: False, 0.33 and later: True)."""
    from types import SimpleNamespace

    from vllm.distributed.kv_transfer.kv_connector.utils import yield_req_data

    cached = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set(), resumed_from_preemption=[])
    output = SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id="r", block_ids=([1],))], scheduled_cached_reqs=cached
    )
    return bool(next(iter(yield_req_data(output)))[2])


def test_translation_before_the_fix_violates_the_seam(
    model_dir: Path, reference: RunResult, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a vLLM that flags new requests False (0.32), the old translation doubles a new request's block
    list and a later store copies the wrong GPU block: the seam check stops it at the first such job.
    Unchecked, the same run serves wrong KV (tokens or logprobs differ)."""
    if _new_request_flag():
        pytest.skip("this vLLM flags a new request's table True: the old translation read it right")
    monkeypatch.setattr(connector_module, "scheduler_output_of", _translation_before_the_fix)
    with pytest.raises(SeamViolationError, match="the engine's block table holds"):
        run_workload(model_dir, EngineSetup(route="connector", blocks_per_chunk=2), WORKLOAD)
    unchecked = run_workload(model_dir, EngineSetup(route="connector", blocks_per_chunk=2, checked=False), WORKLOAD)
    assert unchecked.tokens != reference.tokens or unchecked.max_logprob_diff(reference) > 100 * LOGPROB_TOLERANCE


def test_tiny_model_is_built_once(model_root: Path, model_dir: Path) -> None:
    assert build_tiny_model(model_root) == model_dir
    assert build_tiny_model(model_root, TinyModel(layers=1)) != model_dir


def test_demo_vllm_reports_hits_and_equal_tokens(model_root: Path) -> None:
    """``kvfsm demo --vllm`` as a user runs it: what it prints is what the engine did."""
    import io

    from kvfsm.vllm.serving import demo

    out = io.StringIO()
    assert demo(model_root, stream=out) == 0
    text = out.getvalue()
    assert "tokens identical to the engine with no connector: yes" in text
    assert "0 violations" in text and "result: OK" in text


def test_readme_vllm_example_runs(tmp_path: Path) -> None:
    """The README's vLLM example, as a user runs it (a script; vLLM's multi-process engine)."""
    import re

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Use with vLLM") :]
    example = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert example is not None and "kv_transfer_config" in example.group(1)
    script = tmp_path / "example.py"
    script.write_text(example.group(1))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=600, check=False, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "prompt tokens 520, served from kvfsm: 512" in proc.stdout
