"""Shared argument checks that raise ConfigError with what was expected."""

from __future__ import annotations

from kvfsm.errors import ConfigError

__all__ = ["is_int", "require_positive_int"]


def is_int(value: object) -> bool:
    """True for an int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive_int(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")
    return value
