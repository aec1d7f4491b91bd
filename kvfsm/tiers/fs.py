"""The file-system secondary tier: real block files in a local directory (vLLM's ``tiering/fs``).

The split is the project's usual one. Every method the tiering manager calls runs on the scheduler
thread, owns all the bookkeeping, and never blocks: it enqueues work and returns. The I/O (block files,
slot bytes, probes, the start-up scan) runs on a :class:`~kvfsm.tiers.pool.DualQueuePool` (reads and
writes queued apart, so promotions are not starved by cascades), a lookup thread and a scan thread, and
reports back through a queue that the scheduler thread drains in :meth:`FileSystemTier.get_finished_jobs`.

Each key the tier holds is an entry driven by the spec's slot machine: ``writing`` while its file is
written, ``ready`` once the file is renamed into place, ``reading(n)`` while n promotions read it,
``absent`` after ``evict`` (capacity, invalidation, corruption). Only ready entries are evicted.

- **Atomic, checksummed files** (:mod:`kvfsm.tiers.blockfile`): a partial block is never visible; a load
  verifies the checksum, and a damaged file is a failed load and is removed. Corrupt data is never
  written into a CPU slot.
- **Persistence**: a new instance on the same directory rebuilds its index on a background scan (newest
  version per key; stray temporary files of dead writers and damaged files are removed) and serves hits.
- **Lookups never block**: a key the index does not know while the scan is still running is probed
  asynchronously (:mod:`kvfsm.tiers.lookup`); the tier answers RETRY until the answer is in.
- **Capacity** in bytes and/or files, with LRU eviction of ready entries.
- **Durable mode** (``durable=True``): a cascade is acknowledged once its file is written and renamed
  into place; the fsync of the file and of its directory (the index a restart's scan rebuilds) run
  afterwards on the write threads, and :meth:`FileSystemTier.has_pending_work` is True until they have
  finished, so the engine keeps stepping until the data is durable. An acknowledged block is served
  from the page cache meanwhile; after a crash it is either intact (its checksum verifies) or a miss,
  and a block whose sync failed is evicted (a miss, never doubtful bytes).
- **Faults**: a :class:`~kvfsm.tiers.faults.FaultPlan` is consulted at every file and slot operation.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from enum import Enum
from functools import partial

from typing_extensions import override

from kvfsm.control.cpu import SlotModel
from kvfsm.control.manager import JobResult, SecondaryTier, TierJob, validate_tier_job
from kvfsm.control.types import LookupResult, OffloadingEvent, OffloadKey, ReqContext
from kvfsm.errors import ConfigError, KvfsmError
from kvfsm.machines import slot_machine
from kvfsm.machines.compiled import SpecMachine
from kvfsm.machines.names import SlotEffect, SlotEvent, SlotState
from kvfsm.tiers.blockfile import HEADER, BlockIO, CorruptBlockError, FileInfo, ScanResult
from kvfsm.tiers.faults import FaultPlan
from kvfsm.tiers.lookup import AsyncLookup
from kvfsm.tiers.pool import DualQueuePool
from kvfsm.tiers.slotio import SlotIO, slot_nbytes

__all__ = ["FileSystemTier", "FsTierCounters", "FsTierStats", "ScanState"]

logger = logging.getLogger(__name__)

_READABLE = (SlotState.READY, SlotState.READING)


def _is_positive_int(n: object) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1


class ScanState(Enum):
    """Where the restart scan that rebuilds the tier's index stands."""

    RUNNING = "running"  #: the index is being rebuilt; unknown keys are probed
    DONE = "done"  #: the index is complete: a key it does not hold is a miss
    FAILED = "failed"  #: the scan failed; unknown keys keep being probed


@dataclass(slots=True, eq=False)
class _Entry(SlotModel):
    """One key held by the tier (the slot machine's model: state and readers, moved by its methods)."""

    key: OffloadKey
    version: int
    reserved: int  #: bytes counted against the capacity (an estimate while writing)
    info: FileInfo | None = None
    doomed: bool = False  #: invalidated while being read: evicted when the last reader is done
    #: Older files of this key found while this entry's own file was being written: removed when that
    #: write commits, served again if it fails (the only valid copy is never removed first).
    superseded: list[FileInfo] = field(default_factory=list)


