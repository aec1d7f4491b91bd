"""Injectable faults for tests and chaos runs: fail, delay, hang or corrupt any transfer or file operation.

A :class:`FaultPlan` is a list of :class:`FaultRule` s. Components that do I/O call
:meth:`FaultPlan.apply` at each named operation (``fs.write``, ``fs.read``, ``slot.read``,
``transfer.store``, ...; see :data:`OPERATIONS`). A matching rule fires by rule (``after``, ``times``,
``keys``) or by probability, and the decision is seeded and reproducible: it depends only on the seed, the
rule, the operation, the key and how many times that (rule, operation, key) was seen, never on thread
timing.

What a fault does:

- ``EIO``, ``ENOSPC``, ``FAIL``: the operation raises :class:`InjectedFault` (an ``OSError`` with that
  errno; FAIL uses EIO).
- ``DELAY``: the operation waits ``delay_s`` first (cut short by cancellation).
- ``HANG``: the operation blocks until :meth:`FaultPlan.release_hangs` or until the caller's cancel event
  is set and :meth:`FaultPlan.notify` is called (a shutdown does that); a cancelled hang raises
  ``InjectedFault(ECANCELED)``. Hangs are cancellable waits, so threads stuck in them can be stopped.
- ``SHORT_READ``, ``SHORT_WRITE``, ``CORRUPT``: data faults, returned to the caller, which passes the
  bytes through :meth:`FaultPlan.mangle` (truncated to half, or one byte flipped). Only the file
  operations ``fs.read`` and ``fs.write`` carry data faults; anywhere else they act as ``FAIL``.

:class:`FaultyCopyBackend` wraps a data-plane copy backend (any object with the ``CopyBackend`` methods)
and applies ``transfer.store`` / ``transfer.load`` faults to whole copies.
"""

from __future__ import annotations

import errno
import fnmatch
import functools
import hashlib
import threading
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.errors import ConfigError, KvfsmError

__all__ = [
    "DATA_FAULTS",
    "OPERATIONS",
    "FaultKind",
    "FaultPlan",
    "FaultRule",
    "FaultyCopyBackend",
    "InjectedFault",
]

#: Every operation name a kvfsm component reports to a fault plan.
OPERATIONS: frozenset[str] = frozenset(
    {
        "fs.write",  # write a block file's bytes into its temporary file
        "fs.replace",  # rename the temporary file onto its final name
        "fs.fsync",  # durable mode, in the background after the cascade is acknowledged: fsync a block file
        "fs.dirsync",  # durable mode, after fs.fsync: fsync the block's directory (and the root naming it)
        "fs.read",  # read a block file
        "fs.unlink",  # remove a block file
        "fs.scan",  # rebuild the index from the directory at start-up
        "fs.probe",  # asynchronous lookup of one key on disk
        "slot.read",  # a tier reads a CPU primary slot (cascade)
        "slot.write",  # a tier writes a CPU primary slot (promotion)
        "transfer.store",  # a GPU -> CPU copy
        "transfer.load",  # a CPU -> GPU copy
    }
)


class FaultKind(StrEnum):
    """What an injected fault does to the operation it matches (see the module docstring)."""

    EIO = "eio"
    ENOSPC = "enospc"
    FAIL = "fail"
    SHORT_READ = "short_read"
    SHORT_WRITE = "short_write"
    CORRUPT = "corrupt"
    DELAY = "delay"
    HANG = "hang"


#: Faults that change the bytes of an operation rather than its control flow.
DATA_FAULTS: frozenset[FaultKind] = frozenset({FaultKind.SHORT_READ, FaultKind.SHORT_WRITE, FaultKind.CORRUPT})
_DATA_OPS = frozenset({"fs.read", "fs.write"})
_ERRNO = {FaultKind.EIO: errno.EIO, FaultKind.ENOSPC: errno.ENOSPC, FaultKind.FAIL: errno.EIO}


class InjectedFault(OSError):
    """An I/O error raised on purpose by a fault plan."""


