"""Generated tampering over a recorded trace: every tampering of each class must be rejected (100%).

The trace is the demo's multi-turn workload (3 users x 3 turns through the reference engine, W=2, real
copies) plus a deterministic drain, recorded in two scopes. Each class is applied many times with a
seeded generator; the catch rate of every class is printed (``pytest -s``) and must be 1.0. The
untampered trace validates.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("torch")

from helpers import engine_config, gated_engine
from test_trace import drain

from kvfsm.data.events import copy_events_to
from kvfsm.demo import DEMO_CONFIG, run_workload
from kvfsm.machines.loader import load_machine
from kvfsm.observe.trace import TraceRecorder, TraceReport, verify_trace

Record = dict[str, Any]
Tamper = Callable[[list[Record], random.Random], Iterator[tuple[str, list[Record]]]]


@pytest.fixture(scope="module")
def trace() -> list[Record]:
    sink = io.StringIO()
    # The data plane's copy events recorded too: every real copy's submission and completion, with checksums.
    with TraceRecorder(sink, data_plane=True) as rec, copy_events_to(rec.copy_event):
        rec.scope("workload")
        run_workload(DEMO_CONFIG, users=3, turns=3)
        rec.scope("drain")
        with gated_engine(engine_config(world_size=2)) as ge:
            drain(ge)
    return [json.loads(line) for line in sink.getvalue().splitlines()]


def verify(records: list[Record]) -> TraceReport:
    return verify_trace(json.dumps(r) for r in records)


def copy(records: list[Record]) -> list[Record]:
    return [dict(r) for r in records]


def renumber(records: list[Record]) -> list[Record]:
    """Consecutive seq again and a matching end line: the tampering leaves no gap to find."""
    seq = 0
    for r in records:
        if "seq" in r:
            r["seq"] = seq
            seq += 1
        elif "end" in r:
            r["end"] = seq
    return records


def transitions(records: list[Record], machine: str | None = None) -> list[int]:
    return [
        i
        for i, r in enumerate(records)
        if "seq" in r and "copy" not in r and (machine is None or r["machine"] == machine)
    ]


def copies(records: list[Record], event: str) -> list[int]:
    return [i for i, r in enumerate(records) if r.get("copy") == event]


def job_kinds(records: list[Record]) -> dict[int, str]:
    return {r["inst"]: r["kind"] for r in records if r.get("machine") == "job" and "kind" in r}


# ------------------------------------------------------------------------------------------ the classes


def drop_a_line(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Exhaustive: the seq gap, the end line's counts (records, scope lines) or a later check finds it."""
    for i in range(1, len(trace)):  # every line but the header, each in turn
        t = copy(trace)
        del t[i]
        yield "seq|end|sequence|format|job_terminates|store_becomes_readable", t


