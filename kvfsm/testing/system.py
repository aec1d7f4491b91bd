"""The whole-system state machine, independent of how the system is built (no torch here).

:class:`SystemStateMachine` holds the rules and the checks; a :class:`SystemHarness` builds and drives one
system: :class:`kvfsm.testing.engine.EngineStateMachine` uses the reference engine with real torch copies,
:class:`kvfsm.testing.control.ControlPlaneStateMachine` a torch-free engine loop over the same scheduler,
managers and tier, whose "memory" is a tag per block and slot.

Rules are the spec's events; each names the events it drives (:func:`~kvfsm.testing.coverage.covers`) and
the class is checked against ``spec/*.toml`` when it is created. Rules draw only enabled actions: a
precondition says whether any target exists, and the target is drawn from the eligible ones. Every
transfer finishes only when a rule says so (or when a step blocks on it, as a fence or preemption flush
does), so each example is deterministic. Time passes only through ``advance_clock`` (a
:class:`~kvfsm.control.deadlines.ManualClock`).

Checked after every rule (:meth:`SystemStateMachine.system_violations`):

* every invariant of ``spec/invariants.toml`` (:func:`kvfsm.check.invariants.check_all`);
* ``has_pending_push_work()`` is True while any transfer is in flight or uncommitted: a copy of a live job
  on any worker (held, or finished and not yet polled), an un-launched store, a job that is not terminal,
  a tier job (submitted, or finished and not yet applied); stale and timed-out (quarantined) jobs are
  given up on by the spec and do not count;
* the engine is idle only when nothing is pending;
* the same on the data plane's ground truth (:meth:`SystemStateMachine.pending_covers_data_plane`): while a
  copy backend has a copy of a live job unfinished or unreported (its own futures), or the tier holds a
  live transfer, ``has_pending_push_work()`` is True and the engine is not idle; every job a backend
  reports finished holds its bytes at its destination at that poll (:meth:`SystemHarness.data_plane_problems`);
* every load returns exactly the stored bytes, and every readable CPU slot holds, on every worker, exactly
  the bytes the forward wrote for its chunk; a store that has not copied yet still finds its GPU source
  blocks intact (gpu_source_not_overwritten, on the data);
* no slot is evicted or reused while written or read: each in-flight job's keys are still writing (stores,
  promotions) or reading (loads, cascades) in the slots it was given, and no two keys share a slot;
* each job reaches a terminal state once, job ids are never reused, and every store or load that ends
  (unless stale) is completed with the manager exactly once, for exactly its keys.
"""

from __future__ import annotations

import dataclasses
import sys
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from typing_extensions import override

from kvfsm.check.invariants import SystemView, check_all
from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.deadlines import Deadlines, ManualClock
from kvfsm.control.job import Job
from kvfsm.control.manager import OffloadingManager, TierJob
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.tiering import TieringManager
from kvfsm.control.types import LookupResult, OffloadKey, ReqContext, make_offload_key
from kvfsm.engine.requests import EngineRequest
from kvfsm.machines.loader import load_machine
from kvfsm.machines.names import EngineState, JobKind, SlotState
from kvfsm.testing.coverage import TransitionLog, covers, spec_covered
from kvfsm.tiers.memory import InMemoryTier

__all__ = [
    "GROUND_TRUTH_CHECKS",
    "SYSTEM_EXEMPT",
    "TIER_TRAFFIC",
    "CheckedInMemoryTier",
    "CompletionHook",
    "CountingCPUManager",
    "CountingTieringManager",
    "SystemConfig",
    "SystemHarness",
    "SystemStateMachine",
    "make_manager",
]

#: Spec events no rule can drive, with the reason. tests/test_stateful.py checks that the implementation
#: never fires them, so an exemption cannot hide a path that exists.
SYSTEM_EXEMPT: dict[str, str] = {
    "job.cancel": (
        "only a bounded shutdown cancels, and only jobs no worker launched; its empty step launches every "
        "job first, so the engine never has one to cancel"
    ),
}

#: Checks of the data-plane ground truth made while real work remained, per machine class and kind of work
#: (this process): "copy running" (a copy thread not finished), "copy held" (submitted to a held backend,
#: not run yet: :class:`kvfsm.testing.paths.CheckerPathStateMachine`), "copy unpolled" (finished, not reported),
#: "tier job" (held by the tier), "any" (at least one of them), "given up" (work the spec gives up on: a
#: stale or timed-out copy still unreported; not asserted, see :meth:`SystemStateMachine.data_plane_work`),
#: "quarantined copy" (a timed-out job's copy not reported yet: the part of "given up" that issue 10 item 6
#: turns into pending work).
#: tests/conftest.py prints it at the end of the run.
GROUND_TRUTH_CHECKS: Counter[tuple[str, str]] = Counter()

#: Jobs submitted to each secondary tier of the machines (this process): (tier name, "cascade" or
#: "promotion") -> count; tests/test_stateful.py checks that both tiers get both kinds.
TIER_TRAFFIC: Counter[tuple[str, str]] = Counter()

_MAX_DRAIN_STEPS = 200
_JOB_TERMINAL = load_machine("job").terminal


