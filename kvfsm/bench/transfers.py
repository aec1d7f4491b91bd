"""Transfer benchmark: scattered-block copies through the real backends against one contiguous copy.

For each block size (4 KiB .. 2 MiB) one job moves ``count`` blocks - enough for 256 MiB (32 MiB in quick
mode) - between the KV cache and the CPU slot pool, at random GPU block ids and random slots with one block per
chunk and one layer, so every block is a separate piece of memory on both sides: the small-block worst case.
Each direction is timed through the backend's own submit/wait (address lists, path choice and all) and
compared with one contiguous copy of the same total bytes between the same two memories, measured in the same
run, interleaved; the figures are medians of several repeats. On a CPU-only machine both memories are host
memory; with CUDA the GPU rows also time both directions at once.

``python -m kvfsm.bench.transfers [--quick] [--json FILE] [--backend cpu|cuda]``
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvfsm.control.types import GPUBlockSpec, SlotSpec
from kvfsm.control.worker import CopyBackend
from kvfsm.data.backend import ThreadPoolCopyBackend, copy_executor
from kvfsm.data.hostmem import host_buffer
from kvfsm.data.pool import CPUSlotPool

__all__ = ["BLOCK_SIZES", "format_table", "main", "run_transfer_bench"]

KiB = 1 << 10
MiB = 1 << 20
BLOCK_SIZES = (4 * KiB, 16 * KiB, 64 * KiB, 256 * KiB, 2 * MiB)
FULL_BYTES = 256 * MiB
QUICK_BYTES = 32 * MiB

#: CPU goals (ratio to the contiguous copy) and H200 goals (GB/s) from issue 3.
CPU_RATIO_GOALS = {16 * KiB: 0.5, 64 * KiB: 0.8, 256 * KiB: 0.8, 2 * MiB: 0.8}
CUDA_GBPS_GOALS = {("load", 16 * KiB): 20.0, **{(d, s): 45.0 for d in ("store", "load") for s in (256 * KiB, 2 * MiB)}}


@dataclass(frozen=True, slots=True)
class _Timing:
    job: float  #: median job seconds
    base: float  #: median baseline seconds
    ratio: float  #: median over the interleaved pairs of base / job
    best_ratio: float  #: fastest baseline / fastest job: what the code does when nothing else runs
    spread: float  #: slowest / fastest baseline: how noisy the machine was


def _interleaved(job: Callable[[], float], base: Callable[[], float], repeats: int) -> _Timing:
    """The job and the baseline timed alternately after one warm-up each, so drift on a shared machine hits
    both alike."""
    job()
    base()
    tj, tb = [], []
    for _ in range(repeats):
        tj.append(job())
        tb.append(base())
    return _Timing(
        statistics.median(tj),
        statistics.median(tb),
        statistics.median(b / j for j, b in zip(tj, tb, strict=True)),
        min(tb) / min(tj),
        max(tb) / min(tb),
    )


class _Rig:
    """One block size: a one-layer KV cache of ``count`` blocks, a pool of ``count`` slots, a backend."""

    def __init__(self, backend: str, block_bytes: int, count: int, seed: int) -> None:
        self.kind = backend
        self.block_bytes = block_bytes
        self.count = count
        self.nbytes = block_bytes * count
        elems = block_bytes // 2
        if backend == "cuda":
            self.kv = torch.empty((count, elems), dtype=torch.float16, device="cuda")
        else:  # host memory allocated like the CPU engine's KV caches (allocate_kv_caches): on huge pages
            self.kv = host_buffer(self.nbytes).view(torch.float16).view(count, elems)
        self.kv.view(torch.int16).random_(-(1 << 15), 1 << 15)
        self.pool = CPUSlotPool(count, 1, (elems,), 1, torch.float16)
        gen = torch.Generator().manual_seed(seed)
        self.blocks = [tuple(torch.randperm(count, generator=gen).tolist()) for _ in range(2)]
        self.slots = [tuple(torch.randperm(count, generator=gen).tolist()) for _ in range(2)]
        self.job = 0
        self.backend: CopyBackend
        if backend == "cuda":
            from kvfsm.data.cuda import CudaCopyBackend

            self.backend = CudaCopyBackend([self.kv], self.pool, 1)
        else:
            self.backend = ThreadPoolCopyBackend([self.kv], self.pool, 1)
        self.helpers: ThreadPoolExecutor = copy_executor(1, "kvfsm-bench")

    def close(self) -> None:
        self.backend.shutdown()
        self.helpers.shutdown(wait=True)
        self.pool.close()

    def transfer(self, is_store: bool, which: int = 0) -> float:
        """Seconds for one job through the backend: submit, then block until it is done, then poll."""
        self.job += 1
        t0 = time.perf_counter()
        self.backend.submit(self.job, is_store, GPUBlockSpec(self.blocks[which]), SlotSpec(self.slots[which]))
        self.backend.wait([self.job])
        dt = time.perf_counter() - t0
        done = self.backend.poll()
        if done != [(self.job, True)]:
            raise RuntimeError(f"benchmark job {self.job} did not complete cleanly: {done}")
        return dt

    def both(self) -> float:
        """Seconds for a store and a load at once (different blocks and slots), both submitted, then waited."""
        half = self.count // 2  # disjoint blocks and slots, so the two jobs never wait for each other
        st_blocks, ld_blocks = self.blocks[0][:half], self.blocks[0][half : 2 * half]
        st_slots, ld_slots = self.slots[0][:half], self.slots[0][half : 2 * half]
        t0 = time.perf_counter()
        self.backend.submit(self.job + 1, True, GPUBlockSpec(st_blocks), SlotSpec(st_slots))
        self.backend.submit(self.job + 2, False, GPUBlockSpec(ld_blocks), SlotSpec(ld_slots))
        self.backend.wait([self.job + 1, self.job + 2])
        dt = time.perf_counter() - t0
        self.job += 2
        self.backend.poll()
        return dt

    # -- contiguous baselines between the same two memories --

    def contiguous(self, is_store: bool) -> float:
        """Seconds for one contiguous copy of the same bytes between the same two memories: on CUDA one
        ``copy_``; on CPU the faster of torch's ``copy_`` (its default threads) and one ``memmove`` on a copy
        thread - the stricter baseline."""
        host = self.pool.data.view(-1)
        kv = self.kv.view(-1)
        dst, src = (host, kv) if is_store else (kv, host)
        if self.kind == "cuda":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        dst.copy_(src)
        t_copy = time.perf_counter() - t0
        d, s, n = dst.data_ptr(), src.data_ptr(), self.nbytes

        def memmove() -> float:
            t = time.perf_counter()
            ctypes.memmove(d, s, n)
            return time.perf_counter() - t

        return min(t_copy, self.helpers.submit(memmove).result())

    def contiguous_both(self) -> float:
        """CUDA only: a contiguous D2H and a contiguous H2D of half the bytes each, on two streams at once."""
        half = self.nbytes // 2
        host = self.pool.data.view(-1).view(torch.uint8)
        kv = self.kv.view(-1).view(torch.uint8)
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s1):
            host[:half].copy_(kv[:half], non_blocking=True)
        with torch.cuda.stream(s2):
            kv[half : 2 * half].copy_(host[half : 2 * half], non_blocking=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def verify(self, is_store: bool, which: int = 0) -> None:
        """The last job moved the right bytes (every block)."""
        b = torch.tensor(self.blocks[which])
        s = torch.tensor(self.slots[which])
        kv = self.kv.cpu().view(torch.int16)[b]
        host = self.pool.rows.view(torch.int16)[s]
        if not torch.equal(kv, host):
            raise RuntimeError(f"benchmark {'store' if is_store else 'load'} moved the wrong bytes")


def _goal(kind: str, direction: str, block: int) -> str:
    if kind == "cpu":
        g = CPU_RATIO_GOALS.get(block)
        return f">= {g:.1f}x" if g is not None and direction != "both" else ""
    gb = CUDA_GBPS_GOALS.get((direction, block))
    return f">= {gb:.0f} GB/s" if gb is not None else ""


def _met(kind: str, direction: str, block: int, gbps: float, ratio: float) -> bool | None:
    if kind == "cpu":
        g = CPU_RATIO_GOALS.get(block)
        return None if g is None or direction == "both" else ratio >= g
    gb = CUDA_GBPS_GOALS.get((direction, block))
    return None if gb is None else gbps >= gb


def _path_of(rig: _Rig, is_store: bool) -> str:
    stats = getattr(rig.backend, "path_counts", None)
    if not stats:
        return ""
    direction = "store" if is_store else "load"
    used = sorted(p for (d, p) in stats if d == direction)
    return "+".join(used)


def run_transfer_bench(
    quick: bool,
    *,
    backends: Sequence[str] | None = None,
    sizes: Sequence[int] = BLOCK_SIZES,
    repeats: int | None = None,
    total_bytes: int | None = None,
) -> list[dict[str, object]]:
    """One row per (backend, block size, direction): GB/s, contiguous GB/s and their ratio, and the goal.

    ``backends`` defaults to ``["cpu"]`` plus ``"cuda"`` when CUDA is available.
    """
    kinds = list(backends) if backends is not None else ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    reps = repeats if repeats is not None else (5 if quick else 9)
    target = total_bytes if total_bytes is not None else (QUICK_BYTES if quick else FULL_BYTES)
    rows: list[dict[str, object]] = []
    for kind in kinds:
        for block in sizes:
            count = max(2, -(-target // block))
            rig = _Rig(kind, block, count, seed=block)
            try:
                rig.transfer(True)
                rig.verify(True)
                rig.transfer(False, 1)
                rig.verify(False, 1)
                directions: list[tuple[str, Callable[[], float], Callable[[], float]]] = [
                    ("store", functools.partial(rig.transfer, True), functools.partial(rig.contiguous, True)),
                    ("load", functools.partial(rig.transfer, False, 1), functools.partial(rig.contiguous, False)),
                ]
                if kind == "cuda":
                    directions.append(("both", rig.both, rig.contiguous_both))
                for direction, job, base in directions:
                    t = _interleaved(job, base, reps)
                    nbytes = rig.nbytes if direction != "both" else 2 * (rig.count // 2) * block
                    gbps = nbytes / t.job / 1e9
                    base_gbps = nbytes / t.base / 1e9
                    ratio = t.ratio
                    rows.append(
                        {
                            "backend": kind,
                            "direction": direction,
                            "block_bytes": block,
                            "blocks": count,
                            "mib": nbytes / MiB,
                            "gbps": gbps,
                            "contiguous_gbps": base_gbps,
                            "ratio": ratio,
                            "best_ratio": t.best_ratio,
                            "baseline_spread": t.spread,
                            "path": _path_of(rig, direction == "store") if direction != "both" else "",
                            "goal": _goal(kind, direction, block),
                            "met": _met(kind, direction, block, gbps, ratio),
                            "repeats": reps,
                        }
                    )
            finally:
                rig.close()
            gc.collect()
    return rows


def _size(b: object) -> str:
    n = int(b)  # type: ignore[call-overload]
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def format_table(rows: Sequence[dict[str, object]]) -> str:
    """The rows as a fixed-width text table."""
    header = (
        "backend",
        "dir",
        "block",
        "blocks",
        "MiB",
        "GB/s",
        "contig GB/s",
        "ratio",
        "best ratio",
        "noise",
        "path",
        "goal",
        "met",
    )
    lines = []
    for r in rows:
        met = r["met"]
        lines.append(
            (
                str(r["backend"]),
                str(r["direction"]),
                _size(r["block_bytes"]),
                str(r["blocks"]),
                f"{r['mib']:.0f}",
                f"{r['gbps']:.2f}",
                f"{r['contiguous_gbps']:.2f}",
                f"{r['ratio']:.2f}",
                f"{r['best_ratio']:.2f}",
                f"{r['baseline_spread']:.1f}x",
                str(r["path"]),
                str(r["goal"]),
                "" if met is None else ("yes" if met else "NO"),
            )
        )
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out.extend("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) for line in lines)
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvfsm.bench.transfers", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="32 MiB per transfer, 5 repeats (full: 256 MiB, 9)")
    parser.add_argument("--backend", action="append", choices=("cpu", "cuda"), help="repeatable; default: all")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    rows = run_transfer_bench(args.quick, backends=args.backend)
    print(format_table(rows))
    print(
        f"({time.perf_counter() - t0:.1f} s. ratio: median over interleaved pairs of contiguous time / job time; "
        "best ratio: fastest contiguous / fastest job; noise: slowest / fastest contiguous copy.)"
    )
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
