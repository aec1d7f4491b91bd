"""The build backend (build_backend/kvfsm_build.py): mypy joins the build only for a compiled build.

``KVFSM_MYPYC=1`` makes setup.py compile the model checker with mypyc; a plain build must stay pure Python
and need nothing beyond setuptools, and a compiled build without mypyc must be refused, not quietly built
pure.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _backend() -> ModuleType:
    pytest.importorskip("setuptools")
    spec = importlib.util.spec_from_file_location("kvfsm_build", ROOT / "build_backend" / "kvfsm_build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_plain_build_needs_no_mypy(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend()
    monkeypatch.chdir(ROOT)  # setuptools runs setup.py from the current directory
    monkeypatch.delenv("KVFSM_MYPYC", raising=False)
    requires = backend.get_requires_for_build_wheel(None)
    assert not [r for r in requires if r.startswith("mypy")]


def test_a_compiled_build_adds_mypy(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = _backend()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KVFSM_MYPYC", "1")
    requires = backend.get_requires_for_build_wheel(None)
    assert [r for r in requires if r.startswith("mypy")] == ["mypy>=1.10"]
    assert backend.get_requires_for_build_editable(None)[-3:] == backend.COMPILE_REQUIRES


def test_a_compiled_build_without_mypyc_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    backend = _backend()
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("KVFSM_MYPYC", "1")
    monkeypatch.setitem(sys.modules, "mypyc.build", None)  # import mypyc.build now raises ImportError
    with pytest.raises(RuntimeError, match="KVFSM_MYPYC=1 compiles the checker with mypyc"):
        backend.build_wheel(str(tmp_path))
    assert not list(tmp_path.iterdir())  # refused before anything was built
