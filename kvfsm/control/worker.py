"""The worker half, sans IO: launches each step's jobs on a copy backend and reports their outcomes.

Per engine step the engine calls, on every worker (one per tensor-parallel rank):

1. :meth:`OffloadingWorker.before_forward` - launch the store jobs the scheduler wants flushed (new or
   still un-launched), block until every flushed job this worker launched has finished (the GPU blocks they
   read are about to be reused), then launch this step's load jobs.
2. the forward pass;
3. :meth:`OffloadingWorker.after_forward` - launch the step's remaining store jobs: they read blocks the
   forward has just written, so they start after it;
4. :meth:`OffloadingWorker.poll` - a :class:`WorkerOutput` with this rank's ack (or failure) of each finished job.

The job machine decides every launch: ``job.launch(rank)`` fires ``launch`` for this rank (at most once,
the spec's ``worker_not_launched`` guard) and returns True when its effect is ``start_copy``. Terminal jobs
(stale, cancelled, failed, complete) are skipped without a copy or an ack. The worker never acks or fails
a job itself: the scheduler does that when it processes the summed outputs of all workers.

The copies themselves are a :class:`CopyBackend`'s: the torch backends live in :mod:`kvfsm.data`
(:mod:`kvfsm.data.worker` builds workers over them); :class:`HeldCopyBackend` is a torch-free one whose
copies run only when the caller completes them (or a flush waits on them), for control-plane tests and the
model checker's replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Protocol

from typing_extensions import override

from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.machines.names import JobKind
from kvfsm.validation import is_int

__all__ = ["CopyBackend", "CopyFn", "HeldCopyBackend", "OffloadingWorker"]

logger = logging.getLogger(__name__)


class CopyBackend(Protocol):
    """What a worker needs from a copy engine: asynchronous batched copies with completion polling."""

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        """Raise ConfigError if the job cannot be copied; never changes anything."""
        ...

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        """Start the copy of one job; its outcome is reported once by :meth:`poll`."""
        ...

    def poll(self) -> list[tuple[int, bool]]:
        """``(job_id, success)`` for every submitted job that finished since the last poll, each once."""
        ...

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs (those submitted and not yet polled) have finished."""
        ...

    def shutdown(self) -> None:
        """Finish everything outstanding and release the copy threads."""
        ...


class OffloadingWorker:
    """One tensor-parallel rank's half of the connector."""

    __slots__ = ("_launched", "_submit_failures", "_unlaunched_stores", "backend", "rank", "world_size")

    def __init__(self, rank: int, world_size: int, backend: CopyBackend) -> None:
        if not is_int(world_size) or world_size < 1:
            raise ConfigError(f"world_size must be a positive int, got {world_size!r}")
        if not is_int(rank) or not 0 <= rank < world_size:
            raise ConfigError(f"rank must be an int in 0..{world_size - 1}, got {rank!r}")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        #: Store jobs received but not launched by this rank yet, in arrival order.
        self._unlaunched_stores: dict[int, Job] = {}
        #: Jobs this rank launched whose outcome poll() has not reported yet.
        self._launched: dict[int, Job] = {}
        #: Jobs launched whose copy could not even be submitted: reported failed by the next poll().
        self._submit_failures: list[int] = []

    @override
    def __repr__(self) -> str:
        return (
            f"OffloadingWorker(rank={self.rank}, world_size={self.world_size}, "
            f"in_flight={len(self._launched)}, unlaunched_stores={len(self._unlaunched_stores)})"
        )

    # ------------------------------------------------------------------ the engine step

    def before_forward(self, meta: ConnectorMetadata) -> None:
        """Flush the stores in ``meta.jobs_to_flush``, wait for them, then launch this step's loads."""
        new_stores = self._new_jobs(meta.store_jobs.values(), JobKind.STORE)
        loads = self._new_jobs(meta.load_jobs.values(), JobKind.LOAD)
        pending = dict(self._unlaunched_stores)
        pending.update((job.job_id, job) for job in new_stores)
        flush = meta.jobs_to_flush
        flushed = [job for jid, job in pending.items() if jid in flush]
        self._check(flushed + loads)  # validate everything before the first transition fires
        self._unlaunched_stores = pending
        for job in flushed:
            self._launch(job)
        to_wait = [jid for jid in flush if jid in self._launched]
        if to_wait:
            self.backend.wait(to_wait)
        for job in loads:
            self._launch(job)

    def after_forward(self, meta: ConnectorMetadata) -> None:
        """Launch every store job not launched yet: this step's and any left over from earlier steps."""
        new_stores = self._new_jobs(meta.store_jobs.values(), JobKind.STORE)
        pending = dict(self._unlaunched_stores)
        pending.update((job.job_id, job) for job in new_stores)
        self._check(list(pending.values()))
        self._unlaunched_stores = pending
        for job in list(pending.values()):
            self._launch(job)

    def poll(self) -> WorkerOutput:
        """This rank's report of each job that finished since the last poll: ``completed`` on success, else
        ``failed``, attributed to :attr:`rank`.

        A finished load also reports its request in ``finished_recving`` (whatever its outcome: this rank is
        done with it; the scheduler reads the job's outcome from the counts).
        """
        out = WorkerOutput()
        results = [(jid, False) for jid in self._submit_failures]
        self._submit_failures = []
        results.extend(self.backend.poll())
        for job_id, ok in results:
            job = self._launched.pop(job_id, None)
            out.add(job_id, self.rank, ok=ok)
            if job is not None and job.kind is JobKind.LOAD:
                out.finished_recving.add(job.req_id)
        return out

    def wait_all(self) -> None:
        """Block until every job this rank launched has finished (its outcome still comes from poll)."""
        if self._launched:
            self.backend.wait(list(self._launched))

    def shutdown(self) -> None:
        """Wait for the outstanding copies, then stop the backend. Un-launched stores are dropped."""
        self.wait_all()
        self._unlaunched_stores.clear()
        self.backend.shutdown()

    # ------------------------------------------------------------------ queries

    @property
    def num_in_flight(self) -> int:
        """Jobs this rank launched whose outcome poll() has not reported yet."""
        return len(self._launched)

    @property
    def unlaunched_store_ids(self) -> tuple[int, ...]:
        return tuple(self._unlaunched_stores)

    def in_flight_jobs(self) -> dict[int, Job]:
        """Jobs this rank launched whose outcome poll() has not reported yet, by id, in launch order."""
        return dict(self._launched)

    def unlaunched_stores(self) -> dict[int, Job]:
        """Store jobs received but not launched by this rank yet, by id, in arrival order."""
        return dict(self._unlaunched_stores)

    def launched_here(self, job: Job) -> bool:
        """This rank fired ``launch`` for ``job`` (with or without a copy)."""
        return bool((job.launched_mask >> self.rank) & 1)

    # ------------------------------------------------------------------ internals

    def _new_jobs(self, jobs: Iterable[Job], kind: JobKind) -> list[Job]:
        """The jobs this rank has not launched yet (a repeated metadata object is not a second launch)."""
        fresh: list[Job] = []
        for job in jobs:
            if job.kind is not kind:
                raise ConfigError(f"job {job.job_id} is a {job.kind.value} job; expected a {kind.value} job")
            if job.world_size != self.world_size:
                raise ConfigError(f"job {job.job_id} has world_size={job.world_size}; expected {self.world_size}")
            if not self.launched_here(job):
                fresh.append(job)
        return fresh

    def _check(self, jobs: list[Job]) -> None:
        for job in jobs:
            if not job.is_terminal:
                self.backend.check(job.kind is JobKind.STORE, job.gpu, job.slots)

    def _launch(self, job: Job) -> None:
        self._unlaunched_stores.pop(job.job_id, None)
        if job.is_terminal or self.launched_here(job):
            return
        if not job.launch(self.rank):
            return
        self._launched[job.job_id] = job
        try:
            self.backend.submit(job.job_id, job.kind is JobKind.STORE, job.gpu, job.slots)
        except Exception:
            # The job machine already counts this rank as launched: it must still get an outcome.
            logger.exception("job %d: could not submit the copy on rank %d", job.job_id, self.rank)
            self._submit_failures.append(job.job_id)


