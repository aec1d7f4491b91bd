"""Data-plane events: a copy submitted and a copy finished, with a checksum of the bytes (issue 10, item 8).

The copy backend emits them from the real copy path, at the edges of the system (never from the sans-IO
core): :meth:`~kvfsm.data.backend.ThreadPoolCopyBackend.submit` emits ``submitted`` with a checksum of the
job's source bytes as they are when the copy is handed to its thread, and the copy thread emits ``finished``
with a checksum of the destination bytes once it has moved them, before the job's future completes (so before
any poll can report the job). For a store the source is the job's GPU blocks and the destination the CPU slot
rows; for a load the other way round. An honest copy makes the two checksums equal.

A listener is any callable ``(event, job_id, is_store, source, checksum, ok)``: ``event`` is ``"submitted"`` or
``"finished"``, ``source`` numbers the backend that copies (one per rank), ``checksum`` is a hex digest (None
for a failed copy) and ``ok`` says whether the copy succeeded (None at submission).
:meth:`kvfsm.observe.trace.TraceRecorder.copy_event` is one: :func:`copy_events_to` connects it while a
block runs. With no listener the backend computes no checksum at all.
"""

from __future__ import annotations

import hashlib
import itertools
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

__all__ = [
    "CopyListener",
    "add_copy_listener",
    "checksum",
    "copy_events_to",
    "emit_copy",
    "listening",
    "next_source",
    "remove_copy_listener",
]

#: ``(event, job_id, is_store, source, checksum, ok)``.
CopyListener = Callable[[str, int, bool, int, str | None, bool | None], None]

_lock = threading.Lock()
_listeners: dict[int, CopyListener] = {}
_handles = itertools.count()
_sources = itertools.count()


def next_source() -> int:
    """A new backend's number in the events (process-wide, never reused)."""
    return next(_sources)


def listening() -> bool:
    """Whether any listener is connected (backends skip the checksums otherwise)."""
    return bool(_listeners)


def add_copy_listener(listener: CopyListener) -> int:
    """Connect ``listener``; returns the handle :func:`remove_copy_listener` takes."""
    with _lock:
        handle = next(_handles)
        _listeners[handle] = listener
        return handle


def remove_copy_listener(handle: int) -> None:
    with _lock:
        _listeners.pop(handle, None)


@contextmanager
def copy_events_to(listener: CopyListener) -> Iterator[None]:
    """Connect ``listener`` while the block runs."""
    handle = add_copy_listener(listener)
    try:
        yield
    finally:
        remove_copy_listener(handle)


def emit_copy(event: str, job_id: int, is_store: bool, source: int, digest: str | None, ok: bool | None) -> None:
    """Hand one event to every listener (on the calling thread: the submitting or the copy thread)."""
    with _lock:
        listeners = list(_listeners.values())
    for listener in listeners:
        listener(event, job_id, is_store, source, digest, ok)


def checksum(parts: Iterable[bytes]) -> str:
    """The digest of the bytes ``parts`` hold, in order."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part)
    return h.hexdigest()
