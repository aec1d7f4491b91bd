"""Wiring a reference engine: tiers and a copy-backend factory as constructor arguments, the README's
"Wiring" snippet run as written, and the geometry checks that run before anything is allocated."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch
from helpers import engine_config, tokens
from tier_support import GUARD_S

from kvfsm.control.cpu import CPUOffloadingManager
from kvfsm.control.tiering import TieringManager
from kvfsm.control.worker import CopyBackend, HeldCopyBackend, OffloadingWorker
from kvfsm.data.backend import ThreadPoolCopyBackend
from kvfsm.data.pool import CPUSlotPool
from kvfsm.engine.core import PoolsSlotIO, ReferenceEngine
from kvfsm.errors import ConfigError
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.memory import InMemoryTier

README = Path(__file__).resolve().parents[1] / "README.md"


def wiring_snippet() -> str:
    section = README.read_text().split("### Wiring", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.DOTALL)
    assert blocks, "the README's Wiring subsection has no python block"
    return str(blocks[0])


def test_the_readme_wiring_snippet_runs_and_the_warm_engine_loads_from_disk(tmp_path: Path) -> None:
    code = wiring_snippet().replace("tempfile.mkdtemp()", repr(str(tmp_path)))
    ns: dict[str, Any] = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md#wiring", "exec"), ns)
    lines = out.getvalue().splitlines()
    assert [line.split()[0] for line in lines] == ["cold", "warm"]
    warm = ns["engine"].integrity
    assert warm.loads_completed == 1 and warm.loads_failed == 0
    assert warm.blocks_verified > 0 and warm.mismatches == 0
    assert any(tmp_path.rglob("*.kvb")), "the cold engine's KV never reached the file-system tier"


class CountingBackend:
    """A custom CopyBackend: the thread-pool one, counting its submissions."""

    def __init__(self, inner: ThreadPoolCopyBackend) -> None:
        self.inner = inner
        self.pool = inner.pool
        self.submitted = 0

    def check(self, *args: Any) -> None:
        self.inner.check(*args)

    def submit(self, *args: Any) -> Any:
        self.submitted += 1
        return self.inner.submit(*args)

    def poll(self) -> list[tuple[int, bool]]:
        return self.inner.poll()

    def wait(self, job_ids: Any) -> None:
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_tiers_and_a_backend_factory_are_wired_internally(tmp_path: Path) -> None:
    made: list[CountingBackend] = []

    def factory(shard: list[torch.Tensor], pool: CPUSlotPool, bpc: int, threads: int) -> CopyBackend:
        made.append(CountingBackend(ThreadPoolCopyBackend(shard, pool, bpc, max_workers=threads)))
        return made[-1]

    mem = InMemoryTier("mem", 64, autocomplete=True)
    fs = FileSystemTier(tmp_path)
    assert fs.wait_scan(GUARD_S)
    cfg = engine_config(world_size=2, num_cpu_slots=8)
    engine = ReferenceEngine(cfg, tiers=[mem, fs], backend_factory=factory)
    try:
        assert isinstance(engine.manager, TieringManager) and engine.tiers == (mem, fs)
        assert [w.backend for w in engine.workers] == made and len(made) == 2
        assert isinstance(mem.slot_io, PoolsSlotIO) and fs.slot_io is mem.slot_io
        assert list(mem.slot_io.pools) == [b.pool for b in made] == list(engine.pools)
        assert mem.slot_io.nbytes_per_slot == sum(b.pool.nbytes_per_slot for b in made)
        # A's chunks are evicted from the 8 CPU slots by B's, then come back from the tiers, byte-exact.
        prompt = tokens("wire", 25)
        for req_id, toks in (("a", prompt), ("b", tokens("other", 25)), ("a2", prompt)):
            engine.add_request(engine.make_request(req_id, toks, 2))
            engine.run_until_idle()
            engine.reset_prefix_cache()
        assert sum(b.submitted for b in made) > 0
        assert engine.integrity.loads_completed == 1 and engine.integrity.blocks_verified > 0
        assert engine.integrity.mismatches == 0
    finally:
        engine.shutdown()


def test_a_tier_with_its_own_slot_io_is_left_alone(tmp_path: Path) -> None:
    from kvfsm.tiers.slotio import DictSlotIO

    own = DictSlotIO()
    tier = InMemoryTier("mem", 8, slot_io=own)
    engine = ReferenceEngine(engine_config(), tiers=[tier])
    try:
        assert tier.slot_io is own
    finally:
        engine.shutdown()


def _refused(match: str, **kwargs: Any) -> None:
    with pytest.raises(ConfigError, match=match):
        ReferenceEngine(kwargs.pop("config", engine_config()), **kwargs)


def test_wiring_conflicts_are_refused_before_anything_is_built() -> None:
    tier = InMemoryTier("mem", 8)
    _refused("both tiers and a manager", tiers=[tier], manager=CPUOffloadingManager(8))
    _refused("both workers and a backend_factory", workers=[], backend_factory=lambda *a: HeldCopyBackend())
    _refused("twice", tiers=[tier, tier])
    _refused("expected a SecondaryTier", tiers=[object()])
    _refused("backpressure without tiers", backpressure=object())
    assert tier.slot_io is None  # nothing was bound by the refused constructions


def test_tiers_need_the_cpu_pools_of_given_workers() -> None:
    tier = InMemoryTier("mem", 8)
    workers = [OffloadingWorker(0, 1, HeldCopyBackend())]
    _refused("found the CPU slot pools of 0 of 1 ranks", tiers=[tier], workers=workers)
    assert tier.slot_io is None
    # A backend factory needs no pool attribute: the engine built the pools and knows them.
    other = InMemoryTier("mem", 8)
    engine = ReferenceEngine(engine_config(), tiers=[other], backend_factory=lambda *a: HeldCopyBackend())
    try:
        assert isinstance(other.slot_io, PoolsSlotIO) and other.slot_io.pools == engine.pools
    finally:
        engine.shutdown()
