"""kvfsm: KV-cache offloading for LLM inference engines, driven by formally specified state machines.

``import kvfsm`` needs only ``transitions`` and ``typing_extensions``; the data plane (``kvfsm.data``) and
the reference engine (``kvfsm.engine``) need the ``torch`` extra.
"""

from __future__ import annotations

from kvfsm.errors import (
    AckCountError,
    ConfigError,
    DuplicateJobError,
    DuplicateRequestError,
    InvalidTransition,
    KeyNotReadyError,
    KvfsmError,
    SpecError,
    UnknownJobError,
    UnknownRequestError,
)
from kvfsm.machines.names import (
    EngineEffect,
    EngineEvent,
    EngineState,
    JobEffect,
    JobEvent,
    JobKind,
    JobState,
    RequestEffect,
    RequestEvent,
    RequestState,
    SlotEffect,
    SlotEvent,
    SlotState,
)

__version__ = "0.1.0"

__all__ = [
    "AckCountError",
    "ConfigError",
    "DuplicateJobError",
    "DuplicateRequestError",
    "EngineEffect",
    "EngineEvent",
    "EngineState",
    "InvalidTransition",
    "JobEffect",
    "JobEvent",
    "JobKind",
    "JobState",
    "KeyNotReadyError",
    "KvfsmError",
    "RequestEffect",
    "RequestEvent",
    "RequestState",
    "SlotEffect",
    "SlotEvent",
    "SlotState",
    "SpecError",
    "UnknownJobError",
    "UnknownRequestError",
    "__version__",
]
