"""Issue 13, bug 7: the engine no longer busy-spins while it waits on transfers.

A step that only polls (nothing admitted, scheduled, launched or reported) ends with a bounded wait on
the engine's readiness signal, growing from IDLE_WAIT_MIN_S to IDLE_WAIT_MAX_S while such steps follow each
other. An arrival ends it at once (the request is still admitted at the very next step), and so does
``notify()``. Copies are held by a gated backend, so every step below is a polling step by construction:
nothing here waits on a clock to decide what happens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future

import pytest

pytest.importorskip("torch")

from helpers import GatedBackend, GatedEngine, engine_config, gated_engine, tokens

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.engine.core import EngineConfig, PollMode
from kvfsm.engine.loop import IDLE_WAIT_MAX_S, IDLE_WAIT_MIN_S
from kvfsm.machines.names import EngineState


class PollHook:
    """A gated backend that runs ``hook`` inside its poll (that is, in the middle of an engine step)."""

    def __init__(self, inner: GatedBackend) -> None:
        self.inner = inner
        self.hook: Callable[[], None] | None = None

    def check(self, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> None:
        self.inner.check(is_store, gpu, slots)

    def submit(self, job_id: int, is_store: bool, gpu: GPUBlockSpec, slots: SlotSpec) -> Future[None]:
        return self.inner.submit(job_id, is_store, gpu, slots)

    def poll(self) -> list[tuple[int, bool]]:
        if self.hook is not None:
            self.hook()
        return self.inner.poll()

    def wait(self, job_ids: Iterable[int]) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()


def draining(ge: GatedEngine) -> PollHook:
    """A finishes; its store is held by the closed gate, so the engine drains with nothing to do."""
    e = ge.engine
    hook = PollHook(ge.backends[0])
    e.workers[0].backend = hook
    e.add_request(e.make_request("A", tokens("A", 9), 1))
    while e.state is not EngineState.DRAINING:
        assert e.step() is not None
    assert ge.held_ids(), "A's store should be held by the gate"
    return hook


def schedule(n: int) -> float:
    return float(sum(min(IDLE_WAIT_MAX_S, IDLE_WAIT_MIN_S * (1 << i)) for i in range(n)))


def test_polling_steps_wait_on_the_readiness_signal_with_a_growing_bound() -> None:
    with gated_engine(engine_config()) as ge:
        e = ge.engine
        draining(ge)
        waits, waited = e.idle_waits, e.idle_wait_s
        t0 = time.perf_counter()
        for _ in range(8):
            rec = e.step()
            assert rec is not None and rec.state is EngineState.DRAINING and rec.scheduled == ()
        elapsed = time.perf_counter() - t0
        # Busy polling spent microseconds on these 8 steps; each waited at least its bound (nothing set
        # the signal), and the bounds double up to the cap.
        assert elapsed >= schedule(8)
        assert e.idle_waits - waits == 8 and e.idle_wait_s - waited >= schedule(8)
        ge.open_all()
        e.run_until_idle()
        assert e.state is EngineState.IDLE


def test_an_arrival_during_a_polling_step_ends_its_wait_and_is_admitted_next_step() -> None:
    with gated_engine(engine_config()) as ge:
        e = ge.engine
        hook = draining(ge)
        for _ in range(8):
            e.step()  # the wait bound is at its cap now
        b = e.make_request("B", tokens("B", 5), 1)

        def arrive() -> None:  # B arrives mid-step, once
            e.add_request(b)
            hook.hook = None

        hook.hook = arrive
        waits = e.idle_waits
        rec = e.step()
        assert rec is not None and rec.scheduled == () and e.idle_waits == waits  # did not wait
        rec = e.step()
        assert rec is not None and rec.scheduled == ("B",)  # the very next step
        # The same for a late arrival (the drain benchmark's B).
        c = e.make_request("C", tokens("C", 5), 1)
        e.add_request_during_next_step(c)
        waits = e.idle_waits
        e.step()  # C arrives during this step: no wait at its end
        assert e.idle_waits == waits
        rec = e.step()
        assert rec is not None and rec.scheduled == ("C",)
        ge.open_all()
        e.run_until_idle()
        assert b.is_finished and c.is_finished


def test_notify_ends_a_polling_step_wait_at_once() -> None:
    with gated_engine(engine_config()) as ge:
        e = ge.engine
        hook = draining(ge)
        for _ in range(8):
            e.step()
        hook.hook = e.notify  # a backend that signals its completions
        waits, waited = e.idle_waits, e.idle_wait_s
        for _ in range(20):
            e.step()
        assert e.idle_waits - waits == 20
        assert e.idle_wait_s - waited < 20 * IDLE_WAIT_MAX_S / 2  # each wait found the signal set
        ge.open_all()
        e.run_until_idle()


def test_busy_polling_is_kept_as_an_option() -> None:
    cfg = engine_config(poll="busy")
    assert cfg.poll is PollMode.BUSY and EngineConfig().poll is PollMode.WAIT
    with gated_engine(cfg) as ge:
        e = ge.engine
        draining(ge)
        for _ in range(8):
            e.step()
        assert e.idle_waits == 0 and e.idle_wait_s == 0.0
        ge.open_all()
        e.run_until_idle()


def test_the_bench_measures_both_poll_modes_on_the_same_work() -> None:
    from kvfsm.bench.drain import CPU_DRAIN_REQUESTS, drain_cpu_point, promotion_cpu_point

    drain = drain_cpu_point(repeats=1)
    assert [r.poll for r in drain.busy + drain.wait] == [PollMode.BUSY, PollMode.WAIT]
    assert all(r.jobs == CPU_DRAIN_REQUESTS and r.steps > 0 and r.cpu_s >= 0 for r in drain.busy + drain.wait)
    promo = promotion_cpu_point(repeats=1)  # each warm run loaded its prefix from disk, verified
    assert [r.jobs for r in promo.busy + promo.wait] == [1, 1]
    d = promo.as_dict()
    assert set(d) >= {"busy", "wait", "ratio_busy_over_wait_engine_cpu_ms_per_job"}
