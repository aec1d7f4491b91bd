"""The one engine loop and the one worker protocol, torch-free: the settle decision, the held copy
backend, the loop over tag memory (kvfsm.testing.control.TagEngine) and its shutdown."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvfsm.control.deadlines import ManualClock
from kvfsm.control.decisions import settle_event
from kvfsm.control.scheduler import OffloadRequest
from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import HeldCopyBackend
from kvfsm.errors import KvfsmError
from kvfsm.machines.names import EngineEvent, EngineState
from kvfsm.testing.control import TagEngine
from kvfsm.testing.system import SystemConfig


@pytest.mark.parametrize("state", list(EngineState))
def test_settle_event_follows_the_engine_loop(state: EngineState) -> None:
    assert settle_event(state, True) is (None if state is EngineState.RUNNING else EngineEvent.ADMIT)
    expected = {
        EngineState.RUNNING: EngineEvent.ALL_FINISHED,
        EngineState.FINISHING: EngineEvent.SETTLE,
        EngineState.DRAINING: EngineEvent.SETTLE,
    }.get(state)
    assert settle_event(state, False) is expected


def test_the_loop_the_worker_and_the_replay_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvfsm.engine.loop, kvfsm.control.worker, kvfsm.check.replay, kvfsm.testing.control\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_held_copy_backend_runs_a_copy_only_when_told() -> None:
    ran: list[tuple[bool, tuple[int, ...]]] = []
    backend = HeldCopyBackend(lambda is_store, gpu, slots: ran.append((is_store, gpu.block_ids)))
    gpu, slots = GPUBlockSpec((1,)), SlotSpec((0,))
    for job_id in (5, 3, 4):
        backend.submit(job_id, True, gpu, slots)
    assert backend.held_ids == (5, 3, 4) and not ran
    backend.complete(4, ok=False)  # a failed copy moves nothing
    backend.wait([5, 3, 4])  # a flush runs what it waits for, in job id order
    assert backend.poll() == [(4, False), (3, True), (5, True)]
    assert backend.poll() == [] and len(ran) == 2
    with pytest.raises(KvfsmError):
        backend.complete(3)


def test_a_deferred_lookup_with_no_free_gpu_block_ends_the_waiting_scan(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loop stops asking the connector about waiting requests once the GPU pool is empty."""
    engine = TagEngine(SystemConfig(num_gpu_blocks=4), ManualClock())
    asked: list[str] = []

    def deferred(request: OffloadRequest, num_computed_tokens: int) -> tuple[int | None, bool]:
        asked.append(request.req_id)
        return None, False

    monkeypatch.setattr(engine.scheduler, "get_num_new_matched_tokens", deferred)
    assert engine.block_pool.allocate(4) is not None  # every GPU block is taken
    for name in "abc":
        engine.add_request(engine.make_request(name, list(range(9)), 1))
    engine.step()
    assert asked == ["a"]
    assert [r.req_id for r in engine.waiting] == ["a", "b", "c"]


def test_tag_engine_shuts_down_through_the_flush_all_effect() -> None:
    engine = TagEngine(SystemConfig(), ManualClock())
    engine.add_request(engine.make_request("a", list(range(9)), 1))
    engine.step()  # prefill: the request finishes, its stores are launched and held
    assert any(b.held_ids for b in engine.backends)
    report = engine.shutdown()
    assert engine.state is EngineState.STOPPED and not report.deadline_hit
    assert not engine.has_pending_push_work()
    assert not any(b.in_flight_ids() for b in engine.backends)
    assert engine.shutdown().already_stopped
