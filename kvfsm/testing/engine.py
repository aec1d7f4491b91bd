"""The whole system with real torch copies: the reference engine under :class:`SystemStateMachine`.

Needs the ``torch`` extra. :class:`EngineStateMachine` runs the rules and checks of
:mod:`kvfsm.testing.system` on a :class:`~kvfsm.engine.core.ReferenceEngine`: the scheduler half, the CPU
primary (optionally in front of an :class:`~kvfsm.tiers.memory.InMemoryTier` that copies real slot
bytes), and ``W`` workers whose :class:`~kvfsm.data.backend.ThreadPoolCopyBackend` copies run real torch
gathers and scatters. Each backend has a :class:`~kvfsm.data.gate.CopyGate` and is wrapped in a
:class:`~kvfsm.testing.backend.GatedCopyBackend`: a submitted copy is genuinely running on the backend's
thread, held inside the real copy path until a rule releases it (or a step blocks on it), so the engine
steps, looks up and admits while real copies are in flight. Which copies are in flight is read from the
backends' own futures (the data plane's ground truth), and every job a backend reports finished has its
destination bytes checked at the poll that reports it.

The data checks are byte for byte: a readable CPU slot must hold, on every rank, the head shard of the
value the stand-in forward writes for each of its blocks; a store that has not copied yet must find those
values in its GPU source blocks; and the engine verifies every block a load brings back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import torch
from typing_extensions import override

from kvfsm.control.deadlines import ManualClock
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.gate import CopyGate
from kvfsm.data.layout import head_shard
from kvfsm.data.pool import CPUSlotPool
from kvfsm.engine.core import EngineConfig, ReferenceEngine
from kvfsm.engine.loop import PollMode
from kvfsm.testing.backend import GatedCopyBackend
from kvfsm.testing.control import LoopHarness
from kvfsm.testing.coverage import spec_covered
from kvfsm.testing.system import SYSTEM_EXEMPT, SystemConfig, SystemHarness, SystemStateMachine, make_manager

__all__ = ["EngineHarness", "EngineStateMachine", "PoolsSlotIO"]

#: Copy threads per rank: more than the copies one rank can have held at once (each held copy occupies a
#: thread; a released one must always find a free thread, or waiting for it would never end).
GATED_COPY_THREADS = 32


class PoolsSlotIO:
    """A tier's view of a CPU slot over W workers' pools: the ranks' bytes, concatenated. Bound late: the
    harness's manager (and its tier) exists before the engine has built the pools."""

    def __init__(self, pools: Sequence[CPUSlotPool] = ()) -> None:
        self.pools: list[CPUSlotPool] = list(pools)

    def read_slot(self, slot_id: int) -> bytes:
        return b"".join(pool.read_slot(slot_id) for pool in self.pools)

    def write_slot(self, slot_id: int, data: bytes) -> None:
        offset = 0
        for pool in self.pools:
            n = pool.nbytes_per_slot
            pool.write_slot(slot_id, data[offset : offset + n])
            offset += n
        if offset != len(data):
            raise AssertionError(f"slot data has {len(data)} bytes; expected {offset}")


class EngineHarness(LoopHarness):
    """A ReferenceEngine whose W workers copy through manual backends over real thread-pool backends."""

    engine: ReferenceEngine

    def __init__(self, config: SystemConfig, device: str | None = "cpu") -> None:
        self.config = config
        self.clock = ManualClock()
        io = PoolsSlotIO()
        manager, self.tiers, self.hook = make_manager(config, self.clock, io)
        engine_config = EngineConfig(
            num_layers=2,
            num_heads=4,
            head_dim=2,
            tokens_per_block=config.tokens_per_block,
            blocks_per_chunk=config.blocks_per_chunk,
            num_gpu_blocks=config.num_gpu_blocks,
            num_cpu_slots=config.num_cpu_slots,
            world_size=config.world_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            copy_threads=1,
            device=device,
            # A step that only polls returns at once (no idle wait: completion is the rules' input).
            poll=PollMode.BUSY,
        )
        self.backends: list[GatedCopyBackend] = []
        self.pools: list[CPUSlotPool] = []

        def gated_backend(shard: list[torch.Tensor], pool: CPUSlotPool, bpc: int, threads: int) -> CopyBackend:
            inner = ThreadPoolCopyBackend(shard, pool, bpc, max_workers=GATED_COPY_THREADS, gate=CopyGate())
            backend = GatedCopyBackend(inner, max_held=GATED_COPY_THREADS - 1)
            self.pools.append(pool)
            self.backends.append(backend)
            return backend

        self.engine = ReferenceEngine(
            engine_config,
            manager=manager,
            deadlines=config.deadlines,
            clock=self.clock,
            backend_factory=gated_backend,
        )
        io.pools = self.pools
        scheduler = self.engine.scheduler
        for b in self.backends:
            # A stale job's slots are reused at once (the spec gives up on it): its late report finds them
            # holding a later job's bytes.
            b.report_exempt = lambda job_id: job_id < scheduler.stale_threshold
        world = config.world_size
        self._shards = [head_shard(engine_config.num_heads, world, rank) for rank in range(world)]
        self._expected: dict[tuple[bytes, int, int], torch.Tensor] = {}

    def expected_block(self, block_hash: bytes, layer: int, rank: int) -> torch.Tensor:
        """The value the forward writes for a block of content ``block_hash``, in ``rank``'s heads (CPU)."""
        key = (block_hash, layer, rank)
        value = self._expected.get(key)
        if value is None:
            full = self.engine.expected_block(block_hash, layer)
            value = full[:, self._shards[rank]].contiguous()
            self._expected[key] = value
        return value

    # -- SystemHarness --

    @override
    def slot_mismatches(self, rank: int, slot_id: int, sub: int, block_hash: bytes) -> list[str]:
        pool = self.pools[rank]
        return [
            f", layer {layer}"
            for layer in range(pool.num_layers)
            if not torch.equal(pool.layers[layer][slot_id, sub], self.expected_block(block_hash, layer, rank))
        ]

    @override
    def gpu_mismatches(self, rank: int, block: int, block_hash: bytes) -> list[str]:
        heads = self._shards[rank]
        return [
            f", layer {layer}"
            for layer, kv in enumerate(self.engine.kv_caches)
            if not torch.equal(kv[block][:, heads].cpu(), self.expected_block(block_hash, layer, rank))
        ]

    @override
    def copies_running(self) -> dict[int, set[int]]:
        out: dict[int, set[int]] = {}
        for rank, b in enumerate(self.backends):
            for job_id in b.running_ids():
                out.setdefault(job_id, set()).add(rank)
        return out

    @override
    def data_plane_problems(self) -> list[str]:
        tiers = super().data_plane_problems()
        return tiers + [f"rank {rank}: {p}" for rank, b in enumerate(self.backends) for p in b.problems]

    @override
    def close(self) -> None:
        for b in self.backends:
            b.close()


@spec_covered("job", "request", "engine", "slot", exempt=SYSTEM_EXEMPT)
class EngineStateMachine(SystemStateMachine):
    """The reference engine with real copies against the spec (see :mod:`kvfsm.testing.system`).

    ``device`` is ``"cpu"`` unless a subclass sets it (``None``: CUDA when available).
    """

    device: ClassVar[str | None] = "cpu"

    @override
    def make_harness(self, config: SystemConfig) -> SystemHarness:
        return EngineHarness(config, self.device)
