"""The NDJSON transition trace: recording it from the reference engine, and verifying it against the spec.

Every run is deterministic (gated copies released between steps), so a recorded trace is always the
same, and each tampered copy must be rejected for the expected reason.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from helpers import GatedEngine, engine_config, gated_engine, run_released, tokens

from kvfsm.errors import KvfsmError
from kvfsm.machines.compiled import set_tracer
from kvfsm.observe.trace import TRACE_VERSION, TraceError, TraceRecorder, TraceReport, verify_trace, verify_trace_file

Record = dict[str, Any]


def _clock() -> Callable[[], float]:
    ticks = iter(range(10**9))
    return lambda: float(next(ticks)) / 1000


def record(scenario: Callable[[TraceRecorder], None]) -> list[Record]:
    sink = io.StringIO()
    with TraceRecorder(sink, clock=_clock()) as rec:
        scenario(rec)
    return [json.loads(line) for line in sink.getvalue().splitlines()]


def verify(records: list[Record]) -> TraceReport:
    return verify_trace(json.dumps(r) for r in records)


def rules(records: list[Record]) -> set[str]:
    return {v.rule for v in verify(records).violations}


def renumber(records: list[Record]) -> list[Record]:
    """Consecutive seq and times again, so that only the intended tampering is found."""
    seq = 0
    for r in records:
        if "seq" in r:
            r["seq"] = seq
            r["t"] = seq / 1000
            seq += 1
    return records


def drain(ge: GatedEngine, req_id: str = "A") -> None:
    """A finishes with its store held (finishing), the engine drains one step, then the store commits."""
    e = ge.engine
    e.add_request(e.make_request(req_id, tokens(req_id, 9), 1))
    e.step()
    e.step()  # draining: the copy is still held
    ge.release_all()
    run_released(ge)


def workload(ge: GatedEngine) -> None:
    """Two requests sharing a prefix, then a third continuing the first after the GPU cache is reset (a
    load from the CPU tier), then a drain."""
    e = ge.engine
    shared = tokens("system", 8)
    a = e.make_request("a", shared + tokens("a", 6), 2)
    e.add_request(a)
    e.add_request(e.make_request("b", shared + tokens("b", 5), 2))
    run_released(ge)
    e.reset_prefix_cache()
    e.add_request(e.make_request("c", a.all_token_ids + tokens("c", 4), 2))
    run_released(ge)
    drain(ge, "d")


@pytest.fixture(scope="module")
def trace() -> list[Record]:
    def scenario(rec: TraceRecorder) -> None:
        rec.scope("engine")
        with gated_engine(engine_config(world_size=2)) as ge:
            workload(ge)

    return record(scenario)


def fresh(trace: list[Record]) -> list[Record]:
    return [dict(r) for r in trace]


def find(records: list[Record], pred: Callable[[Record], bool]) -> int:
    for i, r in enumerate(records):
        if pred(r):
            return i
    raise AssertionError("no such record in the trace")


def job_kinds(records: list[Record]) -> dict[int, str]:
    return {r["inst"]: r["kind"] for r in records if r.get("machine") == "job" and "kind" in r}


# ------------------------------------------------------------------------------------------ recording


def test_a_recorded_engine_run_is_a_valid_behaviour_of_the_spec(trace: list[Record]) -> None:
    report = verify(trace)
    assert report.ok, report.summary()
    assert trace[0]["kvfsm_trace"] == TRACE_VERSION and set(trace[0]["spec"]) == {"job", "slot", "request", "engine"}
    assert set(report.models) == {"job", "slot", "request", "engine"}
    kinds = set(job_kinds(trace).values())
    assert kinds == {"store", "load"}
    fired = set(report.transitions)
    for needed in ("job.launch", "job.ack", "slot.begin_read", "slot.commit_write", "request.start_load",
                   "engine.settle", "engine.stop"):  # fmt: skip
        assert needed in fired
    # Every record carries the fields of the format.
    assert trace[-1] == {"end": report.records, "scopes": 1}  # the recorder's end line
    for r in trace[2:-1]:
        assert {"seq", "t", "machine", "id", "inst", "event", "from", "to"} <= set(r)


def test_records_name_models_and_carry_their_counters(trace: list[Record]) -> None:
    first_job = trace[find(trace, lambda r: r.get("machine") == "job")]
    assert first_job["W"] == 2 and first_job["pending"] == 2 and first_job["failed"] == 0
    assert first_job["keys"] and all(len(k) == 40 for k in first_job["keys"])
    slot = trace[find(trace, lambda r: r.get("machine") == "slot")]
    assert len(slot["id"]) == 40 and slot["readers"] == 0
    engine = trace[find(trace, lambda r: r.get("machine") == "engine" and r["to"] == "draining")]
    assert engine["pending"] is True


def test_recorder_chains_the_previous_tracer_and_restores_it() -> None:
    seen: list[tuple[str, str]] = []

    def previous(machine: str, model: object, event: str, source: str, dest: str) -> None:
        seen.append((machine, event))

    old = set_tracer(previous)
    try:
        sink = io.StringIO()
        with TraceRecorder(sink) as rec, gated_engine(engine_config()) as ge:
            drain(ge)
        assert rec.records == len(seen) > 0
        assert len(sink.getvalue().splitlines()) == rec.records + 2  # plus the header and the end line
        assert set_tracer(previous) is previous  # the recorder put it back
    finally:
        set_tracer(old)


def test_recorder_refuses_a_second_start() -> None:
    rec = TraceRecorder(io.StringIO()).start()
    try:
        with pytest.raises(TraceError, match="already started"):
            rec.start()
    finally:
        rec.stop()


def test_scopes_separate_systems_recorded_one_after_another() -> None:
    def two_engines(rec: TraceRecorder, scoped: bool) -> None:
        for name in ("first", "second"):
            if scoped:
                rec.scope(name)
            with gated_engine(engine_config()) as ge:
                drain(ge)

    scoped = record(lambda rec: two_engines(rec, True))
    assert verify(scoped).ok and verify(scoped).scopes == 2
    # The same two runs without scope lines: job 0 appears twice in one scope.
    assert "complete_exactly_once" in rules(record(lambda rec: two_engines(rec, False)))


def test_trace_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.ndjson"
    with TraceRecorder(path), gated_engine(engine_config()) as ge:
        drain(ge)
    assert verify_trace_file(path).ok
    with pytest.raises(TraceError, match="cannot read trace"):
        verify_trace_file(tmp_path / "missing.ndjson")
    assert issubclass(TraceError, KvfsmError)


# ------------------------------------------------------------------------------------------ tampering


def test_dropping_a_store_commit_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    stores = {i for i, k in job_kinds(t).items() if k == "store"}
    del t[find(t, lambda r: r.get("inst") in stores and r["to"] == "complete")]
    found = rules(renumber(t))
    # Its slots now commit without a completed store, and the engine went idle with the job live.
    assert {"readable_only_after_commit", "pending_work_covers_jobs"} <= found


def test_a_transition_the_spec_does_not_have_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    i = find(t, lambda r: r.get("event") == "commit_write")
    t[i]["to"] = "reading"
    assert "transition" in rules(t)
    t = fresh(trace)
    t[find(t, lambda r: r.get("event") == "commit_write")]["event"] = "evict"  # evict from writing
    assert "transition" in rules(t)


def test_a_broken_state_sequence_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    i = find(t, lambda r: r.get("machine") == "request" and r["event"] == "signal")
    t[i]["from"] = "running"
    found = rules(t)
    assert "sequence" in found
    t = fresh(trace)
    i = find(t, lambda r: r.get("machine") == "engine")
    t[i]["from"] = t[i]["to"] = "running"
    t[i]["event"] = "admit"
    assert "sequence" in rules(t)  # an engine first seen outside its initial state


def test_a_duplicated_or_reordered_record_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    i = find(t, lambda r: r.get("event") == "begin_write")
    t.insert(i + 1, dict(t[i]))
    assert {"format", "sequence"} <= rules(t)
    t = fresh(trace)
    t[5], t[6] = t[6], t[5]
    assert "format" in rules(t)  # seq goes backwards


def test_guards_the_trace_can_decide_are_enforced(trace: list[Record]) -> None:
    # The engine settles to draining only with pending push work.
    t = fresh(trace)
    t[find(t, lambda r: r.get("machine") == "engine" and r["to"] == "draining")]["pending"] = False
    assert "guard" in rules(t)
    # A job commits only after W launches and without a failure report.
    t = fresh(trace)
    t[find(t, lambda r: r.get("machine") == "job" and r["to"] == "complete")]["failed"] = 1
    assert "guard" in rules(t)
    t = fresh(trace)
    i = find(t, lambda r: r.get("machine") == "job" and r["event"] == "launch" and r["from"] == "in_flight")
    t.insert(i + 1, dict(t[i]))  # a third launch with W=2
    assert "guard" in rules(renumber(t))
    # Readers rebuilt from begin_read/end_read must match the model's.
    t = fresh(trace)
    t[find(t, lambda r: r.get("event") == "end_read")]["readers"] = 2
    assert "guard" in rules(t)


def test_a_request_deleted_while_its_store_is_live_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    d = find(t, lambda r: r.get("machine") == "request" and r["id"] == "d" and r["event"] == "delete")
    signal = find(t, lambda r: r.get("machine") == "request" and r["id"] == "d" and r["event"] == "signal")
    record_ = t.pop(d)
    t.insert(signal + 1, record_)  # before the store of d commits
    assert "guard" in rules(renumber(t))


def test_the_engine_idle_with_pending_work_is_rejected(trace: list[Record]) -> None:
    t = fresh(trace)
    t[find(t, lambda r: r.get("machine") == "engine" and r["to"] == "idle")]["pending"] = True
    assert "idle_only_when_nothing_pending" in rules(t)


def test_malformed_lines_and_headers_are_rejected(trace: list[Record]) -> None:
    lines = [json.dumps(r) for r in trace]
    report = verify_trace([*lines[:3], "{not json", *lines[3:]])
    assert not report.ok and report.violations[0].rule == "format" and report.violations[0].line == 4
    assert "format" in {v.rule for v in verify_trace([*lines, "[1, 2]"]).violations}
    t = fresh(trace)
    t[0]["kvfsm_trace"] = 99
    assert "format" in rules(t)
    t = fresh(trace)
    t[3]["machine"] = "tier"
    assert "format" in rules(t)
    t = fresh(trace)
    del t[3]["inst"]
    assert "format" in rules(t)


def _job(seq: int, inst: int, job_id: int, kind: str, req: str, keys: list[str]) -> Record:
    return {
        "seq": seq, "t": 0.0, "machine": "job", "id": str(job_id), "inst": inst, "event": "launch",
        "from": "submitted", "to": "in_flight", "kind": kind, "req": req, "W": 1, "keys": keys,
        "pending": 1, "failed": 0,
    }  # fmt: skip


def test_cross_model_invariants_on_synthetic_traces() -> None:
    key = "ab" * 20
    other = "cd" * 20
    ok = [_job(0, 0, 0, "load", "r1", [key]), _job(1, 1, 1, "load", "r2", [other])]
    assert rules(ok) == {"job_terminates"}  # both loads are still in flight at the end of the trace
    # Two live loads of one key (single_loader_per_chunk).
    assert "single_loader_per_chunk" in rules([_job(0, 0, 0, "load", "r1", [key]), _job(1, 1, 1, "load", "r2", [key])])
    # A load next to a store of the same request (one_load_per_request).
    assert "one_load_per_request" in rules([_job(0, 0, 0, "store", "r1", [key]), _job(1, 1, 1, "load", "r1", [other])])
    # The same scheduler job id on two jobs (complete_exactly_once).
    assert "complete_exactly_once" in rules(
        [_job(0, 0, 5, "store", "r1", [key]), _job(1, 1, 5, "store", "r2", [other])]
    )
    # A slot committed with no store at all (readable_only_after_commit).
    slot = {"machine": "slot", "id": key, "inst": 7, "readers": 0}
    begin = {**slot, "seq": 0, "t": 0.0, "event": "begin_write", "from": "absent", "to": "writing"}
    commit = {**slot, "seq": 1, "t": 0.0, "event": "commit_write", "from": "writing", "to": "ready"}
    assert "readable_only_after_commit" in rules([begin, commit])
    done = {**_job(1, 0, 0, "store", "r1", [key]), "event": "ack", "from": "in_flight", "to": "complete"}
    launched = _job(0, 0, 0, "store", "r1", [key])
    assert verify(renumber([launched, done, begin, commit])).ok


def test_kvfsm_check_trace_accepts_a_valid_trace_and_rejects_a_tampered_one(
    trace: list[Record], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvfsm.cli import main

    good = tmp_path / "good.ndjson"
    good.write_text("".join(json.dumps(r) + "\n" for r in trace))
    assert main(["check", "--trace", str(good)]) == 0
    assert "a valid behaviour of the spec" in capsys.readouterr().out
    t = fresh(trace)
    t[find(t, lambda r: r.get("event") == "commit_write")]["to"] = "reading"
    bad = tmp_path / "bad.ndjson"
    bad.write_text("".join(json.dumps(r) + "\n" for r in t))
    assert main(["check", "--trace", str(bad), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False and out["violations"] >= 1 and "[transition]" in out["first_violations"][0]
    assert main(["check", "--trace", str(tmp_path / "missing.ndjson")]) == 2


def test_a_trace_recorded_under_a_lying_data_plane_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the copy backends' events recorded (format 3), a backend whose poll reports a copy that is still
    held on its thread leaves a store committed before its copy finished in the trace: rejected."""
    from planted_bugs import plant_poll_reports_unfinished

    from kvfsm.data.events import copy_events_to
    from kvfsm.testing.engine import EngineHarness
    from kvfsm.testing.system import SystemConfig

    def scenario() -> TraceReport:
        """A store held on both ranks' copy threads (inside the real copy path) while the engine steps."""
        sink = io.StringIO()
        with TraceRecorder(sink, data_plane=True) as rec, copy_events_to(rec.copy_event):
            h = EngineHarness(SystemConfig(world_size=2))
            try:
                h.add_request(h.make_request("A", tokens("A", 9), 1), late=False)
                h.step()
                h.step()  # the copies are held on their threads: an honest poll reports nothing
                for backend in h.backends:
                    backend.gate.open()  # every copy runs now (a lying poll has forgotten them already)
                while h.step() is not None:
                    pass
                h.shutdown(None)
            finally:
                h.close()
        return verify_trace(sink.getvalue().splitlines())

    honest = scenario()
    assert honest.ok and honest.copies == 4, honest.summary()  # one store, two ranks: submitted and finished
    with plant_poll_reports_unfinished(monkeypatch):
        lying = scenario()
    assert {v.rule for v in lying.violations} >= {"copy_before_commit"}, lying.summary()


