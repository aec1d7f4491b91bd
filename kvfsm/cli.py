"""The ``kvfsm`` command line: demo, bench, check, diagram, spec."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _cmd_spec(_: argparse.Namespace) -> int:
    from kvfsm.spec_loader import MACHINE_NAMES, load_invariants, load_machine

    for name in MACHINE_NAMES:
        m = load_machine(name)
        print(
            f"{name:8} {len(m.states)} states, {len(m.events)} events, {len(m.transitions)} transitions, "
            f"{len(m.guards)} guards, {len(m.effects)} effects"
        )
    print(f"{len(load_invariants())} invariants")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvfsm.demo import run_demo

    return run_demo(quick=args.quick, trace=args.trace, plot=args.plot)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfsm.bench import run_bench

    return run_bench(
        quick=args.quick,
        quiet=args.quiet,
        as_json=args.json,
        out=args.out,
        jobs=args.jobs,
        repeats=args.repeats,
        workload=args.workload,
        sections=args.only,
    )


def _cmd_check(args: argparse.Namespace) -> int:
    if args.trace is not None:
        return _check_trace(args.trace, as_json=bool(getattr(args, "json", False)))
    from kvfsm.check.cli import run as run_check

    return run_check(args)


def _check_trace(path: str, as_json: bool) -> int:
    """``kvfsm check --trace FILE``: is a recorded NDJSON trace a valid behaviour of the spec?"""
    import json

    from kvfsm.trace import TraceError, verify_trace_file

    try:
        report = verify_trace_file(path)
    except TraceError as exc:
        print(f"kvfsm check --trace: {exc}", file=sys.stderr)
        return 2
    if as_json:
        print(json.dumps({"trace": path, **report.as_dict()}, indent=2))
    else:
        print(f"{path}: {report.summary()}")
        for note in report.notes:
            print(f"  note: {note}")
    return 0 if report.ok else 1


def _cmd_diagram(args: argparse.Namespace) -> int:
    from kvfsm.diagrams import main as diagrams_main

    return diagrams_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="multi-turn workload with real transfers, drain comparison")
    p.add_argument("--quick", action="store_true", help="a smaller workload")
    p.add_argument("--trace", metavar="FILE", help="record every machine transition as NDJSON, then verify it")
    p.add_argument("--plot", metavar="FILE", help="draw the engine-state timeline as a PNG (needs matplotlib)")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="drain, control-plane, lifecycle, transfer and verification benchmarks")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (under a minute; CI smoke)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE")
    p.add_argument(
        "--only",
        action="append",
        choices=("drain", "control", "lifecycle", "transfers", "verification"),
        help="run only this section (repeatable)",
    )
    p.add_argument("--workload", metavar="FILE", help="replay this JSONL trace (one list of block ids per line)")
    p.add_argument("--jobs", type=int, default=None, help="jobs per lifecycle run (default 2000, quick 500)")
    p.add_argument("--repeats", type=int, default=None, help="lifecycle repeats (default 5, quick 3)")
    p.set_defaults(func=_cmd_bench)
    p = sub.add_parser("check", help="exhaustive bounded model check of the spec's abstract model")
    from kvfsm.check.cli import add_arguments as add_check_arguments

    add_check_arguments(p)
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="instead of exploring, verify that a recorded NDJSON trace (kvfsm demo --trace) is a valid "
        "behaviour of the spec",
    )
    p.set_defaults(func=_cmd_check)
    p = sub.add_parser("diagram", help="Mermaid diagrams of the spec machines")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_diagram)
    p = sub.add_parser("spec", help="summary of the spec machines")
    p.set_defaults(func=_cmd_spec)
    args = parser.parse_args(argv)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
