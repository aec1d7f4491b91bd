"""A thread pool with separate read and write queues, so that loads are not starved by stores.

Read threads serve the read queue only; write threads take from the write queue first and help with
reads when no write is queued. So a burst of cascades (writes), however slow, can never occupy the
threads promotions (reads) need: a read waits at most for a read thread to finish another read. (vLLM's
pool lets its load threads fall back to stores, so stuck stores can occupy every thread; kvfsm does not.)

All threads are daemon threads: a task stuck in the kernel cannot keep the process alive.
:meth:`DualQueuePool.shutdown` cancels queued tasks (their futures end cancelled, so whoever submitted
them still learns the outcome) and waits at most ``timeout`` for running ones.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from kvfsm.errors import ConfigError, KvfsmError

__all__ = ["DualQueuePool"]

T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


def _is_count(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 0


class DualQueuePool:
    """``read_threads`` read-only and ``write_threads`` write-first daemon threads.

    - ``read_threads`` (int >= 0; default 2): threads that serve only the read queue (promotions). 0: reads
      run only on the write threads, when no write is queued.
    - ``write_threads`` (int >= 1; default 2): threads that take a queued write first and otherwise help
      with reads (0 is refused: nothing would ever write).
    - ``name`` (str; default ``"kvfsm-io"``): the prefix of the thread names (``<name>-r0``, ``<name>-w0``).

    vLLM's ``OffloadingConnector`` file-system backend (llm-d) has one pool, ``threads_per_gpu``, shared by
    both directions, with loads falling back to stores; LMCache has no thread setting for its disk backend.
    """

    def __init__(self, read_threads: int = 2, write_threads: int = 2, *, name: str = "kvfsm-io") -> None:
        for what, n in (("read_threads", read_threads), ("write_threads", write_threads)):
            if not _is_count(n):
                raise ConfigError(f"{what}={n!r}; expected an int >= 0")
        if write_threads == 0:
            raise ConfigError("write_threads=0: nothing would ever run a write; expected >= 1")
        self.name = name
        self._reads: deque[_Task] = deque()
        self._writes: deque[_Task] = deque()
        self._cond = threading.Condition()
        self._active = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        for i in range(read_threads):
            self._start(True, f"{name}-r{i}")
        for i in range(write_threads):
            self._start(False, f"{name}-w{i}")

    def _start(self, read_first: bool, thread_name: str) -> None:
        t = threading.Thread(target=self._run, args=(read_first,), name=thread_name, daemon=True)
        self._threads.append(t)
        t.start()

    # -- submission --

    def submit_read(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._submit(self._reads, fn, args)

    def submit_write(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        return self._submit(self._writes, fn, args)

    def _submit(self, queue: deque[_Task], fn: Callable[..., T], args: tuple[Any, ...]) -> Future[T]:
        future: Future[T] = Future()
        with self._cond:
            if self._closed:
                raise KvfsmError(f"pool {self.name!r} is shut down; expected no new tasks")
            queue.append((future, fn, args))
            self._cond.notify_all()  # a plain notify might wake a read thread for a write
        return future

    # -- introspection --

    @property
    def queued_reads(self) -> int:
        with self._cond:
            return len(self._reads)

    @property
    def queued_writes(self) -> int:
        with self._cond:
            return len(self._writes)

    @property
    def pending(self) -> int:
        """Tasks queued or running."""
        with self._cond:
            return len(self._reads) + len(self._writes) + self._active

    @property
    def closed(self) -> bool:
        return self._closed

    def threads_alive(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running; False if ``timeout`` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._reads or self._writes or self._active), timeout)

    # -- threads --

    def _run(self, read_first: bool) -> None:
        cond = self._cond
        while True:
            with cond:
                if read_first:
                    cond.wait_for(lambda: bool(self._reads or self._closed))
                else:
                    cond.wait_for(lambda: bool(self._reads or self._writes or self._closed))
                if read_first:
                    if not self._reads:
                        return  # closed and nothing left for a read thread
                    task = self._reads.popleft()
                elif self._writes:
                    task = self._writes.popleft()
                elif self._reads:
                    task = self._reads.popleft()
                else:
                    return  # closed and nothing left
                self._active += 1
            future, fn, args = task
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        result = fn(*args)
                    except BaseException as exc:
                        future.set_exception(exc)
                    else:
                        future.set_result(result)
            finally:
                with cond:
                    self._active -= 1
                    cond.notify_all()

    def shutdown(self, timeout: float | None = None, *, cancel_pending: bool = True) -> bool:
        """Stop taking tasks, cancel the queued ones (or let them run), and join the threads.

        Returns True when every thread stopped within ``timeout`` (None: wait as long as it takes).
        """
        cancelled: list[Future[Any]] = []
        with self._cond:
            self._closed = True
            if cancel_pending:
                cancelled = [f for f, _fn, _args in (*self._reads, *self._writes)]
                self._reads.clear()
                self._writes.clear()
            self._cond.notify_all()
        for future in cancelled:  # outside the lock: done-callbacks may take their own locks
            future.cancel()
        end = None if timeout is None else time.monotonic() + timeout
        for t in self._threads:
            t.join(None if end is None else max(0.0, end - time.monotonic()))
        return self.threads_alive() == 0
