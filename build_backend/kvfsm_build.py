"""kvfsm's build backend: setuptools, plus mypy in the build environment when the checker is compiled.

``KVFSM_MYPYC=1 pip install .`` builds a wheel whose model checker hot modules (setup.py, ``COMPILED``) are
compiled to C extensions with mypyc; without it the wheel is pure Python, as before. mypyc type-checks what
it compiles, so the compiled build needs mypy and kvfsm's typed runtime dependencies while it builds; a
plain build needs neither. This is setuptools' documented way to add build dependencies that depend on the
build (an in-tree backend that extends ``get_requires_for_build_*``).
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import (
    build_sdist,
    get_requires_for_build_sdist,
    prepare_metadata_for_build_editable,
    prepare_metadata_for_build_wheel,
)

__all__ = [
    "build_editable",
    "build_sdist",
    "build_wheel",
    "get_requires_for_build_editable",
    "get_requires_for_build_sdist",
    "get_requires_for_build_wheel",
    "prepare_metadata_for_build_editable",
    "prepare_metadata_for_build_wheel",
]

#: What mypyc needs to type-check and compile the checker: mypy (mypyc ships with it) and the runtime
#: dependencies whose types the compiled modules see.
COMPILE_REQUIRES = ["mypy>=1.10", "transitions>=0.9.2,<0.10", "typing_extensions>=4.4"]


def compiling() -> bool:
    return os.environ.get("KVFSM_MYPYC", "") == "1"


def get_requires_for_build_wheel(config_settings: dict[str, str] | None = None) -> list[str]:
    extra = COMPILE_REQUIRES if compiling() else []
    return [*_setuptools.get_requires_for_build_wheel(config_settings), *extra]


def get_requires_for_build_editable(config_settings: dict[str, str] | None = None) -> list[str]:
    extra = COMPILE_REQUIRES if compiling() else []
    return [*_setuptools.get_requires_for_build_editable(config_settings), *extra]


def _require_mypyc() -> None:
    if not compiling():
        return
    try:
        import mypyc.build  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "KVFSM_MYPYC=1 compiles the checker with mypyc, which is not installed in this build "
            "environment; build with isolation (the default) or pip install 'mypy>=1.10' first"
        ) from None


def build_wheel(
    wheel_directory: str, config_settings: dict[str, str] | None = None, metadata_directory: str | None = None
) -> str:
    _require_mypyc()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def build_editable(
    wheel_directory: str, config_settings: dict[str, str] | None = None, metadata_directory: str | None = None
) -> str:
    _require_mypyc()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)
