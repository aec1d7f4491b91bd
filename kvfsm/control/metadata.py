"""Per-step messages between the scheduler half and the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.control.job import Job

__all__ = ["ConnectorMetadata", "WorkerOutput"]


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """What the scheduler half hands the workers each step: the job objects themselves."""

    load_jobs: dict[int, Job] = field(default_factory=dict)
    store_jobs: dict[int, Job] = field(default_factory=dict)
    jobs_to_flush: frozenset[int] = frozenset()


@dataclass(slots=True)
class WorkerOutput:
    """What workers return each step, summed over workers: acks and failures per job id."""

    completed: dict[int, int] = field(default_factory=dict)
    failed: dict[int, int] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)

    def merge(self, other: WorkerOutput) -> None:
        for jid, n in other.completed.items():
            self.completed[jid] = self.completed.get(jid, 0) + n
        for jid, n in other.failed.items():
            self.failed[jid] = self.failed.get(jid, 0) + n
        self.finished_recving |= other.finished_recving

    def is_empty(self) -> bool:
        return not (self.completed or self.failed or self.finished_recving)
