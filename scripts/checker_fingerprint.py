"""Fingerprints of the graphs that ``kvfsm check`` explores, to show that a speed change explores the same.

For each of a set of bounds / option combinations (and each planted bug, which stops at its first
violation), prints one line: the states, edges and pruned edges, the violations (invariant and
counterexample length), and a digest of the explored graph itself (every canonical state in BFS order and
every edge), so that two runs agree only if they discovered the same states in the same order.

    python scripts/checker_fingerprint.py > /tmp/before.txt   # before a change
    python scripts/checker_fingerprint.py | diff /tmp/before.txt -  # after it: no output

``--quick`` leaves out the default bounds and the larger combinations.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path

import pytest

from kvfsm.check import Bounds, Model, explore
from kvfsm.check.bfs import ExplorationResult, graph_digest
from kvfsm.check.properties import DrainMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

D = Bounds()
SMALL = Bounds(requests=2, prompts=1, chunks=1, workers=2, slots=1, groups=1, tiers=1, resets=1, preemptions=1)

#: name -> (bounds, drain mode, stop at the first violation, quick)
COMBOS: dict[str, tuple[Bounds, DrainMode, bool, bool]] = {
    "default": (D, DrainMode.NON_BLOCKING, True, False),
    "small": (SMALL, DrainMode.NON_BLOCKING, False, True),
    "tiers0": (dataclasses.replace(D, tiers=0), DrainMode.NON_BLOCKING, False, True),
    "tiers2-small": (dataclasses.replace(SMALL, tiers=2, slots=2), DrainMode.NON_BLOCKING, False, True),
    "durable-small": (dataclasses.replace(SMALL, durable=True, tiers=2, slots=2), DrainMode.NON_BLOCKING, False, True),
    "promotions-small": (
        Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, tiers=2, promotions=True, resets=1),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "promotions-mid": (
        Bounds(requests=2, prompts=1, chunks=2, slots=2, groups=2, tiers=2, promotions=True, resets=1),
        DrainMode.NON_BLOCKING,
        False,
        False,
    ),
    "deadlines-small": (
        Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, deadlines=1, resets=1, preemptions=1),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "deadlines2": (
        dataclasses.replace(D, deadlines=2, resets=0, slots=3, requests=1),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "shutdown-small": (
        Bounds(requests=2, prompts=1, chunks=1, slots=1, groups=1, shutdown=True, deadlines=1),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "blocking": (D, DrainMode.BLOCKING, True, True),
    "blocking-keep-going": (SMALL, DrainMode.BLOCKING, False, True),
    "no-failures-w3": (dataclasses.replace(SMALL, failures=False, workers=3), DrainMode.NON_BLOCKING, False, True),
    "max-jobs": (dataclasses.replace(D, max_jobs=2), DrainMode.NON_BLOCKING, False, True),
    "w1-slots3": (
        dataclasses.replace(D, workers=1, slots=3, groups=3, requests=2),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "prompts3-small": (
        dataclasses.replace(SMALL, prompts=3, requests=3, groups=2, slots=2, resets=0, preemptions=0),
        DrainMode.NON_BLOCKING,
        False,
        True,
    ),
    "big-promotions": (
        dataclasses.replace(D, promotions=True, tiers=2, deadlines=1, shutdown=True, failures=False),
        DrainMode.NON_BLOCKING,
        False,
        False,
    ),
}


def planted() -> Iterator[tuple[str, Bounds, AbstractContextManager[None]]]:
    from planted_bugs import PLANTED_BUGS
    from planted_model_bugs import PLANTED_MODEL_BUGS

    for name, plant in sorted(PLANTED_BUGS.items()):
        yield f"planted:{name}", D, _with_patch(plant)
    for name, (model_plant, bounds) in sorted(PLANTED_MODEL_BUGS.items()):
        yield f"planted-model:{name}", bounds, _with_patch(model_plant)


@contextmanager
def _with_patch(plant: object) -> Iterator[None]:
    mp = pytest.MonkeyPatch()
    try:
        with plant(mp):  # type: ignore[operator]
            yield
    finally:
        mp.undo()


def fingerprint(result: ExplorationResult) -> str:
    digest = graph_digest(result.graph) if result.graph is not None else "-"
    violations = ",".join(f"{v.invariant}/{v.length}" for v in result.violations)
    return (
        f"states={result.states} edges={result.edges} pruned={result.pruned} "
        f"responsiveness={result.responsiveness_checks} liveness={result.liveness_checked} "
        f"violations=[{violations}] graph={digest}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="leave out the default bounds and larger runs")
    parser.add_argument("--only", help="run only the combinations whose name contains this")
    args = parser.parse_args()
    runs: list[tuple[str, Bounds, DrainMode, bool, AbstractContextManager[None]]] = [
        (name, bounds, drain, stop, nullcontext())
        for name, (bounds, drain, stop, quick) in COMBOS.items()
        if quick or not args.quick
    ]
    runs += [(name, bounds, DrainMode.NON_BLOCKING, True, ctx) for name, bounds, ctx in planted()]
    for name, bounds, drain, stop, ctx in runs:
        if args.only and args.only not in name:
            continue
        t0 = time.process_time()
        with ctx:
            result = explore(model=Model(bounds, drain), stop_at_first=stop)
        cpu = time.process_time() - t0
        print(f"{name}: {fingerprint(result)}", flush=True)
        print(f"  {name}: {cpu:.2f} s CPU, {result.states / cpu if cpu else 0:,.0f} states/s", file=sys.stderr)


if __name__ == "__main__":
    main()
