"""Shared test utilities.

Control plane (no torch): :class:`FakeRequest`, :class:`LoopbackWorkers`, :func:`tokens`, :func:`keys_of`,
:func:`defect_search` (the Hypothesis settings of a search for a planted defect).

Data plane and engine (torch, imported lazily so that control-plane tests never import torch):
:class:`GatedBackend` (a real :class:`~kvfsm.data.backend.ThreadPoolCopyBackend` whose submissions are held
until the test opens a gate), :func:`make_gated_engine` (a :class:`~kvfsm.engine.core.ReferenceEngine`
whose W workers use gated backends), :class:`StepInThread` (runs one engine step on another thread, for
steps that are expected to block) and :func:`run_released` (a fully deterministic engine loop).

Nothing here sleeps or measures time. The only timeouts are deadlock guards: a test that would otherwise
hang forever fails instead.
"""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hypothesis import HealthCheck, Phase, settings

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.job import Job
from kvfsm.control.metadata import ConnectorMetadata, WorkerOutput
from kvfsm.control.requests import TokenRequest
from kvfsm.control.types import GPUBlockSpec, OffloadKey, SlotSpec, make_offload_key

if TYPE_CHECKING:
    from kvfsm.data.backend import ThreadPoolCopyBackend
    from kvfsm.engine.core import EngineConfig, ReferenceEngine, StepRecord

__all__ = [
    "DEADLOCK_GUARD_S",
    "FakeRequest",
    "GatedBackend",
    "GatedEngine",
    "LoopbackWorkers",
    "StepInThread",
    "check_cpu_copies",
    "cpu_manager",
    "engine_config",
    "gated_engine",
    "keys_of",
    "make_gated_engine",
    "run_released",
    "tokens",
]

#: Upper bound on any wait for another thread. Never reached by a passing test; it turns a deadlock
#: (a bug) into a failure instead of a hung test run.
DEADLOCK_GUARD_S = 60.0


# ---------------------------------------------------------------------------------------------- control


def defect_search(max_examples: int, steps: int = 30, **extra: Any) -> settings:
    """Settings of a search for a planted defect: derandomized, generation only, the first failure reported,
    no health checks (a planted machine may be slow or filter much), no database to replay from."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        database=None,
        derandomize=True,
        deadline=None,
        phases=[Phase.generate],
        report_multiple_bugs=False,
        suppress_health_check=list(HealthCheck),
        **extra,
    )


def tokens(seed: str, n: int, vocab: int = 32000) -> list[int]:
    """``n`` deterministic token ids; different seeds give different (non-colliding) sequences."""
    out: list[int] = []
    for i in range(n):
        digest = hashlib.blake2b(f"{seed}:{i}".encode(), digest_size=4).digest()
        out.append(int.from_bytes(digest, "little") % vocab)
    return out


class FakeRequest(TokenRequest):
    """A request as the scheduler half reads it (the OffloadRequest protocol), mutable by tests (whose
    token ids only ever grow)."""

    __slots__ = ()


def keys_of(block_hashes: Sequence[bytes], blocks_per_chunk: int) -> list[OffloadKey]:
    """The offload key of every full chunk (the scheduler's rule: the hash of the chunk's last block)."""
    bpc = blocks_per_chunk
    return [make_offload_key(block_hashes[i * bpc + bpc - 1]) for i in range(len(block_hashes) // bpc)]


@dataclass
class LoopbackWorkers:
    """W worker ranks in one object: each launches (``job.launch(rank)``) every job it is handed, copies
    nothing, and reports an outcome only when the test asks for it."""

    world_size: int
    #: Every job ever delivered, by id.
    jobs: dict[int, Job] = field(default_factory=dict)
    #: Ranks that already reported, per job id.
    reported: dict[int, set[int]] = field(default_factory=dict)
    #: Every id that was ever in a metadata's ``jobs_to_flush``.
    flushed: set[int] = field(default_factory=set)
    metas: list[ConnectorMetadata] = field(default_factory=list)

    def deliver(self, meta: ConnectorMetadata) -> None:
        """What the real workers do with a step's metadata, minus the copies."""
        self.metas.append(meta)
        self.flushed |= meta.jobs_to_flush
        for job in (*meta.load_jobs.values(), *meta.store_jobs.values()):
            self.jobs[job.job_id] = job
            self.reported.setdefault(job.job_id, set())
            for rank in range(self.world_size):
                if not job.is_terminal and not (job.launched_mask >> rank) & 1:
                    job.launch(rank)

    def report(self, job_id: int, ranks: Iterable[int] | None = None, *, ok: bool = True) -> WorkerOutput:
        """The summed output of ``ranks`` (default: every rank that has not reported) for one job."""
        done = self.reported.setdefault(job_id, set())
        chosen = [r for r in range(self.world_size) if r not in done] if ranks is None else list(ranks)
        done.update(chosen)
        out = WorkerOutput()
        if chosen:
            (out.completed if ok else out.failed)[job_id] = set(chosen)
        return out

    def report_all(self) -> WorkerOutput:
        """Every rank acks every delivered job it has not reported yet."""
        out = WorkerOutput()
        for job_id in sorted(self.jobs):
            out.merge(self.report(job_id))
        return out


