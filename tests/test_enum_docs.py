"""Every Enum in kvfsm has its own class docstring, so ``help()`` never shows Python's generic one."""

from __future__ import annotations

import enum
import importlib
import inspect
import pkgutil
from typing import Any

import pytest

import kvfsm

_GENERIC = {enum.Enum.__doc__, enum.StrEnum.__doc__, enum.IntEnum.__doc__, None}


def _package_enums() -> list[type[enum.Enum]]:
    found: dict[str, type[enum.Enum]] = {}
    for info in pkgutil.walk_packages(kvfsm.__path__, "kvfsm."):
        if info.name.endswith("__main__"):
            continue  # running it is the CLI
        try:
            module = importlib.import_module(info.name)
        except ImportError:
            continue  # an optional extra (torch, matplotlib) that is not installed
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, enum.Enum) and obj.__module__.startswith("kvfsm."):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return [found[k] for k in sorted(found)]


ENUMS = _package_enums()


def _param(cls: type[enum.Enum]) -> Any:
    return pytest.param(cls, id=f"{cls.__module__}.{cls.__qualname__}")


def test_the_walk_finds_the_spec_enums() -> None:
    names = {e.__name__ for e in ENUMS}
    assert {"JobState", "SlotState", "RequestState", "EngineState", "DrainMode", "LookupResult"} <= names


@pytest.mark.parametrize("cls", [_param(c) for c in ENUMS])
def test_every_enum_has_its_own_docstring(cls: type[enum.Enum]) -> None:
    doc = cls.__dict__.get("__doc__")
    assert isinstance(doc, str) and doc not in _GENERIC and doc.strip(), f"{cls.__qualname__} has no docstring"