def test_a_format_2_trace_is_still_read() -> None:
    """Traces of the previous format (no data-plane records) are read and checked as before."""
    sink = io.StringIO()
    with TraceRecorder(sink) as rec, gated_engine(engine_config()) as ge:
        drain(ge)
    lines = sink.getvalue().splitlines()
    header = json.loads(lines[0])
    header["kvfsm_trace"] = 2
    del header["data_plane"]
    report = verify_trace([json.dumps(header), *lines[1:]])
    assert report.ok and report.records == rec.records, report.summary()
    header["kvfsm_trace"] = 1
    old = verify_trace([json.dumps(header), *lines[1:]])
    assert any(v.rule == "format" and "trace version 1" in v.detail for v in old.violations)


@pytest.mark.parametrize("backend_kind", ["thread-pool", "cuda-emulated"])
def test_both_copy_backends_emit_the_data_plane_events(backend_kind: str) -> None:
    """A store and then a load of the same blocks: each copy is "submitted" with its source bytes' checksum
    and "finished" with its destination bytes' checksum, equal; the load's bytes are the store's."""
    torch = pytest.importorskip("torch")
    from kvfsm.control.types import GPUBlockSpec, SlotSpec
    from kvfsm.data.backend import ThreadPoolCopyBackend
    from kvfsm.data.cuda import CudaCopyBackend, EmulatedDevice
    from kvfsm.data.events import copy_events_to, listening
    from kvfsm.data.pool import CPUSlotPool

    kv = [torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * layer for layer in range(2)]
    pool = CPUSlotPool(4, 2, (4,), 2, torch.float32, pin_memory=False)
    backend: ThreadPoolCopyBackend | CudaCopyBackend
    if backend_kind == "thread-pool":
        backend = ThreadPoolCopyBackend(kv, pool, 2, max_workers=1)
    else:
        backend = CudaCopyBackend(kv, pool, 2, copy_path="dma", device_api=EmulatedDevice())
    seen: list[tuple[str, int, bool, int, str | None, bool | None]] = []
    assert not listening()
    with copy_events_to(lambda *event: seen.append(event)):
        assert listening()
        backend.submit(1, True, GPUBlockSpec((3, 1, 6)), SlotSpec((2, 0)))
        backend.wait([1])
        assert backend.poll() == [(1, True)]
        for layer in kv:
            layer.zero_()  # the GPU blocks are overwritten: the load must bring the stored bytes back
        backend.submit(2, False, GPUBlockSpec((3, 1, 6)), SlotSpec((2, 0)))
        backend.wait([2])
        assert backend.poll() == [(2, True)]
    backend.shutdown()
    assert [(e[0], e[1], e[2], e[5]) for e in seen] == [
        ("submitted", 1, True, None),
        ("finished", 1, True, True),
        ("submitted", 2, False, None),
        ("finished", 2, False, True),
    ]
    assert len({e[3] for e in seen}) == 1  # one backend
    sums = [e[4] for e in seen]
    assert sums[0] == sums[1] == sums[2] == sums[3] is not None  # stored bytes, loaded back unchanged