@dataclass(frozen=True, slots=True)
class FaultRule:
    """One fault: which operations (an fnmatch pattern), what happens, and when.

    ``after``: let the first ``after`` matching operations through. ``times``: fire at most this many
    times (None: unlimited). ``probability``: chance that a matching operation (past ``after``) fires.
    ``keys``: only operations on these keys match (None: any key).
    """

    #: an fnmatch pattern over :data:`OPERATIONS` (default ``"*"``: every operation)
    op: str = "*"
    #: what happens when the rule fires (default EIO)
    kind: FaultKind = FaultKind.EIO
    #: chance in [0, 1] that a matching operation past ``after`` fires (default 1.0: every one)
    probability: float = 1.0
    #: fire at most this many times (default None: unlimited)
    times: int | None = None
    #: let this many matching operations through first (default 0)
    after: int = 0
    #: only operations on these keys match (default None: any key; file removals and scans have key b"")
    keys: frozenset[bytes] | None = None
    #: seconds a DELAY waits (required > 0 for DELAY, cut short by cancellation; ignored otherwise)
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.kind, FaultKind):
            raise ConfigError(f"fault kind {self.kind!r}; expected one of {[k.value for k in FaultKind]}")
        if not 0.0 <= self.probability <= 1.0:
            raise ConfigError(f"fault probability {self.probability!r}; expected a number in [0, 1]")
        if self.times is not None and self.times < 0:
            raise ConfigError(f"fault times={self.times}; expected >= 0 or None")
        if self.after < 0:
            raise ConfigError(f"fault after={self.after}; expected >= 0")
        if self.delay_s < 0:
            raise ConfigError(f"fault delay_s={self.delay_s}; expected >= 0")
        if self.kind is FaultKind.DELAY and self.delay_s == 0:
            raise ConfigError("a DELAY fault needs delay_s > 0")

    def matches(self, op: str, key: bytes) -> bool:
        if self.keys is not None and key not in self.keys:
            return False
        return self.op == op or fnmatch.fnmatchcase(op, self.op)


