"""The README's Results section is generated from one bench run's JSON (scripts/update_readme_results.py):
the committed README matches the committed JSON, and a stale figure anywhere in it is caught. No bench
runs here: ``--check`` only renders the section from ``docs/bench-results.json``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "update_readme_results.py"
README = ROOT / "README.md"
RESULTS = ROOT / "docs" / "bench-results.json"


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def section(text: str) -> str:
    begin, end = text.index("<!-- results:begin"), text.index("<!-- results:end -->")
    return text[begin:end]


def test_the_committed_readme_matches_the_committed_bench_json() -> None:
    done = run("--check")
    assert done.returncode == 0, done.stdout + done.stderr


def test_prose_and_table_come_from_the_same_run() -> None:
    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    body = section(README.read_text(encoding="utf-8"))
    prose = " ".join(body.split())  # the prose is wrapped
    points = data["drain"]["points"]
    last = points[-1]
    assert f"{last['ratio_blocking_over_nonblocking']:.1f}x longer" in prose
    assert f"{last['ratio_blocking_over_nonblocking']:.1f}x" in data["report"]  # table
    r25 = next(r for r in data["control"]["replay"] if r["capacity"] == 0.25)
    assert f"in {r25['cpu_s']:.3f} s of CPU time" in prose
    assert "CPU time (s, best of 3)  " in data["report"] and f"{r25['cpu_s']:.3f}" in data["report"]
    assert f"full run, {data['meta']['seconds']:.1f} s" in prose
    assert f"bench finished in {data['meta']['seconds']:.1f} s" in body
    assert data["report"].strip() in body
    assert "a few seconds" not in README.read_text(encoding="utf-8")


def test_a_stale_figure_in_the_prose_or_the_table_fails_the_check(tmp_path: Path) -> None:
    text = README.read_text(encoding="utf-8")
    body = section(text)
    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    ratio = f"{data['drain']['points'][-1]['ratio_blocking_over_nonblocking']:.1f}x"
    finished = re.search(r"bench finished in [0-9.]+ s", body)
    assert finished is not None
    for old, new in ((ratio, "660.0x"), (finished.group(0), "bench finished in 90.0 s")):
        stale = tmp_path / "README.md"
        stale.write_text(text.replace(old, new), encoding="utf-8")
        done = run("--check", "--readme", str(stale))
        assert done.returncode == 1
        assert "stale" in done.stdout


def test_a_readme_without_markers_is_an_error(tmp_path: Path) -> None:
    bare = tmp_path / "README.md"
    bare.write_text("# no results here\n", encoding="utf-8")
    done = run("--check", "--readme", str(bare))
    assert done.returncode == 2
    assert done.stderr.startswith("update_readme_results: error:") and "Traceback" not in done.stderr
