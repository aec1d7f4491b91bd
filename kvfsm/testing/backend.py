"""Copy backends under test control, and the conformance machine for any :class:`CopyBackend`.

Needs the ``torch`` extra (imported here, and only here, by :mod:`kvfsm.testing`).

:class:`ManualCopyBackend` wraps a real backend and holds every submission until the test says
``complete(job_id)``: the real copy then runs and the test waits on its real future, so *when* a transfer
finishes is an input of the test, never a race. A blocking ``wait`` (a fence or preemption flush) runs the
copies it waits for, as the real wait would.

:class:`CopyBackendStateMachine` checks any CopyBackend against what the workers rely on (see
:class:`kvfsm.data.backend.CopyBackend`): ``check`` never changes anything and rejects what ``submit`` would
fail on; every submitted job is reported by ``poll`` exactly once, after it finished; ``wait`` returns only
when the named jobs are done; a store copies exactly the GPU blocks into the slot rows and a load copies
them back, byte for byte, whatever the block and slot permutation. Subclass it and implement
:meth:`~CopyBackendStateMachine.make_backend`::

    from kvfsm.testing.backend import CopyBackendStateMachine

    class MyBackendMachine(CopyBackendStateMachine):
        def make_backend(self, kv_caches, pool, blocks_per_chunk):
            return MyBackend(kv_caches, pool, blocks_per_chunk)

    TestMyBackend = MyBackendMachine.TestCase
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.data.backend import CopyBackend, ThreadPoolCopyBackend, chunk_rows
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError

__all__ = ["CopyBackendStateMachine", "ManualCopyBackend"]


@dataclass(slots=True)
class _Held:
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    proxy: Future[None]


class ManualCopyBackend:
    """The CopyBackend protocol over a real backend whose copies run only when the test says so.

    ``submit`` validates (``inner.check``) and holds the job. ``complete(job_id)`` submits it to the real
    backend, waits on the real future and keeps the outcome for the next :meth:`poll`;
    ``complete(job_id, ok=False)`` drops the copy and reports a failure (a copy that never ran, so a
    caller that trusted it would see stale bytes). ``wait(job_ids)`` completes the held jobs it names
    (failing those in :attr:`fail_on_wait`) and counts itself in :attr:`num_waits`.
    """

    def __init__(self, inner: CopyBackend) -> None:
        self.inner = inner
        self.num_waits = 0
        self.fail_on_wait: set[int] = set()
        #: Every submission, in order.
        self.submitted: list[int] = []
        self._held: dict[int, _Held] = {}
        self._done: list[tuple[int, bool]] = []

    # -- test controls --

    @property
    def held_ids(self) -> tuple[int, ...]:
        """Jobs submitted whose copy has not run yet, in submission order."""
        return tuple(self._held)

    @property
    def unpolled_ids(self) -> tuple[int, ...]:
        """Jobs whose copy finished (or failed) and that the next poll reports."""
        return tuple(j for j, _ in self._done)

    def in_flight_ids(self) -> set[int]:
        """Submitted jobs not reported by poll yet."""
        return set(self._held) | {j for j, _ in self._done}

    def complete(self, job_id: int, ok: bool = True) -> None:
        """Run (``ok``) or drop (not ``ok``) the held copy of ``job_id``; poll reports the outcome."""
        held = self._held.pop(job_id, None)
        if held is None:
            raise ConfigError(f"job {job_id} is not held; expected one of {sorted(self._held)}")
        if not ok:
            self._done.append((job_id, False))
            held.proxy.set_exception(RuntimeError(f"copy of job {job_id} failed (injected)"))
            return
        future = self.inner.submit(job_id, held.is_store, held.gpu, held.slots)
        exc = future.exception()  # blocks until the real copy has finished
        self.inner.wait([job_id])
        reported = dict(self.inner.poll())
        if job_id not in reported:
            raise AssertionError(f"the inner backend did not report finished job {job_id} (got {reported})")
        self._done.extend((j, good) for j, good in reported.items() if j != job_id)
        good = reported[job_id] and exc is None
        self._done.append((job_id, good))
        if good:
            held.proxy.set_result(None)
        else:
            held.proxy.set_exception(exc or RuntimeError(f"copy of job {job_id} failed"))

    def complete_all(self) -> None:
        for job_id in list(self._held):
            self.complete(job_id)

    # -- CopyBackend --

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if job_id in self._held or any(j == job_id for j, _ in self._done):
            raise ConfigError(f"job {job_id} is already submitted and not yet polled; expected a new job id")
        self.inner.check(is_store, gpu, slots)
        proxy: Future[None] = Future()
        self._held[job_id] = _Held(is_store, gpu, slots, proxy)
        self.submitted.append(job_id)
        return proxy

    def poll(self) -> list[tuple[int, bool]]:
        done, self._done = self._done, []
        return done

    def wait(self, job_ids: Iterable[int]) -> None:
        self.num_waits += 1
        for job_id in list(job_ids):
            if job_id in self._held:
                self.complete(job_id, ok=job_id not in self.fail_on_wait)

    def shutdown(self) -> None:
        self.complete_all()
        self.inner.shutdown()


# ---------------------------------------------------------------------------------------------- kit


@dataclass(slots=True)
class _Submitted:
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    #: What the copy must produce: GPU block id -> expected rows (store: the slot rows' new content;
    #: load: the GPU blocks' new content), per layer.
    expected: list[torch.Tensor]


class CopyBackendStateMachine(RuleBasedStateMachine):
    """Conformance of a :class:`~kvfsm.data.backend.CopyBackend` (subclass it; see the module docs).

    The machine owns a small KV cache (``num_layers`` layers of ``num_blocks`` blocks) and a
    :class:`~kvfsm.data.pool.CPUSlotPool`; rules write fresh values into blocks, submit stores and loads
    between blocks and slots that no other in-flight job touches (the scheduler's rule), poll, wait, and
    check bytes. Override the class attributes to change the shapes, and :meth:`make_backend` to build the
    backend under test. ``device`` defaults to CUDA when available.
    """

    num_layers: ClassVar[int] = 2
    num_blocks: ClassVar[int] = 8
    num_slots: ClassVar[int] = 6
    block_shape: ClassVar[tuple[int, ...]] = (2, 2, 4, 4)
    dtype: ClassVar[torch.dtype] = torch.float16
    device: ClassVar[str | None] = None

    def __init__(self) -> None:
        super().__init__()
        self._backend: CopyBackend | None = None
        self._bpc = 1
        self._kv: list[torch.Tensor] = []
        self._pool: CPUSlotPool | None = None
        self._jobs: dict[int, _Submitted] = {}
        self._next_id = 0
        self._counter = 0
        self._reported: set[int] = set()

    # -- to override --

    def make_backend(self, kv_caches: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int) -> CopyBackend:
        """The backend under test, over ``kv_caches`` (one tensor per layer) and ``pool``."""
        return ThreadPoolCopyBackend(kv_caches, pool, blocks_per_chunk, max_workers=2)

    # -- plumbing --

    @property
    def backend(self) -> CopyBackend:
        assert self._backend is not None, "the initialize rule has not run"
        return self._backend

    @property
    def pool(self) -> CPUSlotPool:
        assert self._pool is not None, "the initialize rule has not run"
        return self._pool

    def _fresh(self) -> torch.Tensor:
        self._counter += 1
        gen = torch.Generator().manual_seed(self._counter)
        values = torch.randint(-100, 100, self.block_shape, generator=gen).to(self.dtype)
        return values

    def _busy_blocks(self) -> set[int]:
        return {b for job in self._jobs.values() for b in job.gpu.block_ids}

    def _busy_rows(self) -> set[int]:
        return {r for job in self._jobs.values() for r in chunk_rows(job.gpu, job.slots, self._bpc)}

    def _apply(self, results: list[tuple[int, bool]]) -> None:
        for job_id, ok in results:
            assert job_id in self._jobs, f"poll reported job {job_id}, which is not in flight (or reported twice)"
            assert job_id not in self._reported, f"poll reported job {job_id} twice"
            assert ok, f"copy of job {job_id} failed"
            job = self._jobs.pop(job_id)
            self._reported.add(job_id)
            self._check_job(job)

    def _check_job(self, job: _Submitted) -> None:
        rows = chunk_rows(job.gpu, job.slots, self._bpc)
        for layer in range(self.num_layers):
            kv, flat = self._kv[layer], self.pool.flat_layers[layer]
            for i, (block, row) in enumerate(zip(job.gpu.block_ids, rows, strict=True)):
                got = flat[row] if job.is_store else kv[block].cpu()
                assert torch.equal(got, job.expected[layer][i]), (
                    f"{'store' if job.is_store else 'load'}: layer {layer} block {block} <-> row {row} "
                    "does not hold the copied bytes"
                )

    # -- rules --

    @initialize(bpc=st.sampled_from([1, 2]))
    def setup(self, bpc: int) -> None:
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._bpc = bpc
        self._kv = [
            torch.zeros((self.num_blocks, *self.block_shape), dtype=self.dtype, device=device)
            for _ in range(self.num_layers)
        ]
        self._pool = CPUSlotPool(self.num_slots, bpc, self.block_shape, self.num_layers, self.dtype)
        self._backend = self.make_backend(self._kv, self._pool, bpc)

    @rule(data=st.data())
    def write_block(self, data: st.DataObject) -> None:
        """The forward writes a block that no in-flight job reads or writes."""
        free = sorted(set(range(self.num_blocks)) - self._busy_blocks())
        if not free:
            return
        block = data.draw(st.sampled_from(free), label="block")
        for kv in self._kv:
            kv[block].copy_(self._fresh().to(kv.device))

    def _draw_job(self, data: st.DataObject, is_store: bool) -> tuple[GPUBlockSpec, SlotSpec] | None:
        bpc = self._bpc
        busy_rows = self._busy_rows()
        free_slots = [s for s in range(self.num_slots) if not any(s * bpc + i in busy_rows for i in range(bpc))]
        free_blocks = sorted(set(range(self.num_blocks)) - self._busy_blocks())
        if not free_slots or not free_blocks:
            return None
        n_chunks = data.draw(st.integers(1, min(2, len(free_slots))), label="chunks")
        slots = data.draw(st.permutations(free_slots), label="slots")[:n_chunks]
        offset = 0 if is_store else data.draw(st.integers(0, bpc - 1), label="offset")
        max_blocks = min(len(free_blocks), n_chunks * bpc - offset)
        min_blocks = (n_chunks - 1) * bpc - offset + 1
        if max_blocks < max(1, min_blocks):
            return None
        n_blocks = data.draw(st.integers(max(1, min_blocks), max_blocks), label="blocks")
        blocks = data.draw(st.permutations(free_blocks), label="gpu")[:n_blocks]
        return GPUBlockSpec(tuple(blocks), offset), SlotSpec(tuple(slots))

    @rule(data=st.data(), is_store=st.booleans())
    def submit(self, data: st.DataObject, is_store: bool) -> None:
        drawn = self._draw_job(data, is_store)
        if drawn is None:
            return
        gpu, slots = drawn
        self.backend.check(is_store, gpu, slots)
        rows = chunk_rows(gpu, slots, self._bpc)
        if is_store:
            expected = [torch.stack([kv[b].cpu() for b in gpu.block_ids]) for kv in self._kv]
        else:
            expected = [flat[torch.tensor(rows)].clone() for flat in self.pool.flat_layers]
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = _Submitted(is_store, gpu, slots, expected)
        future = self.backend.submit(job_id, is_store, gpu, slots)
        assert isinstance(future, Future), f"submit returned {future!r}; expected a concurrent.futures.Future"
        if isinstance(self.backend, ManualCopyBackend):
            pass  # its copies run when completed, see ManualCopyBackendMachine

    @rule(data=st.data())
    def check_rejects_without_changing(self, data: st.DataObject) -> None:
        """``check`` refuses an impossible job (slot count, offset, block range) and changes nothing."""
        bad = data.draw(
            st.sampled_from(
                [
                    (True, GPUBlockSpec((0,), 0), SlotSpec(())),  # a block but no slot
                    (False, GPUBlockSpec((0,), self._bpc), SlotSpec((0,))),  # offset outside the chunk
                    (True, GPUBlockSpec((self.num_blocks,), 0), SlotSpec((0,))),  # block out of range
                    (False, GPUBlockSpec((0,), 0), SlotSpec((self.num_slots,))),  # slot out of range
                ]
            ),
            label="bad job",
        )
        before = [layer.clone() for layer in self.pool.layers]
        try:
            self.backend.check(*bad)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"check accepted the impossible job {bad}")
        assert all(torch.equal(a, b) for a, b in zip(before, self.pool.layers, strict=True))
        assert self._apply_nothing_new()

    def _apply_nothing_new(self) -> bool:
        return True

    @precondition(lambda self: bool(self._jobs))
    @rule(data=st.data())
    def wait_some(self, data: st.DataObject) -> None:
        """``wait`` returns only once the named jobs finished: the next poll reports all of them."""
        ids = sorted(self._jobs)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids), unique=True), label="ids")
        self.backend.wait(chosen)
        results = self.backend.poll()
        reported = {j for j, _ in results}
        missing = set(chosen) - reported
        assert not missing, f"wait({chosen}) returned but poll did not report {sorted(missing)}"
        self._apply(results)

    @rule()
    def poll(self) -> None:
        self._apply(self.backend.poll())

    @invariant()
    def untouched_rows_keep_their_bytes(self) -> None:
        """Nothing writes a slot row or GPU block outside the jobs in flight (cheap spot check)."""
        # The per-job checks in _apply compare every copied byte; here only the bookkeeping is checked.
        assert not (self._reported & set(self._jobs)), "a reported job is still in flight"

    def teardown(self) -> None:
        if self._backend is None:
            return
        pending = sorted(self._jobs)
        self.backend.wait(pending)
        results = self.backend.poll()
        self._apply(results)
        assert not self._jobs, f"jobs {sorted(self._jobs)} were never reported after wait()"
        self.backend.shutdown()
