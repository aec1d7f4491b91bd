"""A structured trace of every spec-machine transition (NDJSON), and its verification against the spec.

Recording: :class:`TraceRecorder` installs itself as the process-wide transition tracer
(:func:`kvfsm.machines.compiled.add_tracer`, beside any other tracer) and writes one JSON object per line::

    {"kvfsm_trace": 3, "spec": {"job": "3f1c...", ...}, "clock": "perf_counter",
     "data_plane": true}                                                                   <- header
    {"scope": "workload"}                                                                  <- optional
    {"seq": 0, "t": 0.000123, "machine": "job", "id": "7", "inst": 3, "event": "launch",
     "from": "submitted", "to": "in_flight", "kind": "store", "req": "u0-t0", "W": 2,
     "keys": ["ab12..."], "pending": 2, "failed": 0, "launched": 0, "reported": 0}
    {"seq": 9, ..., "machine": "request", "id": "u0-t0", "event": "load_done", "from": "loading",
     "to": "running", "load": "complete"}
    {"seq": 12, "t": 0.0021, "copy": "finished", "job": "7", "kind": "store", "src": 0,
     "sum": "93c8...", "ok": true}                                  <- a data-plane record
    {"end": 40, "scopes": 1}                                   <- the final stop: records and scope lines

``id`` is the model's own name (job id, request id, slot key in hex, ``engine``); ``inst`` numbers model
objects, so two schedulers' job 0 are told apart. Per machine a few fields of the model are added, read
when the transition fires (before the caller updates its counters): a job's kind, request, world size
and keys (first record only), its pending count, failure reports and rank masks (``launched``,
``reported``: bit r set for rank r); a slot's readers; the engine's ``has_pending_push_work()``; on a
request leaving ``loading``, the state of its load job read from the job (``load``). ``seq`` counts
from 0 without gaps; :meth:`TraceRecorder.stop` writes the end line. Format 2 added the rank masks,
``load`` and the end line; format 3 (this one) adds the data plane's copy records, written by
:meth:`TraceRecorder.copy_event` when the copy backends' events (:mod:`kvfsm.data.events`) are connected to
it (``TraceRecorder(..., data_plane=True)`` says so in the header): ``submitted`` with a checksum of the
job's source bytes, ``finished`` with a checksum of its destination bytes, per backend (``src``, one per
rank). Copy records share the ``seq`` count. A version 2 trace is still read (it has no copy records); a
version 1 trace is rejected (record it again). ``scope`` lines
separate independent systems recorded one after another
(cross-model checks never mix scopes).

Verification (:func:`verify_trace`, ``kvfsm check --trace FILE``) replays the records against the spec
tables and reports every violation with its line number:

- format: every line is a JSON object with the fields above, names the spec knows; ``seq`` is 0, 1, 2, ...
  with no gap (a missing record is found wherever it was), and the end line's record and scope-line
  counts match (a missing last line, end line or scope line is found); nothing follows the end line;
- per model: the first record starts in the machine's initial state, each record's ``from`` is the
  previous record's ``to``, and ``(from, event, to)`` is a transition of the spec (so nothing follows a
  terminal state);
- guards the trace can decide: a job starts with ``pending == W``, its pending count never grows, it is
  launched at most W times and commits only after all W launches with no failure report (``ack`` to
  ``failed`` only after one); ack counts: each record's rank masks count exactly the launches and
  reports (``ack``/``fail`` from ``in_flight``) replayed before it, only grow, ``reported`` within
  ``launched``, ``pending == W - |reported|``, and the report that ends a job is the W-th (``pending == 1``)
  while an earlier one leaves it in flight; a slot's readers (rebuilt from ``begin_read``/``end_read``) match
  ``other_readers_remain`` / ``last_reader``; the engine settles to ``draining`` only with pending push
  work and to ``idle`` or ``stopped`` only without;
- invariants the trace can decide (spec/invariants.toml): ``idle_only_when_nothing_pending`` and
  ``pending_work_covers_jobs`` (no job of the scope is live when the engine goes idle);
  ``readable_only_after_commit`` (a slot commits only for a key of a store or promotion that has just
  completed); ``one_load_per_request`` and the request machine's ``no_jobs`` guard; ``single_loader_per_chunk``;
  ``complete_exactly_once`` (one terminal state per job, job ids never reused in a scope);
- load outcomes: a request leaves ``loading`` (``load_done``, or ``reset``) only after its load job has
  ended, and the outcome it carries is that job's recorded final state, so a request runs as if loaded
  exactly when its load committed (a load whose final state was changed, or a request that saw another
  outcome, is rejected);
- the data plane (format 3, header ``data_plane``): each copy finishes once, after its submission on the
  same backend, and a successful one holds the bytes it was given (``finished`` checksum equals
  ``submitted``); a store or load is acked only after as many of its copies finished, and commits only once
  all W of its copies finished and succeeded (a commit recorded before its copy finished is rejected);
- at the end of each scope (the next scope line, the end line, or the end of the file): every job is in
  a terminal state; every key of a store or promotion that completed was committed (``commit_write``,
  its slot readable) after it; no slot is left ``writing`` or ``reading``; an engine seen is
  ``stopped``, and then every request seen is ``deleted``.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO, TypeGuard

from typing_extensions import override

from kvfsm.errors import KvfsmError
from kvfsm.machines.compiled import TracerHandle, add_tracer, remove_tracer
from kvfsm.machines.loader import MACHINE_NAMES, MachineSpec, load_machine

__all__ = [
    "READABLE_VERSIONS",
    "TRACE_VERSION",
    "TraceError",
    "TraceRecorder",
    "TraceReport",
    "TraceViolation",
    "read_trace",
    "spec_fingerprint",
    "verify_trace",
    "verify_trace_file",
]

TRACE_VERSION = 3  # 2: seq from 0 without gaps, an end line, job rank masks, load outcomes; 3: copy records
#: Formats :func:`verify_trace` reads: a version 2 trace has no data-plane records (nothing to check there).
READABLE_VERSIONS = (2, 3)
_MAX_KEPT = 200  # violations kept in a report (all are counted)


class TraceError(KvfsmError, ValueError):
    """A trace cannot be recorded or read at all (not a trace file, recorder misuse)."""


def spec_fingerprint(name: str) -> str:
    """A short hash of one machine's transition table, to tell which spec a trace was recorded against."""
    spec = load_machine(name)
    rows = sorted(f"{t.source}|{t.event}|{t.dest}|{t.guard}|{t.effect}" for t in spec.transitions)
    return hashlib.sha256("\n".join([spec.initial, *rows]).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------- recording


def _model_id(machine: str, model: object) -> str:
    if machine == "job":
        return str(getattr(model, "job_id", "?"))
    if machine == "slot":
        key = getattr(model, "key", b"")
        return key.hex() if isinstance(key, bytes) else str(key)
    if machine == "request":
        ctx = getattr(model, "ctx", None)
        return str(getattr(ctx, "req_id", "?"))
    return machine


#: The handle of a started recorder that is not a process-wide tracer (``process_wide=False``).
_NOT_PROCESS_WIDE = TracerHandle(-1)


class TraceRecorder:
    """Write every transition as NDJSON while started; use as a context manager.

    ``sink`` is a path (opened, written, closed by the recorder) or an open text stream. ``clock`` gives
    the ``t`` field (seconds since start); inject one to make traces reproducible.
    """

    def __init__(
        self,
        sink: str | Path | TextIO,
        *,
        clock: Callable[[], float] = time.perf_counter,
        data_plane: bool = False,
        process_wide: bool = True,
    ) -> None:
        #: The data plane's copy events are connected to :meth:`copy_event` (the header says so, and the
        #: verifier then holds every store and load to its copies).
        self.data_plane = data_plane
        #: While started, every spec machine of the process is recorded (the recorder is a process-wide
        #: tracer). False records only what is handed to the recorder by a call: a recorder of another
        #: system (kvfsm.vllm.tier_recorder) whose components run kvfsm machines of their own below it.
        self.process_wide = process_wide
        self._path = Path(sink) if isinstance(sink, str | Path) else None
        self._stream: TextIO | None = None if self._path is not None else sink  # type: ignore[assignment]
        self._clock = clock
        self._t0 = 0.0
        self._seq = 0
        self._scopes = 0
        self._next_inst = 0
        # id(model) -> (inst, model): the strong reference keeps id() from being reused while tracked.
        self._insts: dict[int, tuple[int, object]] = {}
        self._terminal: dict[str, frozenset[str]] = {}
        self._initial: dict[str, str] = {}
        self._handle: TracerHandle | None = None  # set while started
        self._lock = threading.Lock()
        # request id -> its latest load job model (this scope), to read the load's outcome at load_done
        self._loads: dict[str, object] = {}
        self.records = 0
        self.copies = 0

    # -- lifecycle --

    def start(self) -> TraceRecorder:
        if self._handle is not None:
            raise TraceError("the trace recorder is already started; expected one start per recording")
        for name in MACHINE_NAMES:
            spec = load_machine(name)
            self._terminal[name] = spec.terminal
            self._initial[name] = spec.initial
        if self._path is not None:
            self._stream = self._path.open("w", encoding="utf-8")
        self._t0 = self._clock()
        header = {
            "kvfsm_trace": TRACE_VERSION,
            "spec": {name: spec_fingerprint(name) for name in MACHINE_NAMES},
            "clock": getattr(self._clock, "__name__", "clock"),
            "data_plane": self.data_plane,
        }
        self._write(header)
        self._handle = add_tracer(self) if self.process_wide else _NOT_PROCESS_WIDE
        return self

    def stop(self) -> None:
        if self._handle is None:
            return
        if self._handle is not _NOT_PROCESS_WIDE:
            remove_tracer(self._handle)
        self._handle = None
        self._insts.clear()
        self._loads.clear()
        with self._lock:
            self._write({"end": self._seq, "scopes": self._scopes})  # the final stop: what precedes it
        if self._stream is not None:
            self._stream.flush()
            if self._path is not None:
                self._stream.close()
                self._stream = None

    def __enter__(self) -> TraceRecorder:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def scope(self, name: str) -> None:
        """Start a new scope: later records belong to an independent system named ``name``."""
        with self._lock:
            self._loads.clear()
            self._scopes += 1
            self._write({"scope": name})

    # -- the tracer --

    def _write(self, obj: dict[str, Any]) -> None:
        if self._stream is None:
            raise TraceError("the trace recorder has no open stream; call start() first")
        self._stream.write(json.dumps(obj, separators=(",", ":")))
        self._stream.write("\n")

    def __call__(self, machine: str, model: object, event: str, source: str, dest: str) -> None:
        with self._lock:
            key = id(model)
            known = self._insts.get(key)
            first = known is None or known[1] is not model
            if first:
                inst = self._next_inst
                self._next_inst += 1
                self._insts[key] = (inst, model)
            else:
                assert known is not None
                inst = known[0]
            rec: dict[str, Any] = {
                "seq": self._seq,
                "t": round(self._clock() - self._t0, 9),
                "machine": machine,
                "id": _model_id(machine, model),
                "inst": inst,
                "event": event,
                "from": source,
                "to": dest,
            }
            self._seq += 1
            self._extra(machine, model, rec, first)
            if machine == "job" and first and rec.get("kind") == "load" and isinstance(rec.get("req"), str):
                self._loads[rec["req"]] = model
            elif machine == "request" and source == "loading" and event in ("load_done", "reset"):
                job = self._loads.pop(rec["id"], None)
                if job is not None:
                    state = getattr(job, "state", None)
                    rec["load"] = str(getattr(state, "value", state))  # the load job's outcome, read from it
            self._write(rec)
            self.records += 1
            if dest in self._terminal.get(machine, ()) or (machine == "slot" and dest == self._initial["slot"]):
                del self._insts[key]  # a slot back to absent is a discarded object

    def copy_event(
        self, event: str, job_id: int, is_store: bool, source: int, checksum: str | None, ok: bool | None
    ) -> None:
        """One data-plane event (a :data:`kvfsm.data.events.CopyListener`): a copy ``submitted`` or
        ``finished`` by backend ``source``, with the checksum of the bytes (source bytes at submission,
        destination bytes once copied). Called on the submitting thread or on a copy thread."""
        with self._lock:
            if self._handle is None:
                return  # not recording (before start or after stop)
            rec: dict[str, Any] = {
                "seq": self._seq,
                "t": round(self._clock() - self._t0, 9),
                "copy": event,
                "job": str(job_id),
                "kind": "store" if is_store else "load",
                "src": source,
                "sum": checksum,
            }
            if ok is not None:
                rec["ok"] = ok
            self._seq += 1
            self._write(rec)
            self.copies += 1

    @staticmethod
    def _extra(machine: str, model: object, rec: dict[str, Any], first: bool) -> None:
        get = getattr
        if machine == "job":
            if first:
                kind = get(model, "kind", None)
                rec["kind"] = str(get(kind, "value", kind))
                rec["req"] = get(model, "req_id", None)
                rec["W"] = get(model, "world_size", None)
                rec["keys"] = [k.hex() for k in get(model, "keys", ())]
            rec["pending"] = get(model, "pending", None)
            rec["failed"] = get(model, "failed_reports", None)
            rec["launched"] = get(model, "launched_mask", None)
            rec["reported"] = get(model, "reported_mask", None)
        elif machine == "slot":
            rec["readers"] = get(model, "readers", None)
        elif machine == "engine":
            pending = get(model, "has_pending_push_work", None)
            if callable(pending):
                rec["pending"] = bool(pending())


# ---------------------------------------------------------------------------- reading and verifying


@dataclass(frozen=True, slots=True)
class TraceViolation:
    line: int
    rule: str
    detail: str

    @override
    def __str__(self) -> str:
        return f"line {self.line}: [{self.rule}] {self.detail}"


@dataclass(slots=True)
class TraceReport:
    records: int = 0
    copies: int = 0  #: data-plane copy records
    models: Counter[str] = field(default_factory=Counter)
    transitions: Counter[str] = field(default_factory=Counter)
    scopes: int = 0
    violations: list[TraceViolation] = field(default_factory=list)
    num_violations: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.num_violations == 0

    def as_dict(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "records": self.records,
            "copies": self.copies,
            "models": dict(self.models),
            "scopes": self.scopes,
            "violations": self.num_violations,
            "first_violations": [str(v) for v in self.violations],
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        models = ", ".join(f"{n} {m}s" for m, n in sorted(self.models.items()))
        head = (
            f"{self.records} transitions of {models or 'no models'}"
            f"{f' in {self.scopes} scopes' if self.scopes > 1 else ''}"
            f"{f', {self.copies} data-plane copy records' if self.copies else ''}: "
        )
        if self.ok:
            return head + "a valid behaviour of the spec"
        shown = "\n".join(f"  {v}" for v in self.violations)
        more = self.num_violations - len(self.violations)
        return head + f"{self.num_violations} violation(s)\n{shown}" + (f"\n  ... and {more} more" if more else "")


@dataclass(slots=True)
class _Model:
    machine: str
    scope: int
    id: str
    state: str
    # job
    kind: str = ""
    req: str = ""
    world_size: int = 0
    keys: tuple[str, ...] = ()
    launches: int = 0
    reports: int = 0  # ack / fail records from in_flight
    launched: int | None = None  # rank masks of the latest record
    reported: int | None = None
    pending: int | None = None
    line: int = 0  # the model's latest record
    # slot
    readers: int = 0


@dataclass(slots=True)
class _Copies:
    """One store or load job's copies as the data-plane records show them: per backend (``src``), the
    checksum at submission, and the backends whose copy finished (and succeeded)."""

    submitted: dict[int, str | None] = field(default_factory=dict)
    finished: set[int] = field(default_factory=set)
    succeeded: set[int] = field(default_factory=set)


def read_trace(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any] | None, str]]:
    """``(line number, object or None, error)`` for every non-blank line."""
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            yield lineno, None, f"not valid JSON ({exc.msg})"
            continue
        if not isinstance(obj, dict):
            yield lineno, None, f"a JSON {type(obj).__name__}, expected an object"
            continue
        yield lineno, obj, ""


