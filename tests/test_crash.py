"""Crash safety: a child process writing blocks through the file-system tier is killed with SIGKILL
mid-write, 20 times. On restart no partial block is visible and every block the child saw committed is
served with identical bytes.

Three kinds of kill point, so that every stage of a write is hit for certain, not by luck:

- ``mid-write``: the child's write of one block stops after half its bytes (a patched ``os.write``), says
  so, and is killed there: a partial temporary file is on disk.
- ``before-replace``: the temporary file is complete but not renamed yet (a HANG fault on
  ``fs.replace``).
- ``random``: the child writes blocks in a loop and is killed right after it reported the n-th one, while
  it is somewhere in the next write.

And three in durable mode, where a block is acknowledged once written and renamed, and its fsync and
directory sync run afterwards in the background:

- ``durable-fsync`` / ``durable-dirsync``: killed while the background fsync (or directory sync) of the
  last acknowledged block is held (a HANG fault on ``fs.fsync`` / ``fs.dirsync``);
- ``durable-random``: killed right after the n-th acknowledgement, with that block's sync queued or
  running;
- ``durable-lost``: as ``durable-fsync``, and then the unsynced block's bytes are zeroed on disk before
  the restart, a stand-in for what a power loss may leave of data that was never fsynced: the restart
  must answer a miss for it (its checksum fails), never serve it.

After a restart every acknowledged block is byte-exact or (``durable-lost`` only, the unsynced one) a
miss; never wrong.

With ``-s`` every kill prints its figures (the kill point, the temporary files it left, the committed
blocks checked byte for byte after the restart, the in-progress block's fate), and the module ends with
the totals.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import pytest
from tier_support import GUARD_S, SLOT_BYTES, block_files, fs_rig, temp_files

import kvfsm
from kvfsm.control.types import OffloadKey
from kvfsm.tiers.blockfile import key_name

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")

BLOCK_DATA = """
import hashlib


def block_key(i: int) -> bytes:
    return b"crash-key-" + i.to_bytes(8, "big")


def block_data(i: int, n: int) -> bytes:
    out = b""
    while len(out) < n:
        out += hashlib.blake2b(b"crash-%d-%d" % (i, len(out)), digest_size=64).digest()
    return out[:n]
"""

CHILD = (
    BLOCK_DATA
    + """
import os
import sys
import threading

import kvfsm.tiers.blockfile as blockfile
from kvfsm.control.manager import TierJob
from kvfsm.tiers.faults import FaultKind, FaultPlan, FaultRule
from kvfsm.tiers.fs import FileSystemTier
from kvfsm.tiers.slotio import DictSlotIO

root, mode, stop_at, nbytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])


def say(msg):
    sys.stdout.write(msg + "\\n")
    sys.stdout.flush()


plan = None
durable = mode.startswith("durable")
if mode == "before-replace":
    plan = FaultPlan([FaultRule("fs.replace", FaultKind.HANG, after=stop_at)])
if mode in ("durable-fsync", "durable-lost"):
    plan = FaultPlan([FaultRule("fs.fsync", FaultKind.HANG, after=stop_at)])
if mode == "durable-dirsync":
    plan = FaultPlan([FaultRule("fs.dirsync", FaultKind.HANG, after=stop_at)])