@dataclass(frozen=True, slots=True)
class SystemConfig:
    """One drawn configuration of the system under test."""

    world_size: int = 1
    blocks_per_chunk: int = 1
    num_gpu_blocks: int = 8
    num_cpu_slots: int = 4
    #: Capacity of the first secondary tier, or None for the CPU manager alone.
    tier_capacity: int | None = None
    #: Capacity of a second secondary tier behind the first (every commit cascades to both; a lookup
    #: promotes from the first that holds the key), or None for one tier. Only with a first tier.
    second_tier_capacity: int | None = None
    max_num_batched_tokens: int = 64
    tokens_per_block: int = 4
    #: Deadline of stores and cascades in (manual) clock seconds, or None for no deadlines; loads and
    #: promotions get a sixth of it (a request waits on them), so deadlines do not expire in the order
    #: they were set.
    job_deadline_s: float | None = None
    #: False: the GPU prefix cache is emptied before every step, so every offloaded prefix is loaded back
    #: (as in the model checker, which has no GPU prefix cache).
    gpu_prefix_cache: bool = True

    @property
    def deadlines(self) -> Deadlines:
        d = self.job_deadline_s
        short = None if d is None else d / 6
        # Only the job deadlines drawn here: the manual clock may jump past any default lookup wait.
        return dataclasses.replace(Deadlines.none(), store_s=d, load_s=short, cascade_s=d, promote_s=short)


class CompletionHook:
    """Receives every ``complete_store`` / ``complete_load`` the scheduler makes on the manager."""

    def __init__(self) -> None:
        self.callback: Callable[[JobKind, tuple[OffloadKey, ...]], None] | None = None

    def __call__(self, kind: JobKind, keys: Sequence[OffloadKey]) -> None:
        if self.callback is not None:
            self.callback(kind, tuple(keys))


class CountingCPUManager(CPUOffloadingManager):
    """The CPU manager, reporting every complete_store / complete_load to :attr:`hook`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook = CompletionHook()

    @override
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        self.hook(JobKind.STORE, keys)
        super().complete_store(keys, ctx, success)

    @override
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.hook(JobKind.LOAD, keys)
        super().complete_load(keys, ctx)


# The same two overrides as CountingCPUManager: a shared mixin would call the ABC's abstract methods
# through super() (mypy's safe-super), so each manager gets its own three-line pair instead.
class CountingTieringManager(TieringManager):
    """The tiering manager, reporting every complete_store / complete_load to :attr:`hook`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.hook = CompletionHook()

    @override
    def complete_store(self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True) -> None:
        self.hook(JobKind.STORE, keys)
        super().complete_store(keys, ctx, success)

    @override
    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.hook(JobKind.LOAD, keys)
        super().complete_load(keys, ctx)