# ---------------------------------------------------------------------------------------------- data


@dataclass
class _Held:
    job_id: int
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    proxy: Future[None]


class GatedBackend:
    """The CopyBackend protocol over a real ThreadPoolCopyBackend, with a gate in front of it.

    While the gate is closed, submissions are validated and then held (not copied). ``open()`` submits
    every held job to the real backend and lets later submissions through. ``wait()`` sets
    :attr:`wait_started` (a blocking wait began: tests can wait on it from another thread) and blocks
    until the gate opens, then waits for the real copies. ``release()`` runs the held jobs to completion
    without opening the gate, so a test can decide exactly when in-flight copies finish.

    With ``release_on_wait=True`` a wait never blocks on the gate: it releases the jobs it waits for. That
    gives a fully deterministic backend: every copy finishes at a point the test chose, never by chance.

    ``fail_job_ids``: jobs whose outcome is reported as a failure (the copy itself still runs).
    """

    def __init__(self, inner: ThreadPoolCopyBackend, *, release_on_wait: bool = False) -> None:
        self.inner = inner
        self.release_on_wait = release_on_wait
        self.gate = threading.Event()
        self.wait_started = threading.Event()
        self.fail_job_ids: set[int] = set()
        self.num_waits = 0
        self.submitted: list[int] = []
        self._held: dict[int, _Held] = {}
        self._lock = threading.Lock()

    # -- test controls --

    @property
    def held_ids(self) -> tuple[int, ...]:
        with self._lock:
            return tuple(self._held)

    @property
    def is_open(self) -> bool:
        return self.gate.is_set()

    def open(self) -> None:
        with self._lock:
            self.gate.set()
            self._submit_held(list(self._held))

    def close(self) -> None:
        with self._lock:
            self.gate.clear()

    def release(self, job_ids: Iterable[int] | None = None) -> None:
        """Submit the held jobs (all, or ``job_ids``) and block until their copies have finished.

        Without ``job_ids`` this waits for every copy submitted so far, held or not."""
        if job_ids is None:
            with self._lock:
                self._submit_held(list(self._held))
            self.inner.wait_all()
            return
        ids = list(job_ids)
        with self._lock:
            self._submit_held([j for j in ids if j in self._held])
        self.inner.wait(ids)

    def _submit_held(self, job_ids: list[int]) -> None:
        for job_id in job_ids:
            h = self._held.pop(job_id)
            real = self.inner.submit(h.job_id, h.is_store, h.gpu, h.slots)
            real.add_done_callback(functools.partial(_copy_outcome, proxy=h.proxy))

    # -- CopyBackend --

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        self.inner.check(is_store, gpu, slots)  # refuse at once, as the real backend does
        with self._lock:
            self.submitted.append(job_id)
            if self.gate.is_set():
                return self.inner.submit(job_id, is_store, gpu, slots)
            proxy: Future[None] = Future()
            self._held[job_id] = _Held(job_id, is_store, gpu, slots, proxy)
            return proxy

    def poll(self) -> list[tuple[int, bool]]:
        return [(job_id, ok and job_id not in self.fail_job_ids) for job_id, ok in self.inner.poll()]

    def wait(self, job_ids: Iterable[int]) -> None:
        ids = list(job_ids)
        self.num_waits += 1
        self.wait_started.set()
        if self.release_on_wait:
            self.release(ids)
            return
        if not self.gate.wait(DEADLOCK_GUARD_S):
            raise AssertionError(f"a blocking wait on jobs {ids} was never released (gate still closed)")
        with self._lock:
            self._submit_held([j for j in ids if j in self._held])
        self.inner.wait(ids)

    def shutdown(self) -> None:
        self.open()
        self.inner.shutdown()


