"""Every ``kvfsm`` command the README shows works as shown.

The commands are read from the README itself (inline code and ``sh`` blocks), so a command added there
without a run here fails ``test_every_readme_command_has_a_run``. Each usage line's options, every
alternative of ``[--a|--b]`` included, must parse; and every command runs, in process, on small inputs.
Two are run in a smaller form the README also documents, because the shown form takes minutes (marked
HEAVY below). Also here: ``kvfsm demo --quick`` (``result: OK``) as CI runs it, and the timeline
picture's legend.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import kvfsm.observe.diagrams
import kvfsm.observe.progress
from kvfsm.bench.workload import WorkloadConfig, generate_trace, write_jsonl
from kvfsm.cli import build_parser, main

README = Path(__file__).resolve().parents[1] / "README.md"
_CMD = re.compile(r"(?:^|/)(kvfsm(?: .*)?)$")


def readme_commands(text: str) -> set[str]:
    """``kvfsm ...`` in inline code spans and in ``sh`` blocks (each ``&&`` part), path prefix dropped."""
    found: set[str] = set()
    for span in re.findall(r"`([^`\n]+)`", text):
        m = _CMD.search(span.strip())
        if m:
            found.add(m.group(1))
    for block in re.findall(r"```sh\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            for part in line.split("&&"):
                m = _CMD.search(part.strip())
                if m:
                    found.add(m.group(1))
    return found


def expand_usage(command: str) -> list[list[str]]:
    """The argv of a usage line with every optional part given, once per ``[--a|--b]`` alternative."""
    values = {"FILE": "x.jsonl", "N": "1", "SECTION": "control"}
    words = command.split()[1:]
    variants: list[list[str]] = [[]]
    for word in words:
        options = [values.get(o, o) for o in word.strip("[]").split("|")]
        variants = [[*v, o] for v in variants for o in options]
    return variants


@pytest.fixture
def work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with a small workload, a docs/ folder, and a stale copy of spec/README.md that
    ``kvfsm diagram`` uses instead of the real one."""
    write_jsonl(generate_trace(WorkloadConfig(distinct_blocks=3000, num_prefixes=32, seed=7)), tmp_path / "w.jsonl")
    (tmp_path / "docs").mkdir()
    real = kvfsm.observe.diagrams.readme_path().read_text(encoding="utf-8")
    stale = re.sub(r"(<!-- diagram:job:start -->\n).*?(<!-- diagram:job:end -->)", r"\1stale\n\2", real, flags=re.S)
    assert stale != real
    (tmp_path / "spec-README.md").write_text(stale, encoding="utf-8")
    monkeypatch.setattr(kvfsm.observe.diagrams, "readme_path", lambda: tmp_path / "spec-README.md")
    # Progress on plain lines: importing rich here would change which display later tests get.
    monkeypatch.setattr(kvfsm.observe.progress, "progress_backend", lambda: "plain")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _has(*fragments: str) -> Callable[[str, Path], None]:
    def check(out: str, _: Path) -> None:
        for fragment in fragments:
            assert fragment in out, (fragment, out[-2000:])

    return check


def _demo_ok(out: str, _: Path) -> None:
    assert out.rstrip().splitlines()[-1] == "result: OK", out[-2000:]


def _bench_json(out: str, work: Path) -> None:
    data = json.loads((work / "bench.json").read_text())
    assert json.loads(out) == data
    assert data["meta"]["sections"] == ["control"] and data["control"]["workload"]["requests"] > 0


def _diagram_written(out: str, work: Path) -> None:
    assert "diagrams updated" in out
    assert (work / "spec-README.md").read_text(encoding="utf-8") == (
        kvfsm.observe.diagrams.render_readme(kvfsm.observe.diagrams.readme_path().read_text(encoding="utf-8"))
    )