class _Verifier:
    _STR_FIELDS = ("machine", "id", "event", "from", "to")

    def __init__(self, report: TraceReport) -> None:
        self.report = report
        self.specs: dict[str, MachineSpec] = {name: load_machine(name) for name in MACHINE_NAMES}
        self.edges: dict[str, set[tuple[str, str, str]]] = {
            name: {(t.source, t.event, t.dest) for t in spec.transitions} for name, spec in self.specs.items()
        }
        self.models: dict[int, _Model] = {}
        self.scope = 0
        self.last_seq: int | None = None
        self.last_t: float | None = None
        self.header_seen = False
        # per scope
        self.live_jobs: dict[int, set[int]] = {}  # scope -> live job insts
        self.job_ids: dict[tuple[int, str, str], int] = {}  # (scope, namespace, id) -> inst
        self.committable: dict[int, Counter[str]] = {}  # scope -> keys of just-completed writers
        self.loading: dict[tuple[int, str], int] = {}  # (scope, key) -> load job inst
        self.owed: dict[tuple[int, str], list[int]] = {}  # (scope, key) -> completed writers' insts not committed
        self.last_load: dict[tuple[int, str], int] = {}  # (scope, request id) -> its latest load job inst
        self.version: object = None
        self.data_plane = False  # the header says the data plane's copy events were recorded
        self.copies: dict[tuple[int, str, str], _Copies] = {}  # (scope, kind, job id) -> its copies
        self.end_line = 0  # the recorder's end line, once seen

    def violation(self, line: int, rule: str, detail: str) -> None:
        self.report.num_violations += 1
        if len(self.report.violations) < _MAX_KEPT:
            self.report.violations.append(TraceViolation(line, rule, detail))

    # -- records --

    def header(self, line: int, obj: dict[str, Any]) -> None:
        if self.header_seen or self.report.records:
            self.violation(line, "format", "a header after the first record")
        self.header_seen = True
        self.version = obj.get("kvfsm_trace")
        if self.version not in READABLE_VERSIONS:
            self.violation(line, "format", f"trace version {self.version!r}; expected one of {list(READABLE_VERSIONS)}")
        self.data_plane = obj.get("data_plane") is True
        spec = obj.get("spec")
        if isinstance(spec, dict):
            for name in MACHINE_NAMES:
                if name in spec and spec[name] != spec_fingerprint(name):
                    self.report.notes.append(
                        f"the {name} table differs from the one the trace was recorded against "
                        f"({spec[name]} vs {spec_fingerprint(name)}); checked against the current spec"
                    )

    def record(self, line: int, obj: dict[str, Any]) -> None:
        if "kvfsm_trace" in obj:
            self.header(line, obj)
            return
        if self.end_line:
            self.violation(line, "end", f"a line after the recorder's end line (line {self.end_line})")
        if "scope" in obj:
            self.close_scope(line)
            self.scope += 1
            self.report.scopes = max(self.report.scopes, self.scope)
            return
        if "end" in obj and "seq" not in obj:
            self.end(line, obj)
            return
        if "copy" in obj:
            self.copy_record(line, obj)
            return
        missing = [f for f in (*self._STR_FIELDS, "seq", "t", "inst") if f not in obj]
        if missing:
            self.violation(line, "format", f"missing field(s) {missing}")
            return
        bad = [f for f in self._STR_FIELDS if not isinstance(obj[f], str)]
        if bad or not _is_int(obj["seq"]) or not _is_int(obj["inst"]) or not isinstance(obj["t"], int | float):
            self.violation(line, "format", f"wrong field types in {obj!r}")
            return
        self.report.records += 1
        self.sequence(line, obj)
        machine, event, src, dst = obj["machine"], obj["event"], obj["from"], obj["to"]
        spec = self.specs.get(machine)
        if spec is None:
            self.violation(line, "format", f"unknown machine {machine!r}; expected one of {list(MACHINE_NAMES)}")
            return
        for what, name in (("state", src), ("state", dst)):
            if name not in spec.states:
                self.violation(line, "format", f"{machine} has no {what} {name!r}")
                return
        if event not in spec.events:
            self.violation(line, "format", f"{machine} has no event {event!r}")
            return
        self.report.transitions[f"{machine}.{event}"] += 1
        inst = obj["inst"]
        model = self.models.get(inst)
        label = f"{machine} {obj['id']!r} (inst {inst})"
        if model is None:
            model = _Model(machine, self.scope, obj["id"], spec.initial)
            self.models[inst] = model
            self.report.models[machine] += 1
            if src != spec.initial:
                self.violation(
                    line, "sequence", f"{label} first appears in {src!r}; expected the initial state {spec.initial!r}"
                )
                model.state = src
            self.first_seen(line, model, obj, label)
        elif model.machine != machine:
            self.violation(line, "sequence", f"inst {inst} was a {model.machine}, now a {machine}")
            return
        elif src != model.state:
            self.violation(line, "sequence", f"{label}: transition from {src!r} but the model is in {model.state!r}")
            model.state = src
        if src in spec.terminal:
            self.violation(line, "transition", f"{label}: {event!r} after the terminal state {src!r}")
        elif (src, event, dst) not in self.edges[machine]:
            self.violation(
                line, "transition", f"{label}: {src} --{event}--> {dst} is not a transition of spec/{machine}.toml"
            )
        self.check(line, model, obj, label, event, src, dst)
        model.state = dst
        model.line = line

    def sequence(self, line: int, obj: dict[str, Any]) -> None:
        """``seq`` counts every record (transitions and copies) from 0 without gaps; ``t`` never decreases."""
        seq, t = obj["seq"], float(obj["t"])
        if self.last_seq is not None and seq <= self.last_seq:
            self.violation(line, "format", f"seq {seq} after {self.last_seq}; expected increasing sequence numbers")
        elif seq != (-1 if self.last_seq is None else self.last_seq) + 1:
            want = 0 if self.last_seq is None else self.last_seq + 1
            self.violation(line, "seq", f"seq {seq} where {want} was due: {seq - want} record(s) missing")
        if self.last_t is not None and t < self.last_t:
            self.violation(line, "format", f"time {t} after {self.last_t}; expected non-decreasing times")
        self.last_seq, self.last_t = seq, t

    def copy_record(self, line: int, obj: dict[str, Any]) -> None:
        """A data-plane record: a copy ``submitted`` (with the source bytes' checksum) or ``finished`` (with
        the destination bytes' checksum and ``ok``). A finished copy must have been submitted by the same
        backend, once, and a successful one must hold the bytes it was given: the checksums agree."""
        event, job, kind, source = obj.get("copy"), obj.get("job"), obj.get("kind"), obj.get("src")
        digest = obj.get("sum")
        if (
            event not in ("submitted", "finished")
            or not isinstance(job, str)
            or kind not in ("store", "load")
            or not _is_int(source)
            or not (digest is None or isinstance(digest, str))
            or not _is_int(obj.get("seq"))
            or not isinstance(obj.get("t"), int | float)
            or (event == "finished" and not isinstance(obj.get("ok"), bool))
        ):
            self.violation(line, "format", f"a malformed copy record {obj!r}")
            return
        self.report.copies += 1
        self.sequence(line, obj)
        copies = self.copies.setdefault((self.scope, kind, job), _Copies())
        label = f"{kind} job {job}'s copy on backend {source}"
        if event == "submitted":
            if source in copies.submitted:
                self.violation(line, "copy_sequence", f"{label} submitted twice")
            copies.submitted[source] = digest
            return
        if source not in copies.submitted:
            self.violation(line, "copy_sequence", f"{label} finished but was never submitted")
        elif source in copies.finished:
            self.violation(line, "copy_sequence", f"{label} finished twice")
        copies.finished.add(source)
        if obj["ok"]:
            copies.succeeded.add(source)
            if source in copies.submitted and digest != copies.submitted[source]:
                self.violation(
                    line,
                    "copy_checksum",
                    f"{label} finished holding bytes of checksum {digest}; it was submitted with "
                    f"{copies.submitted[source]}",
                )

    def check_copies(self, line: int, m: _Model, label: str, event: str, src: str, dst: str) -> None:
        """In a trace with the data plane's records, a store or load is reported only after as many of its
        copies finished, and commits only once every one of its W copies finished and succeeded."""
        if not self.data_plane or m.kind not in ("store", "load"):
            return
        copies = self.copies.get((m.scope, m.kind, m.id), _Copies())
        # Only acks: a rank that could not even submit its copy reports a failure with no copy record.
        if src == "in_flight" and event == "ack" and len(copies.finished) < m.reports + 1:
            self.violation(
                line,
                "copy_before_commit",
                f"{label}: report #{m.reports + 1} ({event}) with {len(copies.finished)} of its copies finished",
            )
        if dst == "complete" and m.world_size and len(copies.succeeded) < m.world_size:
            self.violation(
                line,
                "copy_before_commit",
                f"{label}: committed with {len(copies.succeeded)} of its W={m.world_size} copies finished",
            )

    def end(self, line: int, obj: dict[str, Any]) -> None:
        """The recorder's final line: ``{"end": N, "scopes": S}`` after N records in S scope lines."""
        self.end_line = line
        n, scopes = obj["end"], obj.get("scopes")
        if scopes != self.scope:
            self.violation(line, "end", f"end line says {scopes!r} scope lines; the trace holds {self.scope}")
        due = 0 if self.last_seq is None else self.last_seq + 1
        held = self.report.records + self.report.copies
        if not _is_int(n) or n != due or n != held:
            self.violation(line, "seq", f"end line says {n!r} records; the trace holds {held} (next seq {due})")
        self.close_scope(line)

    def finish(self, line: int) -> None:
        if not self.end_line:
            if self.version in READABLE_VERSIONS and self.report.records:
                self.violation(line, "end", "the trace stops without the recorder's end line (truncated?)")
            self.close_scope(line)

    def close_scope(self, line: int) -> None:
        """What must hold once a scope is over: every job ended, every completed store or promotion's slots
        became readable, no slot is left mid-write or mid-read, an engine seen has stopped and then every
        request of the scope was deleted."""
        mine = [(inst, m) for inst, m in self.models.items() if m.scope == self.scope]
        engine_stopped = any(m.machine == "engine" and m.state == "stopped" for _, m in mine)
        for inst, m in mine:
            label = f"{m.machine} {m.id!r} (inst {inst})"
            if m.machine == "job" and m.state not in self.specs["job"].terminal:
                self.violation(
                    m.line, "job_terminates", f"{label}: {m.kind} job still {m.state} when its scope ends (line {line})"
                )
            elif m.machine == "slot" and m.state in ("writing", "reading"):
                self.violation(m.line, "slot_settles", f"{label}: still {m.state} when its scope ends (line {line})")
            elif m.machine == "engine" and m.state != "stopped":
                self.violation(m.line, "engine_stops", f"{label}: {m.state} when its scope ends (line {line})")
            elif m.machine == "request" and engine_stopped and m.state != "deleted":
                self.violation(
                    m.line, "request_deleted", f"{label}: {m.state} after the engine stopped (scope end, line {line})"
                )
        for (scope, key), writers in sorted(self.owed.items()):
            if scope == self.scope:
                for inst in writers:
                    m = self.models[inst]
                    self.violation(
                        m.line,
                        "store_becomes_readable",
                        f"{m.kind} job {m.id!r} (inst {inst}) completed but its slot {key[:16]} never committed "
                        f"(commit_write) before its scope ended (line {line})",
                    )
        self.owed = {k: v for k, v in self.owed.items() if k[0] != self.scope}

    # -- per machine --

    def first_seen(self, line: int, m: _Model, obj: dict[str, Any], label: str) -> None:
        if m.machine != "job":
            return
        m.kind = str(obj.get("kind", ""))
        m.req = str(obj.get("req", ""))
        w = obj.get("W")
        m.world_size = w if _is_int(w) and w > 0 else 0
        keys = obj.get("keys")
        m.keys = tuple(k for k in keys if isinstance(k, str)) if isinstance(keys, list) else ()
        namespace = "tier" if m.kind in ("cascade", "promote") else "scheduler"
        id_key = (m.scope, namespace, m.id)
        inst = obj["inst"]
        if id_key in self.job_ids and self.job_ids[id_key] != inst:
            self.violation(line, "complete_exactly_once", f"{label}: {namespace} job id {m.id} reused in one scope")
        self.job_ids[id_key] = inst
        live = self.live_jobs.setdefault(m.scope, set())
        if m.kind in ("load", "store") and m.req:
            mine = [
                self.models[i] for i in live if self.models[i].req == m.req and self.models[i].kind in ("load", "store")
            ]
            loads = sum(1 for j in mine if j.kind == "load") + (m.kind == "load")
            if loads > 1 or (loads == 1 and mine):
                kinds = sorted([j.kind for j in mine] + [m.kind])
                self.violation(line, "one_load_per_request", f"{label}: request {m.req!r} has live jobs {kinds}")
        if m.kind == "load":
            if m.req:
                self.last_load[(m.scope, m.req)] = inst
            for key in m.keys:
                other = self.loading.get((m.scope, key))
                if other is not None:
                    self.violation(
                        line, "single_loader_per_chunk", f"{label}: key {key[:16]} is already loaded by inst {other}"
                    )
                self.loading[(m.scope, key)] = inst
        live.add(inst)

    def check(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, src: str, dst: str) -> None:
        if m.machine == "job":
            self.check_job(line, m, obj, label, event, src, dst)
        elif m.machine == "slot":
            self.check_slot(line, m, obj, label, event, dst)
        elif m.machine == "engine":
            self.check_engine(line, m, obj, label, event, dst)
        elif m.machine == "request":
            self.check_request(line, m, obj, label, event, src)

    def check_ranks(
        self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, src: str, dst: str
    ) -> None:
        """The rank masks (read before the transition) against the launches and reports replayed so far;
        the report that ends a job (ack or fail to a terminal state) must be the W-th."""
        launched, reported, pending = obj.get("launched"), obj.get("reported"), obj.get("pending")
        if _is_int(launched) and _is_int(reported):
            if launched.bit_count() != m.launches or reported.bit_count() != m.reports:
                self.violation(
                    line,
                    "ack_count",
                    f"{label}: {launched.bit_count()} rank(s) launched and {reported.bit_count()} reported; the "
                    f"trace shows {m.launches} launch(es) and {m.reports} report(s)",
                )
            if (
                reported & ~launched
                or (m.launched is not None and m.launched & ~launched)
                or (m.reported is not None and m.reported & ~reported)
            ):
                self.violation(line, "ack_count", f"{label}: rank masks launched={launched} reported={reported} "
                               f"after launched={m.launched} reported={m.reported}")  # fmt: skip
            if m.world_size and _is_int(pending) and pending != m.world_size - reported.bit_count():
                self.violation(
                    line,
                    "ack_count",
                    f"{label}: pending={pending} but W={m.world_size} and {reported.bit_count()} rank(s) reported",
                )
            m.launched, m.reported = launched, reported
        elif self.version in READABLE_VERSIONS:
            self.violation(line, "format", f"{label}: a job record without its rank masks (launched, reported)")
        if src == "in_flight" and event in ("ack", "fail"):
            closing = dst in self.specs["job"].terminal
            if m.world_size and closing and (m.reports != m.world_size - 1 or (_is_int(pending) and pending != 1)):
                self.violation(
                    line,
                    "ack_count",
                    f"{label}: {event} to {dst} is report #{m.reports + 1} (pending={pending}); "
                    f"W={m.world_size}: the closing report must be the W-th",
                )
            if m.world_size and not closing and m.reports + 1 >= m.world_size:
                self.violation(
                    line, "ack_count", f"{label}: report #{m.reports + 1} of W={m.world_size} leaves the job in flight"
                )
            m.reports += 1

    def check_job(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, src: str, dst: str) -> None:
        pending, failed = obj.get("pending"), obj.get("failed")
        self.check_copies(line, m, label, event, src, dst)
        self.check_ranks(line, m, obj, label, event, src, dst)
        if _is_int(pending):
            if m.pending is None and m.world_size and pending != m.world_size:
                self.violation(line, "guard", f"{label}: first seen with pending={pending}; expected W={m.world_size}")
            elif m.pending is not None and pending > m.pending:
                self.violation(line, "guard", f"{label}: pending grew from {m.pending} to {pending}")
            m.pending = pending
        if event == "launch":
            m.launches += 1
            if m.world_size and m.launches > m.world_size:
                self.violation(
                    line, "guard", f"{label}: launch #{m.launches} but W={m.world_size} (worker_not_launched)"
                )
        if dst == "complete":
            if m.world_size and m.launches != m.world_size:
                self.violation(line, "guard", f"{label}: committed after {m.launches} of W={m.world_size} launches")
            if _is_int(failed) and failed != 0:
                self.violation(
                    line, "guard", f"{label}: ack to complete after {failed} failure report(s) (last_ack_clean)"
                )
            if m.kind in ("store", "promote"):
                self.committable.setdefault(m.scope, Counter()).update(m.keys)
                for key in m.keys:
                    self.owed.setdefault((m.scope, key), []).append(obj["inst"])
        if event == "ack" and dst == "failed" and _is_int(failed) and failed == 0:
            self.violation(line, "guard", f"{label}: ack to failed without a failure report (last_ack_after_failure)")
        specs = self.specs["job"]
        if dst in specs.terminal:
            self.live_jobs.get(m.scope, set()).discard(obj["inst"])
            if m.kind == "load":
                for key in m.keys:
                    if self.loading.get((m.scope, key)) == obj["inst"]:
                        del self.loading[(m.scope, key)]

    def check_slot(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, dst: str) -> None:
        readers = obj.get("readers")
        if _is_int(readers) and readers != m.readers:
            self.violation(line, "guard", f"{label}: the model has {readers} reader(s); the trace implies {m.readers}")
        if event == "begin_read":
            m.readers += 1
        elif event == "end_read":
            if dst == "reading" and m.readers <= 1:
                self.violation(line, "guard", f"{label}: end_read stays reading with {m.readers} reader(s)")
            if dst == "ready" and m.readers != 1:
                self.violation(line, "guard", f"{label}: end_read to ready with {m.readers} reader(s) (last_reader)")
            m.readers = max(0, m.readers - 1)
        elif dst == "absent":
            m.readers = 0
        if event == "commit_write":
            writers = self.owed.get((m.scope, m.id))
            if writers:
                writers.pop(0)
            pool = self.committable.setdefault(m.scope, Counter())
            if pool[m.id] > 0:
                pool[m.id] -= 1
            else:
                self.violation(
                    line,
                    "readable_only_after_commit",
                    f"{label}: committed with no completed store or promotion of its key",
                )

    def check_engine(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, dst: str) -> None:
        pending = obj.get("pending")
        if isinstance(pending, bool):
            if dst == "draining" and not pending:
                self.violation(line, "guard", f"{label}: settled to draining without pending push work")
            if dst in ("idle", "stopped") and pending:
                self.violation(line, "idle_only_when_nothing_pending", f"{label}: {dst} with pending push work")
        if dst in ("idle", "stopped"):
            live = self.live_jobs.get(m.scope, set())
            if live:
                first = self.models[min(live)]
                self.violation(
                    line,
                    "pending_work_covers_jobs",
                    f"{label}: {dst} while {len(live)} job(s) are live (e.g. {first.kind} job {first.id} "
                    f"in {first.state})",
                )

    def check_request(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str, src: str) -> None:
        if src == "loading" and event in ("load_done", "reset"):
            self.check_load_outcome(line, m, obj, label, event)
        guarded = event == "delete" or (event in ("schedule", "start_load") and src != "loading")
        if not guarded:
            return
        live = self.live_jobs.get(m.scope, set())
        mine = [self.models[i] for i in live if self.models[i].req == m.id and self.models[i].kind in ("load", "store")]
        if mine:
            self.violation(
                line,
                "guard",
                f"{label}: {event} with {len(mine)} live job(s) (no_jobs), e.g. {mine[0].kind} {mine[0].id}",
            )

    def check_load_outcome(self, line: int, m: _Model, obj: dict[str, Any], label: str, event: str) -> None:
        """A request leaves ``loading`` only once its load job has ended, and the outcome the recorder read
        from that job at this moment (``load``) is the job's recorded final state: a request runs as if
        loaded exactly when its load committed."""
        inst = self.last_load.get((m.scope, m.id))
        outcome = obj.get("load")
        if inst is None:
            if event == "load_done":
                self.violation(line, "load_outcome", f"{label}: load_done without a load job of the request")
            return
        job = self.models[inst]
        if job.state not in self.specs["job"].terminal:
            self.violation(line, "load_outcome", f"{label}: {event} while its load job {job.id} is {job.state}")
        elif outcome is None and self.version in READABLE_VERSIONS:
            self.violation(line, "load_outcome", f"{label}: {event} without the load's outcome")
        elif outcome is not None and outcome != job.state:
            self.violation(
                line,
                "load_outcome",
                f"{label}: {event} after a load that ended {outcome!r}; the trace has load job {job.id} {job.state!r}",
            )
        del self.last_load[(m.scope, m.id)]


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def verify_trace(lines: Iterable[str]) -> TraceReport:
    """Check a recorded trace (its lines) against the spec; never raises on bad content."""
    report = TraceReport()
    verifier = _Verifier(report)
    last = 0
    for lineno, obj, error in read_trace(lines):
        last = lineno
        if obj is None:
            verifier.violation(lineno, "format", error)
            continue
        verifier.record(lineno, obj)
    verifier.finish(last)
    if not verifier.header_seen:
        report.notes.append("no header line: the spec version the trace was recorded against is unknown")
    return report


def verify_trace_file(path: str | Path) -> TraceReport:
    """:func:`verify_trace` over a file; TraceError if it cannot be read or holds no transition at all
    (an empty or header-only file proves nothing, so it is not reported valid)."""
    p = Path(path)
    try:
        with p.open(encoding="utf-8") as fh:
            report = verify_trace(fh)
    except OSError as exc:
        raise TraceError(f"cannot read trace {p}: {exc.strerror or exc}; expected an NDJSON file") from exc
    except UnicodeDecodeError as exc:
        raise TraceError(f"trace {p} is not UTF-8 text ({exc.reason}); expected an NDJSON file") from exc
    if report.records == 0 and report.num_violations == 0:
        raise TraceError(
            f"trace {p} holds no transition records; expected an NDJSON trace of at least one transition "
            "(e.g. from kvfsm demo --trace)"
        )
    return report
