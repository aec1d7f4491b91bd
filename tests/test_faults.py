"""The fault plan, and every I/O fault it injects handled as a typed failure: no lost block, nothing corrupt
served, no partial file visible."""

from __future__ import annotations

import dataclasses
import errno
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest
from helpers import engine_config, tokens
from tier_support import GUARD_S, MISS, PENDING, R1, block_files, fs_rig, k, payload, temp_files

from kvfsm.control.types import OffloadingEvent
from kvfsm.errors import ConfigError
from kvfsm.machines.names import SlotState
from kvfsm.tiers.blockfile import key_name
from kvfsm.tiers.faults import OPERATIONS, FaultKind, FaultPlan, FaultRule, InjectedFault

# ---------------------------------------------------------------------------------------------- the plan


def test_rules_are_validated() -> None:
    with pytest.raises(ConfigError, match="probability"):
        FaultRule(probability=1.5)
    with pytest.raises(ConfigError, match="times"):
        FaultRule(times=-1)
    with pytest.raises(ConfigError, match="after"):
        FaultRule(after=-1)
    with pytest.raises(ConfigError, match="delay_s > 0"):
        FaultRule(kind=FaultKind.DELAY)
    with pytest.raises(ConfigError, match="fault kind"):
        FaultRule(kind="eio")  # type: ignore[arg-type]


def test_rules_fire_by_pattern_key_after_and_times() -> None:
    only_k1 = FaultRule("fs.*", FaultKind.EIO, keys=frozenset({k(1)}), after=1, times=2)
    plan = FaultPlan([only_k1])
    assert plan.decide("fs.write", k(2)) is None  # other key
    assert plan.decide("slot.read", k(1)) is None  # other op
    assert plan.decide("fs.write", k(1)) is None  # the first match is let through (after=1)
    assert plan.decide("fs.read", k(1)) is only_k1
    assert plan.decide("fs.write", k(1)) is only_k1
    assert plan.decide("fs.write", k(1)) is None  # times=2 used up
    assert plan.fired(only_k1) == 2
    assert plan.injected[FaultKind.EIO] == 2 and plan.total_injected == 2
    plan.enabled = False
    plan.add(FaultRule())
    assert plan.decide("fs.write", k(1)) is None
    assert "fs.write" in OPERATIONS and "transfer.load" in OPERATIONS


def test_probabilities_are_seeded_and_independent_of_interleaving() -> None:
    def decisions(seed: int, order: Sequence[tuple[str, bytes]]) -> dict[tuple[str, bytes, int], bool]:
        plan = FaultPlan([FaultRule("*", FaultKind.EIO, probability=0.25)], seed=seed)
        seen: dict[tuple[str, bytes], int] = {}
        out = {}
        for op, key in order:
            n = seen.get((op, key), 0)
            seen[(op, key)] = n + 1
            out[(op, key, n)] = plan.decide(op, key) is not None
        return out

    ops = [(op, k(i)) for i in range(50) for op in ("fs.write", "fs.read")] * 20
    a = decisions(7, ops)
    b = decisions(7, list(reversed(ops)))  # another thread interleaving: same decisions per occurrence
    assert a == b
    assert decisions(8, ops) != a
    rate = sum(a.values()) / len(a)
    assert 0.2 < rate < 0.3


def test_control_faults_raise_typed_os_errors_and_data_faults_return() -> None:
    plan = FaultPlan([FaultRule("fs.write", FaultKind.ENOSPC, times=1), FaultRule("fs.read", FaultKind.EIO, times=1)])
    with pytest.raises(InjectedFault) as info:
        plan.apply("fs.write", k(1))
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    with pytest.raises(InjectedFault) as info:
        plan.apply("fs.read", k(1))
    assert info.value.errno == errno.EIO
    assert plan.apply("fs.read", k(1)) is None
    data = FaultPlan([FaultRule("fs.read", FaultKind.CORRUPT)])
    rule = data.apply("fs.read", k(1))
    assert rule is not None and rule.kind is FaultKind.CORRUPT
    mangled = FaultPlan.mangle(rule, b"abcdef")
    assert len(mangled) == 6 and mangled != b"abcdef"
    assert FaultPlan.mangle(FaultRule(kind=FaultKind.SHORT_READ), b"abcdef") == b"abc"
    # A data fault on an operation that carries no bytes is a failure.
    odd = FaultPlan([FaultRule("slot.read", FaultKind.CORRUPT)])
    with pytest.raises(InjectedFault):
        odd.apply("slot.read", k(1))
    assert odd.injected[FaultKind.FAIL] == 1


