"""``kvfsm check``: run the model checker from the command line, with a progress display.

The progress display (shared with ``kvfsm bench``) uses ``rich`` if it is installed, else ``tqdm``, else plain
lines on stderr; none of them is needed (``pip install kvfsm[progress]`` brings rich). ``--quiet`` turns it off,
``--json`` prints the result as JSON on stdout. The exit status is 0 when nothing is violated, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from kvfsm.bench_progress import Progress as ProgressDisplay
from kvfsm.check.bfs import ExplorationResult, explore, format_trace
from kvfsm.check.model import Bounds, Model

__all__ = ["add_arguments", "run"]

#: (states, edges, queued, seconds) -> None
Progress = Callable[[int, int, int, float], None]


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Bounds()
    b = p.add_argument_group("bounds")
    b.add_argument("--requests", type=int, default=d.requests, help="requests that arrive, in all (%(default)s)")
    b.add_argument("--prompts", type=int, default=d.prompts, help="distinct prompts, sharing chunk 0 (%(default)s)")
    b.add_argument("--chunks", type=int, default=d.chunks, help="chunks per prompt (%(default)s)")
    b.add_argument("--workers", type=int, default=d.workers, help="W: workers copying each job (%(default)s)")
    b.add_argument("--slots", type=int, default=d.slots, help="CPU primary slots (%(default)s)")
    b.add_argument("--groups", type=int, default=d.groups, help="GPU block groups, one request each (%(default)s)")
    b.add_argument("--tiers", type=int, default=d.tiers, choices=(0, 1), help="secondary tiers (%(default)s)")
    b.add_argument("--resets", type=int, default=d.resets, help="reset_cache calls (%(default)s)")
    b.add_argument("--preemptions", type=int, default=d.preemptions, help="preemptions (%(default)s)")
    b.add_argument("--max-jobs", type=int, default=d.max_jobs, help="jobs created in all; 0: no bound (%(default)s)")
    b.add_argument("--no-failures", action="store_true", help="copies and cascades never fail")
    o = p.add_argument_group("run")
    o.add_argument("--keep-going", action="store_true", help="report the first violation of every invariant")
    o.add_argument("--no-liveness", action="store_true", help="skip the liveness check (and keep no edges)")
    o.add_argument("--max-states", type=int, default=0, help="stop after this many states (0: no limit)")
    o.add_argument("--replay", action="store_true", help="also replay every edge on the implementation and probe it")
    o.add_argument("--quiet", action="store_true", help="no progress display")
    o.add_argument("--json", action="store_true", help="print the result as JSON")
    o.add_argument("--brief", action="store_true", help="counterexamples without the state after each event")


def bounds_from(args: argparse.Namespace) -> Bounds:
    return Bounds(
        requests=args.requests,
        prompts=args.prompts,
        chunks=args.chunks,
        workers=args.workers,
        slots=args.slots,
        groups=args.groups,
        tiers=args.tiers,
        resets=args.resets,
        preemptions=args.preemptions,
        failures=not args.no_failures,
        max_jobs=args.max_jobs,
    )


@contextmanager
def progress_display(enabled: bool, stream: TextIO = sys.stderr) -> Iterator[Progress | None]:
    """A progress callback for explore(), on the shared progress display (:mod:`kvfsm.bench_progress`)."""
    if not enabled:
        yield None
        return
    with ProgressDisplay(None, "exploring", stream=stream) as display:

        def update(states: int, edges: int, queued: int, seconds: float) -> None:
            rate = states / seconds if seconds > 0 else 0.0
            display.status(
                f"{states:,} states, {edges:,} edges, {queued:,} queued, {seconds:.1f} s ({rate:,.0f} states/s)",
                final=queued == 0,
            )

        yield update


def run(args: argparse.Namespace) -> int:
    bounds = bounds_from(args)
    show = not args.quiet and not args.json
    model = Model(bounds)
    if show:
        print(f"kvfsm check: {_bounds_text(bounds)}", file=sys.stderr)
    with progress_display(show) as progress:
        result = explore(
            bounds,
            stop_at_first=not args.keep_going,
            keep_graph=not args.no_liveness or args.replay,
            check_liveness=not args.no_liveness,
            max_states=args.max_states,
            progress=progress,
            model=model,
        )
    summary: dict[str, Any] = result.summary()
    replay: dict[str, Any] | None = None
    if args.replay and result.graph is not None and result.ok:
        from kvfsm.check.replay import replay_edges

        rep = replay_edges(result)
        replay = {
            "edges_replayed": rep.edges_replayed,
            "probes": rep.probes,
            "seconds": round(rep.seconds, 3),
            "mismatches": [str(m) for m in rep.mismatches],
            "probe_failures": rep.probe_failures[:20],
        }
        summary["replay"] = replay
    if args.json:
        json.dump(summary, sys.stdout, indent=2)
        print()
    else:
        _print_text(result, model, replay, brief=args.brief)
    failed = bool(result.violations) or bool(replay and (replay["mismatches"] or replay["probe_failures"]))
    return 1 if failed else 0


def _bounds_text(b: Bounds) -> str:
    return ", ".join(f"{k}={v}" for k, v in b.as_dict().items())


def _print_text(result: ExplorationResult, model: Model, replay: dict[str, Any] | None, *, brief: bool) -> None:
    status = "complete" if result.complete else "stopped early"
    print(
        f"{result.states:,} states, {result.edges:,} edges in {result.seconds:.2f} s "
        f"({result.states_per_second:,.0f} states/s, {result.edges / max(result.seconds, 1e-9):,.0f} edges/s); "
        f"{status}"
        + (f", {result.pruned:,} edges pruned by --max-jobs" if result.pruned else "")
        + (", liveness checked" if result.liveness_checked else "")
    )
    for v in result.violations:
        print()
        print(format_trace(v, model, states=not brief))
    if replay is not None:
        print(
            f"replayed {replay['edges_replayed']:,} edges and {replay['probes']:,} negative probes on the "
            f"implementation in {replay['seconds']:.1f} s: {len(replay['mismatches'])} mismatches, "
            f"{len(replay['probe_failures'])} probe failures"
        )
        for line in [*replay["mismatches"], *replay["probe_failures"]]:
            print(f"  {line}")
    if not result.violations:
        print("no invariant violated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfsm check", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
