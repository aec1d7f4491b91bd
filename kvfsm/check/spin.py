"""Run SPIN on the Promela model generated from the spec (``kvfsm check --engine spin``).

``spin -a`` turns the model into a verifier (``pan.c``), ``gcc`` compiles it (``-DSAFETY`` for the
assertions; ``-DNFAIR`` and ``pan -a -f`` for the LTL liveness claim under weak fairness; ``-DBITSTATE`` for
bitstate hashing, which reaches bounds that an exhaustive search cannot hold in memory, at the price of
possibly missing states), and ``./pan`` searches. The result is parsed from pan's report: errors, states
stored, transitions, elapsed time and rate, and which property an assertion named.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvfsm.check.promela import PROPERTIES, PromelaBounds, generate
from kvfsm.errors import KvfsmError

__all__ = ["INSTALL_HINT", "SpinMissing", "SpinResult", "find_tools", "parse_pan", "run_spin"]

INSTALL_HINT = "install SPIN: apt-get install -y spin"


class SpinMissing(KvfsmError):
    """spin or a C compiler is not on PATH."""


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

    @property
    def ok(self) -> bool:
        return self.errors == 0 and self.complete

    def summary(self) -> dict[str, object]:
        return {
            "engine": "spin",
            "bounds": self.bounds.as_dict(),
            "bitstate": self.bitstate,
            "liveness": self.liveness,
            "errors": self.errors,
            "states": self.states,
            "transitions": self.transitions,
            "seconds": self.seconds,
            "states_per_second": round(self.states_per_second),
            "depth": self.depth,
            "complete": self.complete,
            "violated": list(self.violated),
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
        name = next(iter(re.findall(r"violated_(\w+)\)", line)), "")
        if name in PROPERTIES and name not in violated:
            violated.append(name)
    if re.search(r"pan:\d+: acceptance cycle", report) and "liveness" not in violated:
        violated.append("liveness")
    if re.search(r"pan:\d+: invalid end state", report) and "deadlock" not in violated:
        violated.append("deadlock")
    errors = _int(r"errors:\s*(\d+)", report)
    seconds = _float(r"pan: elapsed time ([0-9.e+]+) seconds", report)
    states = _int(r"([0-9.e+]+) states, stored", report)
    rate = _float(r"pan: rate\s+([0-9.e+]+) states/second", report)
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


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    try:
        out = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired as exc:
        raise KvfsmError(f"{cmd[0]} did not finish within {timeout:.0f} s") from exc
    if out.returncode != 0 and Path(cmd[0]).name != "pan":
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
) -> SpinResult:
    """Generate the model for ``bounds``, compile SPIN's verifier and run it; ``bounds.liveness`` checks the
    LTL liveness claim under weak fairness instead of the safety assertions alone. ``optimize=False``
    compiles the verifier with -O0 (about 5x faster to compile, about 3x slower to search: for small bounds)."""
    b = bounds or PromelaBounds()
    spin, cc = find_tools()
    with tempfile.TemporaryDirectory(prefix="kvfsm-spin-") as tmp:
        where = workdir or Path(tmp)
        where.mkdir(parents=True, exist_ok=True)
        (where / "model.pml").write_text(generate(b), encoding="utf-8")
        _run([spin, "-a", "-o3", "model.pml"], where, timeout)  # -o3: no statement merging (large atomics)
        nprocs = b.jobs * b.ranks + b.requests + 4  # workers, requests, manager, engine, monitor, init
        flags = ["-O2" if optimize else "-O0", "-w", f"-DNFAIR={nprocs // 4 + 2}" if b.liveness else "-DSAFETY"]
        if bitstate:
            flags.append("-DBITSTATE")
        _run([cc, *flags, "-o", "pan", "pan.c"], where, timeout)
        pan = [str(where / "pan"), "-n", f"-m{max_depth}", f"-w{hash_bits}" if bitstate else "-w24"]
        if b.liveness:
            pan += ["-a", "-f"]
        report = _run(pan, where, timeout)
    return parse_pan(report, b, bitstate=bitstate, liveness=b.liveness)