def _copy_outcome(real: Future[None], proxy: Future[None]) -> None:
    exc = real.exception()
    if exc is None:
        proxy.set_result(None)
    else:
        proxy.set_exception(exc)


@dataclass
class GatedEngine:
    """A reference engine and the gated backend of each of its W workers (index = rank)."""

    engine: ReferenceEngine
    backends: list[GatedBackend]

    def open_all(self) -> None:
        for b in self.backends:
            b.open()

    def close_all(self) -> None:
        for b in self.backends:
            b.close()

    def release_all(self) -> None:
        for b in self.backends:
            b.release()

    def held_ids(self) -> set[int]:
        return {j for b in self.backends for j in b.held_ids}

    def step_released(self) -> StepRecord | None:
        """One step, then every copy it launched runs to completion (reported by the next step's poll)."""
        rec = self.engine.step()
        self.release_all()
        return rec

    def shutdown(self) -> None:
        self.open_all()
        self.engine.shutdown()


def make_gated_engine(config: EngineConfig, *, release_on_wait: bool = False) -> GatedEngine:
    """A ReferenceEngine whose W workers copy through :class:`GatedBackend` (gates closed).

    The engine allocates its KV caches in ``__init__``, so it is built with its default workers, which
    are shut down at once (their thread pools never started) and replaced by gated ones over the same
    KV caches.
    """
    from kvfsm.control.worker import OffloadingWorker
    from kvfsm.data.backend import ThreadPoolCopyBackend
    from kvfsm.data.layout import shard_kv_caches
    from kvfsm.data.pool import CPUSlotPool
    from kvfsm.engine.core import ReferenceEngine

    engine = ReferenceEngine(config)
    for w in engine.workers:
        w.shutdown()
    world = config.world_size
    backends: list[GatedBackend] = []
    workers: list[OffloadingWorker] = []
    for rank in range(world):
        shard = shard_kv_caches(engine.kv_caches, world, rank)
        block_shape = tuple(int(d) for d in shard[0].shape[1:])
        pool = CPUSlotPool(config.num_cpu_slots, config.blocks_per_chunk, block_shape, len(shard), shard[0].dtype)
        inner = ThreadPoolCopyBackend(shard, pool, config.blocks_per_chunk, max_workers=config.copy_threads)
        backend = GatedBackend(inner, release_on_wait=release_on_wait)
        backends.append(backend)
        workers.append(OffloadingWorker(rank, world, backend))
    engine.workers = workers
    return GatedEngine(engine, backends)


@contextmanager
def gated_engine(config: EngineConfig, *, release_on_wait: bool = False) -> Iterator[GatedEngine]:
    """:func:`make_gated_engine`, shut down (gates opened first) when the block exits."""
    ge = make_gated_engine(config, release_on_wait=release_on_wait)
    try:
        yield ge
    finally:
        ge.shutdown()