#: What a :class:`HeldCopyBackend` does when a held copy runs: ``(is_store, gpu, slots)``.
CopyFn = Callable[[bool, GPUBlockSpec, SlotSpec], None]


class HeldCopyBackend:
    """A CopyBackend whose copies run only when told: deterministic, no threads, no torch.

    ``submit`` holds the job; :meth:`complete` runs it (calling ``copy``, if any, on success) or fails it,
    and the next :meth:`poll` reports the outcome. ``wait`` is the blocking wait of a flush: it runs the
    held copies it names, successfully, in job id order.
    """

    __slots__ = ("_copy", "done", "held")

    def __init__(self, copy: CopyFn | None = None) -> None:
        self._copy = copy
        #: Submitted jobs whose copy has not run yet, in submission order.
        self.held: dict[int, tuple[bool, GPUBlockSpec, SlotSpec]] = {}
        #: Copies that ran (ok?) and that the next poll reports, in the order they ran.
        self.done: dict[int, bool] = {}

    @property
    def held_ids(self) -> tuple[int, ...]:
        """Jobs submitted whose copy has not run yet, in submission order."""
        return tuple(self.held)

    def in_flight_ids(self) -> set[int]:
        """Submitted jobs not reported by poll yet."""
        return set(self.held) | set(self.done)

    def complete(self, job_id: int, ok: bool = True) -> None:
        """Run (``ok``) or fail the held copy of ``job_id``; the next poll reports it."""
        held = self.held.pop(job_id, None)
        if held is None:
            raise KvfsmError(f"job {job_id} has no copy held; expected one of {sorted(self.held)}")
        if ok and self._copy is not None:
            self._copy(*held)
        self.done[job_id] = ok

    # -- CopyBackend --

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        pass

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if job_id in self.held or job_id in self.done:
            raise ConfigError(f"job {job_id} is already submitted and not yet polled; expected a new job id")
        self.held[job_id] = (is_store, gpu, slots)
        return _NOT_TRACKED

    def poll(self) -> list[tuple[int, bool]]:
        out = list(self.done.items())
        self.done = {}
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        for job_id in sorted(job_ids):
            if job_id in self.held:
                self.complete(job_id, ok=True)

    def shutdown(self) -> None:
        """Nothing to release: the worker's shutdown already waited for every held copy."""


#: What HeldCopyBackend.submit returns: outcomes come from poll, so no per-copy future is kept (a future
#: holds a lock, which would also make the backend impossible to deep-copy).
_NOT_TRACKED: Future[None] = Future()