class CheckedInMemoryTier(InMemoryTier):
    """The in-memory tier, checking on its side of the seam that it is asked to promote only keys it
    answered HIT for: a tiering manager that serves a promotion from the wrong tier (one that missed, or was
    never asked) is caught when it submits the job, whatever bytes the tiers hold."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._hits: set[OffloadKey] = set()
        #: What was wrong, in order (read by :meth:`SystemHarness.data_plane_problems`).
        self.problems: list[str] = []

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        answer = super().lookup(key, ctx)
        if answer is LookupResult.HIT:
            self._hits.add(key)
        return answer

    @override
    def submit_load(self, job: TierJob) -> None:
        missed = [k.hex()[:12] for k in job.keys if k not in self._hits]
        if missed:
            self.problems.append(
                f"tier {self.name!r} was asked to promote keys {missed} (promotion job {job.job_id}) "
                "that it never answered HIT for: the promotion is served by the wrong tier"
            )
        self._hits.difference_update(job.keys)
        TIER_TRAFFIC[(self.name, "promotion")] += 1
        super().submit_load(job)

    @override
    def submit_store(self, job: TierJob) -> None:
        TIER_TRAFFIC[(self.name, "cascade")] += 1
        super().submit_store(job)


def make_manager(
    config: SystemConfig, clock: ManualClock, slot_io: Any = None
) -> tuple[CountingCPUManager | CountingTieringManager, tuple[CheckedInMemoryTier, ...], CompletionHook]:
    """The manager for ``config`` (CPU alone, or CPU in front of one or two InMemoryTiers over ``slot_io``)."""
    if config.tier_capacity is None:
        cpu = CountingCPUManager(config.num_cpu_slots)
        return cpu, (), cpu.hook
    tiers = [CheckedInMemoryTier("mem", config.tier_capacity, slot_io=slot_io)]
    if config.second_tier_capacity is not None:
        tiers.append(CheckedInMemoryTier("mem2", config.second_tier_capacity, slot_io=slot_io))
    tiering = CountingTieringManager(
        CPUOffloadingManager(config.num_cpu_slots), tiers, deadlines=config.deadlines, clock=clock
    )
    return tiering, tuple(tiers), tiering.hook


class SystemHarness(ABC):
    """One system under test, as the state machine drives and inspects it."""

    config: SystemConfig
    clock: ManualClock
    #: The secondary tiers, in the tiering manager's order (empty: the CPU manager alone).
    tiers: tuple[CheckedInMemoryTier, ...]
    hook: CompletionHook

    def tier_of(self, job_id: int) -> CheckedInMemoryTier:
        """The tier holding tier job ``job_id`` (submitted, or finished and not yet reported)."""
        for tier in self.tiers:
            if job_id in tier.pending_job_ids():
                return tier
        raise AssertionError(f"no tier holds tier job {job_id}")

    def tier_job_ids(self) -> list[int]:
        """Every tier job some tier holds, sorted."""
        return sorted(j for tier in self.tiers for j in tier.pending_job_ids())

    # -- the parts --

    @property
    @abstractmethod
    def scheduler(self) -> OffloadingScheduler: ...

    @property
    def manager(self) -> OffloadingManager:
        return self.scheduler.manager

    @property
    def primary(self) -> CPUOffloadingManager:
        primary = self.manager.primary
        assert primary is not None, f"{type(self.manager).__name__} has no CPU primary"
        return primary

    @property
    @abstractmethod
    def state(self) -> EngineState: ...

    # -- inputs --

    @abstractmethod
    def make_request(self, req_id: str, prompt: list[int], max_tokens: int) -> EngineRequest: ...

    @abstractmethod
    def add_request(self, request: EngineRequest, late: bool) -> None:
        """Queue a request for the next step (``late``: it arrives during the next step)."""

    @abstractmethod
    def step(self) -> tuple[EngineState, bool] | None:
        """One engine step; its end state and has_pending_push_work(), or None when idle with nothing to do."""

    @abstractmethod
    def has_pending_push_work(self) -> bool:
        """The engine's own answer (it may differ from the scheduler's if the engine is wrong)."""

    @abstractmethod
    def live_request_ids(self) -> list[str]:
        """Admitted requests that are not finished (abortable), sorted."""

    @abstractmethod
    def is_admitted(self, req_id: str) -> bool:
        """The engine took the request from its input queue (admission happens at a step)."""

    @abstractmethod
    def abort(self, req_id: str) -> None: ...

    @abstractmethod
    def reset_offload_cache(self) -> None: ...

    @abstractmethod
    def reset_prefix_cache(self) -> None: ...

    @abstractmethod
    def held_copies(self) -> list[tuple[int, int]]:
        """(job id, rank) of every copy a worker submitted that has not run yet, sorted."""

    @abstractmethod
    def complete_copy(self, job_id: int, rank: int, ok: bool) -> None:
        """Run (``ok``) or fail one held copy; the next step's poll reports it."""

    @abstractmethod
    def copies_in_flight(self) -> dict[int, set[int]]:
        """Job id -> ranks whose copy was submitted and not reported by a poll yet."""

    def copies_running(self) -> dict[int, set[int]]:
        """Job id -> ranks whose copy has not finished on the data plane (its future is not done): a subset of
        :meth:`copies_in_flight`. Empty where copies are not run on threads."""
        return {}

    def data_plane_problems(self) -> list[str]:
        """What the data plane's report-time checks found (a job reported finished whose destination does not
        hold the copied bytes; a tier asked to promote a key it did not hit); empty where there are none."""
        return [p for tier in self.tiers for p in tier.problems]

    @abstractmethod
    def unlaunched_store_ids(self, rank: int) -> tuple[int, ...]: ...

    @abstractmethod
    def load_mismatches(self) -> int:
        """Blocks loaded back that differ from what was stored (the engine verifies each finished load)."""

    @abstractmethod
    def slot_mismatches(self, rank: int, slot_id: int, sub: int, block_hash: bytes) -> list[str]:
        """Where rank ``rank``'s copy of block ``sub`` of slot ``slot_id`` does not hold content ``block_hash``,
        read from the data plane: one entry per wrong part (e.g. ``", layer 1"``; ``""`` for a cell that has no
        parts), empty when it holds the right bytes."""

    @abstractmethod
    def gpu_mismatches(self, rank: int, block: int, block_hash: bytes) -> list[str]:
        """Where rank ``rank``'s GPU block ``block`` does not hold content ``block_hash`` (as
        :meth:`slot_mismatches`)."""

    def slot_violations(self, key: OffloadKey, slot_id: int, hashes: Sequence[bytes]) -> list[str]:
        """What is wrong with the bytes of readable slot ``slot_id`` (chunk ``key`` of blocks ``hashes``)."""
        return [
            f"readable key {key.hex()[:12]} (slot {slot_id}, block {sub}{where}) holds the wrong bytes on rank {rank}"
            for rank in range(self.config.world_size)
            for sub, block_hash in enumerate(hashes)
            for where in self.slot_mismatches(rank, slot_id, sub, block_hash)
        ]

    def source_violations(self, job: Job, ranks: set[int], hashes: Sequence[bytes]) -> list[str]:
        """What is wrong with store ``job``'s GPU source blocks on ``ranks`` (whose copies have not run);
        ``hashes[i]`` is the content block ``job.gpu.block_ids[i]`` must still hold."""
        return [
            f"GPU block {block}{where} read by store job {job.job_id} was overwritten before rank {rank} copied it"
            for rank in sorted(ranks)
            for block, block_hash in zip(job.gpu.block_ids, hashes, strict=True)
            for where in self.gpu_mismatches(rank, block, block_hash)
        ]

    @abstractmethod
    def shutdown(self, timeout: float | None) -> None:
        """Stop the engine (abort, flush, stop); ``timeout`` as ReferenceEngine.shutdown takes it."""

    @abstractmethod
    def close(self) -> None:
        """Release threads and memory, whatever state the system is in."""