def _picture(out: str, work: Path) -> None:
    _demo_ok(out, work)
    assert (work / "docs" / "engine-timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _help_is_plain(out: str, _: Path) -> None:
    assert "usage: kvfsm" in out
    assert "``" not in out and ":mod:" not in out and ":func:" not in out


_HELP = [[c, "--help"] for c in ("demo", "bench", "check", "diagram", "spec")]

#: README command -> the runs that show it works: (argv..., check of the last run's stdout); every argv
#: must exit 0. ``{w}`` is the working folder.
RUNS: dict[str, tuple[list[list[str]], Callable[[str, Path], None]]] = {
    "kvfsm --version": ([["--version"]], _has("kvfsm 0.1.0")),
    "kvfsm COMMAND --help": (_HELP, _help_is_plain),
    "kvfsm check --help": ([["check", "--help"]], _has("--requests", "1 to 16", "--trace FILE")),
    "kvfsm demo": ([["demo"]], _demo_ok),
    "kvfsm demo [--quick] [--trace FILE] [--plot FILE]": (
        [["demo", "--quick", "--trace", "{w}/t.ndjson", "--plot", "{w}/t.png"]],
        _has("a valid behaviour of the spec", "engine timeline picture", "result: OK"),
    ),
    "kvfsm demo --plot docs/engine-timeline.png": ([["demo", "--plot", "docs/engine-timeline.png"]], _picture),
    # Needs a vLLM that serves here (tox env e2e, which also runs kvfsm.vllm.serving.demo itself).
    "kvfsm demo --vllm": (
        [["demo", "--vllm"]],
        _has("tokens identical to the engine with no connector: yes", "result: OK"),
    ),
    "kvfsm bench --only e2e": (
        [["bench", "--only", "e2e", "--quick", "--quiet"]],
        _has("(9) e2e: a serving vLLM engine", "bench finished"),
    ),
    # HEAVY: the full `kvfsm bench` takes minutes; its documented --quick form runs whole in
    # tests/test_bench_smoke.py, here one quick section with the README's --jobs/--repeats.
    "kvfsm bench": (
        [["bench", "--quick", "--quiet", "--only", "lifecycle", "--jobs", "50", "--repeats", "1"]],
        _has("(3) lifecycle overhead: median of 1 runs, 50 jobs per run", "bench finished"),
    ),
    "kvfsm bench [--quick] [--quiet] [--json] [--out FILE] [--only SECTION] [--workload FILE]": (
        [
            [
                *("bench", "--quick", "--quiet", "--json", "--out", "{w}/bench.json"),
                *("--only", "control", "--workload", "{w}/w.jsonl"),
            ]
        ],
        _bench_json,
    ),
    "kvfsm bench --only control --workload FILE": (
        [["bench", "--only", "control", "--workload", "{w}/w.jsonl"]],
        _has("(2) control-plane cost", "w.jsonl", "bench finished"),
    ),
    # HEAVY: default bounds explore ~90k states (minutes with --replay); the shown options, small.
    "kvfsm check [--requests N] [--workers N] [--slots N] [--quiet] [--json]": (
        [["check", "--requests", "1", "--workers", "1", "--slots", "1", "--quiet", "--json"]],
        lambda out, _: _check_json(json.loads(out)),
    ),
    "kvfsm check --trace FILE": (
        [["demo", "--quick", "--trace", "{w}/run.ndjson"], ["check", "--trace", "{w}/run.ndjson"]],
        _has("run.ndjson: ", "a valid behaviour of the spec"),
    ),
    "kvfsm diagram [--write|--check]": (
        [["diagram"], ["diagram", "--write"], ["diagram", "--check"]],
        lambda out, _: None,  # the exit status of --check after --write is the check
    ),
    "kvfsm spec": (
        [["spec"]],
        _has(
            "job: ",
            "  states: ",
            "  events: ",
            "    submitted --launch [worker_not_launched] / start_copy--> in_flight",
            "invariants",
        ),
    ),
}


def _check_json(data: dict[str, Any]) -> None:
    assert data["violations"] == [] and data["states"] > 0
    assert (data["bounds"]["requests"], data["bounds"]["workers"], data["bounds"]["slots"]) == (1, 1, 1)


def test_every_readme_command_has_a_run() -> None:
    assert readme_commands(README.read_text(encoding="utf-8")) == set(RUNS)


@pytest.mark.parametrize("command", sorted(c for c in RUNS if "[" in c))
def test_every_option_of_a_usage_line_parses(command: str) -> None:
    variants = expand_usage(command)
    assert variants and all(len(v) > 1 for v in variants)
    for argv in variants:
        build_parser().parse_args(argv)  # SystemExit (a failure here) if one is not accepted


def test_diagram_write_and_check_parse() -> None:
    """The old parser took them as unrecognized arguments (exit 2)."""
    for flag in ("--write", "--check"):
        assert getattr(build_parser().parse_args(["diagram", flag]), flag[2:]) is True


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # --help and --version
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize("command", sorted(RUNS))
def test_the_readme_command_works(command: str, work: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs, check = RUNS[command]
    if any("--plot" in argv for argv in runs):
        pytest.importorskip("matplotlib")
    if any(argv[0] in ("demo", "bench") and "--help" not in argv for argv in runs):
        pytest.importorskip("torch")
    if any("--vllm" in argv or "e2e" in argv for argv in runs):
        pytest.importorskip("vllm.entrypoints.llm")
    out = ""
    for argv in runs:
        rc = _exit_code([a.format(w=work) for a in argv])
        out, err = capsys.readouterr()
        assert rc == 0, (argv, out[-2000:], err[-2000:])
        assert "Traceback" not in out + err
    check(out, work)


# ------------------------------------------------------------------------------------- demo, picture


def test_demo_quick_says_result_ok(capsys: pytest.CaptureFixture[str]) -> None:
    """What CI runs: ``kvfsm demo --quick``; the drain part shows what differs between the modes."""
    pytest.importorskip("torch")
    assert main(["demo", "--quick"]) == 0
    out = capsys.readouterr().out
    assert "\nresult: OK\n" in out
    assert "B waited" in out and "blocking waits" in out and " ms " in out
    nonblocking = next(line for line in out.splitlines() if line.startswith("  nonblocking: "))
    assert "draining (B arrived" in nonblocking and "blocked" not in nonblocking
    blocking = next(line for line in out.splitlines() if line.startswith("  blocking: "))
    assert "blocked until" in blocking and "draining" not in blocking


def test_the_legend_lists_every_state_the_timeline_passed_through() -> None:
    pytest.importorskip("torch")
    from kvfsm.engine.core import StepRecord
    from kvfsm.machines.names import EngineState
    from kvfsm.observe.timeline import legend_entries

    states = [EngineState.RUNNING, EngineState.FINISHING, EngineState.DRAINING, EngineState.DRAINING]
    states += [EngineState.IDLE, EngineState.SHUTTING_DOWN, EngineState.STOPPED]
    records = [StepRecord(i + 1, s, (), 0, 0, False) for i, s in enumerate(states)]
    labels = dict(legend_entries(records))
    assert set(labels) == set(states)
    assert labels[EngineState.DRAINING] == "draining (2 steps)"
    # A run that never drained still says so: draining is always in the legend.
    quiet = dict(legend_entries(records[:1]))
    assert quiet[EngineState.DRAINING] == "draining (0 steps)" and EngineState.STOPPED not in quiet


def test_the_demo_picture_draws_the_drain(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The demo's picture includes its non-blocking drain round, so draining is in the bands too."""
    pytest.importorskip("torch")
    pytest.importorskip("matplotlib")
    import kvfsm.observe.timeline
    from kvfsm.demo import run_demo
    from kvfsm.machines.names import EngineState

    drawn: list[set[EngineState]] = []
    real = kvfsm.observe.timeline.plot_timeline

    def spy(records: Any, path: Path, **kw: Any) -> Path:
        drawn.append({r.state for r in records})
        return real(records, path, **kw)

    monkeypatch.setattr(kvfsm.observe.timeline, "plot_timeline", spy)
    assert run_demo(quick=True, plot=tmp_path / "t.png") == 0
    assert drawn and EngineState.DRAINING in drawn[0] and EngineState.RUNNING in drawn[0]
    assert (tmp_path / "t.png").stat().st_size > 0


def test_usage_expansion() -> None:
    assert expand_usage("kvfsm diagram [--write|--check]") == [["diagram", "--write"], ["diagram", "--check"]]
    assert expand_usage("kvfsm bench [--only SECTION]") == [["bench", "--only", "control"]]