def test_hangs_block_until_released_or_cancelled() -> None:
    plan = FaultPlan([FaultRule("fs.write", FaultKind.HANG)])
    cancel = threading.Event()
    outcomes: list[str] = []

    def op() -> None:
        try:
            plan.apply("fs.write", k(1), cancel=cancel)
            outcomes.append("released")
        except InjectedFault as exc:
            outcomes.append(f"errno {exc.errno}")

    t1 = threading.Thread(target=op)
    t1.start()
    assert plan.wait_for_hangs(1, GUARD_S)
    assert plan.hanging == 1 and outcomes == []
    plan.release_hangs()
    t1.join(GUARD_S)
    t2 = threading.Thread(target=op)
    t2.start()
    assert plan.wait_for_hangs(1, GUARD_S)  # later hangs hang again
    cancel.set()
    plan.notify()
    t2.join(GUARD_S)
    assert outcomes == ["released", f"errno {errno.ECANCELED}"]
    assert plan.hanging == 0


def test_a_cancelled_delay_returns_at_once() -> None:
    plan = FaultPlan([FaultRule("fs.read", FaultKind.DELAY, delay_s=3600.0)])
    cancel = threading.Event()
    cancel.set()
    assert plan.apply("fs.read", k(1), cancel=cancel) is None  # would take an hour if not cancelled


# ---------------------------------------------------------------------------------------------- fs tier


@pytest.mark.parametrize(
    "rule",
    [
        FaultRule("fs.write", FaultKind.EIO),
        FaultRule("fs.write", FaultKind.ENOSPC),
        FaultRule("fs.write", FaultKind.SHORT_WRITE),
        FaultRule("fs.replace", FaultKind.EIO),
        FaultRule("slot.read", FaultKind.EIO),
    ],
    ids=lambda r: f"{r.op}-{r.kind.value}",
)
def test_a_failed_cascade_leaves_no_file_and_the_cpu_copy_valid(tmp_path: Path, rule: FaultRule) -> None:
    plan = FaultPlan([rule])
    rig = fs_rig(tmp_path, faults=plan)
    try:
        rig.store(k(1))
        rig.settle()
        assert plan.fired(rule) == 1
        s = rig.tm.stats()
        assert (s.cascades_failed, s.cascades_completed) == (1, 0)
        assert rig.primary.slot_state(k(1)) is SlotState.READY  # unpinned, still valid
        assert rig.read_through(k(1)) == payload(k(1))
        assert block_files(tmp_path) == [] and temp_files(tmp_path) == []  # nothing partial visible
        assert k(1) not in rig.tier
        assert all(e.medium != "fs" for e in rig.tm.take_events())  # never reported stored in the tier
    finally:
        rig.shutdown()


@pytest.mark.parametrize(
    ("rule", "corrupt"),
    [
        (FaultRule("fs.read", FaultKind.CORRUPT), True),
        (FaultRule("fs.read", FaultKind.SHORT_READ), False),
        (FaultRule("fs.read", FaultKind.EIO), False),
        (FaultRule("fs.write", FaultKind.CORRUPT), True),  # bad bytes on disk, caught by the checksum
    ],
    ids=lambda v: f"{v.op}-{v.kind.value}" if isinstance(v, FaultRule) else str(v),
)
def test_a_failed_promotion_is_never_served_and_the_key_misses_after(
    tmp_path: Path, rule: FaultRule, corrupt: bool
) -> None:
    rule = dataclasses.replace(rule, keys=frozenset({k(1)}))
    plan = FaultPlan([rule])
    rig = fs_rig(tmp_path, num_slots=2, faults=plan)
    try:
        rig.store(k(1))
        rig.settle()
        rig.evict_primary(k(1))
        assert k(1) in rig.tier
        rig.tm.take_events()
        assert rig.read_through(k(1)) is None  # promotion failed; the lookup now misses
        assert plan.fired(rule) == 1
        assert rig.primary.slot_state(k(1)) is SlotState.ABSENT
        assert k(1) not in rig.tier
        assert OffloadingEvent((k(1),), "fs", removed=True) in rig.tm.take_events()
        assert rig.tier.stats().corrupt_detected == int(corrupt)
        assert rig.tier.wait_idle(GUARD_S)
        assert not [p for p in block_files(tmp_path) if p.name.startswith(key_name(k(1)))]  # its file is gone
        assert rig.tm.lookup(k(1), R1) is MISS
    finally:
        rig.shutdown()


