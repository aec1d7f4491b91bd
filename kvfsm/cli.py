"""The ``kvfsm`` command line: demo, bench, diagram, spec."""

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

    return run_demo(quick=args.quick)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfsm.bench import run_bench

    return run_bench(jobs=args.jobs, repeats=args.repeats, as_json=args.json)


def _cmd_diagram(args: argparse.Namespace) -> int:
    from kvfsm.diagrams import main as diagrams_main

    return diagrams_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvfsm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="multi-turn workload with real transfers, drain comparison")
    p.add_argument("--quick", action="store_true", help="a smaller workload")
    p.set_defaults(func=_cmd_demo)
    p = sub.add_parser("bench", help="lifecycle cost: compiled tables vs transitions-checked mode")
    p.add_argument("--jobs", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=_cmd_bench)
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
