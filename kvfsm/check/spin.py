"""Run SPIN on the Promela model generated from the spec (``kvfsm check --engine spin``).

``spin -a`` turns the model into a verifier (``pan.c``), ``gcc`` compiles it (``-DSAFETY`` for the
assertions; ``-DNFAIR`` and ``pan -a -f`` for the LTL liveness claim under weak fairness; ``-DBITSTATE`` for
bitstate hashing, which reaches bounds that an exhaustive search cannot hold in memory, at the price of
possibly missing states; ``-DNCORE=N`` for pan's multi-core safety search), and ``./pan`` searches. The
result is parsed from pan's report: errors, states stored, transitions, elapsed time and rate, and which
property an assertion named.

A violation is turned into a trace people can read: pan's trail is shortened (``-DREACH``, ``pan -i``, for
safety), ``spin -t`` replays it and prints what the generated model prints at every atomic step (the event,
in the spec's words, and the abstract state after it; kvfsm.check.promela), and :func:`format_trace` numbers
the events as the native checker's trace does.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvfsm.check.promela import PROPERTIES, TRACE_FIELDS, PromelaBounds, generate
from kvfsm.errors import KvfsmError

__all__ = [
    "INSTALL_HINT",
    "SpinMissing",
    "SpinResult",
    "TraceStep",
    "describe_state",
    "find_tools",
    "format_trace",
    "parse_pan",
    "parse_replay",
    "run_spin",
]

INSTALL_HINT = "install SPIN: apt-get install -y spin"


class SpinMissing(KvfsmError):
    """spin or a C compiler is not on PATH."""


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One event of a replayed counterexample: what happened, and the abstract state after it (None when the
    event itself broke a property, so that no state after it was printed)."""

    event: str
    state: str | None
    cycle: bool = False  #: a liveness counterexample's cycle starts here


@dataclass(frozen=True, slots=True)
class SpinResult:
    bounds: PromelaBounds
    bitstate: bool
    liveness: bool
    errors: int
    states: int
    transitions: int
    seconds: float
    states_per_second: float
    depth: int
    complete: bool  #: the search was not cut short (search depth, memory)
    violated: tuple[str, ...]  #: property names (spec/invariants.toml) pan reported violated
    report: str = field(repr=False)
    cores: int = 1  #: pan's multi-core search (-DNCORE) when > 1
    initial: str | None = None  #: the counterexample's initial abstract state
    trace: tuple[TraceStep, ...] = ()  #: the counterexample, replayed (empty when nothing was violated)

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.complete

    def summary(self) -> dict[str, object]:
        return {
            "engine": "spin",
            "bounds": self.bounds.as_dict(),
            "bitstate": self.bitstate,
            "cores": self.cores,
            "liveness": self.liveness,
            "errors": self.errors,
            "states": self.states,
            "transitions": self.transitions,
            "seconds": self.seconds,
            "states_per_second": round(self.states_per_second),
            "depth": self.depth,
            "complete": self.complete,
            "violated": list(self.violated),
            "trace": [
                {"event": t.event, "state": t.state, **({"cycle_starts": True} if t.cycle else {})} for t in self.trace
            ],
        }


def find_tools() -> tuple[str, str]:
    """Paths of ``spin`` and a C compiler; SpinMissing (with the install hint) if either is missing."""
    spin = shutil.which("spin")
    cc = shutil.which("gcc") or shutil.which("cc")
    if spin is None:
        raise SpinMissing(f"spin is not on PATH; {INSTALL_HINT}")
    if cc is None:
        raise SpinMissing(f"no C compiler (gcc or cc) on PATH to compile SPIN's verifier; {INSTALL_HINT} gcc")
    return spin, cc


def _int(pattern: str, text: str) -> int:
    """An integer pan prints, plain or (past about 10^8) as 2.1582e+08."""
    m = re.search(pattern, text)
    return int(float(m.group(1))) if m else 0


def _float(pattern: str, text: str) -> float:
    m = re.search(pattern, text)
    return float(m.group(1)) if m else 0.0


def parse_pan(report: str, bounds: PromelaBounds, *, bitstate: bool = False, liveness: bool = False) -> SpinResult:
    """Parse pan's report."""
    violated: list[str] = []
    for line in report.splitlines():
        if "assertion violated" not in line:
            continue
        name = next(iter(re.findall(r"violated_(\w+)", line)), "")
        if name in PROPERTIES and name not in violated:
            violated.append(name)
    if re.search(r"pan:\d+: acceptance cycle", report) and "liveness" not in violated:
        violated.append("liveness")
    if re.search(r"pan:\d+: invalid end state", report) and "deadlock" not in violated:
        violated.append("deadlock")
    # a multi-core run whose other core found the error prints no summary: count the violations it reported
    errors = max(
        _int(r"errors:\s*(\d+)", report),
        len(re.findall(r"pan:\d+: (?:assertion violated|acceptance cycle|invalid end state)", report)) and 1,
    )
    # multi-core pan (-DNCORE) prints the totals on cpu0's lines
    seconds = _float(r"(?:pan|cpu0): elapsed time ([0-9.e+]+) seconds", report)
    states = _int(r"([0-9.e+]+) states, stored", report) or _int(
        r"cpu0: elapsed time .* \((\d+) states visited\)", report
    )
    rate = _float(r"(?:pan|cpu0): rate\s+([0-9.e+]+) states/second", report)
    if rate == 0.0 and seconds > 0:
        rate = states / seconds
    truncated = "max search depth too small" in report or "out of memory" in report.lower()
    return SpinResult(
        bounds=bounds,
        bitstate=bitstate,
        liveness=liveness,
        errors=errors,
        states=states,
        transitions=_int(r"([0-9.e+]+) transitions", report),
        seconds=seconds,
        states_per_second=rate,
        depth=_int(r"depth reached (\d+)", report),
        complete=not truncated,
        violated=tuple(violated),
        report=report,
    )


