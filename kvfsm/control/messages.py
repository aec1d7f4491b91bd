"""The scheduler/worker boundary as plain messages (spec/README.md, "The scheduler/worker boundary").

In-process, the scheduler half and the workers share :class:`~kvfsm.control.job.Job` objects
(:class:`~kvfsm.control.metadata.ConnectorMetadata`). Across a process boundary (vLLM serializes its
connector metadata from the scheduler process to every worker) only plain data may cross:

- scheduler -> workers, once per step: a :class:`StepMessage` of :class:`JobSpec` records (job ids,
  kinds, requests, GPU blocks and CPU slots) and the ids of the stores to flush before the forward;
- each worker -> scheduler, once per step: a :class:`RankReport` (its rank, the ids of the jobs it
  finished, ok or failed).

A worker keeps its own mirror of each job (:class:`RemoteWorker`, over the real
:class:`~kvfsm.control.worker.OffloadingWorker` and its copy backend): the job machine runs on both sides,
the worker's copy for its own rank's ``launch``, the scheduler's for every rank's ``launch``, ``ack`` and
``fail``. Every message is made of ints, strings and tuples: :meth:`StepMessage.to_wire` /
:meth:`StepMessage.from_wire` (and the same on :class:`RankReport`) round-trip through JSON.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import OffloadingWorker
from kvfsm.errors import AckCountError, ConfigError
from kvfsm.machines import job_machine
from kvfsm.machines.names import JobKind

__all__ = ["JobSpec", "RankReport", "RemoteWorker", "StepMessage", "merge_reports", "spec_of"]


def _ints(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or not all(type(v) is int for v in value):
        raise ConfigError(f"{name} must be a list of ints, got {value!r}")
    return tuple(value)


def _int(name: str, value: object) -> int:
    if type(value) is not int:
        raise ConfigError(f"{name} must be an int, got {value!r}")
    return value


#: The job kinds that cross the boundary (cascades and promotions stay inside the scheduler's manager).
_WIRE_KINDS = {JobKind.STORE.value: JobKind.STORE, JobKind.LOAD.value: JobKind.LOAD}


@dataclass(frozen=True, slots=True)
class JobSpec:
    """One job as it crosses the boundary: what a worker needs to copy it, nothing live."""

    job_id: int
    kind: JobKind
    req_id: str
    #: The job's GPU blocks, in logical order, and the index of the first one inside its chunk.
    gpu_block_ids: tuple[int, ...]
    first_block_offset: int
    #: One CPU slot per chunk, in key order.
    slot_ids: tuple[int, ...]
    world_size: int

    def to_wire(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "kind": self.kind.value,
            "req_id": self.req_id,
            "gpu": list(self.gpu_block_ids),
            "offset": self.first_block_offset,
            "slots": list(self.slot_ids),
            "world_size": self.world_size,
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> JobSpec:
        try:
            kind = data["kind"]
            if kind not in _WIRE_KINDS:
                raise ConfigError(f"job spec field 'kind' = {kind!r}; expected one of {sorted(_WIRE_KINDS)}")
            req_id = data["req_id"]
            if not isinstance(req_id, str):
                raise ConfigError(f"req_id must be a string, got {req_id!r}")
            return cls(
                _int("job_id", data["job_id"]),
                _WIRE_KINDS[kind],
                req_id,
                _ints("gpu", data["gpu"]),
                _int("offset", data["offset"]),
                _ints("slots", data["slots"]),
                _int("world_size", data["world_size"]),
            )
        except KeyError as exc:
            raise ConfigError(f"job spec lacks the field {exc.args[0]!r}; got fields {sorted(data)}") from None

    def to_job(self) -> Job:
        """A fresh worker-side mirror of this job (state ``submitted``; only this rank will launch it)."""
        return Job(
            self.job_id,
            self.kind,
            self.req_id,
            (),
            GPUBlockSpec(self.gpu_block_ids, self.first_block_offset),
            SlotSpec(self.slot_ids),
            self.world_size,
            job_machine(),
        )


def spec_of(job: Job) -> JobSpec:
    return JobSpec(
        job.job_id,
        job.kind,
        job.req_id,
        job.gpu.block_ids,
        job.gpu.first_block_offset,
        job.slots.slot_ids,
        job.world_size,
    )


@dataclass(frozen=True, slots=True)
class StepMessage:
    """Scheduler -> every worker, once per step."""

    load_jobs: tuple[JobSpec, ...] = ()
    store_jobs: tuple[JobSpec, ...] = ()
    #: Store jobs every worker must finish before this step's forward (fences, preemption, reset).
    jobs_to_flush: frozenset[int] = frozenset()

    @classmethod
    def of(cls, meta: ConnectorMetadata) -> StepMessage:
        return cls(
            tuple(spec_of(j) for j in meta.load_jobs.values()),
            tuple(spec_of(j) for j in meta.store_jobs.values()),
            frozenset(meta.jobs_to_flush),
        )

    def is_empty(self) -> bool:
        return not (self.load_jobs or self.store_jobs or self.jobs_to_flush)

    def to_wire(self) -> dict[str, Any]:
        return {
            "loads": [j.to_wire() for j in self.load_jobs],
            "stores": [j.to_wire() for j in self.store_jobs],
            "flush": sorted(self.jobs_to_flush),
        }

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> StepMessage:
        try:
            return cls(
                tuple(JobSpec.from_wire(j) for j in data["loads"]),
                tuple(JobSpec.from_wire(j) for j in data["stores"]),
                frozenset(_ints("flush", data["flush"])),
            )
        except KeyError as exc:
            raise ConfigError(f"step message lacks the field {exc.args[0]!r}; got fields {sorted(data)}") from None


@dataclass(frozen=True, slots=True)
class RankReport:
    """One worker -> the scheduler, once per step: which jobs this rank finished since its last report."""

    rank: int
    completed: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()

    def is_empty(self) -> bool:
        return not (self.completed or self.failed)

    def to_wire(self) -> dict[str, Any]:
        return {"rank": self.rank, "completed": list(self.completed), "failed": list(self.failed)}

    @classmethod
    def from_wire(cls, data: Mapping[str, Any]) -> RankReport:
        try:
            return cls(
                _int("rank", data["rank"]), _ints("completed", data["completed"]), _ints("failed", data["failed"])
            )
        except KeyError as exc:
            raise ConfigError(f"rank report lacks the field {exc.args[0]!r}; got fields {sorted(data)}") from None


def merge_reports(reports: Iterable[RankReport]) -> WorkerOutput:
    """The W workers' reports of one step as one :class:`WorkerOutput`, attributed to ranks. A rank
    reporting one job twice raises :class:`AckCountError` and nothing is returned."""
    out = WorkerOutput()
    for report in reports:
        if not report.failed and not out.completed and not out.failed:
            # The first report, successes only (most steps, and every step of one worker): one set per
            # job in one pass. A job listed twice falls through to the checks below, which raise.
            rank = report.rank
            completed = {job_id: {rank} for job_id in report.completed}
            if len(completed) == len(report.completed):
                out.completed = completed
                continue
        for job_id in report.completed:
            out.add(job_id, report.rank, ok=True)
        for job_id in report.failed:
            out.add(job_id, report.rank, ok=False)
    return out


@dataclass(frozen=True, slots=True)
class StepResult:
    """What one worker hands back after a step: its report, plus what the engine needs per request."""

    report: RankReport
    #: Requests whose load this rank finished (ok or not): the engine's ``finished_recving``.
    finished_loads: frozenset[str]
    #: GPU blocks of loads this rank failed: the engine recomputes them.
    failed_load_blocks: frozenset[int]


class RemoteWorker:
    """One rank's worker half on the far side of the boundary: decodes each :class:`StepMessage` into its
    own job mirrors and runs them on an :class:`OffloadingWorker` (the same launch protocol as in-process).

    A message is decoded once per step (:meth:`bind`); :meth:`before_forward` and :meth:`after_forward`
    act on those mirrors; :meth:`poll` returns this rank's :class:`StepResult`. A job id the worker has
    seen already (a repeated message) is never launched twice.
    """

    __slots__ = ("_bound", "_load_req", "_seen", "worker")

    def __init__(self, worker: OffloadingWorker) -> None:
        self.worker = worker
        self._bound = ConnectorMetadata()
        #: Load jobs this rank launched and has not reported: job id -> (request, GPU blocks).
        self._load_req: dict[int, tuple[str, tuple[int, ...]]] = {}
        #: Ids of every job this rank received and has not reported yet.
        self._seen: set[int] = set()

    @property
    def rank(self) -> int:
        return self.worker.rank

    def bind(self, message: StepMessage) -> None:
        """Decode this step's message into job mirrors (jobs already received are not mirrored again)."""
        loads = self._mirrors(message.load_jobs, JobKind.LOAD)
        stores = self._mirrors(message.store_jobs, JobKind.STORE)
        self._bound = ConnectorMetadata(load_jobs=loads, store_jobs=stores, jobs_to_flush=message.jobs_to_flush)
        for job_id in (*loads, *stores):
            self._seen.add(job_id)
        for job in loads.values():
            self._load_req[job.job_id] = (job.req_id, job.gpu.block_ids)

    def _mirrors(self, specs: Sequence[JobSpec], kind: JobKind) -> dict[int, Job]:
        out: dict[int, Job] = {}
        for spec in specs:
            if spec.kind is not kind:
                raise ConfigError(f"job {spec.job_id} is a {spec.kind.value} job; expected a {kind.value} job")
            if spec.world_size != self.worker.world_size:
                raise ConfigError(
                    f"job {spec.job_id} has world_size={spec.world_size}; expected {self.worker.world_size}"
                )
            if spec.job_id not in self._seen:
                out[spec.job_id] = spec.to_job()
        return out

    def before_forward(self) -> None:
        self.worker.before_forward(self._bound)

    def after_forward(self) -> None:
        self.worker.after_forward(self._bound)

    def poll(self) -> StepResult:
        out = self.worker.poll()
        completed: list[int] = []
        failed: list[int] = []
        loads: set[str] = set()
        bad_blocks: set[int] = set()
        for job_id in out.job_ids():
            if job_id not in self._seen:
                raise AckCountError(f"rank {self.rank}: the copy backend reported job {job_id}, never received")
            self._seen.discard(job_id)
            ok = job_id in out.completed
            (completed if ok else failed).append(job_id)
            load = self._load_req.pop(job_id, None)
            if load is not None:
                loads.add(load[0])
                if not ok:
                    bad_blocks.update(load[1])
        return StepResult(
            RankReport(self.rank, tuple(completed), tuple(failed)), frozenset(loads), frozenset(bad_blocks)
        )

    @property
    def num_unreported(self) -> int:
        """Jobs this rank received and has not reported yet."""
        return len(self._seen)

    def shutdown(self) -> None:
        self.worker.shutdown()