def run_released(ge: GatedEngine, max_steps: int = 10_000) -> int:
    """Step until idle, completing every launched copy between steps; returns the number of steps."""
    taken = 0
    while ge.step_released() is not None:
        taken += 1
        if taken >= max_steps:
            raise AssertionError(f"engine still {ge.engine.state.value} after {max_steps} steps")
    return taken


def engine_config(**overrides: Any) -> EngineConfig:
    """A small CPU engine configuration (tiny KV shapes, 4 tokens per block), with ``overrides``."""
    from kvfsm.engine.core import EngineConfig

    base: dict[str, Any] = {
        "num_layers": 2,
        "num_heads": 4,
        "head_dim": 4,
        "tokens_per_block": 4,
        "num_gpu_blocks": 32,
        "num_cpu_slots": 32,
        "device": "cpu",
        "copy_threads": 1,
    }
    base.update(overrides)
    return EngineConfig(**base)


def cpu_manager(engine: ReferenceEngine) -> CPUOffloadingManager:
    """The engine's manager, which these tests always leave the default CPU one."""
    assert isinstance(engine.manager, CPUOffloadingManager)
    return engine.manager


def check_cpu_copies(ge: GatedEngine, block_hashes: Sequence[bytes]) -> int:
    """Compare every rank's CPU copy of each ready chunk of ``block_hashes`` with the value the forward
    wrote for it (its head shard); returns the number of (chunk, rank) copies checked."""
    import torch

    from kvfsm.data.layout import head_shard
    from kvfsm.machines.names import SlotState

    engine = ge.engine
    manager = cpu_manager(engine)
    cfg = engine.config
    bpc = cfg.blocks_per_chunk
    checked = 0
    for c, key in enumerate(keys_of(block_hashes, bpc)):
        if manager.slot_state(key) not in (SlotState.READY, SlotState.READING):
            continue
        slot_id = manager.slot_id(key)
        assert slot_id is not None
        for rank, backend in enumerate(ge.backends):
            heads = head_shard(cfg.num_heads, cfg.world_size, rank)
            for sub in range(bpc):
                block_hash = block_hashes[c * bpc + sub]
                for layer, stored in enumerate(backend.inner.pool.layers):
                    expected = engine.expected_block(block_hash, layer)[:, heads]
                    assert torch.equal(stored[slot_id, sub], expected), (
                        f"rank {rank}: CPU copy of chunk {c} (block {sub}, layer {layer}) is wrong"
                    )
            checked += 1
    return checked


class StepInThread:
    """Run one ``engine.step()`` on a helper thread, for a step that is expected to block in a wait.

    ``start()`` returns once ``backend.wait_started`` is set (the step began a blocking wait) and fails
    the test if the step instead returned without waiting. ``finish()`` joins and returns the step's
    record, re-raising anything the step raised.
    """

    def __init__(self, engine: ReferenceEngine, backend: GatedBackend) -> None:
        self.engine = engine
        self.backend = backend
        self.record: StepRecord | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-step", daemon=True)

    def _run(self) -> None:
        try:
            self.record = self.engine.step()
        except BaseException as exc:
            self.error = exc
        finally:
            self._done.set()
            self.backend.wait_started.set()  # wake start() even if the step never waited

    def start(self) -> StepInThread:
        self.backend.wait_started.clear()
        self._thread.start()
        if not self.backend.wait_started.wait(DEADLOCK_GUARD_S):
            raise AssertionError("the step neither started a blocking wait nor returned")
        if self._done.is_set():
            if self.error is not None:
                raise self.error
            raise AssertionError("the step returned without a blocking wait")
        return self

    @property
    def is_blocked(self) -> bool:
        return not self._done.is_set()

    def finish(self) -> StepRecord | None:
        self._thread.join(DEADLOCK_GUARD_S)
        if self._thread.is_alive():
            raise AssertionError("the step is still blocked; was the gate opened?")
        if self.error is not None:
            raise self.error
        return self.record
