"""Hypothesis profiles, chosen by HYPOTHESIS_PROFILE: ci (deterministic, default in tox), dev, nightly."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=60,
    deadline=None,
    derandomize=True,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.register_profile("nightly", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """One line per state machine: how many of its ground-truth checks (issue 10) found real work in flight
    on the data plane (copy threads held or unpolled, tier jobs held), whatever ``-s`` says."""
    from kvfsm.testing.system import GROUND_TRUTH_CHECKS

    machines = sorted({name for name, _ in GROUND_TRUTH_CHECKS})
    for name in machines:
        kinds = ", ".join(
            f"{kind}: {GROUND_TRUTH_CHECKS[(name, kind)]}"
            for kind in ("copy running", "copy held", "copy unpolled", "tier job", "given up", "quarantined copy")
        )
        terminalreporter.write_line(
            f"{name}: ground-truth checks with real work in flight: {GROUND_TRUTH_CHECKS[(name, 'any')]} ({kinds})"
        )