_SHARD_NAMES = ("unlaunched", "copying", "done", "failed", "reported")


def _name(mtype: str) -> str:
    """``R_finished_signalled`` -> ``finished_signalled``."""
    return mtype.split("_", 1)[1] if "_" in mtype else mtype


def describe_state(line: str, bounds: PromelaBounds) -> str:
    """One ``ST|`` line of a replay as the abstract state, in the spec's vocabulary (the native trace's style)."""
    parts = line.split("|")[1:]
    b = bounds
    expected = 1 + b.requests + b.jobs + b.slots + b.groups + 1
    if len(parts) != expected:
        return line
    fields = [p.split(",") for p in parts]
    engine, reqs = fields[0], fields[1 : 1 + b.requests]
    jobs = fields[1 + b.requests : 1 + b.requests + b.jobs]
    slots = fields[1 + b.requests + b.jobs : 1 + b.requests + b.jobs + b.slots]
    groups = fields[-1 - b.groups : -1]
    galloc, thr = (int(x) for x in fields[-1])
    assert len(engine) == len(TRACE_FIELDS["engine"])
    text = f"engine={_name(engine[0])}"
    if engine[1] == "1":
        text += " BLOCKED in flush_all"
    if engine[2] == "1":
        text += " (transfers held until the arrivals are looked up)"
    out = []
    for r, (state, arrived, queued, live, group) in enumerate(reqs):
        if arrived == "0":
            continue
        if queued == "1":
            out.append(f"R{r + 1} queued")
            continue
        g = int(group)
        holds = g < len(groups) and groups[g][0] == "1" and groups[g][1] == str(r)
        out.append(f"R{r + 1} {_name(state)}" + (f" g{g}" if holds and live == "1" else ""))
    text += " | requests: " + (", ".join(out) or "-")
    out = []
    for j, (state, created, group, jid, *shards) in enumerate(jobs):
        if created == "0":
            continue
        ranks = "/".join(_SHARD_NAMES[int(c)] if int(c) < len(_SHARD_NAMES) else c for c in shards)
        out.append(f"J{j + 1} store of R{j % b.requests + 1} from g{group} id={jid} {_name(state)} {ranks}")
    text += " | jobs: " + (", ".join(out) or "-")
    out = []
    for k, (state, readers, _written, cascades, promotion) in enumerate(slots):
        extra = f"({readers})" if _name(state) == "reading" else ""
        extra += {"0": "", "1": " cascading"}.get(cascades, f" cascading x{cascades}")
        extra += {"0": "", "1": " promotion queued", "2": " promoting"}.get(promotion, "")
        out.append(f"s{k}={_name(state)}{extra}")
    text += " | slots: " + " ".join(out)
    text += " | gpu: " + " ".join(
        f"g{g}={'R' + str(int(owner) + 1) if busy == '1' else 'free'}" for g, (busy, owner) in enumerate(groups)
    )
    if galloc:
        text += " batch=" + ",".join(f"g{g}" for g in range(b.groups) if galloc >> g & 1)
    if thr:
        text += f" | stale threshold={thr}"
    return text


def parse_replay(text: str, bounds: PromelaBounds) -> tuple[str | None, tuple[TraceStep, ...]]:
    """The initial state and the events of ``spin -t``'s replay of a trail (its ``EV|`` and ``ST|`` lines)."""
    initial: str | None = None
    events: list[str] = []
    states: list[str | None] = []
    cycles: set[int] = set()
    for line in text.splitlines():
        if line.startswith("EV|"):
            events.append(line[3:].strip())
            states.append(None)
        elif line.startswith("ST|"):
            state = describe_state(line.strip(), bounds)
            if events:
                states[-1] = state
            else:
                initial = state
        elif "START OF CYCLE" in line:
            cycles.add(len(events))
    steps = tuple(TraceStep(e, st, n in cycles) for n, (e, st) in enumerate(zip(events, states, strict=True)))
    return initial, steps


