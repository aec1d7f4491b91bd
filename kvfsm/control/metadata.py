"""Per-step messages between the scheduler half and the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfsm.control.job import Job
from kvfsm.errors import AckCountError

__all__ = ["ConnectorMetadata", "WorkerOutput"]


@dataclass(frozen=True, slots=True)
class ConnectorMetadata:
    """What the scheduler half hands the workers each step: the job objects themselves."""

    load_jobs: dict[int, Job] = field(default_factory=dict)
    store_jobs: dict[int, Job] = field(default_factory=dict)
    jobs_to_flush: frozenset[int] = frozenset()


@dataclass(slots=True)
class WorkerOutput:
    """What workers return each step, merged over workers: the ranks that report each job.

    ``completed[job_id]`` is the set of worker ranks whose shard of the job succeeded, ``failed[job_id]``
    those whose shard failed. Reports are attributed to ranks, never counted (spec/job.toml: a job commits
    only when every one of its W ranks has launched and reported).
    """

    completed: dict[int, set[int]] = field(default_factory=dict)
    failed: dict[int, set[int]] = field(default_factory=dict)
    finished_recving: set[str] = field(default_factory=set)

    def add(self, job_id: int, rank: int, *, ok: bool) -> None:
        """Record rank ``rank``'s report of ``job_id``; a rank reporting a job twice raises
        :class:`AckCountError` and changes nothing."""
        if rank in self.completed.get(job_id, ()) or rank in self.failed.get(job_id, ()):
            raise AckCountError(f"job {job_id}: rank {rank} reported twice in one output")
        (self.completed if ok else self.failed).setdefault(job_id, set()).add(rank)

    def merge(self, other: WorkerOutput) -> None:
        """Add ``other``'s reports. Two outputs reporting one job from the same rank raise
        :class:`AckCountError` before anything is merged."""
        for jid in other.job_ids():
            mine = self.completed.get(jid, set()) | self.failed.get(jid, set())
            theirs = other.completed.get(jid, set()) | other.failed.get(jid, set())
            if mine & theirs:
                raise AckCountError(f"job {jid}: ranks {sorted(mine & theirs)} reported twice in one step")
        for jid, ranks in other.completed.items():
            self.completed.setdefault(jid, set()).update(ranks)
        for jid, ranks in other.failed.items():
            self.failed.setdefault(jid, set()).update(ranks)
        self.finished_recving |= other.finished_recving

    def job_ids(self) -> list[int]:
        """Every job this output reports, failures' first (the order they are applied in)."""
        return list(dict.fromkeys([*self.failed, *self.completed]))

    def is_empty(self) -> bool:
        return not (self.completed or self.failed or self.finished_recving)
