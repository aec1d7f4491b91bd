"""A transfer job: the job machine's model, shared by the scheduler half and the workers."""

from __future__ import annotations

from dataclasses import dataclass

from typing_extensions import override

from kvfsm.control.types import GPUBlockSpec, OffloadKey, ReqContext, SlotSpec
from kvfsm.errors import AckCountError
from kvfsm.machines import job_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import JOB_TERMINAL, JobEffect, JobEvent, JobKind, JobState

__all__ = ["Job", "Quarantined"]


class Job:
    """One job from planning to its terminal outcome; only ``launch/ack/fail/cancel/discard/time_out``
    move it.

    ``pending`` starts at the world size W and reaches 0 exactly at the W-th ack, when the job commits.
    """

    __slots__ = (
        "failed_reports",
        "gpu",
        "job_id",
        "keys",
        "kind",
        "launched_mask",
        "machine",
        "pending",
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
        self.pending = world_size
        self.launched_mask = 0
        self.failed_reports = 0
        self.state = JobState.SUBMITTED
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
        effect = self.machine.fire(self, JobEvent.LAUNCH, rank)
        self.launched_mask |= 1 << rank
        return effect is JobEffect.START_COPY

    def _check_count(self, count: int, what: str) -> None:
        if self.state is JobState.IN_FLIGHT and not 0 < count <= self.pending:
            raise AckCountError(
                f"job {self.job_id}: {count} {what} reported but {self.pending} pending; expected 1..{self.pending}"
            )

    def ack(self, count: int = 1) -> JobEffect | None:
        """Record ``count`` successful worker reports.

        Returns the effect: COMMIT exactly once when the W-th report arrives and all succeeded,
        RELEASE when the W-th arrives after a failure, None while reports are still pending.
        """
        self._check_count(count, "acks")
        effect = self.machine.fire(self, JobEvent.ACK, count)
        self.pending -= count
        return effect

    def fail(self, count: int = 1) -> JobEffect | None:
        """Record ``count`` failed worker reports; RELEASE once every worker has reported."""
        if self.state is JobState.IN_FLIGHT:
            self._check_count(count, "failures")
        effect = self.machine.fire(self, JobEvent.FAIL, count)
        self.pending = max(0, self.pending - count)
        self.failed_reports += count
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

    Shared by the scheduler half (GPU <-> CPU jobs, ``outstanding`` = launched workers yet to report) and
    the tiering manager (primary <-> tier jobs, one copy: the tier, named by ``tier``). The job already
    ended ``timed_out`` with the RELEASE effect; the owner carries that effect out once :meth:`report`
    says every outstanding copy has reported.
    """

    job: Job
    ctx: ReqContext
    outstanding: int = 1
    #: The index of the tier running the copy (tiering manager); -1 for GPU workers.
    tier: int = -1

    def report(self, count: int = 1) -> bool:
        """``count`` outstanding copies reported (late); True once none is left."""
        self.outstanding -= count
        return self.outstanding <= 0