def test_a_failed_slot_write_frees_the_reserved_slot(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("slot.write", FaultKind.EIO)])
    rig = fs_rig(tmp_path, num_slots=2, faults=plan)
    try:
        rig.store(k(1))
        rig.settle()
        rig.evict_primary(k(1))
        assert rig.tm.lookup(k(1), R1) is PENDING
        rig.tm.on_schedule_end()
        rig.settle()
        assert rig.primary.slot_state(k(1)) is SlotState.ABSENT
        assert rig.tm.lookup(k(1), R1) is MISS
    finally:
        rig.shutdown()


def test_a_failed_unlink_only_leaves_valid_data_behind(tmp_path: Path) -> None:
    plan = FaultPlan([FaultRule("fs.unlink", FaultKind.EIO)])
    rig = fs_rig(tmp_path, capacity_files=1, faults=plan)
    rig.store(k(1))
    rig.settle()
    rig.store(k(2))  # evicts k1; removing its file fails
    rig.settle()
    assert rig.tier.wait_idle(GUARD_S)
    assert plan.fired(plan.rules[0]) == 1
    assert rig.tier.keys() == [k(2)]
    rig.shutdown()
    again = fs_rig(tmp_path, capacity_files=4)
    try:
        # The file that could not be removed comes back after a restart, intact.
        assert again.read_through(k(1)) == payload(k(1))
        assert again.read_through(k(2)) == payload(k(2))
    finally:
        again.shutdown()


def test_random_faults_on_every_file_operation_never_serve_bad_bytes(tmp_path: Path) -> None:
    kinds = [FaultKind.EIO, FaultKind.ENOSPC, FaultKind.SHORT_WRITE, FaultKind.SHORT_READ, FaultKind.CORRUPT]
    plan = FaultPlan(
        [FaultRule(op, kind, probability=0.05) for op in ("fs.write", "fs.read", "slot.read") for kind in kinds],
        seed=3,
    )
    rig = fs_rig(tmp_path, num_slots=4, faults=plan, capacity_files=24)
    served = misses = 0
    try:
        for i in range(60):
            rig.store(k(i))
            rig.settle()
            j = (i * 7) % (i + 1)
            data = rig.read_through(k(j))
            if data is None:
                misses += 1
            else:
                assert data == payload(k(j)), f"corrupt bytes served for key {j}"
                served += 1
        assert plan.total_injected > 0
        assert served > 0
    finally:
        rig.shutdown()


# ---------------------------------------------------------------------------------------------- transfers


def test_failed_gpu_transfers_are_typed_failures_in_the_engine() -> None:
    pytest.importorskip("torch")
    from kvfsm.engine.core import ReferenceEngine
    from kvfsm.tiers.faults import FaultyCopyBackend

    plan = FaultPlan(
        [FaultRule("transfer.store", FaultKind.EIO, probability=0.3), FaultRule("transfer.load", FaultKind.EIO)],
        seed=1,
    )
    cfg = engine_config(num_gpu_blocks=12, num_cpu_slots=16)
    engine = ReferenceEngine(cfg)
    for w in engine.workers:
        w.backend = FaultyCopyBackend(w.backend, plan)
    try:
        history = {c: tokens(f"conv{c}", 14) for c in range(3)}
        for turn in range(3):
            reqs = []
            for c in history:
                req = engine.make_request(f"c{c}-t{turn}", history[c], 3)
                engine.add_request(req)
                reqs.append(req)
            while engine.step() is not None:
                engine.wait_for_transfers()
            for req in reqs:
                assert req.is_finished
                c = int(req.req_id[1])
                history[c] = req.all_token_ids + tokens(f"conv{c}-t{turn}", 6)
        s = engine.scheduler.stats
        assert s.failed_stores > 0  # failed stores: slots freed, keys never readable
        assert s.failed_loads > 0 and engine.integrity.loads_failed == s.failed_loads  # recomputed
        assert engine.integrity.loads_completed == 0  # every load failed: none marked loaded
        assert engine.integrity.mismatches == 0
        assert not engine.has_pending_push_work()
    finally:
        report = engine.shutdown(timeout=10.0)
    assert report.clean
    assert plan.injected[FaultKind.EIO] > 0


def test_tiers_faults_and_deadlines_import_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import kvfsm.tiers, kvfsm.tiers.fs, kvfsm.tiers.faults, kvfsm.control.deadlines, kvfsm.control.tiering\n"
        "assert 'torch' not in {k for k, v in sys.modules.items() if v is not None}\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
