"""Copy-path calibration: measured throughput per (path, unit size, unit count), and the choice it drives.

Which way of moving a job's blocks is fastest depends on the unit size (bytes per contiguous piece), on how
many pieces there are, and on the machine - a threshold tuned on one GPU is wrong on the next (vLLM #57555).
So backends never compare against constants: at start-up (CUDA, outside the engine path) or lazily on their
first job (CPU, on a copy thread) they measure each candidate path on scratch memory over a small grid of unit
sizes and counts, verify the bytes, and keep the rates in a :class:`CalibrationTable`. For a job, each path's
time is predicted from the rate measured nearest to the job's own (unit, count) - the unit being what that path
moves per operation - and the fastest path wins.

Tables are cached per process under a context string (backend, device, element width) and, when the
``KVFSM_CALIBRATION_FILE`` environment variable names a JSON file, persisted there across processes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvfsm.errors import ConfigError

__all__ = [
    "CALIBRATION_FILE_ENV",
    "CalibrationTable",
    "Choice",
    "Measure",
    "cached_table",
    "calibrate",
    "clear_cache",
    "grid",
    "median_seconds",
]

logger = logging.getLogger(__name__)

CALIBRATION_FILE_ENV = "KVFSM_CALIBRATION_FILE"

#: (unit bytes, unit count) -> bytes per second
Rates = dict[tuple[int, int], float]


def _log2(x: float) -> float:
    return math.log2(max(x, 1.0))


@dataclass(frozen=True, slots=True)
class Choice:
    """A path's workload for one job: ``nbytes`` moved in ``count`` operations of ``unit`` bytes each."""

    nbytes: int
    unit: int
    count: int


@dataclass(slots=True)
class CalibrationTable:
    """Measured rates (bytes/s) per path name and (unit bytes, unit count)."""

    context: str
    rates: dict[str, Rates] = field(default_factory=dict)
    seconds: float = 0.0  #: how long the calibration took

    def paths(self) -> tuple[str, ...]:
        return tuple(self.rates)

    def rate(self, path: str, unit: int, count: int) -> float | None:
        """The rate measured nearest (in log space, unit size first) to ``(unit, count)``; None if unmeasured."""
        table = self.rates.get(path)
        if not table:
            return None
        lu, lc = _log2(unit), _log2(count)
        best = min(table, key=lambda k: (abs(_log2(k[0]) - lu) + 0.25 * abs(_log2(k[1]) - lc), k))
        return table[best]

    def predict(self, path: str, work: Choice) -> float | None:
        """Predicted seconds for ``work`` on ``path``; None if the path was never measured."""
        r = self.rate(path, work.unit, work.count)
        if r is None or r <= 0:
            return None
        return work.nbytes / r

    def choose(self, options: Mapping[str, Choice], default: str) -> str:
        """The option with the smallest predicted time; ``default`` when none was measured."""
        best: tuple[float, str] | None = None
        for path, work in options.items():
            t = self.predict(path, work)
            if t is not None and (best is None or t < best[0]):
                best = (t, path)
        return default if best is None else best[1]

    def to_json(self) -> dict[str, object]:
        return {
            "context": self.context,
            "seconds": self.seconds,
            "rates": {p: [[u, c, r] for (u, c), r in sorted(t.items())] for p, t in self.rates.items()},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> CalibrationTable:
        try:
            context = str(data["context"])
            raw = data["rates"]
            if not isinstance(raw, dict):
                raise TypeError("rates is not a mapping")
            rates: dict[str, Rates] = {
                str(p): {(int(u), int(c)): float(r) for u, c, r in entries} for p, entries in raw.items()
            }
            seconds_raw = data.get("seconds", 0.0)
            seconds = float(seconds_raw) if isinstance(seconds_raw, int | float) else 0.0
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"malformed calibration table ({exc}); expected the output of to_json()") from exc
        return cls(context, rates, seconds)

    def summary(self) -> list[dict[str, object]]:
        """One row per measured point: path, unit bytes, count, GB/s."""
        return [
            {"path": p, "unit_bytes": u, "count": c, "gbps": r / 1e9}
            for p, t in sorted(self.rates.items())
            for (u, c), r in sorted(t.items())
        ]


def grid(units: Iterable[int], counts: Iterable[int], max_bytes: int) -> list[tuple[int, int]]:
    """The (unit, count) points to measure: every pair within ``max_bytes``, and at least one count per unit."""
    cs = sorted(counts)
    points: list[tuple[int, int]] = []
    for u in sorted(units):
        fits = [c for c in cs if u * c <= max_bytes]
        points.extend((u, c) for c in (fits or [max(1, max_bytes // u)]))
    return points


def median_seconds(run: Callable[[], None], repeats: int, warmup: int = 1) -> float:
    """Median wall time of ``run`` (which must complete its work before returning)."""
    for _ in range(warmup):
        run()
    samples = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        run()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


#: path -> measure(unit, count) -> bytes/s (or raises to disable the path)
Measure = Callable[[int, int], float]


def calibrate(context: str, measures: Mapping[str, Measure], points: Iterable[tuple[int, int]]) -> CalibrationTable:
    """Measure every path at every point, paths interleaved at each point (so drift on a shared machine hits
    them alike). A path whose measurement raises is dropped (logged) and never chosen."""
    t0 = time.perf_counter()
    rates: dict[str, Rates] = {path: {} for path in measures}
    failed: set[str] = set()
    for unit, count in points:
        for path, measure in measures.items():
            if path in failed:
                continue
            try:
                rates[path][(unit, count)] = float(measure(unit, count))
            except Exception as exc:
                logger.warning("calibration of copy path %r failed (%r); the path is disabled", path, exc)
                failed.add(path)
    table = CalibrationTable(context, {p: r for p, r in rates.items() if p not in failed})
    table.seconds = time.perf_counter() - t0
    return table


_cache: dict[str, CalibrationTable] = {}
_cache_lock = threading.Lock()


def _file() -> Path | None:
    name = os.environ.get(CALIBRATION_FILE_ENV)
    return Path(name) if name else None


def _load_file(context: str) -> CalibrationTable | None:
    path = _file()
    if path is None or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        entry = data.get(context) if isinstance(data, dict) else None
        return None if entry is None else CalibrationTable.from_json(entry)
    except (OSError, ValueError, ConfigError) as exc:
        logger.warning("ignoring calibration file %s: %r", path, exc)
        return None


def _save_file(table: CalibrationTable) -> None:
    path = _file()
    if path is None:
        return
    try:
        data = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(data, dict):
            data = {}
        data[table.context] = table.to_json()
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)
    except (OSError, ValueError) as exc:
        logger.warning("could not save calibration to %s: %r", path, exc)


def cached_table(context: str, build: Callable[[], CalibrationTable]) -> CalibrationTable:
    """The table for ``context``: from this process's cache, else the calibration file, else ``build()``."""
    with _cache_lock:
        table = _cache.get(context)
        if table is not None:
            return table
        table = _load_file(context)
        if table is None:
            table = build()
            _save_file(table)
        _cache[context] = table
        return table


def clear_cache() -> None:
    """Forget every cached table of this process (the file, if any, is kept)."""
    with _cache_lock:
        _cache.clear()