@dataclass(slots=True)
class FsTierCounters:
    """What a file-system tier has counted since it was built."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    retries: int = 0
    stores_submitted: int = 0
    stores_committed: int = 0
    stores_failed: int = 0
    stores_rejected: int = 0
    loads_submitted: int = 0
    loads_completed: int = 0
    loads_failed: int = 0
    corrupt_detected: int = 0
    evictions: int = 0
    invalidations: int = 0
    probe_hits: int = 0
    scan_entries: int = 0
    temp_files_removed: int = 0
    bad_files_removed: int = 0
    #: superseded versions of a block: removed by the start-up scan, or given to the I/O threads for
    #: removal as soon as the version that replaces them is committed (kept if it is not on disk)
    old_versions_removed: int = 0
    #: durable mode: blocks whose background fsync and directory sync finished
    blocks_made_durable: int = 0
    #: durable mode: blocks whose background sync failed (evicted: their bytes on disk are in doubt)
    durability_failed: int = 0


@dataclass(frozen=True, slots=True)
class FsTierStats:
    """A snapshot of a file-system tier: its counters and its index and I/O now."""

    lookups: int
    hits: int
    misses: int
    retries: int
    stores_submitted: int
    stores_committed: int
    stores_failed: int
    stores_rejected: int
    loads_submitted: int
    loads_completed: int
    loads_failed: int
    corrupt_detected: int
    evictions: int
    invalidations: int
    probe_hits: int
    scan_entries: int
    temp_files_removed: int
    bad_files_removed: int
    old_versions_removed: int
    blocks_made_durable: int
    durability_failed: int
    entries: int
    used_bytes: int
    jobs_in_flight: int
    io_pending: int
    durability_pending: int

    def as_dict(self) -> dict[str, int]:
        """The same numbers by field name (logs, JSON, metrics)."""
        return asdict(self)


@dataclass(frozen=True, slots=True)
class _Done:
    """One finished task, reported by an I/O thread."""

    job_id: int
    key: OffloadKey
    is_store: bool
    version: int
    ok: bool
    info: FileInfo | None = None
    corrupt: bool = False
    cancelled: bool = False


@dataclass(slots=True)
class _JobState:
    job: TierJob
    remaining: int
    ok: bool


class FileSystemTier(SecondaryTier):
    """Blocks as files under ``root``; promotions and cascades move real bytes through ``slot_io``.

    Every parameter after ``root`` is keyword-only. The equivalents named are LMCache's local-disk backend
    (``local_disk``, ``max_local_disk_size``) and the llm-d file-system backend of vLLM's
    ``OffloadingConnector`` (``shared_storage_path``, ``threads_per_gpu``); "none" where neither has one.

    - ``root`` (path; required): the directory of the block files, created if missing; one file per block
      (one CPU slot: every layer, every rank), ``<root>/<2 hex>/<40 hex>.<16 hex>.kvb``. A new tier on the
      same directory finds what an earlier one wrote. LMCache ``local_disk`` (``"file:///path/"``, default
      None: disabled); llm-d ``shared_storage_path``.
    - ``slot_io`` (:class:`~kvfsm.tiers.slotio.SlotIO`; default None): reads and writes the CPU primary's
      slot bytes (a cascade reads a slot, a promotion writes one). It may be bound later, but must be set
      before the first submission (ConfigError otherwise). ``ReferenceEngine`` users pass a
      :class:`~kvfsm.tiers.slotio.CompositeSlotIO` over every rank's CPU pool. None (LMCache and vLLM
      wire their storage to their own CPU buffers).
    - ``name`` (str; default ``"fs"``): the tier's name in events, metrics, logs and thread names. None.
    - ``capacity_bytes`` (int bytes >= 1, or None; default None: unbounded): the most bytes of block files
      (headers included) the tier keeps; the least recently used ready blocks are evicted (their files
      removed) to make room, and a block larger than the whole capacity is refused. LMCache
      ``max_local_disk_size`` (in GB, default 0.0); llm-d: none (it leaves clean-up to the storage).
    - ``capacity_files`` (int >= 1, or None; default None: unbounded): the most blocks (files) the tier
      keeps, evicted the same way; either limit, or both, may be set. None.
    - ``read_threads`` (int >= 0; default 2): threads that only read (promotions), so cascades can never
      occupy every thread a promotion needs. ``write_threads`` (int >= 1; default 2): threads that write
      (cascades) first and help with reads when no write is queued. See
      :class:`~kvfsm.tiers.pool.DualQueuePool`. llm-d ``threads_per_gpu`` (one pool for both directions);
      LMCache: none.
    - ``faults`` (:class:`~kvfsm.tiers.faults.FaultPlan`; default None): injected faults, consulted at every
      file and slot operation (tests and chaos runs; swappable through :attr:`faults`). None.
    - ``durable`` (bool; default False): make every committed block survive a power loss, not only a
      crash of the process: after a cascade is acknowledged (its file written and renamed into place),
      the write threads fsync the file (fault operation ``fs.fsync``) and its directory, with the root
      the first time (``fs.dirsync``). :meth:`has_pending_work` is True until every acknowledged block
      is durable; a block whose sync fails is evicted. Costs one or two fsyncs per block, off the
      acknowledgement path. Without it a write is still atomic (rename), and the checksum catches a torn
      file after a power loss. None (LMCache's ``use_odirect`` in ``extra_config`` bypasses the page cache
      but is not a durability setting).
    - ``scan`` (bool; default True): rebuild the index from ``root`` on a background thread at start-up
      (newest version per key; stray temporary files of dead writers, damaged files and superseded versions
      are removed). Until it finishes, keys the index does not know are probed asynchronously and answer
      RETRY. False: start empty and never look at files already there. None.
    - ``lookup_ttl_steps`` (int >= 1 steps; default 64): how many scheduler steps (``on_schedule_end``
      calls) a probed verdict for an unknown key is cached before it is probed again. See
      :class:`~kvfsm.tiers.lookup.AsyncLookup`. None.
    - ``checked`` (bool or None; default None: the ``KVFSM_CHECKED`` environment variable): run every slot
      transition through the ``transitions`` library as well as the compiled table (slower; tests). None.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        slot_io: SlotIO | None = None,
        name: str = "fs",
        capacity_bytes: int | None = None,
        capacity_files: int | None = None,
        read_threads: int = 2,
        write_threads: int = 2,
        faults: FaultPlan | None = None,
        durable: bool = False,
        scan: bool = True,
        lookup_ttl_steps: int = 64,
        checked: bool | None = None,
    ) -> None:
        for what, cap in (("capacity_bytes", capacity_bytes), ("capacity_files", capacity_files)):
            if cap is not None and not _is_positive_int(cap):
                raise ConfigError(f"tier {name!r}: {what}={cap!r}; expected an int >= 1 or None")
        self.name = name
        self.slot_io = slot_io
        self._faults = faults
        self.capacity_bytes = capacity_bytes
        self.capacity_files = capacity_files
        self._cancel = threading.Event()
        self._io = BlockIO(root, faults=faults, durable=durable, cancel=self._cancel)
        self.durable = durable
        #: durable mode: blocks renamed into place whose fsync and directory sync have not finished
        #: (counted from the rename, on the I/O thread; uncounted when the sync ends or is not owed)
        self._unsynced = 0
        self._unsynced_lock = threading.Lock()
        self._synced: deque[tuple[OffloadKey, int, bool]] = deque()  # (key, version, ok) of finished syncs
        self._job_tasks = 0  #: file tasks of submitted jobs not yet finished (their result not yet in _done)
        self._job_tasks_cond = threading.Condition()
        self._machine: SpecMachine[SlotState, SlotEvent, SlotEffect] = slot_machine(checked)
        self._entries: dict[OffloadKey, _Entry] = {}
        self._ready: OrderedDict[OffloadKey, None] = OrderedDict()  # ready entries, least recent first
        self._used_bytes = 0
        self._jobs: dict[int, _JobState] = {}
        self._done: deque[_Done] = deque()  # appended by I/O threads, drained by the scheduler thread
        self._finished: list[JobResult] = []
        self._events: list[OffloadingEvent] = []
        self._last_version = 0
        self._payload_hint = 0
        self._closed = False
        self._stats = FsTierCounters()
        self._pool = DualQueuePool(read_threads, write_threads, name=f"kvfsm-{name}")
        self._lookup: AsyncLookup[OffloadKey, FileInfo | None] = AsyncLookup(
            self._io.probe, None, name=f"kvfsm-{name}-lookup", ttl_steps=lookup_ttl_steps
        )
        self._scan_future: Future[ScanResult] | None = None
        self._scan_thread: threading.Thread | None = None
        self._scan_state = ScanState.DONE
        if scan:
            self._scan_state = ScanState.RUNNING
            fut: Future[ScanResult] = Future()
            self._scan_future = fut
            self._scan_thread = threading.Thread(
                target=self._run_scan, args=(fut,), name=f"kvfsm-{name}-scan", daemon=True
            )
            self._scan_thread.start()

    # ------------------------------------------------------------------ introspection

    @property
    def faults(self) -> FaultPlan | None:
        """The fault plan consulted at every file and slot operation (tests may swap it at any time)."""
        return self._faults

    @faults.setter
    def faults(self, plan: FaultPlan | None) -> None:
        self._faults = plan
        self._io.faults = plan

    @property
    def root(self) -> str:
        return str(self._io.root)

    @property
    def scan_state(self) -> ScanState:
        return self._scan_state

    @property
    def used_bytes(self) -> int:
        return self._used_bytes

    @property
    def used_files(self) -> int:
        return len(self._entries)

    @property
    def closed(self) -> bool:
        return self._closed

    def entry_state(self, key: OffloadKey) -> SlotState:
        e = self._entries.get(key)
        return SlotState.ABSENT if e is None else e.state

    def file_of(self, key: OffloadKey) -> str | None:
        """The path of the key's committed file, if the tier holds one."""
        e = self._entries.get(key)
        return None if e is None or e.info is None else e.info.path

    def keys(self) -> list[OffloadKey]:
        """Readable keys (ready or reading), in no particular order."""
        return [k for k, e in self._entries.items() if e.state in _READABLE and not e.doomed]

    def __contains__(self, key: object) -> bool:
        e = self._entries.get(OffloadKey(key)) if isinstance(key, bytes) else None
        return e is not None and e.state in _READABLE and not e.doomed

    def __len__(self) -> int:
        return len(self.keys())

    def pending_job_ids(self) -> list[int]:
        return list(self._jobs)

    def stats(self) -> FsTierStats:
        return FsTierStats(
            **asdict(self._stats),
            entries=len(self._entries),
            used_bytes=self._used_bytes,
            jobs_in_flight=len(self._jobs),
            io_pending=self._pool.pending,
            durability_pending=self.durability_pending,
        )

    @property
    def durability_pending(self) -> int:
        """Durable mode: blocks written whose background fsync and directory sync have not finished."""
        with self._unsynced_lock:
            return self._unsynced

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until the I/O pool is idle (tests; a real engine polls instead)."""
        return self._pool.wait_idle(timeout)

    def wait_jobs(self, timeout: float | None = None) -> bool:
        """Block until the file I/O of every submitted cascade and promotion has finished (the results
        are applied at the next poll); unlike :meth:`wait_idle`, background syncs and removals are not
        waited for (tests; a real engine polls instead)."""
        with self._job_tasks_cond:
            return self._job_tasks_cond.wait_for(lambda: self._job_tasks == 0, timeout)

    def wait_lookups(self, timeout: float | None = None) -> bool:
        """Block until every posted lookup probe has been answered (applied at the next step)."""
        return self._lookup.wait_idle(timeout)

    def wait_scan(self, timeout: float | None = None) -> bool:
        """Block until the start-up scan has finished (its result is applied at the next call)."""
        if self._scan_thread is None:
            return True
        self._scan_thread.join(timeout)
        return not self._scan_thread.is_alive()

    def threads_alive(self) -> int:
        """The tier's I/O, lookup and scan threads still running (0 after a clean shutdown)."""
        n = self._pool.threads_alive() + int(self._lookup.thread_alive())
        if self._scan_thread is not None and self._scan_thread.is_alive():
            n += 1
        return n

    # ------------------------------------------------------------------ SecondaryTier

    @override
    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._stats.lookups += 1
        self._apply_scan()
        e = self._entries.get(key)
        if e is not None and e.state in _READABLE and not e.doomed:
            self._stats.hits += 1
            if key in self._ready:
                self._ready.move_to_end(key)  # a hit is a use: do not evict it before its promotion runs
            return LookupResult.HIT
        if e is not None or self._scan_state is ScanState.DONE:
            self._stats.misses += 1
            return LookupResult.MISS  # being written (the primary holds it), invalidated, or not on disk
        verdict = self._lookup.lookup(key, ctx.req_id)
        if verdict is None:
            self._stats.retries += 1
            return LookupResult.RETRY
        self._stats.misses += 1
        return LookupResult.MISS  # a hit verdict became an entry when it was applied

    @override
    def submit_store(self, job: TierJob) -> None:
        io = self._check_submission(job, promotion=False)
        del io
        tasks: list[tuple[OffloadKey, int, int]] = []
        ok = True
        seen: set[OffloadKey] = set()
        for key, slot_id in zip(job.keys, job.slot_ids, strict=True):
            if key in seen or key in self._entries:
                continue  # already held or being written: nothing to do for this key
            seen.add(key)
            size = HEADER.size + len(key) + self._payload_size()
            if not self._make_room(size, 1):
                ok = False
                self._stats.stores_rejected += 1
                continue
            e = _Entry(key, self._next_version(), size, machine=self._machine)
            e.begin_write()
            self._entries[key] = e
            self._used_bytes += size
            tasks.append((key, slot_id, e.version))
        self._stats.stores_submitted += len(tasks)
        if not tasks:
            self._finished.append(JobResult(job.job_id, ok))
            return
        self._jobs[job.job_id] = _JobState(job, len(tasks), ok)
        self._count_job_tasks(len(tasks))
        for key, slot_id, version in tasks:
            fut = self._pool.submit_write(self._write_block, key, slot_id, version)
            fut.add_done_callback(partial(self._task_done, job.job_id, key, True, version))

    @override
    def submit_load(self, job: TierJob) -> None:
        self._check_submission(job, promotion=True)
        tasks: list[tuple[OffloadKey, int, FileInfo, int]] = []
        ok = True
        for key, slot_id in zip(job.keys, job.slot_ids, strict=True):
            e = self._entries.get(key)
            if e is None or e.state not in _READABLE or e.doomed or e.info is None:
                ok = False  # evicted or invalidated since the lookup: this key cannot be promoted
                continue
            if e.state is SlotState.READY:
                self._ready.pop(key, None)
            e.begin_read()
            tasks.append((key, slot_id, e.info, e.version))
        self._stats.loads_submitted += len(tasks)
        if not tasks:
            self._finished.append(JobResult(job.job_id, ok))
            return
        self._jobs[job.job_id] = _JobState(job, len(tasks), ok)
        self._count_job_tasks(len(tasks))
        for key, slot_id, info, version in tasks:
            fut = self._pool.submit_read(self._load_block, key, slot_id, info)
            fut.add_done_callback(partial(self._task_done, job.job_id, key, False, version))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._apply_scan()
        self._apply_done()
        finished, self._finished = self._finished, []
        return finished

    @override
    def has_pending_work(self) -> bool:
        """Durable mode: True while a written block is not yet durable (its fsync or directory sync is
        queued or running), from the moment its file is renamed into place; the engine keeps stepping
        until the data is durable (a hung sync keeps it stepping: durability was asked for). Otherwise,
        and after :meth:`shutdown`, False: cascades and promotions are counted by the tiering manager as
        jobs, and a lookup probe's answer matters only to a request that is waiting for it, which keeps
        the engine running anyway. Counting probes would let a hung disk keep an idle engine stepping
        forever (the upper bound of LMCache #4998)."""
        return not self._closed and self.durability_pending > 0

    def probes_pending(self) -> bool:
        """Lookup probes queued or in flight (their answers are applied by the next step)."""
        return not self._closed and self._lookup.has_pending()

    @override
    def drain_jobs(self) -> None:
        """Block until every queued or running I/O task has finished (reset_cache only)."""
        self._pool.wait_idle()

    @override
    def on_schedule_end(self) -> None:
        self._apply_scan()
        if self._closed:
            return
        for key, info in self._lookup.flush():
            if info is not None:
                self._adopt(key, info, source="probe")

    @override
    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        ready = self._ready
        for key in reversed(keys):
            if key in ready:
                ready.move_to_end(key)

    @override
    def take_events(self) -> list[OffloadingEvent]:
        events, self._events = self._events, []
        return events

    @override
    def invalidate(self, key: OffloadKey) -> None:
        """The manager's hook after a failed promotion (called for every key of the job).

        The tier knows each key's own outcome and has already evicted every key whose read failed (its
        file removed), so those answer MISS and are never promoted again (no livelock, vLLM #49176). A
        key of the same job whose copy verified fine, or was never read, keeps it: a promotion job is
        all-or-nothing, but one bad block is no reason to delete its neighbours.
        """
        if key not in self._entries and self._scan_state is not ScanState.DONE:
            self._lookup.set_result([key], None)

    def discard(self, key: OffloadKey) -> None:
        """Forget the tier's copy of ``key`` now (or when its last reader is done); it answers MISS after."""
        if self._scan_state is not ScanState.DONE:
            self._lookup.set_result([key], None)
        e = self._entries.get(key)
        if e is None or e.state is SlotState.WRITING:
            return  # nothing held, or a new copy is being written (that one is not the bad one)
        self._stats.invalidations += 1
        if e.state is SlotState.READY:
            self._evict(e, unlink=True)
        else:
            e.doomed = True

    @override
    def shutdown(self, timeout: float | None = None) -> None:
        """Stop: cancel queued I/O (those tasks report failure), wake injected hangs, join the threads.

        Returns within about ``timeout`` seconds (None: wait for running tasks). Threads still stuck after
        that are daemon threads. Results of tasks that finished or were cancelled are still reported by
        :meth:`get_finished_jobs`, so the manager can release what they held.
        """
        if self._closed:
            return
        self._closed = True
        self._cancel.set()
        if self.faults is not None:
            self.faults.notify()
        end = None if timeout is None else time.monotonic() + timeout

        def left() -> float | None:
            return None if end is None else max(0.0, end - time.monotonic())

        self._pool.shutdown(left())
        self._lookup.shutdown(left())
        if self._scan_thread is not None:
            self._scan_thread.join(left())
        if self._pool.threads_alive():
            logger.warning("tier %r: %d I/O threads still busy after shutdown", self.name, self._pool.threads_alive())

    # ------------------------------------------------------------------ I/O threads

    def _run_scan(self, fut: Future[ScanResult]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(self._io.scan())
        except BaseException as exc:
            fut.set_exception(exc)

    def _write_block(self, key: OffloadKey, slot_id: int, version: int) -> FileInfo:
        io = self.slot_io
        if io is None:
            raise KvfsmError(f"tier {self.name!r} has no slot_io")
        if self.faults is not None:
            self.faults.apply("slot.read", key, cancel=self._cancel)
        payload = io.read_slot(slot_id)
        if not self.durable:
            return self._io.write(key, payload, version)
        info = self._io.write(key, payload, version, sync=False)
        with self._unsynced_lock:
            self._unsynced += 1  # owed from the rename on: paid by _sync_done, or forgiven by _forgive
        return info

    def _forgive(self) -> None:
        """A written block's sync is not owed after all (its write was not committed, or the tier closed)."""
        with self._unsynced_lock:
            self._unsynced -= 1

    def _submit_sync(self, key: OffloadKey, info: FileInfo) -> None:
        """Durable mode, scheduler thread: the committed block's fsync and directory sync, in the background."""
        if self._closed:
            self._forgive()
            return
        fut = self._pool.submit_write(self._io.make_durable, info, key)
        fut.add_done_callback(partial(self._sync_done, key, info.version))

    def _sync_done(self, key: OffloadKey, version: int, fut: Future[bool]) -> None:
        """Done-callback of a sync (I/O thread, or the cancelling one): report it, then stop counting it."""
        if not fut.cancelled():  # cancelled by a shutdown: the file stays, checked by its checksum
            exc = fut.exception()
            if exc is not None:
                logger.warning("tier %r: the sync of %s failed: %r", self.name, key.hex()[:16], exc)
            self._synced.append((key, version, exc is None))
        with self._unsynced_lock:
            self._unsynced -= 1

    def _load_block(self, key: OffloadKey, slot_id: int, info: FileInfo) -> None:
        io = self.slot_io
        if io is None:
            raise KvfsmError(f"tier {self.name!r} has no slot_io")
        payload = self._io.read(info, key, slot_nbytes(io))
        if self.faults is not None:
            self.faults.apply("slot.write", key, cancel=self._cancel)
        io.write_slot(slot_id, payload)

    def _unlink(self, path: str) -> bool:
        return self._io.unlink(path, quiet=True)

    def _count_job_tasks(self, n: int) -> None:
        with self._job_tasks_cond:
            self._job_tasks += n
            if self._job_tasks == 0:
                self._job_tasks_cond.notify_all()

    def _task_done(self, job_id: int, key: OffloadKey, is_store: bool, version: int, fut: Future[object]) -> None:
        """Done-callback of every job's task (on the I/O thread, or the cancelling one): report it."""
        try:
            self._report_task(job_id, key, is_store, version, fut)
        finally:
            self._count_job_tasks(-1)

    def _report_task(self, job_id: int, key: OffloadKey, is_store: bool, version: int, fut: Future[object]) -> None:
        if fut.cancelled():
            self._done.append(_Done(job_id, key, is_store, version, False, cancelled=True))
            return
        exc = fut.exception()
        if exc is not None:
            logger.debug("tier %r: %s of %s failed: %r", self.name, "store" if is_store else "load", key.hex(), exc)
            cancelled = isinstance(exc, OSError) and exc.errno == errno.ECANCELED
            corrupt = isinstance(exc, CorruptBlockError)
            self._done.append(_Done(job_id, key, is_store, version, False, corrupt=corrupt, cancelled=cancelled))
            return
        result = fut.result()
        info = result if isinstance(result, FileInfo) else None
        self._done.append(_Done(job_id, key, is_store, version, True, info=info))

    # ------------------------------------------------------------------ scheduler-thread bookkeeping

    def _check_submission(self, job: TierJob, *, promotion: bool) -> SlotIO:
        what = "submit_load" if promotion else "submit_store"
        if self._closed:
            raise KvfsmError(f"tier {self.name!r} is shut down; {what} of job {job.job_id} expected an open tier")
        validate_tier_job(self.name, job, promotion=promotion, running=self._jobs)
        if self.slot_io is None:
            raise ConfigError(f"tier {self.name!r} has no slot_io; bind the CPU primary's slots before submitting")
        return self.slot_io

    def _payload_size(self) -> int:
        n = slot_nbytes(self.slot_io)
        return n if n is not None else self._payload_hint

    def _next_version(self) -> int:
        v = max(time.time_ns(), self._last_version + 1)
        self._last_version = v
        return v

    def _over(self, extra_bytes: int, extra_files: int) -> bool:
        if self.capacity_bytes is not None and self._used_bytes + extra_bytes > self.capacity_bytes:
            return True
        return self.capacity_files is not None and len(self._entries) + extra_files > self.capacity_files

    def _make_room(self, nbytes: int, nfiles: int) -> bool:
        """Evict least-recent ready entries until ``nbytes`` / ``nfiles`` more fit; False if they cannot."""
        if self.capacity_bytes is not None and nbytes > self.capacity_bytes:
            return False
        while self._over(nbytes, nfiles):
            if not self._ready:
                return False
            victim = self._entries[next(iter(self._ready))]
            self._evict(victim, unlink=True)
            self._stats.evictions += 1
        return True

    def _evict(self, e: _Entry, *, unlink: bool) -> None:
        match e.evict():
            case SlotEffect.EMIT_REMOVED:
                self._events.append(OffloadingEvent((e.key,), self.name, removed=True))
            case _:
                pass
        del self._entries[e.key]
        self._ready.pop(e.key, None)
        self._used_bytes -= e.reserved
        if self._scan_state is not ScanState.DONE:
            self._lookup.set_result([e.key], None)
        if unlink and e.info is not None and not self._closed:
            self._pool.submit_write(self._unlink, e.info.path)

    def _adopt(self, key: OffloadKey, info: FileInfo, *, source: str) -> None:
        """A file found on disk (scan or probe) becomes a ready entry, if the key is not held already."""
        e = self._entries.get(key)
        if e is not None:
            if e.info is not None and e.state is SlotState.READY and info.version > e.info.version:
                # Another writer's newer version: switch to it, and remove ours now that it is superseded.
                old = e.info
                self._used_bytes += info.size - e.reserved
                e.info, e.version, e.reserved = info, info.version, info.size
                self._supersede(old, info)
            elif info.version < e.version:
                if e.state is SlotState.WRITING:
                    e.superseded.append(info)  # removed when our write commits, kept if it fails
                elif e.info is not None:
                    self._supersede(info, e.info)  # superseded by our committed version
            return
        if not self._make_room(info.size, 1):
            return  # does not fit: leave the file for a later instance with more room
        e = _Entry(key, info.version, info.size, machine=self._machine)
        e.begin_write()
        e.commit_write()  # committed to disk before we saw it: no stored event (it is not new)
        e.info = info
        self._entries[key] = e
        self._ready[key] = None
        self._used_bytes += info.size
        self._payload_hint = self._payload_hint or info.payload_len
        match source:
            case "probe":
                self._stats.probe_hits += 1
            case "scan":
                self._stats.scan_entries += 1
            case _:
                pass  # a superseded file served again after the write that replaced it failed

    def _supersede(self, old: FileInfo, new: FileInfo) -> None:
        """Remove ``old``, a version of a key that ``new`` replaces, once ``new`` is durable (I/O thread)."""
        if self._closed or old.path == new.path:
            return
        self._stats.old_versions_removed += 1
        self._pool.submit_write(self._io.supersede, old, new)

    def _apply_scan(self) -> None:
        fut = self._scan_future
        if fut is None or not fut.done():
            return
        self._scan_future = None
        exc = None if fut.cancelled() else fut.exception()
        if fut.cancelled() or exc is not None:
            logger.warning("tier %r: the start-up scan failed (%r); unknown keys will be probed", self.name, exc)
            self._scan_state = ScanState.FAILED
            return
        result = fut.result()
        self._stats.temp_files_removed += result.temp_removed
        self._stats.bad_files_removed += result.bad_removed
        self._stats.old_versions_removed += result.old_versions_removed
        ours = list(self._ready)  # entries this instance made meanwhile are more recent than the scanned ones
        for key, info in sorted(result.entries.items(), key=lambda kv: kv[1].version):
            self._adopt(key, info, source="scan")
        for key in ours:
            if key in self._ready:
                self._ready.move_to_end(key)
        self._scan_state = ScanState.DONE
        self._lookup.forget_all()

    def _apply_synced(self) -> None:
        """Durable mode: a block whose sync failed is evicted (or, while read, when its readers are done)."""
        synced = self._synced
        while synced:
            key, version, ok = synced.popleft()
            if ok:
                self._stats.blocks_made_durable += 1
                continue
            self._stats.durability_failed += 1
            e = self._entries.get(key)
            if e is None or e.version != version or e.state is SlotState.WRITING:
                continue  # evicted or replaced meanwhile: nothing doubtful is served
            if e.state is SlotState.READY:
                self._evict(e, unlink=True)
            else:
                e.doomed = True

    def _apply_done(self) -> None:
        self._apply_synced()
        done = self._done
        while done:
            r = done.popleft()
            e = self._entries.get(r.key)
            if r.is_store:
                self._apply_store(e, r)
            else:
                self._apply_load(e, r)
            js = self._jobs.get(r.job_id)
            if js is None:
                continue
            js.remaining -= 1
            js.ok = js.ok and r.ok
            if js.remaining == 0:
                del self._jobs[r.job_id]
                self._finished.append(JobResult(r.job_id, js.ok))

    def _apply_store(self, e: _Entry | None, r: _Done) -> None:
        if e is None or e.version != r.version or e.state is not SlotState.WRITING:
            if r.ok and r.info is not None:
                if self.durable:
                    self._forgive()
                if not self._closed:
                    self._pool.submit_write(self._unlink, r.info.path)  # written for nothing
            return
        if r.ok and r.info is not None:
            if self.durable:
                self._submit_sync(e.key, r.info)
            match e.commit_write():
                case SlotEffect.EMIT_STORED:
                    self._events.append(OffloadingEvent((e.key,), self.name, removed=False))
                case _:
                    pass
            e.info = r.info
            self._used_bytes += r.info.size - e.reserved
            e.reserved = r.info.size
            self._ready[e.key] = None
            self._payload_hint = r.info.payload_len
            self._stats.stores_committed += 1
            superseded, e.superseded = e.superseded, []
            for old in superseded:
                self._supersede(old, r.info)  # our version is committed: the older files go now
            if self._over(0, 0):
                self._make_room(0, 0)
            return
        e.abort_write()
        del self._entries[e.key]
        self._used_bytes -= e.reserved
        self._stats.stores_failed += 1
        if e.superseded and not self._closed:
            # The write that was to replace them failed: the newest older file is the valid copy again.
            older = sorted(e.superseded, key=lambda i: i.version)
            self._adopt(e.key, older[-1], source="fallback")
            if self._entries.get(e.key) is not None:
                for stale in older[:-1]:
                    self._supersede(stale, older[-1])

    def _apply_load(self, e: _Entry | None, r: _Done) -> None:
        if e is None or e.state is not SlotState.READING or e.version != r.version:
            return
        e.end_read()
        if r.ok:
            self._stats.loads_completed += 1
        else:
            self._stats.loads_failed += 1
            if r.corrupt:
                self._stats.corrupt_detected += 1
            if not r.cancelled:
                e.doomed = True  # its own read failed: never promote it again
                self._stats.invalidations += 1
        if e.current() is SlotState.READY:
            if e.doomed:
                self._evict(e, unlink=True)  # the reader may have removed it already: a quiet no-op then
            else:
                self._ready[e.key] = None  # the last reader's release counts as a use
