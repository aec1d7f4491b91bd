"""The package imports without torch, and finds its spec tables wherever it is installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import kvfsm
from kvfsm.machines.loader import MACHINE_NAMES, load_invariants, load_machine, spec_dir


def test_spec_tables_are_found_next_to_the_imported_package() -> None:
    found = spec_dir()
    assert (found / "job.toml").is_file()
    assert {load_machine(n).name for n in MACHINE_NAMES} == set(MACHINE_NAMES)
    assert len(load_invariants()) >= 9
    # Installed: kvfsm/spec inside the wheel; checkout: the top-level spec/ beside kvfsm/.
    pkg = Path(kvfsm.__file__).resolve().parent
    assert found.resolve() in (pkg / "spec", pkg.parent / "spec")


def test_core_imports_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvfsm, kvfsm.control.scheduler, kvfsm.control.cpu, kvfsm.control.tiering, kvfsm.check.invariants\n"
        "import kvfsm.machines as m; m.job_machine(); m.slot_machine(); m.request_machine(); m.engine_machine()\n"
        "assert 'torch' not in {k for k, v in sys.modules.items() if v is not None}\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
