"""A transfer job: the job machine's model, shared by the scheduler half and the workers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from typing_extensions import override

from kvfsm.control.types import GPUBlockSpec, OffloadKey, ReqContext, SlotSpec
from kvfsm.errors import AckCountError
from kvfsm.machines import job_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import JOB_TERMINAL, JobEffect, JobEvent, JobKind, JobState

__all__ = ["Job", "Quarantined"]

# Enum members read through their class cost a descriptor call each (Python 3.11): every job's launch,
# report and commit reads these.
_SUBMITTED, _IN_FLIGHT = JobState.SUBMITTED, JobState.IN_FLIGHT
_LAUNCH, _ACK, _FAIL = JobEvent.LAUNCH, JobEvent.ACK, JobEvent.FAIL
_START_COPY = JobEffect.START_COPY


class Job:
    """One job from planning to its terminal outcome; only ``launch/ack/fail/cancel/discard/time_out``
    move it.

    Reports are attributed to ranks: ``launched_mask`` and ``reported_mask`` hold one bit per worker rank,
    ``reported_mask`` is always a subset of ``launched_mask``, and ``pending`` (W minus the reported ranks)
    reaches 0 exactly when every one of the W ranks has launched and reported; only then may the job commit.
    """

    __slots__ = (
        "failed_reports",
        "gpu",
        "job_id",
        "keys",
        "kind",
        "launched_mask",
        "machine",
        "reported_mask",
        "req_id",
        "slots",
        "state",
        "world_size",
    )

    def __init__(
        self,
        job_id: int,
        kind: JobKind,
        req_id: str,
        keys: tuple[OffloadKey, ...],
        gpu: GPUBlockSpec,
        slots: SlotSpec,
        world_size: int,
        machine: SpecMachine[JobState, JobEvent, JobEffect] | None = None,
    ) -> None:
        self.job_id = job_id
        self.kind = kind
        self.req_id = req_id
        self.keys = keys
        self.gpu = gpu
        self.slots = slots
        self.world_size = world_size
        self.launched_mask = 0
        self.reported_mask = 0
        self.failed_reports = 0
        self.state = _SUBMITTED
        self.machine = machine if machine is not None else job_machine()

    @override
    def __repr__(self) -> str:
        return f"Job({self.job_id}, {self.kind.value}, req={self.req_id!r}, {self.state.value}, pending={self.pending})"

    @property
    def is_terminal(self) -> bool:
        return self.state in JOB_TERMINAL

    def current(self) -> JobState:
        """The state, read through a call so that mypy does not narrow it across transitions."""
        return self.state

    def launch(self, rank: int) -> bool:
        """Worker ``rank`` starts its shard; True means the caller must start the copy."""
        if not 0 <= rank < self.world_size:
            raise AckCountError(f"job {self.job_id}: worker rank {rank} outside 0..{self.world_size - 1}")
        effect = self.machine.fire(self, _LAUNCH, rank)
        self.launched_mask |= 1 << rank
        return effect is _START_COPY

    @staticmethod
    def launch_all(jobs: Sequence[Job], rank: int) -> None:
        """:meth:`launch` of worker ``rank`` for each of ``jobs`` that it has not launched yet, in order: one
        ``fire_many`` batch (all or nothing) when they share one machine, as a scheduler's jobs do."""
        todo = [job for job in jobs if not (job.launched_mask >> rank) & 1]
        if not todo:
            return
        machine = todo[0].machine
        for job in todo:  # one pass: a job on another machine, or a rank it does not have, takes launch()
            if job.machine is not machine or not 0 <= rank < job.world_size:
                for one in todo:
                    one.launch(rank)  # (raises for a bad rank at the first job, before it changes)
                return
        machine.fire_many(todo, _LAUNCH, rank, distinct=True)
        for job in todo:
            job.launched_mask |= 1 << rank

    @property
    def pending(self) -> int:
        """Ranks that have not reported yet: W at planning, 0 once every rank has reported."""
        return self.world_size - self.reported_mask.bit_count()

    def check_report(self, rank: int) -> None:
        """Raise :class:`AckCountError` unless ``rank`` launched this in-flight job and has not reported it."""
        if self.state is not _IN_FLIGHT:
            return  # the machine itself decides (a refusal before launch, or InvalidTransition)
        if not 0 <= rank < self.world_size:
            raise AckCountError(f"job {self.job_id}: worker rank {rank} outside 0..{self.world_size - 1}")
        if not (self.launched_mask >> rank) & 1:
            raise AckCountError(f"job {self.job_id}: rank {rank} reported a job it never launched")
        if (self.reported_mask >> rank) & 1:
            raise AckCountError(f"job {self.job_id}: rank {rank} already reported")

    def ack(self, rank: int = 0, *, validated: bool = False) -> JobEffect | None:
        """Record worker ``rank``'s successful report.

        Returns the effect: COMMIT exactly once when the last of the W ranks reports and all succeeded,
        RELEASE when the last reports after a failure, None while other ranks are still pending.
        Raises :class:`AckCountError` (changing nothing) for a rank that never launched or already reported.
        ``validated=True`` says the caller has just run :meth:`check_report` for this rank (the scheduler
        checks a whole output before it applies any report); the machine's guards still refuse a bad rank.
        """
        if not validated:
            self.check_report(rank)
        effect = self.machine.fire(self, _ACK, rank)
        self.reported_mask |= 1 << rank
        return effect

    def fail(self, rank: int = 0, *, validated: bool = False) -> JobEffect | None:
        """Record worker ``rank``'s failed report; RELEASE once every rank has reported.

        Before any launch (a tier refused the submission) the job fails at once and ``rank`` is not recorded.
        ``validated`` as for :meth:`ack`.
        """
        if not validated:
            self.check_report(rank)
        launched = self.state is _IN_FLIGHT
        effect = self.machine.fire(self, _FAIL, rank)
        if launched:
            self.reported_mask |= 1 << rank
            self.failed_reports += 1
        return effect

    def cancel(self) -> JobEffect | None:
        """Nothing was launched and nothing will be: the job ends cancelled (RELEASE)."""
        return self.machine.fire(self, JobEvent.CANCEL)

    def discard(self) -> None:
        self.machine.fire(self, JobEvent.DISCARD)

    def time_out(self) -> JobEffect | None:
        """The job's deadline passed: it ends timed_out and its resources are released (RELEASE)."""
        return self.machine.fire(self, JobEvent.TIME_OUT)