def format_trace(result: SpinResult, *, states: bool = True) -> str:
    """The counterexample as numbered events, each with the abstract state after it (as the native checker
    prints its own: kvfsm.check.bfs.format_trace)."""
    what = result.violated[0] if result.violated else "a property"
    lines = [f"VIOLATION {what} (spin)", f"counterexample: {len(result.trace)} events (pan's trail, replayed)"]
    if states and result.initial is not None:
        lines.append(f"   0. initial: {result.initial}")
    for n, step in enumerate(result.trace, 1):
        last = n == len(result.trace)
        mark = f"  <-- {what}" if last and step.state is None else ""
        cycle = "  (the cycle starts here)" if step.cycle else ""
        lines.append(f"  {n:2}. {step.event}{mark}{cycle}")
        if states and step.state is not None:
            lines.append(f"      -> {step.state}")
    if result.trace and result.trace[-1].state is not None:
        lines.append(
            f"      this state breaks {what}"
            if not result.liveness
            else "      ... and the cycle repeats forever (an acceptance cycle of the LTL claim)"
        )
    return "\n".join(lines)


def _run(cmd: list[str], cwd: Path, timeout: float, *, check: bool = True) -> str:
    """Run a tool; with ``check``, a non-zero exit is a KvfsmError (pan's exit status says nothing useful)."""
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise KvfsmError(f"{cmd[0]} did not finish within {timeout:.0f} s") from exc
    if check and out.returncode != 0 and not Path(cmd[0]).name.startswith("pan"):
        first = (out.stderr or out.stdout).strip().splitlines()
        raise KvfsmError(f"{' '.join(cmd)} failed: {first[0] if first else f'exit {out.returncode}'}")
    return out.stdout + out.stderr


def run_spin(
    bounds: PromelaBounds | None = None,
    *,
    bitstate: bool = False,
    hash_bits: int = 28,
    max_depth: int = 2_000_000,
    timeout: float = 600.0,
    workdir: Path | None = None,
    optimize: bool = True,
    trace: bool = True,
    cores: int = 1,
) -> SpinResult:
    """Generate the model for ``bounds``, compile SPIN's verifier and run it; ``bounds.liveness`` checks the
    LTL liveness claim under weak fairness instead of the safety assertions alone. ``optimize=False``
    compiles the verifier with -O0 (about 5x faster to compile, about 3x slower to search: for small bounds).
    With ``trace`` a violation's counterexample is replayed into :attr:`SpinResult.trace`. ``cores`` > 1 runs
    pan's multi-core search (-DNCORE, safety only), on a model without hidden variables."""
    if isinstance(cores, bool) or not 1 <= cores <= 64:
        raise KvfsmError(f"cores = {cores!r}; expected an integer from 1 to 64")
    b = bounds or PromelaBounds()
    spin, cc = find_tools()
    with tempfile.TemporaryDirectory(prefix="kvfsm-spin-") as tmp:
        where = workdir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        (where / "model.pml").write_text(generate(b, hidden=cores == 1), encoding="utf-8")
        _run([spin, "-a", "-o3", "model.pml"], where, timeout)  # -o3: no statement merging (large atomics)
        nprocs = b.jobs * b.ranks + b.requests + 4  # workers, requests, manager, engine, monitor, init
        flags = ["-O2" if optimize else "-O0", "-w", f"-DNFAIR={nprocs // 4 + 2}" if b.liveness else "-DSAFETY"]
        if bitstate:
            flags.append("-DBITSTATE")
        if cores > 1:
            if b.liveness:
                raise KvfsmError("multi-core pan (cores > 1) checks safety only; expected liveness=False")
            flags += [f"-DNCORE={cores}", "-DMEMLIM=8192"]  # the cores share a segment: 8 GiB, not pan's 2
        _run([cc, *flags, "-o", "pan", "pan.c"], where, timeout)
        pan = [str(where / "pan"), "-n", f"-m{max_depth}", f"-w{hash_bits}" if bitstate else "-w24"]
        if b.liveness:
            pan += ["-a", "-f"]
        report = _run(pan, where, timeout)
        result = replace(parse_pan(report, b, bitstate=bitstate, liveness=b.liveness), cores=cores)
        if result.errors and trace and (not b.liveness or (where / "model.pml.trail").exists()):
            initial, steps = _counterexample(spin, cc, flags, pan, where, b, timeout)
            result = replace(result, initial=initial, trace=steps)
    return result


def _counterexample(
    spin: str, cc: str, flags: list[str], pan: list[str], where: Path, b: PromelaBounds, timeout: float
) -> tuple[str | None, tuple[TraceStep, ...]]:
    """Replay pan's trail with ``spin -t``; for safety, first search again for a short trail (-DREACH, -i:
    pan keeps lowering its depth bound while it finds the error at a smaller depth)."""
    if not b.liveness:
        try:
            single = [f for f in flags[1:] if not f.startswith("-DNCORE")]  # the shortening search is sequential
            _run([cc, "-O0", *single, "-DREACH", "-o", "pan_short", "pan.c"], where, timeout)
            _run([str(where / "pan_short"), *pan[1:], "-i"], where, min(timeout, 120.0))
        except KvfsmError:
            pass  # the trail of the first search is still there (or the last shorter one): replay it
    replay = _run([spin, "-t", "-T", "-B", "model.pml"], where, timeout, check=False)
    return parse_replay(replay, b)
