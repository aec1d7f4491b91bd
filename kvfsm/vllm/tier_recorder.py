"""kvfsm as the checker of vLLM's own tiering: a trace of ``TieringOffloadingManager`` and its secondary tiers.

:class:`TieringRecorder` extends :class:`~kvfsm.vllm.recorder.NativeRecorder` (vLLM's connector scheduler,
recorded as before) from the manager down to the tiers, whichever they are: vLLM's fs tier, kvfsm's adapters
(:mod:`kvfsm.vllm.tiers`), vLLM's KVCR tier. Nothing in vLLM is edited; instance attributes are put over the
methods, and the recorder only translates what vLLM observably did into the spec's vocabulary:

- slot: the primary tier's chunks, keyed by offload key. The GPU-facing calls (``prepare_store``,
  ``complete_store``, ``prepare_load``, ``complete_load``) and the tier-facing ones vLLM names apart
  (``prepare_write``/``complete_write`` for a promotion's chunk, ``prepare_read``/``complete_read`` for a
  cascade's read) give ``begin_write``/``evict``, ``commit_write``/``abort_write`` and
  ``begin_read``/``end_read``; a promotion reserves its chunk (``begin_write``) in ``lookup``, before the
  job that fills it exists. ``defer_write_release`` (vLLM 0.34: a failed promotion whose I/O may still write
  the chunk) takes the key out of the cache at once, ``abort_write``, while the chunk itself stays held;
  ``reset_cache`` resets every slot.
- job ``cascade`` (a tier's ``submit_store``) and ``promote`` (``submit_load``), with W = 1: the tier is
  handed the job (``launch``) at submission, and ``get_finished_jobs`` reports it: ``ack`` to ``complete``,
  ``fail`` to ``failed``, or ``time_out`` (to ``timed_out``) where the report carries a ``deferred_release``
  that is not yet set, the spec's quarantine (the I/O may still run). vLLM commits a promotion key by key
  (``successful_keys``), so each key of a promotion is recorded as a job of its own (id ``J.i``), and a
  partly successful promotion is the keys that completed and the keys that failed. A tier's results are
  recorded before vLLM acts on them, so a promoted chunk commits after its job completed.
- engine: as :class:`NativeRecorder`, with the connector's ``has_pending_push_work()``, which under vLLM's
  tiering asks every tier's ``has_pending_work()``.

The trace is written by a :class:`~kvfsm.observe.trace.TraceRecorder` made with ``process_wide=False``:
kvfsm's own tiers, below vLLM's manager, run kvfsm machines of their own that are not vLLM's primary tier.
``kvfsm check --trace`` then replays the trace against the spec: the slot and job rules, an engine that
goes idle with work left, and one that never can (the trace ends with the engine not stopped).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from kvfsm.errors import ConfigError
from kvfsm.observe.trace import TraceRecorder
from kvfsm.vllm.recorder import NativeRecorder, RecordedJob

__all__ = ["TieringRecorder"]

#: vLLM's primary tier binds these tier-facing names at construction (``prepare_write = prepare_store`` and so
#: on); ``prepare_read`` is a method of its own (a cascade's read leaves recency alone).
PRIMARY_ALIASES: dict[str, tuple[str, ...]] = {
    "prepare_store": ("prepare_write",),
    "complete_store": ("complete_write",),
    "prepare_load": ("prepare_read",),
    "complete_load": ("complete_read",),
}


class TieringRecorder(NativeRecorder):
    """Records vLLM's connector scheduler whose manager is a ``TieringOffloadingManager``, and its tiers."""

    def __init__(self, native: Any, trace: TraceRecorder, world_size: int) -> None:
        if trace.process_wide:
            # kvfsm's tiers below vLLM's adapters run kvfsm's own job and slot machines, whose records would
            # mix with the primary tier's under the same keys.
            raise ConfigError(
                "record vLLM's tiering with TraceRecorder(..., process_wide=False): only the recorder's own "
                "records belong in its trace"
            )
        manager = native.manager
        primary = getattr(manager, "primary_tier", None)
        tiers = getattr(manager, "secondary_tiers", None)
        if primary is None or tiers is None:
            raise TypeError(f"{type(manager).__name__} is not vLLM's TieringOffloadingManager")
        super().__init__(native, trace, world_size, slots_of=primary, aliases=PRIMARY_ALIASES)
        self.manager = manager
        #: (tier index, vLLM job id) -> the recorded jobs (one for a cascade, one per key for a promotion)
        self.tier_jobs: dict[tuple[int, int], list[RecordedJob]] = {}
        self._wrap_primary(primary)
        for index, tier in enumerate(tiers):
            self._wrap_tier(index, tier)

    # ------------------------------------------------------------------ the primary's deferred release

    def _wrap_primary(self, primary: Any) -> None:
        orig_defer: Callable[..., Any] | None = getattr(primary, "defer_write_release", None)
        if orig_defer is None:  # vLLM before 0.34
            return

        def defer_write_release(keys: Any) -> Any:
            result = orig_defer(keys)
            for key in keys:
                slot = self.slots.get(bytes(key))
                if slot is not None and slot.state == "writing":
                    self._slot_fire(slot, "abort_write", "absent")
            return result

        primary.defer_write_release = defer_write_release

    # ------------------------------------------------------------------ the tiers' jobs

    def _submitted(self, index: int, job: Any, kind: str) -> None:
        keys = [bytes(k) for k in job.keys]
        req_id = str(getattr(job.req_context, "req_id", ""))
        if kind == "cascade":
            records = [RecordedJob(job.job_id, kind, req_id, keys, 1)]
        else:
            records = [RecordedJob(f"{job.job_id}.{i}", kind, req_id, [k], 1) for i, k in enumerate(keys)]
        self.tier_jobs[(index, int(job.job_id))] = records
        for rec in records:

            def launched(rec: RecordedJob = rec) -> None:
                rec.launched_mask = 1

            self._fire_before("job", rec, "launch", "in_flight", launched)

    def _report(self, rec: RecordedJob, event: str, dest: str) -> None:
        def reported() -> None:
            rec.reported_mask = 1
            rec.pending = 0
            if event == "fail":
                rec.failed_reports += 1

        self._fire_before("job", rec, event, dest, reported)

    def _finished(self, index: int, result: Any) -> None:
        records = self.tier_jobs.pop((index, int(result.job_id)), None)
        if records is None:
            return  # a job the recorder never saw submitted (vLLM's manager asserts on it)
        success = bool(result.success)
        good = {bytes(k) for k in (getattr(result, "successful_keys", None) or ())}
        release = getattr(result, "deferred_release", None)
        quarantined = release is not None and not release.is_set()
        for rec in records:
            if success or (rec.kind == "promote" and rec.keys[0] in good):
                self._report(rec, "ack", "complete")
            elif quarantined and rec.kind == "promote":
                self._fire("job", rec, "time_out", "timed_out")
            else:
                self._report(rec, "fail", "failed")

    def _wrap_tier(self, index: int, tier: Any) -> None:
        orig_store = tier.submit_store
        orig_load = tier.submit_load
        orig_finished = tier.get_finished_jobs

        def submit_store(job_metadata: Any) -> None:
            self._submitted(index, job_metadata, "cascade")
            orig_store(job_metadata)

        def submit_load(job_metadata: Any) -> None:
            self._submitted(index, job_metadata, "promote")
            orig_load(job_metadata)

        def get_finished_jobs() -> Iterable[Any]:
            results = list(orig_finished())
            for result in results:
                self._finished(index, result)
            return results

        tier.submit_store = submit_store
        tier.submit_load = submit_load
        tier.get_finished_jobs = get_finished_jobs
