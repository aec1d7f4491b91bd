"""Conformance of kvfsm's tiers as vLLM ``SecondaryTierManager``s, driven through vLLM's own tiering manager.

A Hypothesis state machine builds vLLM's ``TieringOffloadingManager`` with vLLM's spec factory from a
``secondary_tiers`` entry (``KvfsmFsTier``, or ``KvfsmRedisTier`` on a real redis-server; skipped without one)
and plays vLLM's scheduler against it: it stores chunks (real bytes written into vLLM's primary memory, then
cascaded), looks them up (a secondary hit is promoted into the primary), loads what the primary serves, steps,
drains, empties the primary, injects I/O failures and damages the tier's copies (a block file's byte, a
Redis value). The kvfsm tier's real I/O runs on its own threads but is held in flight by a HANG fault on every
I/O operation (``tier.faults``), and runs only inside the rules that release it; so every rule and every
check sees work really queued or running, and the ground truth read at a check cannot change under it.

What is judged, and against what (never the adapter's own counters):

- **no wrong bytes**: the chunk rows of a promotion are poisoned when vLLM hands the promotion to the adapter,
  so only the tier's writes can make them right; whenever the adapter reports keys of a promotion arrived,
  their rows must hold exactly the bytes stored under those keys, and so must every chunk the primary
  serves (checked after every rule, and at every load);
- **a cascade is reported only once its copy exists**: when the adapter reports a store successful, the tier's
  own copy of each key (the block file decoded, the value read from the server) holds exactly the key's bytes,
  unless the test damaged it meanwhile;
- **every job reported exactly once**: each job vLLM submitted is returned by the adapter's
  ``get_finished_jobs`` once, and nothing else is (recorded on the adapter's vLLM-facing methods);
- **pending work**: the adapter's ``has_pending_work()`` equals (a job vLLM submitted is unreported, or the
  kvfsm tier's own job table holds a job, or the kvfsm tier has work of its own: Redis writes staged, fs
  blocks not yet synced), and vLLM's manager says True whenever that holds;
- **the end**: with the I/O let run, the engine steps until vLLM's manager is idle; then every job was
  reported, the kvfsm tier holds none, nothing hangs, no primary chunk is held for a deferred release.

With vLLM 0.34 (``JobResult.deferred_release``) the fs machine may draw a promotion deadline so short that
every promotion still held at the next poll is reported failed with a deferred release: the same checks then
cover vLLM's deferred-release path.
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import pytest

# The real vLLM with its tiering spec; an older vLLM without tiering skips this module.
pytest.importorskip("vllm.v1.kv_offload.tiering.manager")
pytest.importorskip("vllm.v1.kv_offload.tiering.factory")

import vllm.v1.kv_offload.base as offload_base
from hypothesis import HealthCheck, event, note, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from redis_support import needs_redis, session_server, stop_session_servers
from tiers_support import GUARD_S, ROW, build, flat, fs_entry, key, payload, redis_entry, step
from typing_extensions import override

from kvfsm.machines.names import SlotState
from kvfsm.tiers.blockfile import decode
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.vllm.tiers import KvfsmFsTier, supports_deferred_release

NUM_KEYS = 6  #: the key universe: more keys than primary chunks, so chunks are evicted, promoted, re-stored
NUM_CHUNKS = 4  #: vLLM's primary (CPU) chunks
KEYS = st.integers(0, NUM_KEYS - 1)
#: Bytes a promoted chunk holds until the tier writes it: no stored key has this pattern.
POISON = bytes([0xA5]) * ROW
KEY_INDEX = {key(i): i for i in range(NUM_KEYS)}
_examples = itertools.count()
#: Counts over every example of this run, by machine (printed at the end of the module with -s).
TOTALS: dict[str, Counter[str]] = {}


def index_of(k: Any) -> int:
    """The i of ``tiers_support.key(i)`` (the bytes stored under a key are ``payload(i)``)."""
    i = KEY_INDEX.get(k)
    if i is None:
        i = int.from_bytes(bytes(k)[len(b"kvfsm-tier") : len(b"kvfsm-tier") + 6], "big")
        assert key(i) == k, f"{bytes(k)!r} is not a key of tiers_support.key()"
    return i


def _name(k: Any) -> str:
    return f"key {index_of(k)}"


# ---------------------------------------------------------------------------------------------- the ledger


@dataclass(frozen=True, slots=True)
class SubmittedJob:
    """A job as vLLM handed it to the adapter."""

    job_id: int
    promotion: bool
    keys: tuple[Any, ...]
    chunk_ids: tuple[int, ...]
    #: the test's damage count of each key at submission (a copy damaged since is not the tier's fault)
    damage_at_submit: tuple[int, ...]


class JobLedger:
    """What vLLM's manager handed an adapter and what the adapter handed back, recorded on the adapter's
    vLLM-facing methods (wrapped on the instance, so vLLM calls the real adapter through them).

    At each report it judges against ground truth: the bytes in vLLM's primary memory (``view``) and the
    tier's own copy of a key (``tier_copy``: its bytes, or None where the tier legitimately no longer holds
    it). Problems are collected in :attr:`violations`; the caller asserts them empty.
    """

    def __init__(
        self,
        adapter: Any,
        view: memoryview,
        tier_copy: Callable[[Any], bytes | None],
        damage: Counter[Any] | None = None,
    ) -> None:
        self.adapter = adapter
        self.view = view
        self.tier_copy = tier_copy
        self.damage: Counter[Any] = damage if damage is not None else Counter()
        self.submitted: dict[int, SubmittedJob] = {}
        self.reports: Counter[int] = Counter()
        self.results: dict[int, Any] = {}
        self.violations: list[str] = []
        #: counts, for the reports printed with -s
        self.promoted_keys_checked = 0
        self.copies_checked = 0
        self.deferred_releases = 0
        self._submit_store = adapter.submit_store
        self._submit_load = adapter.submit_load
        self._get_finished_jobs = adapter.get_finished_jobs
        adapter.submit_store = self._on_submit_store
        adapter.submit_load = self._on_submit_load
        adapter.get_finished_jobs = self._on_get_finished_jobs

    # -- the wrapped methods --

    def _record(self, job: Any, promotion: bool) -> None:
        if job.job_id in self.submitted:
            self.violations.append(f"vLLM reused job id {job.job_id}")
        keys = tuple(job.keys)
        self.submitted[job.job_id] = SubmittedJob(
            job.job_id,
            promotion,
            keys,
            tuple(int(c) for c in job.chunk_ids.tolist()),
            tuple(self.damage[k] for k in keys),
        )

    def _on_submit_store(self, job: Any) -> None:
        self._record(job, promotion=False)
        self._submit_store(job)

    def _on_submit_load(self, job: Any) -> None:
        self._record(job, promotion=True)
        # vLLM reserved these chunks for the promotion; until the tier writes them their bytes are undefined.
        # Poisoned, a chunk can only hold a key's bytes if the tier wrote them there.
        for chunk in job.chunk_ids.tolist():
            self.view[int(chunk) * ROW : (int(chunk) + 1) * ROW] = POISON
        self._submit_load(job)

    def _on_get_finished_jobs(self) -> list[Any]:
        results = list(self._get_finished_jobs())
        for res in results:
            self._judge(res)
        self._judge_failed_loads(results)
        return results

    # -- judgments --

    def _judge(self, res: Any) -> None:
        job = self.submitted.get(res.job_id)
        if job is None:
            self.violations.append(f"the adapter reported job {res.job_id}, which vLLM never submitted")
            return
        self.reports[res.job_id] += 1
        if self.reports[res.job_id] > 1:
            self.violations.append(f"the adapter reported job {res.job_id} {self.reports[res.job_id]} times")
            return
        self.results[res.job_id] = res
        if job.promotion:
            arrived = set(job.keys) if res.success else set(res.successful_keys or ())
            if getattr(res, "deferred_release", None) is not None:
                self.deferred_releases += 1
            for k, chunk in zip(job.keys, job.chunk_ids, strict=True):
                if k in arrived:
                    self._check_row(k, chunk, f"promotion job {res.job_id} reported it arrived")
        elif res.success:
            for k, before in zip(job.keys, job.damage_at_submit, strict=True):
                if self.damage[k] != before:
                    continue  # the test damaged this copy after the job was submitted
                copy = self.tier_copy(k)
                self.copies_checked += 1
                if copy is not None and copy != payload(index_of(k)):
                    what = "no committed copy" if not copy else f"{len(copy)} other bytes"
                    self.violations.append(
                        f"store job {res.job_id} reported done, but the tier's copy of {_name(k)} holds {what}"
                    )

    def _judge_failed_loads(self, results: list[Any]) -> None:
        """A key whose promotion failed answers MISS now (else vLLM would promote it again and again), unless
        a store of it succeeded in the same poll (a fresh copy)."""
        failed: set[Any] = set()
        stored: set[Any] = set()
        for res in results:
            job = self.submitted.get(res.job_id)
            if job is None or self.reports[res.job_id] != 1:
                continue
            if job.promotion:
                failed.update(set(job.keys) - (set(job.keys) if res.success else set(res.successful_keys or ())))
            elif res.success:
                stored.update(job.keys)
        ctx = offload_base.ReqContext(req_id="kvfsm-failed-load-check")
        for k in failed - stored:
            answer = self.adapter.lookup(k, ctx)
            if answer is not offload_base.LookupResult.MISS:
                self.violations.append(f"{_name(k)} answers {answer.name} right after its promotion failed")

    def _check_row(self, k: Any, chunk: int, why: str) -> None:
        self.promoted_keys_checked += 1
        row = bytes(self.view[chunk * ROW : (chunk + 1) * ROW])
        if row != payload(index_of(k)):
            what = "the poison (never written)" if row == POISON else "other bytes"
            self.violations.append(f"{why}: {_name(k)} in chunk {chunk} holds {what}")

    # -- ground truth --

    def unreported(self) -> list[int]:
        """Jobs vLLM submitted that the adapter has not reported back yet."""
        return sorted(j for j in self.submitted if self.reports[j] == 0)

    def counts(self) -> dict[str, int]:
        results = list(self.results.values())
        promotions = [r for r in results if self.submitted[r.job_id].promotion]
        return {
            "jobs_submitted": len(self.submitted),
            "jobs_reported": sum(1 for j in self.submitted if self.reports[j] == 1),
            "reported_twice": sum(1 for n in self.reports.values() if n > 1),
            "store_jobs_ok": sum(1 for r in results if r.success and not self.submitted[r.job_id].promotion),
            "store_jobs_failed": sum(1 for r in results if not r.success and not self.submitted[r.job_id].promotion),
            "promotion_jobs_ok": sum(1 for r in promotions if r.success),
            "promotion_jobs_failed": sum(1 for r in promotions if not r.success),
            "deferred_releases": self.deferred_releases,
            "promoted_keys_checked": self.promoted_keys_checked,
            "copies_checked": self.copies_checked,
        }


def primary_wrong_bytes(manager: Any, keys: Iterable[Any]) -> list[str]:
    """Every key vLLM's primary would serve now (HIT) whose chunk does not hold the key's bytes. The chunk is
    pinned as a cascade pins it (``prepare_read``: no request access recorded) while it is read."""
    primary = manager.primary_tier
    ctx = offload_base.ReqContext(req_id="kvfsm-byte-check")
    view = flat(manager)
    wrong = []
    for k in keys:
        if primary.lookup(k, ctx) is not offload_base.LookupResult.HIT:
            continue
        (chunk,) = (int(c) for c in primary.prepare_read([k], ctx).chunk_ids.tolist())
        try:
            if bytes(view[chunk * ROW : (chunk + 1) * ROW]) != payload(index_of(k)):
                wrong.append(f"vLLM's primary serves {_name(k)} from chunk {chunk} with other bytes")
        finally:
            primary.complete_read([k], ctx)
    return wrong


def pending_truth(ledger: JobLedger, inner: Any) -> tuple[bool, str]:
    """Whether the engine must keep stepping for this tier, from ground truth: a job vLLM submitted is not
    reported back yet, the kvfsm tier's own job table holds a job (a promotion reported at its deadline whose
    I/O still runs included), or the kvfsm tier has work of its own (staged writes, unsynced blocks)."""
    unreported = ledger.unreported()
    inner_jobs = sorted(inner.pending_job_ids())
    own = bool(inner.has_pending_work())
    why = f"unreported jobs {unreported}, kvfsm tier jobs {inner_jobs}, kvfsm tier's own work {own}"
    return bool(unreported) or bool(inner_jobs) or own, why


# ---------------------------------------------------------------------------------------------- the machine


@pytest.fixture(scope="module", autouse=True)
def _module_server_and_totals() -> Iterator[None]:
    """The Redis machine's one server is started on first use and stopped after the module; then the counts
    of every example are printed (-s)."""
    yield
    stop_session_servers()
    for machine, counts in TOTALS.items():
        print(f"\n{machine}: {dict(counts)}")


class VllmTierMachine(RuleBasedStateMachine):
    """vLLM's ``TieringOffloadingManager`` over one kvfsm tier adapter, with the tier's I/O held by faults.

    Subclasses say which tier (:meth:`tier_entry`), how to read its copy of a key (:meth:`tier_copy`) and how
    to damage it (:meth:`damage_copy`), and which I/O operations a failure may be armed on (:attr:`FAILURES`).
    """

    #: (operation, fault kind) pairs the ``arm_io_failure`` rule may arm for the next release
    FAILURES: ClassVar[tuple[tuple[str, FaultKind], ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        self.example = next(_examples)
        self.manager: Any = None
        self.adapter: Any = None
        self.ledger: JobLedger | None = None
        self.damage_counts: Counter[Any] = Counter()
        # Every I/O operation of the kvfsm tier hangs while this rule is in the plan (it is always the first).
        self.hold = FaultRule("*", FaultKind.HANG)
        self.plan = FaultPlan([self.hold])
        self.armed: list[FaultRule] = []
        self.served = 0
        self.checks = 0
        self.checks_with_io_held = 0

    # -- to override --

    def tier_entry(self, early_deadline: bool, durable: bool) -> dict[str, Any]:
        raise NotImplementedError

    def tier_copy(self, k: Any) -> bytes | None:
        raise NotImplementedError

    def damage_copy(self, k: Any, how: str) -> bool:
        """Damage the tier's copy of ``k`` behind its back; False if it holds none."""
        raise NotImplementedError

    def cleanup(self) -> None:
        """Remove what the example left (its directory, its values)."""

    # -- plumbing --

    @property
    def inner(self) -> Any:
        """The kvfsm tier the adapter wraps."""
        return self.adapter.tier

    def _let_io_run(self) -> None:
        """Lift the hold (and arm the failures) and release every operation hanging now."""
        self.plan.remove(self.hold)
        for fault in self.armed:
            self.plan.add(fault)
        self.plan.release_hangs()

    def _wait_io(self) -> None:
        assert self.inner.wait_idle(GUARD_S), "the kvfsm tier's I/O never went idle"

    def _hold_io(self) -> None:
        """Hold every I/O operation again (called with the tier's I/O idle; failures armed are disarmed)."""
        for fault in self.armed:
            self.plan.remove(fault)
        self.armed.clear()
        self.plan.add(self.hold)

    def _new_request(self, what: str) -> Any:
        ctx = offload_base.ReqContext(req_id=f"{what}-{next(_examples)}")
        self.manager.on_new_request(ctx)
        return ctx

    # -- rules --

    def _store(self, ids: list[int]) -> None:
        ctx = self._new_request("writer")
        try:
            out = self.manager.prepare_store([key(i) for i in ids], ctx)
            if out is None:
                note(f"store keys {ids}: no room in the primary")
                return
            chunks = [int(c) for c in out.store_spec.chunk_ids.tolist()]
            note(f"store keys {[KEY_INDEX[k] for k in out.keys_to_store]} into chunks {chunks}")
            view = flat(self.manager)
            for k, chunk in zip(out.keys_to_store, chunks, strict=True):
                view[chunk * ROW : (chunk + 1) * ROW] = payload(KEY_INDEX[k])
            if out.keys_to_store:
                self.manager.complete_store(list(out.keys_to_store), ctx)
        finally:
            self.manager.on_request_finished(ctx)

    def _reset_primary(self) -> None:
        """vLLM's reset (the tiers drain), then the primary's memory zeroed: only a promotion can fill it."""
        self.manager.reset_cache()
        if hasattr(self.manager, "on_reset_flushed"):
            self.manager.on_reset_flushed()
        view = flat(self.manager)
        view[:] = bytes(len(view))

    @initialize(
        early_deadline=st.booleans(),
        durable=st.booleans(),
        preload=st.lists(KEYS, max_size=NUM_CHUNKS, unique=True),
    )
    def build(self, early_deadline: bool, durable: bool, preload: list[int]) -> None:
        """vLLM's factory builds the manager and the tier; ``preload`` keys are stored, cascaded and dropped
        from the primary first (I/O let run), so the tier holds them and lookups promote from the start."""
        early_deadline = early_deadline and supports_deferred_release()
        entry = self.tier_entry(early_deadline, durable)
        note(f"tier {entry['type']}: early deadline {early_deadline}, durable {durable}, preloaded keys {preload}")
        self.manager = build([entry], num_chunks=NUM_CHUNKS)
        (self.adapter,) = self.manager.secondary_tiers
        if isinstance(self.adapter, KvfsmFsTier):
            assert self.inner.wait_scan(GUARD_S), "the fs tier's start-up scan never finished"
        self.inner.faults = self.plan
        self.ledger = JobLedger(self.adapter, flat(self.manager), self.tier_copy, self.damage_counts)
        if preload:
            self._let_io_run()
            self._store(preload)
            end = time.monotonic() + GUARD_S
            while self.manager.has_pending_work():
                assert time.monotonic() < end, "the preloaded keys' cascades never ended"
                step(self.manager)
                self._wait_io()
            self._reset_primary()
            self._hold_io()

    @rule(first=KEYS, count=st.integers(1, 3), end_step=st.booleans())
    def store(self, first: int, count: int, end_step: bool) -> None:
        """A request stores chunks: vLLM's GPU->CPU copy writes their bytes into the primary, then the store
        completes, which cascades them to the tier (Redis sends its writes when the step ends: ``end_step``)."""
        self._store([(first + j) % NUM_KEYS for j in range(count)])
        if end_step:
            step(self.manager)

    @rule(first=KEYS, count=st.integers(1, 3), end_step=st.booleans())
    def lookup_and_load(self, first: int, count: int, end_step: bool) -> None:
        """A request looks chunks up: a primary hit is loaded at once (its bytes compared; a later lookup's
        promotion may evict an unpinned chunk), a secondary hit starts a promotion (submitted when the step
        ends: ``end_step``)."""
        ctx = self._new_request("reader")
        answers = []
        try:
            for i in ((first + j) % NUM_KEYS for j in range(count)):
                answer = self.manager.lookup(key(i), ctx)
                answers.append(f"{i}: {answer.name}")
                if answer is not offload_base.LookupResult.HIT:
                    continue
                (chunk,) = (int(c) for c in self.manager.prepare_load([key(i)], ctx).chunk_ids.tolist())
                data = bytes(flat(self.manager)[chunk * ROW : (chunk + 1) * ROW])
                self.manager.complete_load([key(i)], ctx)
                assert data == payload(i), f"vLLM's primary served key {i} from chunk {chunk} with wrong bytes"
                self.served += 1
        finally:
            note(f"lookups {', '.join(answers)}")
            self.manager.on_request_finished(ctx)
        if end_step:
            step(self.manager)

    @rule()
    def step(self) -> None:
        """The end of a scheduler step: vLLM polls the tier, submits queued promotions, ends the tier's step."""
        step(self.manager)

    @rule()
    def io_runs(self) -> None:
        """The kvfsm tier's held I/O (and any armed failure) runs to the end; then it is held again. The
        results wait for vLLM's next poll."""
        note(f"the tier's I/O runs ({self.plan.hanging} operations held, failures armed: {len(self.armed)})")
        self._let_io_run()
        self._wait_io()
        self._hold_io()

    @rule(rounds=st.integers(1, 3))
    def serve_a_while(self, rounds: int) -> None:
        """A few scheduler steps, each followed by the tier's I/O running: promotions and Redis existence
        checks started earlier complete (the long way round, one rule)."""
        note(f"{rounds} steps with the tier's I/O let run after each")
        for _ in range(rounds):
            step(self.manager)
            self.io_runs()

    @rule()
    def drain(self) -> None:
        """The adapter's own drain (what vLLM's reset calls): its I/O finishes and every result is taken from
        the kvfsm tier, not yet delivered to vLLM, so the results wait as undelivered pending work."""
        note("the adapter drains")
        self._let_io_run()
        self.adapter.drain_jobs()
        self._hold_io()

    @rule()
    def empty_primary(self) -> None:
        """vLLM's reset: the tiers drain, the primary forgets everything; its memory is zeroed after, so only
        a promotion can fill it again."""
        note("vLLM's reset_cache empties the primary")
        self._let_io_run()
        self._reset_primary()
        self._hold_io()

    @rule(data=st.data())
    def arm_io_failure(self, data: st.DataObject) -> None:
        """The next release of the held I/O fails one operation of this kind (on whichever job reaches it)."""
        if not self.FAILURES:
            return
        op, kind = data.draw(st.sampled_from(self.FAILURES), label="failure")
        note(f"arm a {kind.value} at the next {op}")
        self.armed.append(FaultRule(op, kind, times=1))

    @rule(i=KEYS, how=st.sampled_from(["garbage", "flip", "truncate", "remove"]))
    def damage(self, i: int, how: str) -> None:
        """The tier's copy of a key is damaged behind its back (a bad disk, another writer on the server)."""
        if self.damage_copy(key(i), how):
            self.damage_counts[key(i)] += 1
            note(f"damage the tier's copy of key {i} ({how})")

    # -- checks --

    @invariant()
    def judged_against_ground_truth(self) -> None:
        if self.ledger is None:
            return
        problems = list(self.ledger.violations)
        problems += primary_wrong_bytes(self.manager, KEY_INDEX)
        truth, why = pending_truth(self.ledger, self.inner)
        said = self.adapter.has_pending_work()
        if said != truth:
            problems.append(f"the adapter's has_pending_work() is {said}, but the ground truth is {truth} ({why})")
        if truth and not self.manager.has_pending_work():
            problems.append(f"vLLM's manager says no pending work, but {why}")
        strangers = set(self.inner.pending_job_ids()) - set(self.ledger.submitted)
        if strangers:
            problems.append(f"the kvfsm tier holds jobs vLLM never submitted: {sorted(strangers)}")
        self.checks += 1
        if self.plan.hanging:
            self.checks_with_io_held += 1
            event("checked with the tier's I/O held in flight")
        assert not problems, "; ".join(problems[:6])

    @override
    def teardown(self) -> None:
        if self.manager is None:
            self.cleanup()
            return
        try:
            self._let_io_run()
            self.plan.clear()  # no more faults: the engine runs everything to the end
            self.plan.release_hangs()
            self._wait_io()  # I/O that is no job's and no pending work (an old block file's removal) ends too
            end = time.monotonic() + GUARD_S
            while self.manager.has_pending_work():
                assert time.monotonic() < end, "vLLM's manager never went idle with the tier's I/O let run"
                step(self.manager)
                self._wait_io()
            ledger = self.ledger
            assert ledger is not None
            assert not ledger.violations, "; ".join(ledger.violations[:6])
            assert not ledger.unreported(), f"jobs never reported: {ledger.unreported()}"
            assert not self.inner.pending_job_ids(), f"the kvfsm tier still holds jobs {self.inner.pending_job_ids()}"
            assert not self.adapter.has_pending_work()
            assert self.plan.hanging == 0
            assert getattr(self.manager.primary_tier, "num_deferred_release_chunks", 0) == 0
            assert not primary_wrong_bytes(self.manager, KEY_INDEX)
            counts = {
                **ledger.counts(),
                "loads_served": self.served,
                "checks": self.checks,
                "checks_with_io_held": self.checks_with_io_held,
            }
            note(f"counts: {counts}")
            TOTALS.setdefault(type(self).__name__, Counter()).update({"examples": 1, **counts})
        finally:
            try:
                self.manager.shutdown()
            finally:
                self.cleanup()