def drop_a_models_last_record(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    last: dict[int, int] = {}
    for i in transitions(trace):
        last[trace[i]["inst"]] = i
    for i in sorted(last.values()):
        t = copy(trace)
        del t[i]
        yield "seq|end", t


def drop_a_models_last_record_and_renumber(
    trace: list[Record], rng: random.Random
) -> Iterator[tuple[str, list[Record]]]:
    """With no seq gap left, the scope-end checks must find it: a job not terminal, a store's slot never
    committed, a slot left reading, a request not deleted, an engine not stopped. A slot whose last
    record is an evict is skipped: without it the slot stays ready, a legal end (only seq finds that)."""
    last: dict[int, int] = {}
    for i in transitions(trace):
        last[trace[i]["inst"]] = i
    for i in sorted(last.values()):
        if trace[i]["event"] == "evict":
            continue
        t = copy(trace)
        del t[i]
        yield "job_terminates|store_becomes_readable|slot_settles|request_deleted|engine_stops", renumber(t)


def leave_a_stores_slot_unreadable(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Drop a commit_write, or turn it into an abort_write (a legal edge), and renumber."""
    for i in transitions(trace, "slot"):
        if trace[i]["event"] != "commit_write":
            continue
        t = copy(trace)
        del t[i]
        yield "store_becomes_readable", renumber(t)
        t = copy(trace)
        t[i].update(event="abort_write", to="absent")
        yield "store_becomes_readable", t


def lower_an_ack_count(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Drop a report that does not close its job (renumbered), lower a pending count, or clear a reported rank."""
    jobs = transitions(trace, "job")
    for i in jobs:
        r = trace[i]
        if r["event"] in ("ack", "fail") and r["to"] == "in_flight":
            t = copy(trace)
            del t[i]
            yield "ack_count", renumber(t)
    for i in rng.sample(jobs, min(60, len(jobs))):
        t = copy(trace)
        t[i]["pending"] -= rng.randint(1, max(1, t[i]["pending"]))
        yield "ack_count", t
    reported = [i for i in jobs if trace[i]["reported"]]
    for i in rng.sample(reported, min(40, len(reported))):
        t = copy(trace)
        mask = t[i]["reported"]
        t[i]["reported"] = mask & ~(1 << rng.choice([b for b in range(mask.bit_length()) if mask >> b & 1]))
        yield "ack_count", t


def change_a_loads_outcome(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Move each load job's final record to every other legal edge from its source state (with a failure
    report where the edge needs one), or change the outcome the request saw."""
    edges = {(t.source, t.event, t.dest) for t in load_machine("job").transitions}
    loads = {inst for inst, kind in job_kinds(trace).items() if kind == "load"}
    assert loads, "the workload must load"
    last: dict[int, int] = {}
    for i in transitions(trace, "job"):
        if trace[i]["inst"] in loads:
            last[trace[i]["inst"]] = i
    for i in last.values():
        r = trace[i]
        for src, event, dst in sorted(edges):
            if src != r["from"] or (event, dst) == (r["event"], r["to"]):
                continue
            t = copy(trace)
            t[i].update(event=event, to=dst)
            if (event, dst) == ("ack", "failed"):
                t[i]["failed"] = 1
            yield "load_outcome|job_terminates", t
    for i in transitions(trace, "request"):
        if "load" in trace[i]:
            for outcome in ("failed", "timed_out", "stale", "cancelled", "complete"):
                if outcome != trace[i]["load"]:
                    t = copy(trace)
                    t[i]["load"] = outcome
                    yield "load_outcome", t


def renumber_seq(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Change one record's seq, open a gap by shifting every later seq, or swap two records' seq."""
    seqs = transitions(trace)
    for _ in range(60):
        t = copy(trace)
        i = rng.choice(seqs)
        t[i]["seq"] += rng.choice([-3, -2, -1, 1, 2, 3, 100])
        yield "seq|format", t
    for _ in range(60):
        t = copy(trace)
        k, by = rng.choice(seqs), rng.randint(1, 5)
        for i in seqs:
            if i >= k:
                t[i]["seq"] += by
        yield "seq", t
    for _ in range(60):
        t = copy(trace)
        i, j = rng.sample(seqs, 2)
        t[i]["seq"], t[j]["seq"] = t[j]["seq"], t[i]["seq"]
        yield "seq|format", t


def commit_before_its_copy_finished(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Move one of a store's or load's "copy finished" records to just after the job's commit (renumbered):
    the trace then says the job committed (or was acked) before that copy had finished."""
    scope = 0
    done: dict[tuple[int, str, str], int] = {}  # (scope, kind, job id) -> index of its commit record
    kinds = job_kinds(trace)
    for i, r in enumerate(trace):
        if "scope" in r:
            scope += 1
        elif r.get("machine") == "job" and r["to"] == "complete" and kinds.get(r["inst"]) in ("store", "load"):
            done[(scope, kinds[r["inst"]], r["id"])] = i
    scope = 0
    for i, r in enumerate(trace):
        if "scope" in r:
            scope += 1
            continue
        if r.get("copy") != "finished":
            continue
        commit = done.get((scope, r["kind"], r["job"]))
        if commit is None or commit < i:
            continue
        t = copy(trace)
        moved = t.pop(i)
        t.insert(commit, moved)  # commit shifted down by one: the record lands right after it
        yield "copy_before_commit", renumber(t)


def change_a_copys_checksum(trace: list[Record], rng: random.Random) -> Iterator[tuple[str, list[Record]]]:
    """Give a successful copy's "finished" record (the bytes it holds) or its "submitted" record (the bytes
    it was given) another checksum."""
    for event in ("finished", "submitted"):
        for i in copies(trace, event):
            if event == "finished" and not trace[i]["ok"]:
                continue
            t = copy(trace)
            old = t[i]["sum"]
            new = old
            while new == old:
                new = f"{rng.getrandbits(64):016x}"
            t[i]["sum"] = new
            yield "copy_checksum", t


CLASSES: dict[str, Tamper] = {
    "drop each line": drop_a_line,
    "drop each model's last record": drop_a_models_last_record,
    "drop each model's last record, renumbered": drop_a_models_last_record_and_renumber,
    "leave a committed store's slot unreadable": leave_a_stores_slot_unreadable,
    "lower an ack count": lower_an_ack_count,
    "change a load job's final state along a legal edge": change_a_loads_outcome,
    "renumber seq": renumber_seq,
    "commit before its copy finished": commit_before_its_copy_finished,
    "change a copy's checksum": change_a_copys_checksum,
}


def test_the_untampered_trace_validates(trace: list[Record]) -> None:
    report = verify(trace)
    assert report.ok, report.summary()
    assert report.scopes == 2 and report.models["job"] >= 10
    assert sum(1 for kind in job_kinds(trace).values() if kind == "load") >= 3
    # Every store and load copied on both ranks is on record, submitted and finished.
    assert report.copies >= 20 and len(copies(trace, "submitted")) == len(copies(trace, "finished"))


@pytest.mark.parametrize("name", list(CLASSES))
def test_every_tampering_of_a_class_is_caught(trace: list[Record], name: str) -> None:
    rng = random.Random(f"tamper:{name}")
    tried = caught = 0
    missed: list[str] = []
    for expected, tampered in CLASSES[name](trace, rng):
        tried += 1
        found = {v.rule for v in verify(tampered).violations}
        if found & set(expected.split("|")):
            caught += 1
        elif len(missed) < 3:
            missed.append(f"expected one of {expected}, found {sorted(found) or 'nothing'}")
    print(f"\ntamper class {name!r}: caught {caught}/{tried} ({caught / max(tried, 1):.0%})")
    assert tried >= 3
    assert caught == tried, missed
