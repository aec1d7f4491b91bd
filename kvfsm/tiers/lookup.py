"""Asynchronous lookups: the scheduler never waits for a disk to answer "do you have this key?".

State is owned by the scheduler thread; only the probes run on a background thread. Per key the
:class:`AsyncLookup` keeps a :class:`LookupState` (generation, phase PENDING -> IN_FLIGHT -> RESOLVED,
result, requesters):

- :meth:`AsyncLookup.lookup` returns the resolved verdict, or None ("unknown": the tier answers RETRY)
  and queues the key for probing.
- :meth:`AsyncLookup.flush`, once per step, applies the results the thread has produced since the last
  flush and posts the queued keys as one batch.
- Every change of a key's truth (:meth:`AsyncLookup.set_result`, :meth:`AsyncLookup.forget`) bumps its
  generation, so a probe that was in flight meanwhile cannot overwrite it with a stale answer. This is
  what makes a failed load's MISS stick (vLLM #49176 / #49328: a cached HIT verdict after the file was
  deleted re-promoted the block forever).
- Resolved verdicts expire ``ttl_steps`` flushes after they were resolved, so an answer is not cached
  forever.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import Enum
from typing import Generic, TypeVar

from kvfsm.errors import ConfigError

__all__ = ["AsyncLookup", "LookupPhase", "LookupState", "Resolved"]

logger = logging.getLogger(__name__)

K = TypeVar("K")
R = TypeVar("R")


class LookupPhase(Enum):
    """Where one asynchronous existence check stands."""

    PENDING = "pending"  #: queued, not yet posted to the probe thread
    IN_FLIGHT = "in_flight"  #: posted; its result has not been applied yet
    RESOLVED = "resolved"


@dataclass(frozen=True, slots=True)
class Resolved(Generic[R]):
    """A known verdict."""

    result: R


@dataclass(slots=True)
class LookupState(Generic[R]):
    generation: int
    phase: LookupPhase = LookupPhase.PENDING
    result: Resolved[R] | None = None
    requesters: set[str] = field(default_factory=set)
    resolved_step: int = 0


_STOP = object()


class AsyncLookup(Generic[K, R]):
    """Probe keys on one daemon thread; answer from cached verdicts on the scheduler thread.

    ``probe(key)`` runs on the thread; if it raises, ``on_error`` is the verdict (a miss, for a tier:
    what cannot be probed cannot be served).

    - ``probe`` (callable; required): answers one key (the file-system tier's: the newest sound file).
    - ``on_error`` (required): the verdict of a probe that raised, and of probes left when shut down.
    - ``name`` (str; default ``"kvfsm-lookup"``): the probe thread's name.
    - ``ttl_steps`` (int >= 1, in :meth:`flush` calls, i.e. scheduler steps; default 64): a resolved verdict
      is dropped this many flushes after it was resolved, and the key is probed again at its next lookup.
      vLLM and LMCache look keys up synchronously and cache no verdict, so neither has a setting for it.
    """

    def __init__(
        self,
        probe: Callable[[K], R],
        on_error: R,
        *,
        name: str = "kvfsm-lookup",
        ttl_steps: int = 64,
    ) -> None:
        if ttl_steps < 1:
            raise ConfigError(f"ttl_steps={ttl_steps}; expected >= 1")
        self._probe = probe
        self._on_error = on_error
        self._ttl = ttl_steps
        self._states: dict[K, LookupState[R]] = {}
        self._generation = 0
        self._step = 0
        self._queued: list[K] = []
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[tuple[K, int, R]] = queue.SimpleQueue()
        self._in_flight = 0
        self._posted = 0  # probes posted to the thread (scheduler thread writes, under _cond)
        self._answered = 0  # probes the thread has answered (thread writes, under _cond)
        self._cond = threading.Condition()
        self._closed = False
        self.probes = 0
        self.errors = 0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # -- scheduler thread --

    def lookup(self, key: K, requester: str = "") -> Resolved[R] | None:
        """The verdict if known; otherwise None, and the key is queued for the next flush."""
        state = self._states.get(key)
        if state is None:
            self._generation += 1
            state = LookupState(self._generation)
            self._states[key] = state
            self._queued.append(key)
        if requester:
            state.requesters.add(requester)
        return state.result

    def state(self, key: K) -> LookupState[R] | None:
        return self._states.get(key)

    def flush(self) -> list[tuple[K, R]]:
        """Apply finished probes (returned, in completion order) and post the queued keys."""
        self._step += 1
        applied: list[tuple[K, R]] = []
        while True:
            try:
                key, generation, result = self._results.get_nowait()
            except queue.Empty:
                break
            self._in_flight -= 1
            state = self._states.get(key)
            if state is None or state.generation != generation or state.phase is not LookupPhase.IN_FLIGHT:
                continue  # stale: the key's truth changed while the probe ran
            state.phase = LookupPhase.RESOLVED
            state.result = Resolved(result)
            state.resolved_step = self._step
            applied.append((key, result))
        horizon = self._step - self._ttl
        expired = [k for k, s in self._states.items() if s.phase is LookupPhase.RESOLVED and s.resolved_step < horizon]
        for k in expired:
            del self._states[k]
        if self._queued and not self._closed:
            batch: list[tuple[K, int]] = []
            for key in self._queued:
                state = self._states.get(key)
                if state is not None and state.phase is LookupPhase.PENDING:
                    state.phase = LookupPhase.IN_FLIGHT
                    batch.append((key, state.generation))
            self._queued = []
            if batch:
                self._in_flight += len(batch)
                with self._cond:
                    self._posted += len(batch)
                self._inbox.put(batch)
        return applied

    def set_result(self, keys: Iterable[K], result: R) -> None:
        """Force a verdict (e.g. MISS after a failed load); probes in flight for these keys are ignored."""
        for key in keys:
            self._generation += 1
            state = self._states.get(key)
            self._states[key] = LookupState(
                self._generation,
                LookupPhase.RESOLVED,
                Resolved(result),
                state.requesters if state is not None else set(),
                self._step,
            )

    def forget(self, keys: Iterable[K]) -> None:
        """Drop what is known about ``keys`` (the tier's own index answers for them now)."""
        for key in keys:
            self._states.pop(key, None)

    def forget_all(self) -> None:
        self._states.clear()
        self._queued.clear()

    def cleanup(self, requester: str) -> None:
        """A request is done: drop its references; resolved verdicts nobody references go."""
        for key in [k for k, s in self._states.items() if requester in s.requesters]:
            state = self._states[key]
            state.requesters.discard(requester)
            if not state.requesters and state.phase is LookupPhase.RESOLVED:
                del self._states[key]

    def has_pending(self) -> bool:
        """Probes queued or in flight (results not yet applied)."""
        return bool(self._queued) or self._in_flight > 0

    def __len__(self) -> int:
        return len(self._states)

    # -- the probe thread --

    def _run(self) -> None:
        while True:
            batch = self._inbox.get()
            if batch is _STOP:
                return
            assert isinstance(batch, list)
            for key, generation in batch:
                if self._closed:
                    result = self._on_error
                else:
                    self.probes += 1
                    try:
                        result = self._probe(key)
                    except Exception as exc:
                        self.errors += 1
                        logger.debug("lookup probe failed: %r", exc)
                        result = self._on_error
                self._results.put((key, generation, result))
                with self._cond:
                    self._answered += 1
                    self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until every posted probe has been answered (its result is applied at the next flush)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._answered >= self._posted, timeout)

    def thread_alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self, timeout: float | None = None) -> bool:
        """Stop the probe thread (probes still queued resolve to ``on_error``); True if it stopped."""
        self._closed = True
        self._inbox.put(_STOP)
        self._thread.join(timeout)
        return not self._thread.is_alive()
