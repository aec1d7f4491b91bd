"""``kvfsm bench``: the quick run end to end (a CI smoke test: structure only, never timing), and the
pieces it is built from: the seeded workload, the replay, the scheduler step and the drain rounds."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from kvfsm.bench import vllm_scheduler, vllm_side
from kvfsm.bench.control import OPERATIONS, replay, scheduler_step_cost
from kvfsm.bench.suite import SECTIONS, format_table, run_bench
from kvfsm.bench.workload import (
    WorkloadConfig,
    WorkloadError,
    generate_trace,
    read_jsonl,
    to_keys,
    trace_stats,
    write_jsonl,
)
from kvfsm.cli import main
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.observe.progress import Progress

SMALL = WorkloadConfig(distinct_blocks=3000, num_prefixes=32, seed=7)


# ------------------------------------------------------------------------------------------ workload


def test_the_generated_trace_is_seeded_and_has_the_asked_shape() -> None:
    trace = generate_trace(SMALL)
    assert trace == generate_trace(SMALL)
    assert trace != generate_trace(WorkloadConfig(distinct_blocks=3000, num_prefixes=32, seed=8))
    stats = trace_stats(trace)
    assert stats.distinct_blocks >= 3000
    assert 0.2 < stats.continuations / stats.requests < 0.4  # about 30% continue an earlier request
    assert stats.blocks > stats.distinct_blocks  # shared prefixes and continuations repeat blocks
    # Every request ends with blocks of its own (its unique suffix).
    seen: set[int] = set()
    for req in trace:
        assert req[-1] not in seen
        seen.update(req)


def test_the_default_trace_has_100k_distinct_blocks() -> None:
    stats = trace_stats(generate_trace())
    assert stats.distinct_blocks >= 100_000


def test_continuations_are_whole_earlier_requests() -> None:
    trace = [[1, 2, 3], [1, 2, 3, 4], [1, 2, 5], [9]]
    assert trace_stats(trace).continuations == 1


def test_jsonl_round_trip_and_keys(tmp_path: Path) -> None:
    trace = generate_trace(SMALL)
    path = tmp_path / "trace.jsonl"
    assert write_jsonl(trace, path) == len(trace)
    assert read_jsonl(path) == trace
    keys = to_keys([[1, "x", 1], ["x"]])
    assert keys[0][0] == keys[0][2] and keys[0][1] == keys[1][0] and keys[0][0] != keys[0][1]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2", "not valid JSON"),
        ('{"a": 1}', "expected a JSON list"),
        ("[1, -2]", "out of range"),
        ("[1, 2.5]", "float"),
        ("[true]", "bool"),
    ],
)
def test_bad_jsonl_lines_are_typed_errors_with_their_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"[1, 2]\n\n{line}\n")
    with pytest.raises(WorkloadError, match=message) as err:
        read_jsonl(path)
    assert f"{path}:3" in str(err.value)
    assert isinstance(err.value, KvfsmError)


def test_workload_config_is_validated() -> None:
    with pytest.raises(ConfigError):
        WorkloadConfig(distinct_blocks=0)
    with pytest.raises(ConfigError):
        WorkloadConfig(suffix_blocks=(3, 2))
    with pytest.raises(ConfigError):
        WorkloadConfig(continue_fraction=1.0)


# ------------------------------------------------------------------------------------------ replay


def test_replay_follows_the_vllm_call_order_and_leaves_nothing_pinned() -> None:
    requests = to_keys(generate_trace(SMALL))
    full = replay(requests, 1.0)
    assert full.calls["finish"] == full.calls["touch"] == full.calls["prepare_store"] == len(requests)
    assert full.calls["complete_load"] == full.calls["prepare_load"]
    assert full.evictions == 0 and full.store_refusals == 0 and full.hit_rate > 0.3
    # Lookups stop at the first non-HIT: never more than the blocks, at most one miss per request.
    assert full.hit_blocks <= full.calls["lookup"] <= full.hit_blocks + len(requests)
    small = replay(requests, 0.25)
    assert small.evictions > 0 and small.hit_rate < full.hit_rate
    us = small.as_dict()["us_per_call"]
    assert isinstance(us, dict) and set(us) == set(OPERATIONS)
    with pytest.raises(ConfigError):
        replay(requests, 0.0)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_scheduler_step_cost_plans_the_expected_jobs(kind: str) -> None:
    cost = scheduler_step_cost(4, kind, steps=3, warmup=1, world_size=2)
    assert cost.jobs_per_step == (4 if kind == "prefill" else 0)
    assert cost.num_requests == 4 and cost.us_per_step > 0
    with pytest.raises(ConfigError):
        scheduler_step_cost(4, "verify")


# ------------------------------------------------------------------------------------------ drain


def test_drain_rounds_schedule_the_new_request_after_one_step() -> None:
    pytest.importorskip("torch")
    from kvfsm.bench.drain import measure_drain_rounds
    from kvfsm.control.config import DrainMode

    (nb,) = measure_drain_rounds(DrainMode.NONBLOCKING, 1, repeats=1)
    (bl,) = measure_drain_rounds(DrainMode.BLOCKING, 1, repeats=1)
    assert nb.steps_waited == bl.steps_waited == 1
    assert nb.blocking_waits == 0 and bl.blocking_waits >= 1  # only the baseline flushes
    assert nb.store_bytes == bl.store_bytes == 2**20
    assert "draining" not in bl.timeline


# ------------------------------------------------------------------------------------------ output


def test_format_table_aligns_columns() -> None:
    text = format_table(("name", "value"), [("a", 1), ("longer", 22)])
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1
    assert lines[1].strip().startswith("----")


def test_progress_is_silent_when_disabled_and_plain_otherwise() -> None:
    quiet = io.StringIO()
    with Progress(2, "x", enabled=False, stream=quiet) as bar:
        bar.advance("one")
    assert quiet.getvalue() == "" and bar.done == 1
    plain = io.StringIO()
    with Progress(2, "work", backend="plain", stream=plain) as bar:
        bar.advance("one")
        bar.advance("two")
    assert plain.getvalue().splitlines()[1].startswith("[2/2] work two")


def test_unknown_sections_are_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown bench section"):
        run_bench(sections=["everything"])


def test_quick_bench_runs_every_section_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CI smoke test: ``kvfsm bench --quick``, checked for structure, never for timing."""
    out = tmp_path / "bench.json"
    assert main(["bench", "--quick", "--quiet", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    data = json.loads(out.read_text())
    assert printed == data
    assert data["meta"]["quick"] is True and data["meta"]["sections"] == list(SECTIONS)
    points = data["drain"]["points"]
    assert len(points) >= 3 and all(p["nonblocking"]["steps"] <= 1 for p in points)
    assert points[0]["store_mib"] < points[-1]["store_mib"]
    control = data["control"]
    assert control["workload"]["distinct_blocks"] >= 100_000
    assert [r["capacity"] for r in control["replay"]] == [0.25, 1.0]
    assert {(s["kind"], s["num_requests"]) for s in control["scheduler_step"]} == {
        (k, n) for k in ("decode", "prefill") for n in (16, 64, 256)
    }
    assert len(data["lifecycle"]["rows"]) == 2
    assert "available" in data["transfers"]
    assert all("available" in v for v in data["verification"])
    # The vLLM sections run (and judge their goals) exactly where vLLM is installed, else report not available.
    assert data["vllm"]["available"] is vllm_side.vllm_available()
    assert data["vllm-scheduler"]["available"] is (vllm_scheduler.available() is None)
    optional = {section for section in ("vllm", "vllm-scheduler") if data[section]["available"]}
    goals = data["goals"]
    assert {g["section"] for g in goals} == {"drain", "control", "lifecycle", "verification"} | optional
    (checker_goal,) = [g for g in goals if g["section"] == "verification"]
    assert "states/s by CPU time" in checker_goal["goal"] and checker_goal["target"] == ">= 100k states/s"
    assert all(g["met"] in (True, False, None) for g in goals)


def test_the_vllm_tiers_section_measures_or_says_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Opt-in section 10: where vLLM's tiering, redis-py and redis-server are all here it measures and every
    promoted chunk is right; elsewhere it says what is missing, and the bench still succeeds."""
    out = tmp_path / "tiers.json"
    assert main(["bench", "--quick", "--quiet", "--json", "--only", "vllm-tiers", "--out", str(out)]) == 0
    capsys.readouterr()
    section = json.loads(out.read_text())["vllm-tiers"]
    if section["available"]:
        assert section["wrong_chunks"] == 0 and section["chunks_verified"] == section["chunks"] == 64
        assert section["store_mb_s"] > 0 and section["promote_mb_s"] > 0
    else:
        assert section["detail"]


def test_bench_tables_for_one_section_and_a_jsonl_workload(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    write_jsonl(generate_trace(SMALL), path)
    assert main(["bench", "--quick", "--quiet", "--only", "control", "--workload", str(path)]) == 0
    text = capsys.readouterr().out
    assert "(2) control-plane cost" in text and str(path) in text
    assert "(1) drain" not in text
    assert "n/a" in text  # the replay goal is only judged on the standard trace


def test_timeline_runs_and_picture(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from kvfsm.engine.core import StepRecord
    from kvfsm.machines.names import EngineState
    from kvfsm.observe.timeline import plot_timeline, state_runs

    states = [EngineState.RUNNING] * 3 + [EngineState.FINISHING, EngineState.DRAINING, EngineState.DRAINING]
    states += [EngineState.IDLE, EngineState.RUNNING]
    records = [
        StepRecord(i + 1, s, ("r",) if s is EngineState.RUNNING else (), i % 3, 0, True) for i, s in enumerate(states)
    ]
    assert state_runs(records) == [
        (EngineState.RUNNING, 1, 3),
        (EngineState.FINISHING, 4, 4),
        (EngineState.DRAINING, 5, 6),
        (EngineState.IDLE, 7, 7),
        (EngineState.RUNNING, 8, 8),
    ]
    pytest.importorskip("matplotlib")
    out = plot_timeline(records, tmp_path / "timeline.png", markers=[(1, "turn 1"), (8, "turn 2")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError):
        plot_timeline([], tmp_path / "empty.png")
