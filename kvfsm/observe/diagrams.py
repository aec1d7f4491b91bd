"""Mermaid diagrams of the spec machines, generated from the transitions Machine built from spec/.

The diagrams in spec/README.md are not drawn by hand: each lies between a pair of markers

    <!-- diagram:job:start -->
    <!-- diagram:job:end -->

and ``kvfsm diagram --write`` (or ``python -m kvfsm.observe.diagrams --write``) regenerates the fenced block
between them. ``--check`` exits 1 if the README is stale (CI and tests/test_spec_conformance.py run
it); with no option every diagram is printed.

The edges are read from ``compile_table(build_transitions_machine(spec))``, that is from the very
transitions Machine object the runtime table is compiled from, so a diagram cannot show an edge the
machines do not have. transitions' own ``GraphMachine(graph_engine="mermaid")`` needs a model attached
and does not print ``after`` callbacks, so the effects would be lost; walking the table is simpler and
gives byte-stable output. Labels read ``event [guard] / effect``; ``[*] -->`` marks the initial state and
``--> [*]`` each terminal state.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from kvfsm.errors import ConfigError, KvfsmError, SpecError
from kvfsm.machines.compiled import build_transitions_machine, compile_table
from kvfsm.machines.loader import MACHINE_NAMES, MachineSpec, load_machine, spec_dir

__all__ = [
    "add_arguments",
    "all_diagrams",
    "main",
    "mermaid",
    "mermaid_for",
    "readme_path",
    "render_readme",
    "run",
]

_MARKER = re.compile(
    r"(?P<start><!-- diagram:(?P<name>[A-Za-z0-9_]+):start -->)"
    r"(?P<body>.*?)"
    r"(?P<end><!-- diagram:(?P=name):end -->)",
    re.DOTALL,
)
# Mermaid ends a transition description at ':' or ';' and treats '#' as an entity escape.
_FORBIDDEN = re.compile(r"[:;#\n]")


def _label(event: str, guard: str | None, effect: str | None) -> str:
    label = event
    if guard is not None:
        label += f" [{guard}]"
    if effect is not None:
        label += f" / {effect}"
    if _FORBIDDEN.search(label):
        raise SpecError(f"cannot draw transition label {label!r}: names must not contain ':', ';' or '#'")
    return label


def mermaid_for(spec: MachineSpec) -> str:
    """The ``stateDiagram-v2`` source of one machine spec (used directly by tests on modified specs)."""
    machine = build_transitions_machine(spec)
    table = compile_table(machine)
    states: list[str] = list(machine.states)
    events: list[str] = list(machine.events)
    lines = [
        "---",
        f"title: {spec.name}",
        "---",
        "stateDiagram-v2",
        "    direction LR",
        f"    [*] --> {machine.initial}",
    ]
    for source in states:
        for event in events:
            for edge in table.get((source, event), ()):
                lines.append(f"    {source} --> {edge.dest}: {_label(event, edge.guard, edge.effect)}")
    lines.extend(f"    {state} --> [*]" for state in states if state in spec.terminal)
    return "\n".join(lines) + "\n"


def mermaid(name: str) -> str:
    """The ``stateDiagram-v2`` source of the spec machine ``name`` (job, slot, request or engine)."""
    return mermaid_for(load_machine(name))


def all_diagrams() -> dict[str, str]:
    """Every machine's diagram, in MACHINE_NAMES order."""
    return {name: mermaid(name) for name in MACHINE_NAMES}


def render_readme(text: str) -> str:
    """Replace the body between each ``<!-- diagram:NAME:start/end -->`` pair with NAME's diagram."""
    diagrams = all_diagrams()

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in diagrams:
            raise SpecError(f"README marker names unknown machine {name!r}; expected one of {MACHINE_NAMES}")
        return f"{match.group('start')}\n```mermaid\n{diagrams[name]}```\n{match.group('end')}"

    return _MARKER.sub(replace, text)


def readme_path() -> Path:
    """spec/README.md, next to the tables."""
    return spec_dir() / "README.md"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvfsm diagram`` and ``python -m kvfsm.observe.diagrams``."""
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="regenerate the diagrams in spec/README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if spec/README.md is out of date")
    parser.add_argument("--readme", type=Path, default=None, help="file to update (default: spec/README.md)")


def run(args: argparse.Namespace) -> int:
    """Print every diagram, or ``--write`` / ``--check`` the README; ConfigError if it cannot be read."""
    if not (args.write or args.check):
        for name, diagram in all_diagrams().items():
            sys.stdout.write(f"%% {name}\n{diagram}\n")
        return 0

    path: Path = args.readme if args.readme is not None else readme_path()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"cannot read {path}: {reason}; expected a UTF-8 Markdown file with diagram markers") from exc
    new = render_readme(text)
    if args.check:
        if new != text:
            sys.stderr.write(f"{path}: diagrams are out of date; run kvfsm diagram --write\n")
            return 1
        return 0
    if new != text:
        try:
            path.write_text(new, encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}; expected a writable file") from exc
        sys.stdout.write(f"{path}: diagrams updated\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvfsm.observe.diagrams", description="Mermaid diagrams of the kvfsm spec machines."
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except KvfsmError as exc:
        sys.stderr.write(f"{parser.prog}: error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