if mode == "mid-write":
    real_write = os.write
    writes = [0]

    class PatchedOs:
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, buf):
            writes[0] += 1
            if writes[0] > stop_at:
                real_write(fd, bytes(buf[: len(buf) // 2]))
                say("at mid-write")
                threading.Event().wait()  # killed here, half the block on disk
            return real_write(fd, buf)

    blockfile.os = PatchedOs()

io = DictSlotIO(nbytes)
tier = FileSystemTier(root, slot_io=io, faults=plan, read_threads=1, write_threads=1, scan=False, durable=durable)
i = 0
while True:
    io.data[i] = block_data(i, nbytes)
    tier.submit_store(TierJob(i, (block_key(i),), (i,), False, "child"))
    if mode == "before-replace" and i == stop_at:
        plan.wait_for_hangs(1, 60)
        say("at before-replace")
        threading.Event().wait()
    # Durable: waits for this block's write, and (one write thread, in order) the earlier blocks' syncs.
    tier.wait_jobs()
    (result,) = tier.get_finished_jobs()  # acknowledged; in durable mode its sync is queued now
    assert result.success, result
    say(f"done {i}")
    if plan is not None and durable and i == stop_at:
        plan.wait_for_hangs(1, 60)  # the sync of block i holds; every earlier block is durable
        assert tier.has_pending_work()
        say("at sync")
        threading.Event().wait()
    i += 1
"""
)

_ns: dict[str, object] = {}
exec(BLOCK_DATA, _ns)
block_key = cast(Callable[[int], OffloadKey], _ns["block_key"])
block_data = cast(Callable[[int, int], bytes], _ns["block_data"])

CASES = (
    [("mid-write", n) for n in range(7)]
    + [("before-replace", n) for n in range(6)]
    + [("random", n) for n in range(1, 8)]
    + [("durable-fsync", n) for n in range(4)]
    + [("durable-dirsync", n) for n in range(3)]
    + [("durable-random", n) for n in range(1, 5)]
    + [("durable-lost", n) for n in range(3)]
)


def _kill_child(root: Path, mode: str, stop_at: int) -> list[int]:
    """Run the child until its kill point, SIGKILL it, reap it; returns the blocks it saw committed."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(kvfsm.__file__).resolve().parent.parent) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), mode, str(stop_at), str(SLOT_BYTES)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    done: list[int] = []
    try:
        while True:
            line = lines.get(timeout=GUARD_S)
            if line is None:
                stderr = proc.stderr.read() if proc.stderr is not None else ""
                raise AssertionError(f"the child exited before its kill point: {stderr}")
            if line.startswith("done "):
                done.append(int(line.split()[1]))
                if mode in ("random", "durable-random") and len(done) == stop_at:
                    break  # it is already writing the next block
            elif line.startswith("at "):
                break
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(GUARD_S)  # reaped: its pid is dead, so its temporary files count as stray
        reader.join(GUARD_S)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return done


@dataclass(frozen=True)
class KillFigures:
    mode: str
    stop_at: int
    temp_files_at_kill: int
    blocks_checked: int
    in_progress: str  # "absent" or "whole" (never partial); durable: the unsynced block's fate

    def line(self) -> str:
        return (
            f"crash {self.mode}-{self.stop_at}: SIGKILL with {self.temp_files_at_kill} temporary file(s) on disk; "
            f"after restart {self.blocks_checked} committed block(s) checked byte for byte, all served; "
            f"the block in progress at the kill: {self.in_progress}"
        )


_FIGURES: list[KillFigures] = []


@pytest.fixture(scope="module", autouse=True)
def crash_totals() -> Iterator[None]:
    """Print the module's totals once every kill ran (shown with ``-s``)."""
    yield
    if _FIGURES:
        kinds = sorted({f.mode for f in _FIGURES})
        print(
            f"\ncrash totals: {len(_FIGURES)} kill points ({', '.join(kinds)}), "
            f"{sum(f.blocks_checked for f in _FIGURES)} committed blocks checked, 0 lost, 0 partial, "
            f"{sum(f.in_progress.startswith('lost') for f in _FIGURES)} unsynced block(s) damaged on purpose, "
            "all misses, "
            f"{sum(f.temp_files_at_kill for f in _FIGURES)} temporary files left by the kills and removed on restart"
        )


@pytest.mark.parametrize(("mode", "stop_at"), CASES, ids=[f"{m}-{n}" for m, n in CASES])
def test_sigkill_mid_write_leaves_no_partial_block_and_loses_no_committed_one(
    tmp_path: Path, mode: str, stop_at: int
) -> None:
    done = _kill_child(tmp_path, mode, stop_at)
    temps_at_kill = len(temp_files(tmp_path))
    assert done == list(range(len(done)))
    if mode.startswith("durable"):
        _check_durable_restart(tmp_path, mode, stop_at, done, temps_at_kill)
        return
    if mode != "random":
        assert len(done) == stop_at
        assert temp_files(tmp_path), "the kill was meant to land with a temporary file on disk"
    rig = fs_rig(tmp_path, num_slots=4)
    try:
        stats = rig.tier.stats()
        assert temp_files(tmp_path) == []  # the dead writer's temporary file was removed
        assert stats.bad_files_removed == 0  # no partial block file was ever visible
        for i in done:
            assert rig.read_through(block_key(i)) == block_data(i, SLOT_BYTES), f"committed block {i} lost"
        in_progress = rig.read_through(block_key(len(done)))
        if mode == "random":
            # Killed after its rename, the block is whole; before it, absent. Never partial.
            assert in_progress in (None, block_data(len(done), SLOT_BYTES))
        else:
            assert in_progress is None
        assert stats.scan_entries >= len(done)
        figures = KillFigures(mode, stop_at, temps_at_kill, len(done), "absent" if in_progress is None else "whole")
        _FIGURES.append(figures)
        print(f"\n{figures.line()}")
    finally:
        rig.shutdown()


def _check_durable_restart(root: Path, mode: str, stop_at: int, done: list[int], temps_at_kill: int) -> None:
    """Durable mode: every acknowledged block was renamed into place before its acknowledgement; after
    the kill (during its background sync) a restart serves it byte for byte, or, when its unsynced bytes
    were lost, answers a miss and removes the damaged file. Never wrong bytes."""
    assert temps_at_kill == 0, "an acknowledged block is renamed into place before it is acknowledged"
    unsynced = None
    if mode != "durable-random":
        assert len(done) == stop_at + 1
        unsynced = stop_at  # its sync was held at the kill; every earlier block's sync had finished
    if mode == "durable-lost":
        (path,) = (p for p in block_files(root) if p.name.startswith(key_name(block_key(stop_at))))
        size = path.stat().st_size
        with open(path, "r+b") as f:  # what a power loss may leave of never-synced data: not its bytes
            f.seek(size - SLOT_BYTES)
            f.write(bytes(SLOT_BYTES))
    rig = fs_rig(root, num_slots=4, durable=True)
    try:
        assert temp_files(root) == []
        served = 0
        fate = "whole"
        for i in done:
            got = rig.read_through(block_key(i))
            if mode == "durable-lost" and i == unsynced:
                assert got is None, f"block {i}'s lost bytes were served"
                assert rig.tier.stats().corrupt_detected == 1
                assert not any(p.name.startswith(key_name(block_key(i))) for p in block_files(root))
                fate = "lost, a miss"
                continue
            assert got == block_data(i, SLOT_BYTES), f"acknowledged block {i} lost or wrong"
            served += 1
        assert rig.read_through(block_key(len(done))) is None  # never submitted
        rig.settle()
        assert not rig.tm.has_pending_work()
        figures = KillFigures(mode, stop_at, temps_at_kill, served, fate)
        _FIGURES.append(figures)
        print(f"\n{figures.line()}")
    finally:
        rig.shutdown()
