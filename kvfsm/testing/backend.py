"""Copy backends under test control, and the conformance machine for any :class:`CopyBackend`.

Needs the ``torch`` extra (imported here, and only here, by :mod:`kvfsm.testing`).

:class:`ManualCopyBackend` wraps a real backend and holds every submission until the test says
``complete(job_id)``: the real copy then runs and the test waits on its real future, so *when* a transfer
finishes is an input of the test, never a race. A blocking ``wait`` (a fence or preemption flush) runs the
copies it waits for, as the real wait would.

:class:`GatedCopyBackend` does the same with the copy genuinely in flight: the real backend's copy thread
holds inside its copy path (:class:`~kvfsm.data.gate.CopyGate`) until the test releases it, and every report
is checked against the destination bytes at the poll that makes it.

:class:`CopyBackendStateMachine` checks any CopyBackend against what the workers rely on (see
:class:`kvfsm.data.backend.CopyBackend`): ``check`` never changes anything and rejects what ``submit`` would
fail on; every submitted job is reported by ``poll`` exactly once, after it finished (its destination bytes
are checked at the poll that reports it); ``wait`` returns only
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

from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from typing_extensions import override

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend, chunk_rows
from kvfsm.data.gate import CopyGate
from kvfsm.data.pool import CPUSlotPool
from kvfsm.errors import ConfigError

__all__ = ["CopyBackendStateMachine", "GatedCopyBackend", "ManualCopyBackend"]


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


@dataclass(slots=True)
class _Gated:
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    rows: list[int]
    future: Future[None]
    #: The source bytes (per layer, per block) as they were when the copy was released: what the destination
    #: must hold once the backend reports the job finished.
    source: list[list[torch.Tensor]] | None = None


class GatedCopyBackend:
    """The CopyBackend protocol over a real :class:`ThreadPoolCopyBackend` whose copy threads hold at its
    :class:`~kvfsm.data.gate.CopyGate`.

    ``submit`` hands the job to the real backend at once: its copy thread starts and holds inside the real
    copy path until :meth:`complete` releases it, so *when* a transfer finishes is an input of the test while
    the copy is genuinely in flight on the data plane (:meth:`in_flight_ids`, :meth:`running_ids` come from
    the backend's own futures, never from this wrapper). ``complete(job_id)`` releases the copy and returns
    once its thread has left the copy path and its future is done, so the next :meth:`poll` reports it;
    ``complete(job_id, ok=False)`` makes the copy fail on its thread without moving anything. ``wait(ids)``
    (a fence or preemption flush) completes the held jobs it names (failing those in :attr:`fail_on_wait`).

    Honesty at report time: every job :meth:`poll` reports as finished has its destination checked right
    then, on the data plane (a store: the CPU slot rows; a load: the GPU blocks), against the source bytes
    as they were when the copy was released (or, for a copy never released, as they are now). What is wrong
    is kept in :attr:`problems` for the harness to raise at its next check.
    """

    def __init__(self, inner: ThreadPoolCopyBackend, max_held: int | None = None) -> None:
        gate = inner.gate
        if gate is None:
            raise ConfigError("GatedCopyBackend needs a ThreadPoolCopyBackend built with gate=CopyGate()")
        self.inner = inner
        self.gate: CopyGate = gate
        self.num_waits = 0
        self.fail_on_wait: set[int] = set()
        #: Every submission, in order.
        self.submitted: list[int] = []
        #: Reports whose destination bytes were checked at poll time.
        self.reports_checked = 0
        #: What the report-time checks found wrong (the harness raises them).
        self.problems: list[str] = []
        self._jobs: dict[int, _Gated] = {}
        #: Held copies allowed at once (each occupies a copy thread: keep it below the backend's threads).
        self.max_held = max_held
        #: Jobs whose report is not byte-checked (set by the harness: jobs the spec has given up on, whose
        #: memory may already hold a later job's bytes when their late report comes, e.g. stale jobs).
        self.report_exempt: Callable[[int], bool] = lambda job_id: False

    # -- test controls and ground truth --

    @property
    def held_ids(self) -> tuple[int, ...]:
        """Jobs submitted whose copy thread has not been released yet, in submission order."""
        return tuple(j for j, job in self._jobs.items() if not self.gate.is_released(j))

    def in_flight_ids(self) -> set[int]:
        """Jobs the real backend has not reported yet (running, held at the gate, or finished unpolled)."""
        return set(self.inner.unreported_job_ids())

    def running_ids(self) -> set[int]:
        """Jobs whose real copy has not finished (their future is not done)."""
        return set(self.inner.unfinished_job_ids())

    def _source(self, job: _Gated) -> list[list[torch.Tensor]]:
        kv, pool = self.inner.kv_caches, self.inner.pool
        if job.is_store:
            return [[layer[b].cpu().clone() for b in job.gpu.block_ids] for layer in kv]
        return [[pool.block(layer, r).clone() for r in job.rows] for layer in range(pool.num_layers)]

    def _destination_problems(self, job_id: int, job: _Gated) -> list[str]:
        kv, pool = self.inner.kv_caches, self.inner.pool
        source = job.source if job.source is not None else self._source(job)
        out: list[str] = []
        for layer in range(pool.num_layers):
            for i, (block, row) in enumerate(zip(job.gpu.block_ids, job.rows, strict=True)):
                got = pool.block(layer, row) if job.is_store else kv[layer][block].cpu()
                if not torch.equal(got, source[layer][i]):
                    where = f"pool row {row}" if job.is_store else f"GPU block {block}"
                    out.append(
                        f"poll reported {'store' if job.is_store else 'load'} job {job_id} finished, but {where} "
                        f"(layer {layer}) does not hold the copied bytes"
                    )
        return out

    def complete(self, job_id: int, ok: bool = True) -> None:
        """Release (``ok``) or fail (not ``ok``) the held copy of ``job_id``; the next poll reports it."""
        job = self._jobs.get(job_id)
        if job is None or self.gate.is_released(job_id):
            raise ConfigError(f"job {job_id} is not held; expected one of {list(self.held_ids)}")
        if ok:
            job.source = self._source(job)
        self.gate.release(job_id, ok)
        self.gate.wait_left(job_id)  # the copy thread has moved every byte it will move
        job.future.exception()  # and its future is done: the next poll reports it (whatever the future says)

    def complete_all(self) -> None:
        for job_id in self.held_ids:
            self.complete(job_id)

    def close(self) -> None:
        """Release every copy thread (held or arriving later) and stop the real backend."""
        self.gate.open()
        self.inner.shutdown()

    # -- CopyBackend --

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        if self.max_held is not None and len(self.held_ids) >= self.max_held:
            raise AssertionError(f"{self.max_held} copies held at once; the backend has no thread left to release one")
        rows = chunk_rows(gpu, slots, self.inner.blocks_per_chunk)
        future = self.inner.submit(job_id, is_store, gpu, slots)
        self._jobs[job_id] = _Gated(is_store, gpu, slots, rows, future)
        self.submitted.append(job_id)
        return future

    def poll(self) -> list[tuple[int, bool]]:
        reported = self.inner.poll()
        for job_id, ok in reported:
            job = self._jobs.pop(job_id, None)
            if job is None:
                self.problems.append(f"poll reported job {job_id}, which is not in flight (never submitted, or twice)")
                continue
            if ok and not self.report_exempt(job_id):
                self.reports_checked += 1
                self.problems.extend(self._destination_problems(job_id, job))
            if self.gate.has_left(job_id):
                self.gate.forget(job_id)
        return reported

    def wait(self, job_ids: Iterable[int]) -> None:
        self.num_waits += 1
        ids = list(job_ids)
        held = set(self.held_ids)
        for job_id in ids:
            if job_id in held:
                self.complete(job_id, ok=job_id not in self.fail_on_wait)
        self.inner.wait(ids)

    def shutdown(self) -> None:
        self.complete_all()
        self.inner.shutdown()


# ---------------------------------------------------------------------------------------------- kit


@dataclass(slots=True)
class _Submitted:
    is_store: bool
    gpu: GPUBlockSpec
    slots: SlotSpec
    rows: list[int]
    #: What the copy must produce, per layer: one tensor per block (store: the slot rows' new content;
    #: load: the GPU blocks' new content).
    expected: list[list[torch.Tensor]]


class CopyBackendStateMachine(RuleBasedStateMachine):
    """Conformance of a :class:`~kvfsm.data.backend.CopyBackend` (subclass it; see the module docs).

    The machine owns a small paged KV cache (``num_layers`` tensors of ``num_blocks`` blocks) and a
    :class:`~kvfsm.data.pool.CPUSlotPool`. Rules write fresh values into GPU blocks (the forward) and into
    slots, submit stores and loads over blocks and slots that no other in-flight job touches (the
    scheduler's guarantee), poll, and wait. Checked: ``check`` rejects impossible jobs and changes nothing;
    ``submit`` returns a Future; every job is reported by ``poll`` exactly once, and ``wait(ids)`` returns
    only once those jobs finished; a store copies exactly its blocks into its slot rows and a load exactly
    its slot rows into its blocks, for any block and slot permutation and chunk offset; nothing else in the
    pool or the KV cache changes. A job stays "in flight" for the machine until a ``wait`` covers it, so a
    backend that completes jobs on its own threads cannot make the draws flaky.

    Override :meth:`make_backend` (and the class attributes to change the shapes). ``device`` defaults to
    CUDA when available.
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
        self._pool: CPUSlotPool | None = None
        self._bpc = 1
        self._kv: list[torch.Tensor] = []
        self._jobs: dict[int, _Submitted] = {}
        self._reported: set[int] = set()
        self._problems: list[str] = []
        self._next_id = 0
        self._fresh_counter = 0
        # What every block and row must hold outside the jobs in flight (CPU copies).
        self._model_kv: list[torch.Tensor] = []
        self._model_pool: list[torch.Tensor] = []

    # -- to override --

    def make_backend(self, kv_caches: list[torch.Tensor], pool: CPUSlotPool, blocks_per_chunk: int) -> CopyBackend:
        """The backend under test, copying between ``kv_caches`` (one tensor per layer) and ``pool``."""
        raise NotImplementedError("subclass CopyBackendStateMachine and implement make_backend(kv, pool, bpc)")

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
        self._fresh_counter += 1
        gen = torch.Generator().manual_seed(self._fresh_counter)
        return torch.randint(-100, 100, self.block_shape, generator=gen).to(self.dtype)

    def _busy_blocks(self) -> set[int]:
        return {b for job in self._jobs.values() for b in job.gpu.block_ids}

    def _busy_rows(self) -> set[int]:
        return {r for job in self._jobs.values() for r in job.rows}

    def _snapshot(self) -> list[torch.Tensor]:
        """Every block and row no in-flight job touches (those may change at any time, on copy threads)."""
        busy_blocks, busy_rows = self._busy_blocks(), self._busy_rows()
        out: list[torch.Tensor] = []
        for layer in range(self.num_layers):
            out.extend(self._kv[layer][b].cpu().clone() for b in range(self.num_blocks) if b not in busy_blocks)
            rows = self.num_slots * self._bpc
            out.extend(self.pool.block(layer, r).clone() for r in range(rows) if r not in busy_rows)
        return out

    def _take(self, results: list[tuple[int, bool]]) -> None:
        """Record reports. Problems are kept, not raised: *when* a backend reports is up to its threads, so
        they are raised at the next deterministic point (a wait), where the same example always fails."""
        for job_id, ok in results:
            if job_id >= self._next_id or job_id < 0:
                self._problems.append(f"poll reported job {job_id}, which was never submitted")
            elif job_id in self._reported:
                self._problems.append(f"poll reported job {job_id} twice")
            elif not ok:
                self._problems.append(f"the copy of job {job_id} failed")
            elif job_id in self._jobs:
                # Honest at report time: the destination holds the copied bytes at the poll that reports it.
                try:
                    self._check_job(job_id, self._jobs[job_id])
                except AssertionError as exc:
                    self._problems.append(f"at the poll that reported it: {exc}")
            self._reported.add(job_id)

    def _check_job(self, job_id: int, job: _Submitted) -> None:
        for layer in range(self.num_layers):
            kv = self._kv[layer]
            for i, (block, row) in enumerate(zip(job.gpu.block_ids, job.rows, strict=True)):
                got = self.pool.block(layer, row) if job.is_store else kv[block].cpu()
                assert torch.equal(got, job.expected[layer][i]), (
                    f"job {job_id} ({'store' if job.is_store else 'load'}): layer {layer}, block {block} <-> "
                    f"pool row {row} does not hold the copied bytes"
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
        self._model_kv = [kv.cpu().clone() for kv in self._kv]
        self._model_pool = [flat.clone() for flat in self._pool.flat_layers]
        self._backend = self.make_backend(self._kv, self._pool, bpc)

    @rule(block=st.integers(0, 1_000), to_slot=st.booleans())
    def write(self, block: int, to_slot: bool) -> None:
        """The forward writes a GPU block, or a slot row gets new bytes, where no in-flight job looks."""
        if to_slot:
            row = block % (self.num_slots * self._bpc)
            if row not in self._busy_rows():
                for layer, model in enumerate(self._model_pool):
                    value = self._fresh()
                    self.pool.block(layer, row).copy_(value)
                    model[row].copy_(value)
            return
        b = block % self.num_blocks
        if b not in self._busy_blocks():
            for kv, model in zip(self._kv, self._model_kv, strict=True):
                value = self._fresh()
                kv[b].copy_(value.to(kv.device))
                model[b].copy_(value)

    @rule(data=st.data(), is_store=st.booleans())
    def submit(self, data: st.DataObject, is_store: bool) -> None:
        """A store (GPU -> slots) or load (slots -> GPU) over blocks and rows no in-flight job touches."""
        bpc = self._bpc
        n_chunks = data.draw(st.integers(1, 2), label="chunks")
        slots = data.draw(st.permutations(range(self.num_slots)), label="slot order")[:n_chunks]
        offset = 0 if is_store else data.draw(st.integers(0, bpc - 1), label="offset")
        lo, hi = max(1, (n_chunks - 1) * bpc - offset + 1), n_chunks * bpc - offset
        n_blocks = data.draw(st.integers(lo, hi), label="blocks")
        blocks = data.draw(st.permutations(range(self.num_blocks)), label="block order")[:n_blocks]
        gpu, spec = GPUBlockSpec(tuple(blocks), offset), SlotSpec(tuple(slots))
        rows = chunk_rows(gpu, spec, bpc)
        if set(blocks) & self._busy_blocks() or set(rows) & self._busy_rows():
            return  # another job in flight touches this memory: the scheduler never submits that
        self.backend.check(is_store, gpu, spec)
        if is_store:
            expected = [[kv[b].cpu().clone() for b in blocks] for kv in self._kv]
        else:
            expected = [[self.pool.block(layer, r).clone() for r in rows] for layer in range(self.num_layers)]
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = _Submitted(is_store, gpu, spec, rows, expected)
        future = self.backend.submit(job_id, is_store, gpu, spec)
        assert isinstance(future, Future), f"submit returned {future!r}; expected a concurrent.futures.Future"

    @rule(which=st.integers(0, 3))
    def check_refuses(self, which: int) -> None:
        """``check`` refuses an impossible job (with ConfigError) and changes nothing."""
        bad = [
            (True, GPUBlockSpec((0,), 0), SlotSpec(())),  # a block but no slot
            (False, GPUBlockSpec((0,), self._bpc), SlotSpec((0,))),  # offset outside the chunk
            (True, GPUBlockSpec((self.num_blocks,), 0), SlotSpec((0,))),  # block out of range
            (False, GPUBlockSpec((0,), 0), SlotSpec((self.num_slots,))),  # slot out of range
        ][which]
        before = self._snapshot()
        try:
            self.backend.check(*bad)
        except ConfigError:
            pass
        else:
            raise AssertionError(f"check accepted the impossible job {bad}")
        after = self._snapshot()
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "check changed memory"

    @rule()
    def poll(self) -> None:
        """Whatever has finished is reported, once, with its bytes in place."""
        self._take(self.backend.poll())

    @precondition(lambda self: bool(self._jobs))
    @rule(data=st.data())
    def wait(self, data: st.DataObject) -> None:
        """``wait(ids)`` returns once those jobs finished: the next poll reports every one not reported."""
        ids = sorted(self._jobs)
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=len(ids), unique=True), label="ids")
        self.backend.wait(chosen)
        self._take(self.backend.poll())
        missing = sorted(j for j in chosen if j not in self._reported)
        assert not missing, f"wait({chosen}) returned, but poll has not reported {missing}"
        assert not self._problems, "; ".join(self._problems)
        for job_id in chosen:
            self._check_job(job_id, self._jobs[job_id])
            job = self._jobs.pop(job_id)  # its memory is free again: the model takes the copied bytes
            for layer in range(self.num_layers):
                for i, (block, row) in enumerate(zip(job.gpu.block_ids, job.rows, strict=True)):
                    target = self._model_pool[layer][row] if job.is_store else self._model_kv[layer][block]
                    target.copy_(job.expected[layer][i])

    @invariant()
    def nothing_else_changes(self) -> None:
        """Outside the jobs in flight, every block and slot row holds exactly what the model says."""
        if self._pool is None:
            return
        busy_blocks, busy_rows = self._busy_blocks(), self._busy_rows()
        for layer in range(self.num_layers):
            kv, model_kv = self._kv[layer], self._model_kv[layer]
            for b in range(self.num_blocks):
                if b not in busy_blocks:
                    assert torch.equal(kv[b].cpu(), model_kv[b]), f"GPU block {b} (layer {layer}) changed"
            model_pool = self._model_pool[layer]
            for r in range(model_pool.shape[0]):
                if r not in busy_rows:
                    assert torch.equal(self.pool.block(layer, r), model_pool[r]), (
                        f"pool row {r} (layer {layer}) changed"
                    )

    @override
    def teardown(self) -> None:
        if self._backend is None:
            return
        self.backend.wait(sorted(self._jobs))
        self._take(self.backend.poll())
        missing = sorted(set(self._jobs) - self._reported)
        self.backend.shutdown()
        assert not missing, f"jobs {missing} were never reported, even after wait()"
        assert not self._problems, "; ".join(self._problems)
        for job_id, job in sorted(self._jobs.items()):
            self._check_job(job_id, job)
