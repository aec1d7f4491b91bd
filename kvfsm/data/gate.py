"""A deterministic completion gate inside a copy backend's real copy path (for tests; no torch here).

A backend built with a :class:`CopyGate` calls :meth:`CopyGate.enter` on the copy thread before it moves a
job's bytes, and :meth:`CopyGate.leave` after (whether the copy succeeded or not). ``enter`` blocks until the
test :meth:`releases <CopyGate.release>` the job: the copy is genuinely submitted and running on the data
plane's thread, only held, so the engine can take any number of steps, lookups and arrivals while it is in
flight. ``release(job_id, ok=False)`` makes ``enter`` raise, so the copy fails on its own thread without
moving anything. :meth:`wait_left` returns once the copy thread has left the copy path, whatever the backend's
future says (so a future that lies cannot make a test racy). :meth:`open` releases everything, now and later
(teardown: no copy thread may stay blocked).

No wall clock anywhere: every wait is on an event that a release or the copy thread sets.
"""

from __future__ import annotations

import threading

__all__ = ["CopyGate", "GateFailure"]


class GateFailure(RuntimeError):
    """Raised on the copy thread of a job released with ``ok=False`` (an injected copy failure)."""


class _Entry:
    __slots__ = ("entered", "left", "ok", "released")

    def __init__(self) -> None:
        self.released = threading.Event()
        self.left = threading.Event()
        self.entered = False
        self.ok = True


class CopyGate:
    """Holds each job's copy on its copy thread until the test releases it (see the module docs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[int, _Entry] = {}
        self._open = False

    def _entry(self, job_id: int) -> _Entry:
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None:
                entry = self._jobs[job_id] = _Entry()
                if self._open:
                    entry.released.set()
            return entry

    # -- the copy thread --

    def enter(self, job_id: int) -> None:
        """Block until ``job_id`` is released; raise :class:`GateFailure` if it was released to fail."""
        entry = self._entry(job_id)
        with self._lock:
            entry.entered = True
        entry.released.wait()
        if not entry.ok:
            raise GateFailure(f"copy of job {job_id} failed (injected at the gate)")

    def leave(self, job_id: int) -> None:
        """The copy thread of ``job_id`` is out of the copy path: every byte it moves is moved."""
        self._entry(job_id).left.set()

    # -- the test --

    def release(self, job_id: int, ok: bool = True) -> None:
        """Let ``job_id``'s copy run (``ok``), or fail without copying (not ``ok``)."""
        entry = self._entry(job_id)
        entry.ok = ok
        entry.released.set()

    def wait_left(self, job_id: int) -> None:
        """Block until ``job_id``'s copy thread has left the copy path (release it first)."""
        self._entry(job_id).left.wait()

    def is_released(self, job_id: int) -> bool:
        with self._lock:
            entry = self._jobs.get(job_id)
        return entry is not None and entry.released.is_set()

    def has_left(self, job_id: int) -> bool:
        with self._lock:
            entry = self._jobs.get(job_id)
        return entry is not None and entry.left.is_set()

    def forget(self, job_id: int) -> None:
        """Drop a job whose copy has left the path (job ids of a backend are never reused)."""
        with self._lock:
            self._jobs.pop(job_id, None)

    def open(self) -> None:
        """Release every job, held now or arriving later (no copy thread may stay blocked)."""
        with self._lock:
            self._open = True
            entries = list(self._jobs.values())
        for entry in entries:
            entry.released.set()
