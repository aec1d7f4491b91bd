"""The kvfsm exception hierarchy.

Every error says what was wrong and what was expected. An operation that raises one of these leaves
every machine exactly as it was: callers validate before they fire any transition.
"""

from __future__ import annotations

from typing_extensions import override

__all__ = [
    "AckCountError",
    "ConfigError",
    "ConfigKeyError",
    "DuplicateJobError",
    "DuplicateRequestError",
    "InvalidTransition",
    "KeyNotReadyError",
    "KvfsmError",
    "SeamViolationError",
    "SpecError",
    "UnknownJobError",
    "UnknownRequestError",
]


class KvfsmError(Exception):
    """Base class of every error kvfsm raises on purpose."""


class SpecError(KvfsmError):
    """spec/ is malformed, or the code and the spec disagree."""


class ConfigError(KvfsmError, ValueError):
    """A configuration value is inconsistent (block sizes, capacities, world size)."""


class ConfigKeyError(ConfigError):
    """One key of a configuration mapping (e.g. vLLM's ``kv_connector_extra_config``) is unknown or has a
    bad value; ``key`` names it."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}")
        self.key = key


class InvalidTransition(KvfsmError):
    """An event was fired in a state where the spec does not enable it."""

    def __init__(self, machine: str, state: str, event: str, detail: str = "") -> None:
        self.machine = machine
        self.state = state
        self.event = event
        extra = f": {detail}" if detail else ""
        super().__init__(
            f"{machine} machine cannot handle event {event!r} in state {state!r}{extra}; "
            f"see spec/{machine}.toml for the events enabled in {state!r}"
        )


class UnknownJobError(KvfsmError, KeyError):
    """A job id at or above the stale threshold that the scheduler never issued or already retired."""

    @override
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown job"


class DuplicateJobError(KvfsmError, ValueError):
    """A job id that is still in flight was submitted again (to the same tier)."""


class AckCountError(KvfsmError, ValueError):
    """A worker reported more acknowledgements for a job than it still awaits."""


class DuplicateRequestError(KvfsmError, ValueError):
    """A request id that is already tracked was added again."""


class UnknownRequestError(KvfsmError, KeyError):
    """A request id the component does not track."""

    @override
    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown request"


class KeyNotReadyError(KvfsmError, ValueError):
    """A load was prepared for keys that are absent or whose store has not committed."""


class SeamViolationError(KvfsmError):
    """A job would copy a GPU block other than the one the engine's block table holds for its key
    (spec/invariants.toml, ``job_copies_engine_block``): raised by the checked mode of kvfsm's vLLM routes
    before the copy starts, because a faithful copy of the wrong block serves wrong KV."""
