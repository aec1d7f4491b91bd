"""Every bad input to the command line: one line on stderr, a non-zero exit status, no traceback, and no
work done first (nothing on stdout: a bad ``--out`` must not cost a whole bench run)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvfsm.cli import main

# A minimal valid trace: the header, a slot written and aborted, and the recorder's end line.
_HEADER = {"kvfsm_trace": 2, "spec": {}, "clock": "perf_counter"}
_RECORD = {
    "machine": "slot",
    "id": "00",
    "inst": 0,
    "readers": 0,
    "seq": 0,
    "t": 0.0,
    "event": "begin_write",
    "from": "absent",
    "to": "writing",
}
_ABORT = {**_RECORD, "seq": 1, "event": "abort_write", "from": "writing", "to": "absent"}
_END = {"end": 2, "scopes": 0}

#: name -> bytes, created in tmp_path as {d}/name
FILES: dict[str, bytes] = {
    "empty.ndjson": b"",
    "header.ndjson": (json.dumps(_HEADER) + "\n").encode(),
    "good.ndjson": "".join(json.dumps(r) + "\n" for r in (_HEADER, _RECORD, _ABORT, _END)).encode(),
    "empty.jsonl": b"",
    "blank.jsonl": b"\n  \n",
    "emptylist.jsonl": b"[]\n",
    "badjson.jsonl": b"[1, 2]\n[1, 2\n",
    "object.jsonl": b'{"a": 1}\n',
    "number.jsonl": b"7\n",
    "null.jsonl": b"null\n",
    "negative.jsonl": b"[1, -2]\n",
    "strings.jsonl": b'["a", "b"]\n',
    "latin1.jsonl": b"[1, 2]\n[\xff\xfe]\n",
    "good.jsonl": b"[1, 2, 3]\n[1, 2, 4]\n",
}

#: the control section on a workload file (would run it, if the file were not refused first)
_W = ["bench", "--quick", "--only", "control", "--workload"]

# (id, argv with {d} for the folder of FILES, a fragment the one error line must contain)
CASES: list[tuple[str, list[str], str]] = [
    # demo: output paths and the plot extra are checked before the demo runs
    ("demo-trace-missing-dir", ["demo", "--quick", "--trace", "{d}/missing/t.ndjson"], "does not exist"),
    ("demo-plot-missing-dir", ["demo", "--quick", "--plot", "{d}/missing/t.png"], "does not exist"),
    ("demo-trace-is-a-dir", ["demo", "--quick", "--trace", "{d}"], "is a directory"),
    ("demo-plot-no-matplotlib", ["demo", "--quick", "--plot", "{d}/t.png"], "pip install 'kvfsm[plot]'"),
    # check: bounds
    ("check-requests-0", ["check", "--requests", "0"], "--requests: expected an integer from 1 to 16, got 0"),
    ("check-requests-negative", ["check", "--requests", "-3"], "--requests: expected an integer from 1 to 16"),
    ("check-requests-absurd", ["check", "--requests", "1000000"], "--requests: expected an integer from 1 to 16"),
    ("check-requests-not-int", ["check", "--requests", "two"], "got 'two'"),
    ("check-workers-0", ["check", "--workers", "0"], "--workers: expected an integer from 1 to 8"),
    ("check-workers-negative", ["check", "--workers", "-1"], "--workers: expected an integer from 1 to 8"),
    ("check-workers-absurd", ["check", "--workers", "99"], "--workers: expected an integer from 1 to 8"),
    ("check-slots-0", ["check", "--slots", "0"], "--slots: expected an integer from 1 to 16"),
    ("check-slots-negative", ["check", "--slots", "-2"], "--slots: expected an integer from 1 to 16"),
    ("check-slots-absurd", ["check", "--slots", "100000"], "--slots: expected an integer from 1 to 16"),
    ("check-max-states-negative", ["check", "--max-states", "-5"], "--max-states: expected an integer from 0"),
    ("check-tiers-3", ["check", "--tiers", "3"], "--tiers: expected an integer from 0 to 2"),
    # check --trace
    ("check-trace-missing", ["check", "--trace", "{d}/missing.ndjson"], "cannot read trace"),
    ("check-trace-empty", ["check", "--trace", "{d}/empty.ndjson"], "holds no transition records"),
    ("check-trace-header-only", ["check", "--trace", "{d}/header.ndjson"], "holds no transition records"),
    ("check-trace-with-bounds", ["check", "--trace", "{d}/good.ndjson", "--requests", "3"], "--requests only apply"),
    ("check-trace-with-max-states", ["check", "--trace", "{d}/good.ndjson", "--max-states", "9"], "--max-states"),
    # bench: numbers and paths, all before any section runs
    ("bench-jobs-0", ["bench", "--quick", "--jobs", "0"], "--jobs: expected an integer from 1"),
    ("bench-jobs-negative", ["bench", "--quick", "--jobs", "-5"], "--jobs: expected an integer from 1"),
    ("bench-repeats-0", ["bench", "--quick", "--repeats", "0"], "--repeats: expected an integer from 1"),
    ("bench-repeats-negative", ["bench", "--quick", "--repeats", "-1"], "--repeats: expected an integer from 1"),
    ("bench-out-missing-dir", ["bench", "--quick", "--only", "lifecycle", "--out", "{d}/missing/x.json"], "/missing"),
    ("bench-out-is-a-dir", ["bench", "--quick", "--only", "lifecycle", "--out", "{d}"], "is a directory"),
    ("bench-only-unknown", ["bench", "--only", "everything"], "invalid choice"),
    # bench --workload: every way a file can be wrong
    ("workload-missing", [*_W, "{d}/nope.jsonl"], "cannot read"),
    ("workload-directory", [*_W, "{d}"], "is a directory"),
    ("workload-bad-json", [*_W, "{d}/badjson.jsonl"], ":2: not valid"),
    ("workload-object", [*_W, "{d}/object.jsonl"], "got a JSON object"),
    ("workload-number", [*_W, "{d}/number.jsonl"], "got a JSON number"),
    ("workload-null", [*_W, "{d}/null.jsonl"], "got a JSON null"),
    ("workload-negative-id", [*_W, "{d}/negative.jsonl"], "range"),
    ("workload-not-utf8", [*_W, "{d}/latin1.jsonl"], "not UTF-8"),
    ("workload-empty", [*_W, "{d}/empty.jsonl"], "no requests"),
    ("workload-blank", [*_W, "{d}/blank.jsonl"], "no requests"),
    ("workload-empty-list", [*_W, "{d}/emptylist.jsonl"], "empty"),
    ("workload-string-ids", [*_W, "{d}/strings.jsonl"], "string"),
    ("workload-only-drain", ["bench", "--quick", "--only", "drain", "--workload", "{d}/good.jsonl"], "control"),
    # the command itself
    ("no-command", [], "required"),
    ("unknown-command", ["frobnicate"], "invalid choice"),
    ("unknown-option", ["spec", "--verbose"], "unrecognized arguments"),
]


@pytest.fixture
def files(tmp_path: Path) -> Path:
    for name, data in FILES.items():
        (tmp_path / name).write_bytes(data)
    return tmp_path


def _run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's errors
        return exc.code if isinstance(exc.code, int) else 1


@pytest.mark.parametrize(("argv", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_bad_input_is_one_line_and_a_non_zero_exit(
    argv: list[str],
    fragment: str,
    files: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    if "--plot" in argv:
        monkeypatch.setitem(sys.modules, "matplotlib", None)  # the README's install has no matplotlib
    rc = _run([a.format(d=files) for a in argv])
    out, err = capsys.readouterr()
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("kvfsm"), lines
    assert ": error: " in lines[0]
    assert fragment.format(d=files) in lines[0]
    assert "Traceback" not in out + err
    assert out == "", "the input must be refused before any work is done"


def test_the_table_covers_every_file_it_creates() -> None:
    used = {name for _, argv, _ in CASES for a in argv for name in FILES if a.endswith("/" + name)}
    assert used == set(FILES)


def test_the_trace_fixture_is_valid_so_the_bounds_cases_test_the_bounds(
    files: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["check", "--trace", str(files / "good.ndjson")]) == 0
    assert "valid behaviour" in capsys.readouterr().out


def test_a_subprocess_shows_no_traceback(files: Path) -> None:
    for argv in (["check", "--slots", "0"], ["bench", "--workload", str(files / "latin1.jsonl")]):
        proc = subprocess.run(
            [sys.executable, "-m", "kvfsm", *argv], capture_output=True, text=True, timeout=120, check=False
        )
        assert proc.returncode == 2, proc
        assert proc.stdout == ""
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert "Traceback" not in proc.stderr


def test_python_m_kvfsm_check_cli_uses_the_same_checks(capsys: pytest.CaptureFixture[str]) -> None:
    from kvfsm.check.cli import main as check_main

    with pytest.raises(SystemExit) as exc:
        check_main(["--requests", "0"])
    assert exc.value.code == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_missing_extra_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pip install kvfsm`` without the torch extra, then ``kvfsm demo``."""
    for name in [m for m in sys.modules if m == "kvfsm.demo" or m.startswith(("kvfsm.engine", "kvfsm.bench.drain"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch", None)
    assert main(["demo", "--quick"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.strip().splitlines() == [
        "kvfsm: error: kvfsm demo needs torch, which is not installed; install it with: pip install 'kvfsm[torch]'"
    ]
