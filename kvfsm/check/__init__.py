"""An exhaustive bounded model checker for kvfsm's offloading protocol, built from spec/.

``explore(Bounds(...))`` visits every reachable state of :class:`~kvfsm.check.model.Model` (requests,
store and load jobs with W workers, CPU slots, up to two secondary tiers, GPU block groups and the
engine; optionally promotions, store deadlines with quarantine, and bounded shutdown) with symmetry
reduction, checks every invariant of spec/invariants.toml in every state and on every transition, checks
responsiveness on every arrival while the engine drains (in either :class:`DrainMode`), then checks
liveness on the explored graph, and returns the shortest counterexample of anything it finds.
``kvfsm check`` is its command line; :mod:`kvfsm.check.replay` replays the explored graph against the
real implementation (model-based tests).
"""

from __future__ import annotations

from kvfsm.check.bfs import (
    LIVENESS,
    RESPONSIVENESS,
    ExplorationResult,
    Graph,
    Violation,
    describe_state,
    explore,
    format_trace,
)
from kvfsm.check.model import Bounds, Model, ModelViolation, State, compiled
from kvfsm.check.properties import DrainMode

__all__ = [
    "LIVENESS",
    "RESPONSIVENESS",
    "Bounds",
    "DrainMode",
    "ExplorationResult",
    "Graph",
    "Model",
    "ModelViolation",
    "State",
    "Violation",
    "compiled",
    "describe_state",
    "explore",
    "format_trace",
]