# ---------------------------------------------------------------------------------------------- fs


class FsTierMachine(VllmTierMachine):
    """``KvfsmFsTier`` on a fresh directory (durable or not, drawn)."""

    FAILURES = (
        ("slot.read", FaultKind.EIO),
        ("fs.write", FaultKind.ENOSPC),
        ("fs.replace", FaultKind.EIO),
        ("fs.read", FaultKind.EIO),
        ("fs.read", FaultKind.CORRUPT),
        ("fs.read", FaultKind.SHORT_READ),
        ("slot.write", FaultKind.EIO),
        ("fs.fsync", FaultKind.EIO),
    )

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="kvfsm-vllm-conf-"))
        #: block files the test damaged: the tier cannot know until it reads one, so they are not judged
        self.damaged_files: set[str] = set()

    @override
    def tier_entry(self, early_deadline: bool, durable: bool) -> dict[str, Any]:
        # A deadline far below any step's length: a promotion still held at the next poll is reported failed
        # at once with a deferred release (vLLM 0.34), deterministically (its I/O cannot finish while held).
        deadline = {"promote_timeout_s": 1e-6} if early_deadline else {}
        return fs_entry(self.root / "fs", fs_durable=durable, lookup_ttl_steps=4, **deadline)

    @override
    def tier_copy(self, k: Any) -> bytes | None:
        """The key's committed block file, decoded and verified (read on the test thread); None if the tier
        no longer holds the key (a failed read evicted it), b"" if it holds it with no committed file."""
        if self.inner.entry_state(k) is SlotState.ABSENT:
            return None
        path = self.inner.file_of(k)
        if path is None:
            return b""
        if path in self.damaged_files:
            return None
        return decode(Path(path).read_bytes(), k)[1]

    @override
    def damage_copy(self, k: Any, how: str) -> bool:
        path = self.inner.file_of(k)
        if path is None or not Path(path).exists():
            return False
        self.damaged_files.add(path)
        raw = bytearray(Path(path).read_bytes())
        if how == "truncate":
            raw = raw[: len(raw) // 2]
        elif how == "remove":
            Path(path).unlink()
            return True
        elif how == "garbage":
            raw[-ROW:] = bytes(ROW)
        else:
            raw[len(raw) - 7] ^= 0x40
        Path(path).write_bytes(bytes(raw))
        return True

    @override
    def cleanup(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- Redis


class RedisTierMachine(VllmTierMachine):
    """``KvfsmRedisTier`` on a real redis-server (one per module; a key prefix of its own per example)."""

    FAILURES = (
        ("slot.read", FaultKind.EIO),
        ("redis.set", FaultKind.EIO),
        ("redis.get", FaultKind.EIO),
        ("redis.exists", FaultKind.EIO),
        ("slot.write", FaultKind.EIO),
    )

    def __init__(self) -> None:
        super().__init__()
        self.server = session_server()
        self.reader: Any = self.server.client()

    @override
    def tier_entry(self, early_deadline: bool, durable: bool) -> dict[str, Any]:
        # The Redis tier's operation timeout is the promotion deadline: no early deadline here.
        return redis_entry(self.server.url, redis_prefix=f"conf{self.example}-{time.time_ns()}", lookup_ttl_steps=4)

    def _redis_key(self, k: Any) -> str:
        name: str = self.inner.redis_key(k)
        return name

    @override
    def tier_copy(self, k: Any) -> bytes | None:
        """The value on the server, decoded and verified; b"" if absent (nothing here evicts it)."""
        from kvfsm.tiers.redis_codec import decode_value

        raw = self.reader.get(self._redis_key(k))
        if raw is None:
            return b""
        return decode_value(raw, self.inner.namespace.digest(), k, ROW)

    @override
    def damage_copy(self, k: Any, how: str) -> bool:
        name = self._redis_key(k)
        raw = self.reader.get(name)
        if raw is None:
            return False
        if how == "remove":
            self.reader.delete(name)
        elif how == "truncate":
            self.reader.set(name, raw[:-7])
        elif how == "garbage":
            self.reader.set(name, b"garbage" * 40)
        else:
            flipped = bytearray(raw)
            flipped[-5] ^= 0x10
            self.reader.set(name, bytes(flipped))
        return True

    @override
    def cleanup(self) -> None:
        try:
            if self.adapter is not None:
                self.reader.delete(*(self._redis_key(k) for k in KEY_INDEX))
        finally:
            self.reader.close()


def _profile(max_examples: int) -> settings:
    return settings(
        settings(),
        max_examples=min(max_examples, settings().max_examples),
        stateful_step_count=50,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )


TestFsTierThroughVllm = FsTierMachine.TestCase
TestFsTierThroughVllm.settings = _profile(60)

TestRedisTierThroughVllm = RedisTierMachine.TestCase
TestRedisTierThroughVllm.settings = _profile(40)
for _skip in needs_redis:  # skipped, with the install command, without redis-server or redis-py
    TestRedisTierThroughVllm = _skip(TestRedisTierThroughVllm)
