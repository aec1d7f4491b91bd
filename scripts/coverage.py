"""The share of the model checker's reachable abstract states that a Hypothesis profile visits (issue 10).

Explores the checker at the default bounds (or those given), projects every reachable state with
:func:`kvfsm.testing.abstraction.project_model_state`, runs the stateful machines as tests/test_stateful.py
runs them under the profile (derandomized, so the figure is reproducible) while recording the projected
state of the system after every step, and prints ``coverage: X% of N reachable abstract states``.

Usage: ``python scripts/coverage.py [--profile ci|dev|nightly] [--machine control|engine|paths|both|all]
[--examples N] [--steps N] [--missing] [checker bounds: --requests N ...]``. ``both`` is control and
engine; ``all`` (the default) adds ``paths``, :class:`kvfsm.testing.paths.CheckerPathStateMachine`: the real
control plane at the checker's granularity, each example following the checker's shortest path to one
abstract state and then any enabled edge, checked against the checker's state after every event.

Measured at the default bounds (591 reachable abstract states), ci profile: all 93.1% (550 of 591); paths
alone 92.2%; both 21.2% (control and engine; before they drew two tiers and per-kind deadlines: control
18.6%, engine 14.2%, both 22.0%). The whole-system machines (control, engine) step the
engine loop whole, so they never stop between a lookup and a step or between two ranks' reports: most states
only they miss hold a job that some but not all ranks have reported; the checker-path machine reaches those.
(Derandomized runs are seeded from the machine class's name, so renaming the recording class moves these
figures a little.)
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvfsm.check.cli import bounds_from
from kvfsm.check.model import Bounds
from kvfsm.testing.abstraction import PROFILES, measure_coverage


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", choices=sorted(PROFILES), default="ci")
    p.add_argument(
        "--machine",
        choices=("control", "engine", "paths", "both", "all"),
        default="all",
        help="both: control and engine; all: control, engine and paths (the checker-path machine)",
    )
    p.add_argument("--examples", type=int, default=None, help="examples per machine (default: as the tests)")
    p.add_argument("--steps", type=int, default=None, help="steps per example (default: as the tests)")
    p.add_argument("--missing", action="store_true", help="also list the reachable states never visited")
    d = Bounds()
    for name in ("requests", "prompts", "chunks", "workers", "slots", "groups", "tiers", "resets", "preemptions"):
        p.add_argument("--" + name, type=int, default=None, metavar="N", help=f"checker bound ({getattr(d, name)})")
    p.add_argument("--no-failures", action="store_true", help="checker: copies and cascades never fail")
    args = p.parse_args(argv)
    args.max_jobs = None
    machines = {"both": ("control", "engine"), "all": ("control", "engine", "paths")}.get(args.machine, (args.machine,))
    cov = measure_coverage(machines, args.profile, bounds_from(args), examples=args.examples, steps=args.steps)
    print(
        f"{args.machine}, profile {args.profile}: {len(cov.covered)} of {len(cov.reachable)} reachable visited, "
        f"{len(cov.outside)} visited outside the bounds"
    )
    if args.missing:
        for s in sorted(cov.reachable - cov.visited):
            print(f"  never visited: {s}")
    print(cov.line())
    return 0


if __name__ == "__main__":
    # The machines inject copy failures, which the data plane logs: noise here, not news.
    logging.disable(logging.CRITICAL)
    sys.exit(main())
