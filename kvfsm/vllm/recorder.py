"""kvfsm as an oracle for vLLM's NATIVE offloading connector: a trace of what vLLM's own scheduler does.

:class:`NativeRecorder` wraps one vLLM 0.33 ``OffloadingConnectorScheduler`` and its offloading manager at
runtime (instance attributes over the class's methods; nothing in vLLM is edited) and writes, through
kvfsm's :class:`~kvfsm.observe.trace.TraceRecorder`, kvfsm's NDJSON trace of the jobs, requests, CPU slots and
(driven by :meth:`NativeRecorder.engine_step`) the engine states vLLM goes through. ``kvfsm check --trace``
then replays that trace against kvfsm's spec. The recorder only translates what vLLM observably did into the
spec's vocabulary; it never decides a transition vLLM did not take:

- job: created when vLLM plans it (its ``_jobs`` grows), ``launch`` by each of the W ranks when it is handed
  to the workers in the step's metadata, one ``ack`` per completion vLLM counts (vLLM counts reports, kvfsm
  attributes them to ranks: the n-th report is recorded as rank n-1's), complete when vLLM completes it,
  ``discard`` (stale) at ``reset_cache``;
- request: ``defer`` (lookup answered None), ``start_load`` / ``schedule`` (allocation with / without
  external tokens), ``load_done`` when its load completes, ``preempt``, ``finish`` (``request_finished``),
  ``signal`` (the next ``build_connector_meta``), ``delete`` when vLLM drops its state, ``reset``;
- slot: ``begin_write`` / ``evict`` (``prepare_store``), ``commit_write`` / ``abort_write``
  (``complete_store``), ``begin_read`` / ``end_read`` (``prepare_load`` / ``complete_load``), ``reset``;
- engine: ``admit``, ``all_finished``, ``settle`` and ``shutdown`` / ``stop`` from the caller's engine loop,
  with vLLM's own ``has_pending_push_work()``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from kvfsm.observe.trace import TraceRecorder

__all__ = ["TRACE_ENV", "NativeRecorder"]


class _Ctx:
    __slots__ = ("req_id",)

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id


class _Request:
    __slots__ = ("ctx", "state")

    def __init__(self, req_id: str) -> None:
        self.ctx = _Ctx(req_id)
        self.state = "tracked"


class RecordedJob:
    __slots__ = (
        "failed_reports",
        "job_id",
        "keys",
        "kind",
        "launched_mask",
        "pending",
        "reported_mask",
        "req_id",
        "state",
        "world_size",
    )

    def __init__(self, job_id: int | str, kind: str, req_id: str, keys: Iterable[bytes], world_size: int) -> None:
        self.job_id = job_id
        self.kind = kind
        self.req_id = req_id
        self.keys = tuple(sorted(bytes(k) for k in keys))
        self.world_size = world_size
        self.pending = world_size
        self.failed_reports = 0
        self.launched_mask = 0
        self.reported_mask = 0
        self.state = "submitted"


class _Slot:
    __slots__ = ("key", "readers", "state")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.readers = 0
        self.state = "absent"


class _Engine:
    __slots__ = ("_pending", "state")

    def __init__(self, pending: Callable[[], bool]) -> None:
        self._pending = pending
        self.state = "idle"

    def has_pending_push_work(self) -> bool:
        return self._pending()


class NativeRecorder:
    """Records one vLLM ``OffloadingConnectorScheduler`` (and its manager) into a :class:`TraceRecorder`."""

    def __init__(
        self,
        native: Any,
        trace: TraceRecorder,
        world_size: int,
        *,
        record_slots: bool = True,
        slots_of: Any = None,
        aliases: dict[str, tuple[str, ...]] | None = None,
    ) -> None:
        """``slots_of`` is the object whose slot calls are recorded (by default ``native.manager``; under
        vLLM's tiering, its primary tier), and ``aliases`` names the other attributes of it that are the same
        calls (vLLM's primary tier binds ``prepare_write`` to ``prepare_store`` and so on)."""
        self.native = native
        self.trace = trace
        self.world_size = world_size
        self.requests: dict[str, _Request] = {}
        self.jobs: dict[int, RecordedJob] = {}
        self.slots: dict[bytes, _Slot] = {}
        self.engine = _Engine(native.has_pending_push_work)
        self.record_slots = record_slots
        self._wrap_scheduler(native)
        if record_slots:  # off where the manager is a test double (vLLM's connector suite mocks it)
            self._wrap_manager(native.manager if slots_of is None else slots_of, aliases or {})

    # ------------------------------------------------------------------ emitting

    def _fire(self, machine: str, model: Any, event: str, dest: str) -> None:
        source = model.state
        model.state = dest
        self.trace(machine, model, event, source, dest)

    def _fire_before(self, machine: str, model: Any, event: str, dest: str, update: Callable[[], None]) -> None:
        """Record with the model's counters as they were before the event (the trace reads them then)."""
        source = model.state
        self.trace(machine, model, event, source, dest)
        model.state = dest
        update()

    # ------------------------------------------------------------------ requests

    def _request(self, req_id: str) -> _Request:
        req = self.requests.get(req_id)
        if req is None:
            req = self.requests[req_id] = _Request(req_id)
        return req

    def _maybe_delete(self, req_id: str) -> None:
        req = self.requests.get(req_id)
        if req is not None and req.state == "finished_signalled" and req_id not in self.native._req_status:
            self._fire("request", req, "delete", "deleted")
            del self.requests[req_id]

    # ------------------------------------------------------------------ jobs

    def _new_jobs(self, before: set[int], kind: str) -> None:
        for job_id, status in self.native._jobs.items():
            if job_id in before or job_id in self.jobs:
                continue
            job_kind = "store" if status.is_store else "load"
            if job_kind != kind:
                continue
            # Without slot records a job's keys name nothing the trace can check, so none are written.
            keys = status.keys if self.record_slots else ()
            self.jobs[job_id] = RecordedJob(job_id, kind, status.req_id, keys, self.world_size)

    def _launch_all(self, job_ids: Iterable[int]) -> None:
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is None or job.state not in ("submitted", "in_flight"):
                continue
            for rank in range(self.world_size):
                if job.launched_mask >> rank & 1:
                    continue

                def launched(job: RecordedJob = job, rank: int = rank) -> None:
                    job.launched_mask |= 1 << rank

                self._fire_before("job", job, "launch", "in_flight", launched)

    def _ack(self, job: RecordedJob, done: bool) -> None:
        rank = next(r for r in range(job.world_size) if not job.reported_mask >> r & 1)
        last = job.pending == 1

        def reported() -> None:
            job.reported_mask |= 1 << rank
            job.pending -= 1

        dest = "complete" if (last and done) else "in_flight"
        self._fire_before("job", job, "ack", dest, reported)

    # ------------------------------------------------------------------ slots

    def _slot(self, key: bytes) -> _Slot:
        k = bytes(key)
        slot = self.slots.get(k)
        if slot is None:
            slot = self.slots[k] = _Slot(k)
        return slot

    def _slot_fire(self, slot: _Slot, event: str, dest: str, readers: int | None = None) -> None:
        self._fire_before("slot", slot, event, dest, lambda: None)
        if readers is not None:
            slot.readers = readers
        if dest == "absent":
            self.slots.pop(slot.key, None)

    # ------------------------------------------------------------------ wrapping

    def _wrap_scheduler(self, native: Any) -> None:
        orig_lookup = native.get_num_new_matched_tokens
        orig_alloc = native.update_state_after_alloc
        orig_build = native.build_connector_meta
        orig_output = native.update_connector_output
        orig_finished = native.request_finished
        orig_reset = native.reset_cache
        orig_new = native.on_new_request

        def on_new_request(request: Any) -> None:
            orig_new(request)
            self._request(request.request_id)

        def get_num_new_matched_tokens(request: Any, num_computed_tokens: int, **kw: Any) -> tuple[int | None, bool]:
            result: tuple[int | None, bool] = orig_lookup(request, num_computed_tokens, **kw)
            req = self._request(request.request_id)
            if result[0] is None and req.state in ("tracked", "deferred", "preempted"):
                self._fire("request", req, "defer", "deferred")
            return result

        def update_state_after_alloc(request: Any, blocks: Any, num_external_tokens: int) -> None:
            before = set(native._jobs)
            orig_alloc(request, blocks, num_external_tokens)
            req = self._request(request.request_id)
            if num_external_tokens > 0:
                self._fire("request", req, "start_load", "loading")
                self._new_jobs(before, "load")
            elif req.state in ("tracked", "deferred", "preempted"):
                self._fire("request", req, "schedule", "running")
            # else: vLLM's second call for a request whose load finished (it is running): no event

        def build_connector_meta(scheduler_output: Any) -> Any:
            before = set(native._jobs)
            for req_id in scheduler_output.preempted_req_ids or ():
                req = self.requests.get(req_id)
                if req is not None and req.state == "running":
                    self._fire("request", req, "preempt", "preempted")
            meta = orig_build(scheduler_output)
            self._new_jobs(before, "store")
            self._launch_all([*meta.load_jobs, *meta.store_jobs])
            for req_id in scheduler_output.finished_req_ids or ():
                req = self.requests.get(req_id)
                if req is not None and req.state == "finished_unsignalled":
                    self._fire("request", req, "signal", "finished_signalled")
                    self._maybe_delete(req_id)
            return meta

        def update_connector_output(connector_output: Any) -> None:
            meta = connector_output.kv_connector_worker_meta
            counts: dict[int, int] = dict(getattr(meta, "completed_jobs", {}) or {})
            threshold = native._stale_job_threshold
            # The acks are recorded before vLLM acts on them: a store's job completes, then its slots commit.
            finished: list[tuple[int, RecordedJob]] = []
            for job_id, count in counts.items():
                job = self.jobs.get(job_id)
                status = native._jobs.get(job_id)
                if job_id < threshold or job is None or status is None or job.state != "in_flight":
                    continue  # a stale job's late report: ignored by id, as kvfsm does
                done = status.pending_count - count <= 0
                for i in range(count):
                    self._ack(job, done and i == count - 1)
                if job.state == "complete":
                    finished.append((job_id, job))
            orig_output(connector_output)
            for job_id, job in finished:
                if job.state == "complete":
                    self.jobs.pop(job_id, None)
                    req = self.requests.get(job.req_id)
                    if job.kind == "load" and req is not None and req.state == "loading":
                        self._fire("request", req, "load_done", "running")
                    self._maybe_delete(job.req_id)

        def request_finished(request: Any) -> Any:
            result = orig_finished(request)
            req = self._request(request.request_id)
            if req.state not in ("finished_unsignalled", "finished_signalled", "deleted"):
                self._fire("request", req, "finish", "finished_unsignalled")
            return result

        def reset_cache() -> None:
            orig_reset()
            for job in list(self.jobs.values()):
                if job.state in ("submitted", "in_flight"):
                    self._fire("job", job, "discard", "stale")
            self.jobs.clear()
            for req_id, req in list(self.requests.items()):
                if req.state in ("finished_unsignalled", "finished_signalled"):
                    self._fire("request", req, "reset", "deleted")
                    del self.requests[req_id]
                elif req.state == "loading":
                    self._fire("request", req, "reset", "running")

        native.on_new_request = on_new_request
        native.get_num_new_matched_tokens = get_num_new_matched_tokens
        native.update_state_after_alloc = update_state_after_alloc
        native.build_connector_meta = build_connector_meta
        native.update_connector_output = update_connector_output
        native.request_finished = request_finished
        native.reset_cache = reset_cache

    def _wrap_manager(self, manager: Any, aliases: dict[str, tuple[str, ...]]) -> None:
        """Record the slot calls of ``manager``: each attribute named here (and each alias of it) is wrapped
        around its own original, so an alias that is a method of its own (vLLM's ``prepare_read``, which
        leaves recency alone) keeps its behaviour."""

        def prepare_store(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(keys: Any, req_context: Any) -> Any:
                out = orig(keys, req_context)
                if out is not None:
                    for key in out.evicted_keys or ():
                        slot = self._slot(key)
                        if slot.state == "ready":
                            self._slot_fire(slot, "evict", "absent")
                    for key in out.keys_to_store:
                        slot = self._slot(key)
                        if slot.state == "absent":
                            self._slot_fire(slot, "begin_write", "writing")
                return out

            return wrapper

        def complete_store(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(keys: Any, req_context: Any, success: bool = True) -> Any:
                result = orig(keys, req_context, success)
                for key in sorted(bytes(k) for k in keys):
                    slot = self.slots.get(key)
                    if slot is not None and slot.state == "writing":
                        self._slot_fire(
                            slot, "commit_write" if success else "abort_write", "ready" if success else "absent"
                        )
                return result

            return wrapper

        def prepare_load(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(keys: Any, req_context: Any) -> Any:
                out = orig(keys, req_context)
                for key in keys:
                    slot = self._slot(key)
                    if slot.state in ("ready", "reading"):
                        self._slot_fire(slot, "begin_read", "reading", slot.readers + 1)
                return out

            return wrapper

        def complete_load(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(keys: Any, req_context: Any) -> Any:
                result = orig(keys, req_context)
                for key in keys:
                    slot = self.slots.get(bytes(key))
                    if slot is not None and slot.state == "reading":
                        dest = "reading" if slot.readers > 1 else "ready"
                        self._slot_fire(slot, "end_read", dest, slot.readers - 1)
                return result

            return wrapper

        def reset_cache(orig: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper() -> Any:
                result = orig()
                for slot in list(self.slots.values()):
                    if slot.state != "absent":
                        self._slot_fire(slot, "reset", "absent", 0)
                return result

            return wrapper

        makers: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]] = {
            "prepare_store": prepare_store,
            "complete_store": complete_store,
            "prepare_load": prepare_load,
            "complete_load": complete_load,
            "reset_cache": reset_cache,
        }
        for name, make in makers.items():
            for attr in (name, *aliases.get(name, ())):
                setattr(manager, attr, make(getattr(manager, attr)))

    # ------------------------------------------------------------------ the engine loop

    def engine_step(self, num_unfinished_requests: int) -> None:
        """The caller's engine loop, once per iteration, with vLLM's count of unfinished requests."""
        engine = self.engine
        if num_unfinished_requests:
            if engine.state != "running":
                self._fire("engine", engine, "admit", "running")
            return
        if engine.state == "running":
            self._fire("engine", engine, "all_finished", "finishing")
        if engine.state in ("finishing", "draining"):
            self._fire("engine", engine, "settle", "draining" if engine.has_pending_push_work() else "idle")

    def engine_shutdown(self) -> None:
        engine = self.engine
        if engine.state not in ("shutting_down", "stopped"):
            self._fire("engine", engine, "shutdown", "shutting_down")
        if engine.state == "shutting_down" and not engine.has_pending_push_work():
            self._fire("engine", engine, "stop", "stopped")


# ---------------------------------------------------------------------------------------------- pytest plugin
#
# ``KVFSM_NATIVE_TRACE=FILE pytest -p kvfsm.vllm.recorder <vLLM's tests>`` records every
# OffloadingConnectorScheduler the tests build, one trace scope per test (nothing in vLLM's tests changes).
# The connector suite mocks the offloading manager, so slots are not recorded there.

#: The environment variable naming the trace file the plugin writes.
TRACE_ENV = "KVFSM_NATIVE_TRACE"
_PLUGIN: dict[str, Any] = {}


def pytest_configure(config: Any) -> None:
    path = os.environ.get(TRACE_ENV)
    if not path:
        return
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler

    trace = TraceRecorder(path).start()
    orig = OffloadingConnectorScheduler.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        orig(self, *args, **kwargs)
        test = _PLUGIN.get("test", "")
        n = _PLUGIN["schedulers"] = _PLUGIN.get("schedulers", 0) + 1
        if n > 1:  # a second scheduler in one test is an independent system: its job ids start at 0 again
            trace.scope(f"{test}#{n}")
        NativeRecorder(self, trace, int(self.config.num_workers), record_slots=False)

    OffloadingConnectorScheduler.__init__ = init
    _PLUGIN.update(trace=trace, orig=orig, cls=OffloadingConnectorScheduler)


def pytest_runtest_setup(item: Any) -> None:
    trace = _PLUGIN.get("trace")
    if trace is not None:
        _PLUGIN["test"] = str(item.nodeid)
        _PLUGIN["schedulers"] = 0
        trace.scope(str(item.nodeid))


def pytest_unconfigure(config: Any) -> None:
    trace = _PLUGIN.pop("trace", None)
    if trace is not None:
        trace.stop()
        _PLUGIN["cls"].__init__ = _PLUGIN.pop("orig")
