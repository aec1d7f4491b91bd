"""scripts/coverage.py: the share of the checker's reachable abstract states a Hypothesis profile visits.

Run here at tiny bounds and a few examples (the real figure, at the default bounds and the ci profile,
takes minutes): the output format, a share between 0 and 100, the same figure twice (the runs are
derandomized), and the script's copies of the profiles and run sizes agree with conftest.py and
test_stateful.py.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings

from kvfsm.check.model import Bounds, Model
from kvfsm.testing.abstraction import CI_RUNS, PROFILES, Coverage, project_model_state, visited_projections
from kvfsm.testing.control import ControlPlaneStateMachine

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--requests", "1", "--workers", "1", "--slots", "1", "--resets", "0", "--preemptions", "0"]
LINE = re.compile(r"^coverage: (\d+\.\d)% of (\d+) reachable abstract states$")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvfsm_coverage_script", ROOT / "scripts" / "coverage.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[float, int, str]:
    assert _script().main(argv) == 0
    out = capsys.readouterr().out
    m = LINE.match(out.splitlines()[-1])
    assert m, f"last line is not the coverage line: {out!r}"
    return float(m.group(1)), int(m.group(2)), out


def test_the_command_prints_a_reproducible_share(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--machine", "control", "--examples", "4", "--steps", "8", *TINY]
    percent, n, out = _run(capsys, argv)
    assert n > 0
    assert 0.0 < percent <= 100.0  # the initial state, at least, is visited
    assert _run(capsys, argv)[2] == out


def test_the_initial_state_projects_alike_on_both_sides() -> None:
    visited = visited_projections(ControlPlaneStateMachine, max_examples=1, steps=1)
    assert project_model_state(Model(Bounds(requests=1)).initial) in visited


def test_coverage_arithmetic() -> None:
    a = project_model_state(Model(Bounds(requests=1)).initial)
    b = ("idle", ("x",), (), (), 0)
    cov = Coverage(frozenset({a, b}), frozenset({a, ("stopped", (), (), (), 0)}))
    assert cov.percent == 50.0 and len(cov.outside) == 1
    assert cov.line() == "coverage: 50.0% of 2 reachable abstract states"


def test_the_profiles_and_run_sizes_match_the_tests() -> None:
    for name, examples in PROFILES.items():
        assert settings.get_profile(name).max_examples == examples, name
    text = (ROOT / "tests" / "test_stateful.py").read_text()
    classes = {
        "control": "ControlPlaneStateMachine",
        "engine": "EngineStateMachine",
        "paths": "CheckerPathStateMachine",
    }
    for name, (steps, scale) in CI_RUNS.items():
        assert f"_run({classes[name]}, steps={steps}, scale={scale})" in text, name


def test_the_checker_path_machine_visits_every_state_at_tiny_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    """Each example walks the checker's shortest path to one abstract state: at bounds this small, a few
    examples reach all of them (the control machine, which steps the engine loop whole, does not)."""
    percent, n, _ = _run(capsys, ["--machine", "paths", "--examples", "30", "--steps", "20", *TINY])
    assert n > 1 and percent == 100.0