@spec_covered("job", "request", "engine", "slot", exempt=SYSTEM_EXEMPT)
class SystemStateMachine(RuleBasedStateMachine):
    """Rules and checks over a :class:`SystemHarness` built by :meth:`make_harness` (see the module docs).

    The configuration is drawn by the ``configure`` initialize rule from the class attributes below;
    subclasses narrow them.
    """

    world_sizes: ClassVar[tuple[int, ...]] = (2, 1)
    blocks_per_chunk_choices: ClassVar[tuple[int, ...]] = (1, 2)
    #: GPU blocks: enough for the largest request (5 blocks), few enough that requests preempt each other
    #: and re-allocate each other's freed (fenced) blocks.
    gpu_blocks: ClassVar[tuple[int, int]] = (5, 8)
    #: CPU primary slots: few, so stores evict and sometimes cannot allocate.
    cpu_slots: ClassVar[tuple[int, int]] = (2, 6)
    #: With a tier, at least as many slots as the chunks one lookup can promote (4): with fewer, promotions
    #: evict each other forever (tests/test_stateful.py::test_a_prefix_larger_than_the_primary_is_scheduled).
    min_cpu_slots_with_tier: ClassVar[int] = 4
    #: Secondary tier capacities to choose from; None means no tier (the CPU manager alone).
    tier_choices: ClassVar[tuple[int | None, ...]] = (None, 3)
    #: With a tier, capacities of a second one behind it; None means one tier. Larger than the first, so
    #: keys the first evicted are promoted from the second.
    second_tier_choices: ClassVar[tuple[int | None, ...]] = (None, 6)
    #: Job deadlines (manual clock seconds) to choose from; None means none.
    deadline_choices: ClassVar[tuple[float | None, ...]] = (None, None, 3.0)
    max_live_requests: ClassVar[int] = 3
    #: Prompt shape: at most this many blocks of a shared prefix, and this many tokens of the request's own.
    max_prefix_blocks: ClassVar[int] = 3
    max_suffix_tokens: ClassVar[int] = 5
    max_restarts: ClassVar[int] = 1
    #: Rules between two runs of the same administrative rule (resets, drain, clock): a deterministic
    #: throttle, so that they punctuate runs instead of dominating them.
    admin_interval: ClassVar[int] = 8

    #: Rules run by every instance of the class (for steps per second).
    steps_total: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        self.log = TransitionLog().install()
        self.log.on_transition.append(self._on_transition)
        self._h: SystemHarness | None = None
        self._config: SystemConfig | None = None
        self._requests: list[EngineRequest] = []
        self._restarts = 0
        self._clock = 0  # rules run so far in this example
        self._last_admin: dict[str, int] = {}
        self._violations: list[str] = []
        self._jobs: dict[tuple[str, int], Job] = {}
        #: When each job was first seen (no earlier than the clock time it was created at, so a deadline
        #: reckoned from it is never earlier than the real one).
        self._born: dict[tuple[str, int], float] = {}
        self._terminated: set[tuple[str, int]] = set()
        self._awaiting_completion: list[Job] = []
        self._chunk_cache: dict[str, tuple[int, dict[OffloadKey, tuple[bytes, ...]]]] = {}

    # ------------------------------------------------------------------ to override

    def make_harness(self, config: SystemConfig) -> SystemHarness:
        """Build the system under test for ``config``."""
        raise NotImplementedError

    # ------------------------------------------------------------------ plumbing

    @property
    def h(self) -> SystemHarness:
        assert self._h is not None, "the configure rule has not run"
        return self._h

    @property
    def configured(self) -> bool:
        """The configure rule has run: there is a system under test."""
        return self._h is not None

    def observed(self) -> tuple[list[str], list[OffloadKey]]:
        """What the run has touched so far: every request id it created and every chunk key they produced
        (what :func:`kvfsm.testing.abstraction.project_system` projects the system over)."""
        return [r.req_id for r in self._requests], list(self._chunks())

    def _start(self) -> None:
        assert self._config is not None
        self._h = self.make_harness(self._config)
        self._h.hook.callback = self._on_complete
        self._jobs.clear()
        self._born.clear()
        self._terminated.clear()
        self._awaiting_completion.clear()
        self._chunk_cache.clear()
        self._requests = []

    @staticmethod
    def _namespace(job: Job) -> str:
        return "tier" if job.kind in (JobKind.CASCADE, JobKind.PROMOTE) else "sched"

    def _register(self, job: Job) -> None:
        key = (self._namespace(job), job.job_id)
        known = self._jobs.get(key)
        if known is None:
            self._jobs[key] = job
            self._born[key] = self.h.clock()
        elif known is not job:
            self._violations.append(f"job id {key} reused by a new job ({job!r} after {known!r})")

    def _on_transition(self, machine: str, model: object, event: str, source: str, dest: str) -> None:
        if machine != "job" or not isinstance(model, Job):
            return
        self._register(model)
        if dest in _JOB_TERMINAL:
            key = (self._namespace(model), model.job_id)
            if key in self._terminated:
                self._violations.append(f"job {key} reached a terminal state twice ({source} -> {dest})")
            self._terminated.add(key)
            if model.kind in (JobKind.STORE, JobKind.LOAD) and dest != "stale":
                self._awaiting_completion.append(model)

    def _on_complete(self, kind: JobKind, keys: tuple[OffloadKey, ...]) -> None:
        # The job that just ended (or whose quarantine was just released); a job still quarantined is not
        # completed yet, even if a later job of the same request has the same keys.
        quarantined = self.h.scheduler.is_quarantined
        for i in range(len(self._awaiting_completion) - 1, -1, -1):
            job = self._awaiting_completion[i]
            if job.kind is kind and job.keys == keys and not quarantined(job.job_id):
                del self._awaiting_completion[i]
                return
        self._violations.append(
            f"complete_{kind.value}({len(keys)} keys) called, but no {kind.value} job just ended with those keys "
            "(completed twice, or before its last report)"
        )

    def _live_requests(self) -> list[EngineRequest]:
        return [r for r in self._requests if not r.is_finished]

    def _held_jobs(self) -> list[int]:
        return sorted({job_id for job_id, _ in self.h.held_copies()})

    def _tier_jobs(self) -> list[int]:
        return self.h.tier_job_ids()

    def _chunks(self) -> dict[OffloadKey, tuple[bytes, ...]]:
        """Every chunk key any request has produced -> the block hashes it covers."""
        bpc = self.h.config.blocks_per_chunk
        out: dict[OffloadKey, tuple[bytes, ...]] = {}
        for req in self._requests:
            cached = self._chunk_cache.get(req.req_id)
            hashes = req.block_hashes
            if cached is None or cached[0] != len(hashes):
                chunks = {
                    make_offload_key(hashes[c * bpc + bpc - 1]): tuple(hashes[c * bpc : (c + 1) * bpc])
                    for c in range(len(hashes) // bpc)
                }
                cached = (len(hashes), chunks)
                self._chunk_cache[req.req_id] = cached
            out.update(cached[1])
        return out

    def _queued(self) -> bool:
        """Some request waits in the engine's input queue (a step would admit it)."""
        return any(not self.h.is_admitted(r.req_id) for r in self._requests)

    def _after_step(self, outcome: tuple[EngineState, bool] | None) -> None:
        s = self.h.scheduler
        now = self.h.clock()
        deadlines = self.h.config.deadlines
        for job in s.jobs().values():
            self._register(job)
            # A step times out every job past its deadline (build_connector_meta), whatever order the
            # deadlines were set in.
            limit = deadlines.for_kind(job.kind)
            born = self._born[(self._namespace(job), job.job_id)]
            if limit is not None and not job.is_terminal and born + limit <= now:
                self._violations.append(
                    f"{job.kind.value} job {job.job_id} outlived its deadline: seen at t={born}, deadline "
                    f"{limit}s, still {job.state.value} after a step at t={now}"
                )
        if outcome is not None and outcome[0] is EngineState.IDLE and outcome[1]:
            self._violations.append("a step ended idle with has_pending_push_work() True")

    def _engine_step(self) -> tuple[EngineState, bool] | None:
        if not self.h.config.gpu_prefix_cache:
            self.h.reset_prefix_cache()
        return self.h.step()

    def _admin_ready(self, name: str, interval: int | None = None) -> bool:
        last = self._last_admin.get(name)
        return last is None or self._clock - last >= (self.admin_interval if interval is None else interval)

    def _admin_ran(self, name: str) -> None:
        self._last_admin[name] = self._clock

    # ------------------------------------------------------------------ rules

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        """Draw the configuration (world size, chunk size, pools, tier, token budget, deadlines)."""
        tier = data.draw(st.sampled_from(self.tier_choices), label="tier_capacity")
        second = None if tier is None else data.draw(st.sampled_from(self.second_tier_choices), label="second_tier")
        lo, hi = self.cpu_slots
        if tier is not None:
            lo, hi = max(lo, self.min_cpu_slots_with_tier), max(hi, self.min_cpu_slots_with_tier)
        self._config = SystemConfig(
            world_size=data.draw(st.sampled_from(self.world_sizes), label="world_size"),
            blocks_per_chunk=data.draw(st.sampled_from(self.blocks_per_chunk_choices), label="blocks_per_chunk"),
            num_gpu_blocks=data.draw(st.integers(*self.gpu_blocks), label="num_gpu_blocks"),
            num_cpu_slots=data.draw(st.integers(lo, hi), label="num_cpu_slots"),
            tier_capacity=tier,
            second_tier_capacity=second,
            max_num_batched_tokens=data.draw(st.sampled_from((6, 64)), label="max_num_batched_tokens"),
            job_deadline_s=data.draw(st.sampled_from(self.deadline_choices), label="job_deadline_s"),
            gpu_prefix_cache=data.draw(st.booleans(), label="gpu_prefix_cache"),
        )
        self._start()

    @covers("engine.admit")
    @precondition(lambda self: len(self._live_requests()) < self.max_live_requests)
    @rule(
        # Listed most useful first (Hypothesis favours early elements): long shared prefixes make loads.
        prefix=st.sampled_from((0, 1, 2)),
        prefix_blocks=st.sampled_from((2, 3, 1, 0)),
        suffix=st.sampled_from((1, 3, 0, 5)),
        max_tokens=st.sampled_from((1, 2, 3)),
        late=st.booleans(),
    )
    def arrive(self, prefix: int, prefix_blocks: int, suffix: int, max_tokens: int, late: bool) -> None:
        """A request arrives (at the next step, or during it): a shared prefix and a suffix of its own."""
        tpb = self.h.config.tokens_per_block
        prefix_blocks = min(prefix_blocks, self.max_prefix_blocks)
        suffix = min(suffix, self.max_suffix_tokens)
        n = len(self._requests)
        base = [1000 * (prefix + 1) + i for i in range(3 * tpb)]
        prompt = base[: prefix_blocks * tpb] + [7 * n + 100_000 + i for i in range(suffix)] or [prefix]
        req = self.h.make_request(f"r{n}", prompt, max_tokens)
        self.h.add_request(req, late)
        self._requests.append(req)

    @covers(
        "engine.all_finished",
        "engine.settle",
        "request.defer",
        "request.start_load",
        "request.schedule",
        "request.load_done",
        "request.preempt",
        "request.finish",
        "request.signal",
        "request.delete",
        "job.launch",
        "slot.begin_write",
        "slot.commit_write",
        "slot.begin_read",
        "slot.end_read",
        "slot.evict",
    )
    @precondition(lambda self: self.h.state is not EngineState.IDLE or self._queued())
    @rule(n=st.integers(1, 3))
    def step(self, n: int) -> None:
        """``n`` engine steps: schedule (preempting when GPU blocks run out), plan, copy, poll, commit, settle."""
        for i in range(n):
            if i:
                self._check_now()
            outcome = self._engine_step()
            self._after_step(outcome)
            if outcome is None:
                break

    @precondition(lambda self: bool(self.h.copies_running()) and self.h.state is not EngineState.IDLE)
    @rule(n=st.integers(4, 10))
    def step_while_copying(self, n: int) -> None:
        """Many engine steps while real copies are running on the data plane's threads (held inside the copy
        path): every step plans, polls and settles around them, and the ground truth is checked after each."""
        self.step(n)

    @covers("job.ack", "slot.commit_write")
    @precondition(lambda self: bool(self.h.held_copies()))
    @rule(data=st.data())
    def complete_copy(self, data: st.DataObject) -> None:
        """One worker's copy of one job runs to completion (reported by the next step's poll)."""
        job_id, rank = data.draw(st.sampled_from(self.h.held_copies()), label="job, rank")
        self.h.complete_copy(job_id, rank, ok=True)

    @covers("job.ack")
    @precondition(lambda self: bool(self.h.held_copies()))
    @rule(data=st.data())
    def complete_job(self, data: st.DataObject) -> None:
        """Every worker's copy of one job runs to completion."""
        job_id = data.draw(st.sampled_from(self._held_jobs()), label="job")
        for held_id, rank in self.h.held_copies():
            if held_id == job_id:
                self.h.complete_copy(job_id, rank, ok=True)

    @covers("job.fail", "slot.abort_write")
    @precondition(lambda self: bool(self.h.held_copies()))
    @rule(data=st.data())
    def fail_copy(self, data: st.DataObject) -> None:
        """One worker's copy of one job fails without copying anything."""
        job_id, rank = data.draw(st.sampled_from(self.h.held_copies()), label="job, rank")
        self.h.complete_copy(job_id, rank, ok=False)

    @covers("job.ack")
    @precondition(lambda self: bool(self._tier_jobs()))
    @rule(data=st.data())
    def complete_tier_job(self, data: st.DataObject) -> None:
        """A cascade or promotion finishes in the secondary tier (applied at the next poll)."""
        job_id = data.draw(st.sampled_from(self._tier_jobs()), label="tier job")
        self.h.tier_of(job_id).complete(job_id)

    @covers("job.fail")
    @precondition(lambda self: bool(self._tier_jobs()))
    @rule(data=st.data())
    def fail_tier_job(self, data: st.DataObject) -> None:
        """A cascade or promotion fails in the secondary tier."""
        job_id = data.draw(st.sampled_from(self._tier_jobs()), label="tier job")
        self.h.tier_of(job_id).complete(job_id, success=False)

    @covers("request.finish")
    @precondition(lambda self: bool(self.h.live_request_ids()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """A waiting, loading or running request is aborted."""
        self.h.abort(data.draw(st.sampled_from(self.h.live_request_ids()), label="request"))

    @covers("job.discard", "request.reset", "slot.reset")
    @precondition(lambda self: self._admin_ready("reset_offload_cache"))
    @rule()
    def reset_offload_cache(self) -> None:
        """reset_cache: in-flight jobs go stale, the CPU tier is emptied, requests are finalised."""
        self._admin_ran("reset_offload_cache")
        self.h.reset_offload_cache()
        # A job still awaiting its manager completion (timed out, quarantined) never gets one now: the
        # reset clears the manager wholesale.
        self._awaiting_completion.clear()

    @precondition(lambda self: self._admin_ready("reset_prefix_cache", 3))
    @rule()
    def reset_prefix_cache(self) -> None:
        """The GPU prefix cache forgets every block: the next identical prefix loads from the CPU."""
        self._admin_ran("reset_prefix_cache")
        self.h.reset_prefix_cache()

    @covers("job.time_out")
    @precondition(lambda self: self.h.config.job_deadline_s is not None and self._anything_in_flight())
    @rule(seconds=st.sampled_from([1.0, 4.0]))
    def advance_clock(self, seconds: float) -> None:
        """Time passes: jobs past their deadline time out at the next step (and tier transfers at its poll)."""
        self.h.clock.advance(seconds)

    @covers("job.time_out")
    @precondition(lambda self: self._next_deadline(None) is not None)
    @rule(transfers=st.booleans())
    def advance_to_next_deadline(self, transfers: bool) -> None:
        """Time passes exactly to the earliest deadline of a live job or tier transfer (the boundary: one whose
        deadline is now times out at the next step), whatever order the deadlines were set in."""
        due = self._next_deadline(transfers)
        if due is None:
            due = self._next_deadline(not transfers)
        assert due is not None
        self.h.clock.advance(due - self.h.clock())

    def _next_deadline(self, transfers: bool | None) -> float | None:
        """The earliest deadline, later than now, of a job the scheduler awaits (``transfers`` False), of a
        tier transfer in flight (True), or of either (None); None if there is none."""
        h = self.h
        deadlines = h.config.deadlines
        if not deadlines.any_job_deadline:
            return None
        now = h.clock()
        live: list[Job] = [] if transfers else list(h.scheduler.jobs().values())
        if transfers is not False:
            live += [
                job
                for j in h.tier_job_ids()
                if h.manager.transfer_in_flight(j) and (job := self._jobs.get(("tier", j))) is not None
            ]
        due = [
            self._born[key] + limit
            for job in live
            if (limit := deadlines.for_kind(job.kind)) is not None
            and (key := (self._namespace(job), job.job_id)) in self._born
            and self._born[key] + limit > now
        ]
        return min(due) if due else None

    def _anything_in_flight(self) -> bool:
        return bool(self.h.scheduler.num_jobs or self._tier_jobs())

    @covers("engine.settle", "engine.all_finished")
    @precondition(lambda self: self.h.state is not EngineState.IDLE and self._admin_ready("drain"))
    @rule()
    def drain(self) -> None:
        """Every transfer finishes and the engine steps until it is idle; then nothing may be pending."""
        self._admin_ran("drain")
        self._drain_to_idle()

    def _drain_to_idle(self) -> None:
        h = self.h
        for _ in range(_MAX_DRAIN_STEPS):
            if h.state is EngineState.IDLE and not self._queued():
                break
            for job_id, rank in h.held_copies():
                h.complete_copy(job_id, rank, ok=True)
            for tier in h.tiers:
                tier.complete_all()
            self._after_step(self._engine_step())
            self._check_now()
        else:
            raise AssertionError(f"the engine is still {h.state.value} after {_MAX_DRAIN_STEPS} drained steps")
        assert not h.has_pending_push_work(), "idle after a drain with has_pending_push_work() True"
        live = sorted(k for k, j in self._jobs.items() if not j.is_terminal)
        assert not live, f"jobs {live} are not terminal after the engine drained to idle"

    @covers("engine.shutdown", "engine.stop")
    @precondition(lambda self: self._restarts < self.max_restarts and self._clock >= 2 * self.admin_interval)
    @rule(bounded=st.booleans())
    def shutdown_and_restart(self, bounded: bool) -> None:
        """Shut down (abort everything, flush, stop), check the stopped system, start a fresh one.

        ``bounded``: a shutdown whose deadline has already passed (every copy has finished, none has been
        reported): it gives up on every job at once, and the late reports then release the quarantine.
        """
        h = self.h
        if bounded:
            for job_id, rank in h.held_copies():
                h.complete_copy(job_id, rank, ok=True)
        h.shutdown(0.0 if bounded else None)
        assert h.state is EngineState.STOPPED
        assert not h.has_pending_push_work(), "stopped with has_pending_push_work() True"
        self._check_now()
        live = sorted(k for k, j in self._jobs.items() if not j.is_terminal)
        assert not live, f"jobs {live} are not terminal after shutdown"
        assert not h.copies_in_flight(), f"copies {h.copies_in_flight()} still in flight after shutdown"
        self._restarts += 1
        h.close()
        self._start()

    # ------------------------------------------------------------------ checks

    def system_violations(self) -> list[str]:
        """Everything wrong with the system right now (empty when healthy)."""
        h = self.h
        s = h.scheduler
        # First what the data plane found at report time (the most specific: a report that lied about bytes).
        out = h.data_plane_problems()
        out.extend(str(v) for v in check_all(SystemView(s, h.state)))
        out.extend(self._violations)

        # has_pending_push_work() covers every transfer in flight or uncommitted.
        threshold = s.stale_threshold
        copies = h.copies_in_flight()

        def live(job_id: int) -> bool:
            """Not stale, not given up on (timed out and quarantined)."""
            if job_id < threshold:
                return False
            job = self._jobs.get(("sched", job_id))
            return job is None or not job.is_terminal or s.job(job_id) is not None

        pending = [f"copy of job {j} on ranks {sorted(r)}" for j, r in sorted(copies.items()) if live(j)]
        for rank in range(h.config.world_size):
            pending.extend(f"un-launched store {j} on rank {rank}" for j in h.unlaunched_store_ids(rank) if live(j))
        pending.extend(f"{j!r} not terminal" for j in self._jobs.values() if not j.is_terminal)
        manager = h.manager
        # A timed-out transfer is given up on (quarantined), by the spec no longer pending.
        pending.extend(f"tier job {j} pending" for j in h.tier_job_ids() if manager.transfer_in_flight(j))
        if manager.num_transfer_jobs:
            pending.append(f"{manager.num_transfer_jobs} tier transfers not applied")
        if pending and h.state is not EngineState.STOPPED:
            if not s.has_pending_push_work():
                out.append(f"has_pending_push_work() is False while: {', '.join(pending[:4])}")
            if not h.has_pending_push_work():
                out.append(f"the engine's has_pending_push_work() is False while: {', '.join(pending[:4])}")
        if h.state is EngineState.IDLE and pending:
            # Copies of stale or timed-out jobs may still be held: the spec gives up on them, and the next
            # step flushes them before any store can reuse their memory (checked on the data).
            out.append(f"the engine is idle while: {', '.join(pending[:4])}")
        never = [j for j in self._awaiting_completion if not s.is_quarantined(j.job_id)]
        if never:
            out.append(f"jobs {never} ended but the manager never completed them")

        # Loads return exactly the stored bytes.
        mismatches = h.load_mismatches()
        if mismatches:
            out.append(f"{mismatches} loaded blocks differ from what was stored")
        out.extend(self._slot_violations(copies))
        return out

    def _slot_violations(self, copies: dict[int, set[int]]) -> list[str]:
        h = self.h
        primary = h.primary
        chunks = self._chunks()
        out: list[str] = []
        # In-flight jobs still own their slots in the state the spec says.
        owners: list[tuple[str, Sequence[OffloadKey], Sequence[int], SlotState]] = []
        for job in h.scheduler.jobs().values():
            want = SlotState.WRITING if job.kind is JobKind.STORE else SlotState.READING
            owners.append((f"{job.kind.value} job {job.job_id}", job.keys, job.slots.slot_ids, want))
        for tier in h.tiers:
            for tj_id in tier.pending_job_ids():
                tj = tier.pending_job(tj_id)
                want = SlotState.WRITING if tj.is_promotion else SlotState.READING
                what = "promotion" if tj.is_promotion else "cascade"
                if not h.manager.transfer_in_flight(tj_id):
                    continue  # timed out: its slot is quarantined, not owned
                owners.append((f"{what} {tj_id}", tj.keys, tj.slot_ids, want))
        for what, keys, slot_ids, want in owners:
            for key, slot_id in zip(keys, slot_ids, strict=True):
                state, sid = primary.slot_state(key), primary.slot_id(key)
                if state is not want or sid != slot_id:
                    out.append(
                        f"{what}: key {key.hex()[:12]} is {state.value} in slot {sid}; "
                        f"expected {want.value} in slot {slot_id}"
                    )
        # A store whose copy has not run on some rank still finds its GPU source blocks intact there.
        bpc = h.config.blocks_per_chunk
        for job in h.scheduler.jobs().values():
            if job.kind is not JobKind.STORE:
                continue
            ranks = set(copies.get(job.job_id, set())) & {r for j, r in h.held_copies() if j == job.job_id}
            ranks |= {r for r in range(h.config.world_size) if job.job_id in h.unlaunched_store_ids(r)}
            if not ranks:
                continue
            sources = [chunks[job.keys[i // bpc]][i % bpc] for i in range(len(job.gpu.block_ids))]
            out.extend(h.source_violations(job, ranks, sources))
        # Readable slots hold exactly the forward's bytes on every rank; no two keys share a slot.
        by_slot: dict[int, OffloadKey] = {}
        for key, hashes in chunks.items():
            state = primary.slot_state(key)
            if state is SlotState.ABSENT:
                continue
            sid = primary.slot_id(key)
            assert sid is not None
            if sid in by_slot and by_slot[sid] != key:
                out.append(f"slot {sid} is held by two keys")
            by_slot[sid] = key
            if state in (SlotState.READY, SlotState.READING):
                out.extend(h.slot_violations(key, sid, hashes))
        return out

    def data_plane_work(self) -> list[str]:
        """The transfers that remain, judged from the data plane alone: each backend's copies not finished or
        not reported (its futures), and the tier's held transfers; never from the scheduler's or the tiering
        manager's jobs. A timed-out (quarantined) copy the data plane still holds is work: the engine keeps
        stepping until it reports (spec/README.md, "Quarantine"). The spec gives up only on stale jobs (below the
        stale threshold, discarded by reset_cache): those are counted under "given up" and not returned."""
        h = self.h
        s = h.scheduler
        name = type(self).__name__
        threshold = s.stale_threshold
        running = h.copies_running()
        work: list[str] = []
        given_up = 0
        kinds: set[str] = set()
        for job_id, ranks in sorted(h.copies_in_flight().items()):
            if job_id < threshold:
                given_up += 1
                continue
            run = ranks & running.get(job_id, set())
            kinds.add("copy running" if run else "copy unpolled")
            if s.is_quarantined(job_id):
                kinds.add("quarantined copy")
            work.append(f"copy of job {job_id} (running on ranks {sorted(run)}, unpolled on {sorted(ranks - run)})")
        for tier in h.tiers:
            for job_id in tier.pending_job_ids():
                # In flight or timed out and quarantined: either way the tier still holds the slot's bytes.
                kinds.add("tier job")
                work.append(f"tier job {job_id} held by the tier")
        for kind in kinds:
            GROUND_TRUTH_CHECKS[(name, kind)] += 1
        if work:
            GROUND_TRUTH_CHECKS[(name, "any")] += 1
        if given_up:
            GROUND_TRUTH_CHECKS[(name, "given up")] += 1
        return work

    def ground_truth_violations(self) -> list[str]:
        """What the data plane says is wrong with the engine's answers right now."""
        h = self.h
        out: list[str] = []
        if h.state is EngineState.STOPPED:
            return out
        work = self.data_plane_work()
        if work:
            if not h.scheduler.has_pending_push_work():
                out.append(f"data plane: has_pending_push_work() is False while {', '.join(work[:4])}")
            if not h.has_pending_push_work():
                out.append(f"data plane: the engine's has_pending_push_work() is False while {', '.join(work[:4])}")
            if h.state is EngineState.IDLE:
                out.append(f"data plane: the engine is idle while {', '.join(work[:4])}")
        return out

    def _check_now(self) -> None:
        violations = self.system_violations() + self.ground_truth_violations()
        if violations:
            raise AssertionError("; ".join(violations[:6]))

    @invariant()
    def pending_covers_data_plane(self) -> None:
        """While the data plane holds a live transfer, the engine says work is pending and is not idle; every
        report was honest about the bytes."""
        if self._h is None:
            return
        violations = self.ground_truth_violations()
        if violations:
            raise AssertionError("; ".join(violations[:6]))

    @invariant()
    def check_system(self) -> None:
        type(self).steps_total += 1
        self._clock += 1
        violations = self.system_violations()
        if violations:
            raise AssertionError("; ".join(violations[:6]))

    @override
    def teardown(self) -> None:
        h = self._h
        if h is None:
            self.log.uninstall()
            return
        failed = sys.exc_info()[1] is not None  # teardown runs in a finally: is the example failing?
        try:
            if h.state is not EngineState.STOPPED and not failed:
                if h.tiers:
                    self._drain_to_idle()
                h.shutdown(None)
        except Exception:
            if not failed:
                raise
        finally:
            self.log.uninstall()
            h.close()
