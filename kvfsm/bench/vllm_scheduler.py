"""Side by side in one process: the scheduler-side cost of kvfsm's ``KvfsmConnector`` against vLLM 0.33's
native ``OffloadingConnector``, inside vLLM's real ``Scheduler``, on the same trace.

Both connectors run in vLLM's ``Scheduler`` (:class:`kvfsm.vllm.drive.SchedulerDriver`, scheduler side only,
the workers' reports in each connector's own format, every job reported in the step it is handed out). What
is timed is the connector alone: every call vLLM's scheduler makes into it (``get_num_new_matched_tokens``,
``update_state_after_alloc``, ``build_connector_meta``, ``update_connector_output``, ``request_finished``,
``has_pending_push_work``), summed per engine step. The trace, for N requests:

- ``prefill``: N new requests (4 blocks of prompt each, no hit anywhere) scheduled in one step: N lookups,
  N allocations, N store plans;
- ``decode``: the N requests decoding, one token per step (a median over the steps);
- ``load``: vLLM's GPU prefix cache dropped, N requests with the same prompts: N lookups hit the CPU tier,
  N loads planned and reported in one step.

Both runs alternate ``repeats`` times; medians per step kind, and the ratio kvfsm / vLLM (below 1: kvfsm
costs less). Needs vLLM (``kvfsm[vllm]``); without it :func:`available` says why.
"""

from __future__ import annotations

import gc
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["CONNECTOR_METHODS", "STEP_KINDS", "available", "run_side_by_side"]

STEP_KINDS = ("prefill", "decode", "load")
#: Every connector method vLLM's scheduler calls in a step (those a connector has are timed).
CONNECTOR_METHODS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "get_external_cache_hit_sources",
    "get_loaded_kv_cache_group_ids",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
    "has_pending_push_work",
    "has_pending_block_frees",
    "take_events",
    "get_kv_connector_stats",
)
PROMPT_BLOCKS = 4
BLOCK = 16


def available() -> str | None:
    """None when vLLM is importable, else why not."""
    try:
        from kvfsm.vllm.drive import import_scheduler

        import_scheduler()
    except Exception as exc:  # vLLM missing, or its import failing: the section is skipped, not the bench
        return f"{type(exc).__name__}: {exc}"
    return None


class _Timer:
    """Wraps a connector's scheduler-side methods (instance attributes) and sums their time."""

    def __init__(self, connector: Any) -> None:
        self.seconds = 0.0
        self.last: dict[str, float] = {}
        #: Seconds per method since the last take().
        self.by_method: dict[str, float] = {}
        for name in CONNECTOR_METHODS:
            fn = getattr(connector, name, None)
            if callable(fn):
                setattr(connector, name, self._timed(name, fn))

    def _timed(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter
        by_method = self.by_method

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = clock() - t0
                self.seconds += dt
                by_method[name] = by_method.get(name, 0.0) + dt

        return timed

    def take(self) -> float:
        s, self.seconds = self.seconds, 0.0
        self.last = dict(self.by_method)
        self.by_method.clear()
        return s


def _prompt(i: int) -> list[int]:
    return [3 + (i * 7919 + j * 104729) % 49_000 for j in range(PROMPT_BLOCKS * BLOCK)]


def _one_run(model_dir: Path, connector: str, n: int, decode_steps: int) -> dict[str, float]:
    """Seconds in the connector for each step kind (decode: the median step), garbage collection paused
    (as timeit does: a collection would land in whichever side happened to be running)."""
    gc.collect()
    gc.disable()
    try:
        return _timed_run(model_dir, connector, n, decode_steps)
    finally:
        gc.enable()


def _timed_run(model_dir: Path, connector: str, n: int, decode_steps: int) -> dict[str, float]:
    from kvfsm.vllm.drive import SchedulerDriver

    extra: dict[str, Any] = {"offload_prompt_only": True} if connector == "kvfsm" else {}
    driver = SchedulerDriver(
        model_dir,
        connector,
        num_gpu_blocks=n * (PROMPT_BLOCKS + 4) + 16,
        cpu_chunks=n * PROMPT_BLOCKS * 2,
        block_size=BLOCK,
        max_num_batched_tokens=n * (PROMPT_BLOCKS * BLOCK + 1),
        max_num_seqs=n,
        max_report_delay=0,
        extra=extra,
    )
    timer = _Timer(driver.scheduler.connector)
    breakdown: dict[str, dict[str, float]] = {}
    for i in range(n):
        driver.add(_prompt(i), max_tokens=decode_steps + 2)
    timer.take()  # on_new_request is not timed (an admission, not a step)
    driver.step()
    prefill = timer.take()
    breakdown["prefill"] = timer.last
    decode: list[float] = []
    for _ in range(decode_steps):
        driver.step()
        decode.append(timer.take())
    while driver.has_work():
        driver.step()
    if not driver.scheduler.reset_prefix_cache():
        raise RuntimeError("vLLM kept GPU blocks after the trace finished; cannot drop its prefix cache")
    for i in range(n):
        driver.add([*_prompt(i), 1], max_tokens=1)
    timer.take()
    out = driver.step()
    load = timer.take()
    breakdown["load"] = timer.last
    if not out.kv_connector_metadata or not _num_loads(connector, out.kv_connector_metadata) == n:
        raise RuntimeError(f"{connector}: expected {n} loads in the load step")
    if _BREAKDOWN is not None:
        _BREAKDOWN.setdefault(connector, []).append(breakdown)
    return {"prefill": prefill, "decode": statistics.median(decode), "load": load}


#: Diagnostics: set to a dict to collect each run's per-method seconds of the prefill and load steps.
_BREAKDOWN: dict[str, list[dict[str, dict[str, float]]]] | None = None


def _num_loads(connector: str, meta: Any) -> int:
    if connector == "native":
        return len(meta.load_jobs)
    return len(meta.message.load_jobs)


def run_side_by_side(
    ns: Sequence[int] = (16, 64, 256), repeats: int = 5, decode_steps: int = 8, model_dir: Path | None = None
) -> list[dict[str, Any]]:
    """One row per (N, step kind): median µs per step for vLLM and kvfsm, and their ratio."""
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    if model_dir is None:
        from kvfsm.vllm.drive import opt_config_dir

        model_dir = opt_config_dir(Path(tempfile.mkdtemp(prefix="kvfsm-bench-vllm-")))
    rows: list[dict[str, Any]] = []
    for n in ns:
        samples: dict[str, dict[str, list[float]]] = {c: {k: [] for k in STEP_KINDS} for c in ("native", "kvfsm")}
        for r in range(repeats):
            order = ("native", "kvfsm") if r % 2 == 0 else ("kvfsm", "native")
            for connector in order:
                for kind, seconds in _one_run(model_dir, connector, n, decode_steps).items():
                    samples[connector][kind].append(seconds)
        for kind in STEP_KINDS:
            native = statistics.median(samples["native"][kind])
            kvfsm = statistics.median(samples["kvfsm"][kind])
            rows.append(
                {
                    "n": n,
                    "step": kind,
                    "vllm_us": native * 1e6,
                    "kvfsm_us": kvfsm * 1e6,
                    "ratio": kvfsm / native if native > 0 else float("inf"),
                }
            )
    return rows
