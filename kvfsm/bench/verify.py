"""Verification throughput: model-checker states per second and Hypothesis stateful steps per second.

Both tools live in other packages of kvfsm (``kvfsm.check``, ``kvfsm.testing``) and in optional
dependencies (hypothesis); every entry point here returns a result saying "not available" instead of
failing when its tool is missing.

Hypothesis steps are counted through ``check_invariants``, which Hypothesis calls once when a machine is
created and once after every step: steps = calls - machines created.
"""

from __future__ import annotations

import importlib
import inspect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

__all__ = ["VerifyResult", "checker_throughput", "hypothesis_throughput"]


@dataclass(slots=True)
class VerifyResult:
    tool: str
    target: str
    available: bool
    detail: str = ""
    units: int = 0  #: states explored, or stateful steps run
    unit_name: str = "states"
    seconds: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.units / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, object]:
        return {
            "tool": self.tool,
            "target": self.target,
            "available": self.available,
            "detail": self.detail,
            self.unit_name: self.units,
            "seconds": self.seconds,
            f"{self.unit_name}_per_s": self.per_second,
            **self.extra,
        }


def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


# ---------------------------------------------------------------------------- model checker


def _states_of(result: object) -> int | None:
    """States explored, from whatever the checker returns (an int, a mapping or a result object)."""
    if isinstance(result, int) and not isinstance(result, bool):
        return result
    for name in ("states", "num_states", "states_explored", "explored", "distinct_states"):
        value = result.get(name) if isinstance(result, dict) else getattr(result, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def checker_throughput(quick: bool = False) -> list[VerifyResult]:
    """States per second of ``kvfsm.check`` over its configurations (the quick ones in ``--quick``)."""
    module = _import("kvfsm.check")
    if module is None:
        return [VerifyResult("model checker", "kvfsm.check", False, "not available (kvfsm.check is not installed)")]
    explore: Callable[..., Any] | None = getattr(module, "explore", None)
    bounds_cls: Callable[..., Any] | None = getattr(module, "Bounds", None)
    if explore is not None and bounds_cls is not None:
        return _explore_throughput(explore, bounds_cls, quick)
    bench: Callable[..., Any] | None = getattr(module, "bench_throughput", None)
    if bench is not None:
        return _from_rows(bench(quick=quick))
    runner: Callable[..., Any] | None = None
    for name in ("check", "run_check", "explore", "model_check"):
        candidate = getattr(module, name, None)
        if callable(candidate):
            runner = candidate
            break
    if runner is None:
        return [VerifyResult("model checker", "kvfsm.check", False, "not available (no check entry point found)")]
    t0 = time.perf_counter()
    result = runner()
    seconds = time.perf_counter() - t0
    states = _states_of(result)
    if states is None:
        return [VerifyResult("model checker", "kvfsm.check", False, f"result {type(result).__name__} has no states")]
    return [VerifyResult("model checker", "default configuration", True, "", states, "states", seconds)]


def _explore_throughput(explore: Callable[..., Any], bounds_cls: Callable[..., Any], quick: bool) -> list[VerifyResult]:
    """Breadth-first exploration at the default bounds: the first 20k states in ``--quick``, else all of
    them; no graph kept and no liveness pass, so this is the raw rate of state generation and checking."""
    bounds = bounds_cls()
    max_states = 20_000 if quick else 0
    t0 = time.perf_counter()
    c0 = time.process_time()
    result = explore(bounds, keep_graph=False, check_liveness=False, stop_at_first=False, max_states=max_states)
    cpu_seconds = time.process_time() - c0
    seconds = float(getattr(result, "seconds", 0.0)) or (time.perf_counter() - t0)
    states = _states_of(result) or 0
    complete = bool(getattr(result, "complete", False))
    violations = len(getattr(result, "violations", ()))
    as_dict = getattr(bounds, "as_dict", None)
    from kvfsm.check import compiled

    # Which build ran: the rate of a KVFSM_MYPYC=1 wheel (setup.py) and of the Python source differ.
    build = "compiled" if compiled() else "interpreted"
    label = f"default bounds, {build}" + (
        ", first 20k states" if quick else ", all reachable states" if complete else ""
    )
    return [
        VerifyResult(
            "model checker",
            label,
            True,
            "",
            states,
            "states",
            seconds,
            {
                "complete": complete,
                "violations": violations,
                "cpu_seconds": cpu_seconds,
                "compiled": build == "compiled",
                "bounds": as_dict() if callable(as_dict) else str(bounds),
            },
        )
    ]


def _from_rows(rows: object) -> list[VerifyResult]:
    out: list[VerifyResult] = []
    if not isinstance(rows, list):
        rows = [rows]
    for row in rows:
        states = _states_of(row)
        seconds = row.get("seconds") if isinstance(row, dict) else getattr(row, "seconds", None)
        target = row.get("config") if isinstance(row, dict) else getattr(row, "config", None)
        if states is None or not isinstance(seconds, int | float):
            out.append(VerifyResult("model checker", str(target), False, f"unrecognised result {row!r}"))
            continue
        out.append(VerifyResult("model checker", str(target or "configuration"), True, "", states, "states", seconds))
    return out


# ---------------------------------------------------------------------------- hypothesis


def _has_rules(cls: type) -> bool:
    return any(getattr(f, "hypothesis_stateful_rule", None) is not None for _, f in inspect.getmembers(cls))


def _machine_classes(module: ModuleType) -> list[type]:
    from hypothesis.stateful import RuleBasedStateMachine

    found: list[type] = []
    for _, obj in inspect.getmembers(module, inspect.isclass):
        if (
            issubclass(obj, RuleBasedStateMachine)
            and obj is not RuleBasedStateMachine
            and obj.__module__ == module.__name__
            and not obj.__name__.startswith("_")
            and not inspect.isabstract(obj)
            and _has_rules(obj)  # a base class without rules is a kit to subclass, not a machine
        ):
            found.append(obj)
    return found


def count_steps(cls: type, max_examples: int, step_count: int) -> tuple[int, int, float]:
    from hypothesis import HealthCheck, Phase, settings
    from hypothesis.stateful import run_state_machine_as_test

    counts = {"machines": 0, "checks": 0}

    class Counting(cls):  # type: ignore[misc]
        def __init__(self) -> None:
            counts["machines"] += 1
            super().__init__()

        def check_invariants(self, *args: Any, **kwargs: Any) -> None:
            counts["checks"] += 1
            super().check_invariants(*args, **kwargs)

    Counting.__name__ = cls.__name__
    cfg = settings(
        max_examples=max_examples,
        stateful_step_count=step_count,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported, not minimised
        report_multiple_bugs=False,
    )
    t0 = time.perf_counter()
    run_state_machine_as_test(Counting, settings=cfg)
    seconds = time.perf_counter() - t0
    return counts["checks"] - counts["machines"], counts["machines"], seconds


def hypothesis_throughput(quick: bool = False) -> list[VerifyResult]:
    """Stateful steps per second of kvfsm's own Hypothesis machines on the real implementation."""
    if _import("hypothesis") is None:
        return [VerifyResult("hypothesis", "kvfsm.testing", False, "not available (hypothesis is not installed)")]
    if _import("kvfsm.testing") is None:
        return [VerifyResult("hypothesis", "kvfsm.testing", False, "not available (kvfsm.testing is not installed)")]
    examples, steps = (10, 20) if quick else (50, 50)
    out: list[VerifyResult] = []
    for name in ("kvfsm.testing.control", "kvfsm.testing.engine"):
        module = _import(name)
        if module is None:
            continue
        for cls in _machine_classes(module):
            target = f"{name.rsplit('.', 1)[-1]}.{cls.__name__}"
            try:
                n, machines, seconds = count_steps(cls, examples, steps)
            except Exception as exc:  # a failing property is a finding, not a benchmark crash
                out.append(VerifyResult("hypothesis", target, False, f"run failed: {type(exc).__name__}: {exc}"))
                continue
            out.append(VerifyResult("hypothesis", target, True, "", n, "steps", seconds, {"examples": machines}))
    if not out:
        return [VerifyResult("hypothesis", "kvfsm.testing", False, "not available (no stateful machine found)")]
    return out