@dataclass(slots=True)
class Quarantined:
    """A timed-out job whose launched copies have not all reported: its memory is not handed back yet.

    Shared by the scheduler half (GPU <-> CPU jobs: ``outstanding`` is the mask of ranks that launched
    and have not reported) and the tiering manager (primary <-> tier jobs, one copy: the tier, named by
    ``tier``, as rank 0). The job already ended ``timed_out`` with the RELEASE effect; the owner carries
    that effect out once :meth:`report` says every outstanding copy has reported. While it is held, the
    copy is pending work (spec/README.md, "Quarantine").
    """

    job: Job
    ctx: ReqContext
    #: Bit ``r`` set: rank ``r`` launched the job and has not reported it yet.
    outstanding: int = 1
    #: The index of the tier running the copy (tiering manager); -1 for GPU workers.
    tier: int = -1

    def check_report(self, rank: int) -> None:
        """Raise :class:`AckCountError` unless ``rank`` is one of the outstanding copies."""
        if not (rank >= 0 and (self.outstanding >> rank) & 1):
            raise AckCountError(
                f"timed-out job {self.job.job_id}: rank {rank} has no outstanding copy "
                f"(outstanding ranks {[r for r in range(self.outstanding.bit_length()) if self.outstanding >> r & 1]})"
            )

    def report(self, rank: int = 0) -> bool:
        """Outstanding rank ``rank`` reported (late); True once none is left."""
        self.check_report(rank)
        self.outstanding &= ~(1 << rank)
        return self.outstanding == 0
