"""The control plane alone under :class:`SystemStateMachine`: no torch, no threads, cheaper per step.

:class:`ControlPlaneStateMachine` runs the rules and checks of :mod:`kvfsm.testing.system` on the real
:class:`~kvfsm.control.scheduler.OffloadingScheduler`, CPU manager, tiering manager and
:class:`~kvfsm.tiers.memory.InMemoryTier`, the engine machine and the GPU
:class:`~kvfsm.engine.block_pool.BlockPool`, driven by :class:`TagEngine`: the reference engine's own loop
(:class:`~kvfsm.engine.loop.EngineLoop`) over *tags* instead of tensors. Every GPU block and CPU sub-slot
of every rank holds a tag, the hash of the content the forward wrote there; a copy moves tags. So the data
checks still mean something (a store that copies an overwritten block, a load that reads a reused slot, a
slot readable before every rank copied) while a step costs microseconds.

Each rank is the real :class:`~kvfsm.control.worker.OffloadingWorker` over a
:class:`~kvfsm.control.worker.HeldCopyBackend` that moves tags: a copy runs only when the machine
completes it or a flush waits on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Protocol

from typing_extensions import override

from kvfsm.control.config import OffloadConfig
from kvfsm.control.deadlines import ManualClock
from kvfsm.control.scheduler import OffloadingScheduler
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import HeldCopyBackend, OffloadingWorker
from kvfsm.engine.loop import EngineLoop
from kvfsm.engine.requests import EngineRequest
from kvfsm.machines.names import EngineState
from kvfsm.testing.coverage import spec_covered
from kvfsm.testing.system import SYSTEM_EXEMPT, SystemConfig, SystemHarness, SystemStateMachine, make_manager

__all__ = ["ControlHarness", "ControlPlaneStateMachine", "HeldCopies", "LoopHarness", "TagEngine", "TagMemory"]

#: What a block or sub-slot holds: the hash of the content written there (None: never written).
Tag = bytes | None


def _rows(gpu: GPUBlockSpec, slots: SlotSpec, blocks_per_chunk: int) -> list[tuple[int, int]]:
    """(slot, sub-block) of each of a job's GPU blocks (kvfsm.data.backend.chunk_rows, unflattened)."""
    off = gpu.first_block_offset
    ids = slots.slot_ids
    return [(ids[p // blocks_per_chunk], p % blocks_per_chunk) for p in range(off, off + len(gpu.block_ids))]


@dataclass
class TagMemory:
    """Every rank's GPU blocks and CPU sub-slots, as tags: the engine loop's KVMemory, and what the
    ranks' held copies move."""

    world_size: int
    blocks_per_chunk: int
    gpu: list[dict[int, Tag]] = field(default_factory=list)
    cpu: list[dict[tuple[int, int], Tag]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gpu = [{} for _ in range(self.world_size)]
        self.cpu = [{} for _ in range(self.world_size)]

    def copy(self, rank: int, is_store: bool, gpu_blocks: GPUBlockSpec, slots: SlotSpec) -> None:
        """One rank's copy of a job: a store moves GPU tags to the slots, a load moves them back."""
        gpu, cpu = self.gpu[rank], self.cpu[rank]
        for block, row in zip(gpu_blocks.block_ids, _rows(gpu_blocks, slots, self.blocks_per_chunk), strict=True):
            if is_store:
                cpu[row] = gpu.get(block)
            else:
                gpu[block] = cpu.get(row)

    # -- KVMemory --

    def write(self, block_id: int, key: bytes) -> None:
        for gpu in self.gpu:
            gpu[block_id] = key

    def verify(self, block_id: int, block_hash: bytes) -> tuple[int, int]:
        """(ranks whose block holds ``block_hash``, ranks whose block does not)."""
        bad = sum(1 for gpu in self.gpu if gpu.get(block_id) != block_hash)
        return self.world_size - bad, bad


class _SlotBytes:
    """A tier's view of a CPU slot: the tags of all ranks, encoded (so a promotion restores them)."""

    def __init__(self, memory: TagMemory) -> None:
        self.memory = memory

    def read_slot(self, slot_id: int) -> bytes:
        parts = [
            cpu.get((slot_id, sub)) or b"\x00" for cpu in self.memory.cpu for sub in range(self.memory.blocks_per_chunk)
        ]
        return b"|".join(p.hex().encode() for p in parts)

    def write_slot(self, slot_id: int, data: bytes) -> None:
        parts = [bytes.fromhex(p.decode()) for p in data.split(b"|")]
        bpc = self.memory.blocks_per_chunk
        for rank, cpu in enumerate(self.memory.cpu):
            for sub in range(bpc):
                tag = parts[rank * bpc + sub]
                cpu[(slot_id, sub)] = None if tag == b"\x00" else tag


class TagEngine(EngineLoop):
    """The reference engine's loop over tag memory, W real workers over held tag-moving copies, and the
    manager of ``config`` (whose tier, if any, reads and writes slot tags)."""

    def __init__(self, config: SystemConfig, clock: ManualClock) -> None:
        self.config = config
        self.tags = TagMemory(config.world_size, config.blocks_per_chunk)
        manager, self.tiers, self.hook = make_manager(config, clock, _SlotBytes(self.tags))
        offload = OffloadConfig(config.tokens_per_block, config.blocks_per_chunk, config.world_size)
        scheduler = OffloadingScheduler(offload, manager, deadlines=config.deadlines, clock=clock)
        self.backends = [HeldCopyBackend(partial(self.tags.copy, rank)) for rank in range(config.world_size)]
        super().__init__(
            config,
            memory=self.tags,
            scheduler=scheduler,
            workers=[OffloadingWorker(rank, config.world_size, b) for rank, b in enumerate(self.backends)],
            threaded=False,
        )


class HeldCopies(Protocol):
    """A copy backend whose submissions are held until the test completes them, as a harness sees it."""

    @property
    def held_ids(self) -> tuple[int, ...]: ...

    def in_flight_ids(self) -> set[int]: ...

    def complete(self, job_id: int, ok: bool = True) -> None: ...


class LoopHarness(SystemHarness):
    """What a harness over an :class:`~kvfsm.engine.loop.EngineLoop` whose ranks copy through held
    backends (``backends[rank]``) does the same whatever its memory: inputs, steps, copies and the
    engine's own answers (the data checks are the subclass's)."""

    engine: EngineLoop
    backends: Sequence[HeldCopies]

    @override
    def held_copies(self) -> list[tuple[int, int]]:
        return sorted((job_id, rank) for rank, b in enumerate(self.backends) for job_id in b.held_ids)

    @override
    def complete_copy(self, job_id: int, rank: int, ok: bool) -> None:
        self.backends[rank].complete(job_id, ok)

    @override
    def copies_in_flight(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for rank, b in enumerate(self.backends):
            for job_id in b.in_flight_ids():
                out.setdefault(job_id, set()).add(rank)
        return out

    @override
    @property
    def scheduler(self) -> OffloadingScheduler:
        return self.engine.scheduler

    @override
    @property
    def state(self) -> EngineState:
        return self.engine.current_state()

    @override
    def make_request(self, req_id: str, prompt: list[int], max_tokens: int) -> EngineRequest:
        return self.engine.make_request(req_id, prompt, max_tokens)

    @override
    def add_request(self, request: EngineRequest, late: bool) -> None:
        if late:
            self.engine.add_request_during_next_step(request)
        else:
            self.engine.add_request(request)

    @override
    def step(self) -> tuple[EngineState, bool] | None:
        rec = self.engine.step()
        return None if rec is None else (rec.state, rec.pending_push_work)

    @override
    def has_pending_push_work(self) -> bool:
        return self.engine.has_pending_push_work()

    @override
    def live_request_ids(self) -> list[str]:
        return sorted(r.req_id for r in self.engine.requests.values() if not r.is_finished)

    @override
    def is_admitted(self, req_id: str) -> bool:
        return req_id in self.engine.requests

    @override
    def abort(self, req_id: str) -> None:
        self.engine.abort(req_id)

    @override
    def reset_offload_cache(self) -> None:
        self.engine.reset_offload_cache()

    @override
    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    @override
    def unlaunched_store_ids(self, rank: int) -> tuple[int, ...]:
        return self.engine.workers[rank].unlaunched_store_ids

    @override
    def load_mismatches(self) -> int:
        return self.engine.integrity.mismatches

    @override
    def shutdown(self, timeout: float | None) -> None:
        if self.engine.state is not EngineState.STOPPED:
            self.engine.shutdown(timeout)


class ControlHarness(LoopHarness):
    """A :class:`TagEngine` as the state machine drives and inspects it."""

    engine: TagEngine

    def __init__(self, config: SystemConfig) -> None:
        self.config = config
        self.clock = ManualClock()
        self.engine = TagEngine(config, self.clock)
        self.backends = self.engine.backends
        self.tiers = self.engine.tiers
        self.hook = self.engine.hook

    @override
    def slot_mismatches(self, rank: int, slot_id: int, sub: int, block_hash: bytes) -> list[str]:
        return [] if self.engine.tags.cpu[rank].get((slot_id, sub)) == block_hash else [""]

    @override
    def gpu_mismatches(self, rank: int, block: int, block_hash: bytes) -> list[str]:
        return [] if self.engine.tags.gpu[rank].get(block) == block_hash else [""]

    @override
    def close(self) -> None:
        pass


@spec_covered("job", "request", "engine", "slot", exempt=SYSTEM_EXEMPT)
class ControlPlaneStateMachine(SystemStateMachine):
    """The control plane over tag memory against the spec (see :mod:`kvfsm.testing.system`)."""

    @override
    def make_harness(self, config: SystemConfig) -> SystemHarness:
        return ControlHarness(config)
