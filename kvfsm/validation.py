"""Shared argument checks that raise ConfigError with what was expected."""

from __future__ import annotations

import os
from pathlib import Path

from kvfsm.errors import ConfigError

__all__ = ["is_int", "require_output_file", "require_positive_int"]


def is_int(value: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value


def require_output_file(what: str, path: str | Path) -> Path:
    """Check, before any work, that ``path`` can be written: its folder exists and is writable, and it is
    not itself a folder. ConfigError otherwise (nothing is created)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ConfigError(f"{what} {p} is a directory; expected a file path")
    if not parent.is_dir():
        raise ConfigError(f"{what} {p}: directory {parent} does not exist; expected a path in an existing directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{what} {p} is not writable; expected a path you can write")
    return p