class FaultPlan:
    """A seeded, thread-safe set of fault rules, consulted by every I/O component it is handed to.

    ``rules`` (default none): the rules, tried in order (the first that fires decides); ``seed`` (int,
    default 0): seeds the probability draws, which depend only on it, the rule, the operation, the key
    and the occurrence, so a run is reproducible whatever the thread timing.
    """

    def __init__(self, rules: Iterable[FaultRule] = (), *, seed: int = 0) -> None:
        self.seed = seed
        self._rules: list[FaultRule] = []
        self._seen: dict[int, int] = {}  # id(rule) -> matching operations seen
        self._fired: dict[int, int] = {}  # id(rule) -> times fired
        self._occurrence: Counter[tuple[int, str, bytes]] = Counter()
        self._cond = threading.Condition()
        self._hang_generation = 0
        self._hanging = 0
        self._enabled = True
        self.injected: Counter[FaultKind] = Counter()
        self.injected_by_op: Counter[tuple[str, FaultKind]] = Counter()
        for rule in rules:
            self.add(rule)

    # -- rules --

    def add(self, rule: FaultRule) -> FaultRule:
        with self._cond:
            self._rules.append(rule)
            self._seen[id(rule)] = 0
            self._fired[id(rule)] = 0
        return rule

    def remove(self, rule: FaultRule) -> None:
        with self._cond:
            self._rules = [r for r in self._rules if r is not rule]

    def clear(self) -> None:
        """Remove every rule (hangs already waiting keep waiting until released)."""
        with self._cond:
            self._rules.clear()

    @property
    def rules(self) -> tuple[FaultRule, ...]:
        with self._cond:
            return tuple(self._rules)

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)

    def fired(self, rule: FaultRule) -> int:
        with self._cond:
            return self._fired.get(id(rule), 0)

    @property
    def total_injected(self) -> int:
        with self._cond:
            return sum(self.injected.values())

    # -- decisions --

    def _draw(self, rule_idx: int, op: str, key: bytes, n: int) -> float:
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.seed}:{rule_idx}:{op}:{n}:".encode())
        h.update(key)
        return int.from_bytes(h.digest(), "big") / 2.0**64

    def decide(self, op: str, key: bytes = b"") -> FaultRule | None:
        """The rule that fires for this operation, if any (the first matching rule that fires wins)."""
        return self.decide_at(op, key)[0]

    def decide_at(self, op: str, key: bytes = b"") -> tuple[FaultRule | None, int]:
        """:meth:`decide`, plus the hang generation at the moment of the decision: a HANG decided before a
        :meth:`release_hangs` is released by it, even if it starts waiting only afterwards."""
        if not self._enabled or not self._rules:
            return None, self._hang_generation
        with self._cond:
            return self._decide_locked(op, key), self._hang_generation

    def _decide_locked(self, op: str, key: bytes) -> FaultRule | None:
        """The rule that fires (the caller holds ``_cond``)."""
        for idx, rule in enumerate(self._rules):
            if not rule.matches(op, key):
                continue
            rid = id(rule)
            self._seen[rid] += 1
            if self._seen[rid] <= rule.after:
                continue
            if rule.times is not None and self._fired[rid] >= rule.times:
                continue
            if rule.probability < 1.0:
                slot = (idx, op, key)
                n = self._occurrence[slot]
                self._occurrence[slot] = n + 1
                if self._draw(idx, op, key, n) >= rule.probability:
                    continue
            self._fired[rid] += 1
            kind = rule.kind
            if kind in DATA_FAULTS and op not in _DATA_OPS:
                kind = FaultKind.FAIL
            self.injected[kind] += 1
            self.injected_by_op[(op, kind)] += 1
            return rule if kind is rule.kind else FaultRule(rule.op, kind, times=rule.times, keys=rule.keys)
        return None

    def apply(self, op: str, key: bytes = b"", *, cancel: threading.Event | None = None) -> FaultRule | None:
        """Decide, and carry out control-flow faults here: raise, delay or hang.

        Returns the rule of a data fault (the caller passes its bytes through :meth:`mangle`), else None.
        """
        rule, generation = self.decide_at(op, key)
        if rule is None:
            return None
        self.carry_out(rule, op, key, cancel=cancel, generation=generation)
        return rule if rule.kind in DATA_FAULTS else None

    def carry_out(
        self,
        rule: FaultRule,
        op: str,
        key: bytes = b"",
        *,
        cancel: threading.Event | None = None,
        generation: int | None = None,
    ) -> None:
        """Raise, delay or hang as ``rule`` says; data faults do nothing here.

        ``generation`` (from :meth:`decide_at`) ties a hang to the releases after its decision.
        """
        kind = rule.kind
        where = f"{op}" + (f" (key {key.hex()[:16]})" if key else "")
        if kind in _ERRNO:
            code = _ERRNO[kind]
            raise InjectedFault(code, f"injected {kind.value} at {where}")
        if kind is FaultKind.DELAY:
            with self._cond:
                self._cond.wait_for(lambda: cancel is not None and cancel.is_set(), timeout=rule.delay_s)
            return
        if kind is FaultKind.HANG:
            with self._cond:
                if generation is None:
                    generation = self._hang_generation
                self._hanging += 1
                self._cond.notify_all()
                try:
                    self._cond.wait_for(
                        lambda: self._hang_generation != generation or (cancel is not None and cancel.is_set())
                    )
                finally:
                    self._hanging -= 1
                    self._cond.notify_all()
                released = self._hang_generation != generation
            if not released:
                raise InjectedFault(errno.ECANCELED, f"injected hang at {where} was cancelled")

    @staticmethod
    def mangle(rule: FaultRule, data: bytes) -> bytes:
        """The bytes a data fault leaves: the first half (short read/write) or one byte flipped (corrupt)."""
        if rule.kind is FaultKind.CORRUPT:
            if not data:
                return data
            buf = bytearray(data)
            pos = len(buf) - 1 - (len(buf) // 3)
            buf[pos] ^= 0xFF
            return bytes(buf)
        if rule.kind in (FaultKind.SHORT_READ, FaultKind.SHORT_WRITE):
            return data[: len(data) // 2]
        return data

    # -- hangs --

    @property
    def hanging(self) -> int:
        """Operations blocked in a HANG right now."""
        with self._cond:
            return self._hanging

    def wait_for_hangs(self, n: int = 1, timeout: float | None = None) -> bool:
        """Block until at least ``n`` operations are hanging (a test's synchronisation point)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._hanging >= n, timeout=timeout)

    def release_hangs(self) -> None:
        """Let every operation hanging now carry on (later HANG faults hang again)."""
        with self._cond:
            self._hang_generation += 1
            self._cond.notify_all()

    def notify(self) -> None:
        """Wake hangs and delays so that they re-check their cancel events (call after setting one)."""
        with self._cond:
            self._cond.notify_all()


# ---------------------------------------------------------------------------------------------- transfers


class _Backend(Protocol):
    """The data plane's CopyBackend protocol (kvfsm.data.backend), restated so this module needs no torch."""

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None: ...

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]: ...

    def poll(self) -> list[tuple[int, bool]]: ...

    def wait(self, job_ids: Iterable[int]) -> None: ...

    def shutdown(self) -> None: ...


@dataclass(slots=True)
class _Held:
    job_id: int
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    rule: FaultRule
    proxy: Future[None]
    waited: threading.Event
    generation: int
    error: BaseException | None = None


class FaultyCopyBackend:
    """A copy backend wrapper that injects ``transfer.store`` / ``transfer.load`` faults per job.

    A failing fault reports the job failed without copying. DELAY and HANG hold the job on a helper
    thread; once the wait is over the copy is handed to the real backend from the engine's own thread (at
    the next ``poll`` or ``wait``), so the real backend is only ever called from one thread. A blocking
    ``wait`` on a held job waits for its hang or delay to end, as a wait on a slow copy would. ``shutdown``
    cancels hangs: held jobs are then reported failed. Corrupt and short faults count as failed copies
    (a copy engine detects a short copy; silent corruption of a GPU copy is not simulated).
    """

    def __init__(self, inner: _Backend, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan
        self._lock = threading.Lock()
        self._failed: list[int] = []
        self._held: dict[int, _Held] = {}
        self._cancel = threading.Event()
        self._threads: list[threading.Thread] = []

    def __getattr__(self, name: str) -> object:
        # Expose the wrapped backend's extras (pool, stats, ...) to code that inspects a backend.
        return getattr(self.inner, name)

    @property
    def held_ids(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._held)

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if self._cancel.is_set():
            raise KvfsmError(f"job {job_id}: the copy backend is shut down; expected no submissions")
        self.inner.check(is_store, gpu, slots)
        op = "transfer.store" if is_store else "transfer.load"
        rule, generation = self.plan.decide_at(op, job_id.to_bytes(8, "big"))
        if rule is None:
            return self.inner.submit(job_id, is_store, gpu, slots)
        proxy: Future[None] = Future()
        if rule.kind not in (FaultKind.DELAY, FaultKind.HANG):
            proxy.set_exception(InjectedFault(errno.EIO, f"injected {rule.kind.value} at {op} of job {job_id}"))
            with self._lock:
                self._failed.append(job_id)
            return proxy
        held = _Held(job_id, is_store, gpu, slots, rule, proxy, threading.Event(), generation)
        with self._lock:
            self._held[job_id] = held
        thread = threading.Thread(target=self._hold, args=(held, op), name=f"kvfsm-fault-{job_id}", daemon=True)
        if len(self._threads) > 64:
            self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()
        return proxy

    def _hold(self, held: _Held, op: str) -> None:
        try:
            self.plan.carry_out(
                held.rule, op, held.job_id.to_bytes(8, "big"), cancel=self._cancel, generation=held.generation
            )
        except BaseException as exc:
            held.error = exc
        finally:
            held.waited.set()

    def _dispatch(self, job_ids: Iterable[int] | None = None) -> None:
        """Hand every held job whose wait is over to the real backend (or fail it)."""
        with self._lock:
            ready = [
                h for jid, h in self._held.items() if h.waited.is_set() and (job_ids is None or jid in set(job_ids))
            ]
            for h in ready:
                del self._held[h.job_id]
        for h in ready:
            if h.error is not None or self._cancel.is_set():
                with self._lock:
                    self._failed.append(h.job_id)
                h.proxy.set_exception(h.error or InjectedFault(errno.ECANCELED, f"job {h.job_id} cancelled"))
                continue
            real = self.inner.submit(h.job_id, h.is_store, h.gpu, h.slots)
            real.add_done_callback(functools.partial(_chain, proxy=h.proxy))

    def poll(self) -> list[tuple[int, bool]]:
        self._dispatch()
        with self._lock:
            failed, self._failed = self._failed, []
        return [(jid, False) for jid in failed] + self.inner.poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        with self._lock:
            held = [self._held[j] for j in ids if j in self._held]
        for h in held:
            h.waited.wait()
        self._dispatch(ids)
        self.inner.wait(ids)

    def release(self) -> None:
        """Release the plan's hangs (every held job may then be dispatched)."""
        self.plan.release_hangs()

    def shutdown(self) -> None:
        self._cancel.set()
        self.plan.notify()
        for thread in self._threads:
            thread.join()
        self._dispatch()
        self.inner.shutdown()


def _chain(real: Future[None], proxy: Future[None]) -> None:
    exc = real.exception()
    if exc is None:
        proxy.set_result(None)
    else:
        proxy.set_exception(exc)
