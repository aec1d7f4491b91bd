"""Prefix-reuse workloads for the control-plane benchmarks: a seeded generator and a JSONL reader.

A workload (a *trace*) is a list of requests, each the list of its block ids in order. Block ids stand
for chained block hashes: two requests that share a prefix share its first block ids, and a block id
names the same block content wherever it appears. The generator draws

- shared prefixes (system prompts, few-shot headers), picked with a Zipf distribution over a pool;
- a unique suffix for every request;
- a fraction of requests that *continue* an earlier one (the next turn of a conversation): the whole
  earlier request, then new unique blocks,

until the trace holds a target number of distinct block ids. The same seed gives the same trace.

JSONL interchange: one request per line, a JSON list of block ids (ints >= 0 or strings), so that other
implementations can replay exactly the same workload (``write_jsonl`` / ``read_jsonl``).
"""

from __future__ import annotations

import bisect
import itertools
import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvfsm.control.types import OffloadKey, make_offload_key
from kvfsm.errors import ConfigError, KvfsmError

__all__ = [
    "BlockId",
    "TraceStats",
    "WorkloadConfig",
    "WorkloadError",
    "generate_trace",
    "read_jsonl",
    "to_keys",
    "trace_stats",
    "write_jsonl",
]

#: One block of a request: an int (>= 0) or a string, as read from JSONL.
BlockId = int | str


class WorkloadError(KvfsmError, ValueError):
    """A trace file is malformed: says which line and what was expected."""


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    """Shape of a generated trace; the defaults give >= 100k distinct block hashes."""

    distinct_blocks: int = 100_000
    num_prefixes: int = 512
    zipf_s: float = 1.1
    prefix_blocks: tuple[int, int] = (4, 48)
    suffix_blocks: tuple[int, int] = (2, 24)
    continue_fraction: float = 0.3
    #: Continuations pick an earlier request among the most recent ones (conversations continue soon).
    continue_window: int = 256
    #: A request longer than this is not continued again (keeps turns of a conversation bounded).
    max_blocks: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("distinct_blocks", "num_prefixes", "continue_window", "max_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        for name in ("prefix_blocks", "suffix_blocks"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ConfigError(f"{name} must be (lo, hi) with 1 <= lo <= hi, got {(lo, hi)!r}")
        if not 0.0 <= self.continue_fraction < 1.0:
            raise ConfigError(f"continue_fraction must be in [0, 1), got {self.continue_fraction!r}")
        if self.zipf_s <= 0:
            raise ConfigError(f"zipf_s must be > 0, got {self.zipf_s!r}")


@dataclass(frozen=True, slots=True)
class TraceStats:
    requests: int
    blocks: int  #: block occurrences over all requests
    distinct_blocks: int
    continuations: int  #: requests whose first blocks are a whole earlier request
    mean_blocks: float
    max_blocks: int


def generate_trace(config: WorkloadConfig | None = None) -> list[list[int]]:
    """A seeded prefix-reuse trace: requests (lists of block ids) until ``distinct_blocks`` are used."""
    cfg = config or WorkloadConfig()
    rng = random.Random(cfg.seed)
    fresh = itertools.count()
    # Zipf over the prefix pool: P(rank k) ~ 1 / k^s, sampled through the cumulative weights.
    cumulative = list(itertools.accumulate(1.0 / (k**cfg.zipf_s) for k in range(1, cfg.num_prefixes + 1)))
    total = cumulative[-1]
    prefixes: list[list[int] | None] = [None] * cfg.num_prefixes  # materialised on first use
    trace: list[list[int]] = []
    distinct = 0

    def new_blocks(lo_hi: tuple[int, int]) -> list[int]:
        nonlocal distinct
        n = rng.randint(*lo_hi)
        distinct += n
        return [next(fresh) for _ in range(n)]

    while distinct < cfg.distinct_blocks:
        earlier: list[int] | None = None
        if trace and rng.random() < cfg.continue_fraction:
            window = trace[-cfg.continue_window :]
            candidate = window[rng.randrange(len(window))]
            if len(candidate) < cfg.max_blocks:
                earlier = candidate
        if earlier is not None:
            trace.append(earlier + new_blocks(cfg.suffix_blocks))
            continue
        rank = min(bisect.bisect_left(cumulative, rng.random() * total), cfg.num_prefixes - 1)
        prefix = prefixes[rank]
        if prefix is None:
            prefix = prefixes[rank] = new_blocks(cfg.prefix_blocks)
        trace.append(prefix + new_blocks(cfg.suffix_blocks))
    return trace


def trace_stats(trace: Sequence[Sequence[BlockId]]) -> TraceStats:
    """Counts over a trace, O(total blocks). A continuation is a request whose first blocks are exactly an
    earlier request (found through chained prefix hashes, as block hashes chain in an engine)."""
    seen: set[BlockId] = set()
    whole: set[int] = set()  # chained hash of every earlier request
    continuations = 0
    blocks = 0
    longest = 0
    for req in trace:
        blocks += len(req)
        longest = max(longest, len(req))
        seen.update(req)
        h = 0
        found = False
        for i, block in enumerate(req):
            h = hash((h, block))
            if not found and i + 1 < len(req) and h in whole:
                found = True
        continuations += found
        whole.add(h)
    n = len(trace)
    return TraceStats(n, blocks, len(seen), continuations, blocks / n if n else 0.0, longest)


def _block_bytes(block: BlockId, where: str) -> bytes:
    if isinstance(block, bool):
        raise WorkloadError(f"{where}: block id {block!r} is a bool; expected an int >= 0 or a string")
    if isinstance(block, int):
        if block < 0 or block >= 1 << 128:
            raise WorkloadError(f"{where}: block id {block} is out of range; expected 0 <= id < 2**128")
        return block.to_bytes(16, "big")
    if isinstance(block, str):
        return b"s:" + block.encode()
    raise WorkloadError(f"{where}: block id {block!r} is a {type(block).__name__}; expected an int >= 0 or a string")


def to_keys(trace: Iterable[Sequence[BlockId]]) -> list[list[OffloadKey]]:
    """Offload keys of every request: the same block id always gives the same key."""
    cache: dict[BlockId, OffloadKey] = {}
    out: list[list[OffloadKey]] = []
    for i, req in enumerate(trace):
        keys: list[OffloadKey] = []
        for block in req:
            key = cache.get(block)
            if key is None:
                key = cache[block] = make_offload_key(_block_bytes(block, f"request {i}"))
            keys.append(key)
        out.append(keys)
    return out


def write_jsonl(trace: Iterable[Sequence[BlockId]], path: str | Path) -> int:
    """Write one JSON list per line; returns the number of requests written."""
    n = 0
    with Path(path).open("w", encoding="utf-8") as fh:
        for req in trace:
            fh.write(json.dumps(list(req), separators=(",", ":")))
            fh.write("\n")
            n += 1
    return n


def read_jsonl(path: str | Path) -> list[list[int]]:
    """Read a JSONL trace: one non-empty JSON list of block ids (ints, 0 <= id < 2**128) per non-blank line.

    WorkloadError (with the file and line) if the file cannot be read, is not UTF-8, holds no request, or
    a line is not such a list. String ids are accepted by :func:`to_keys`, not in a trace file: a file
    written by :func:`write_jsonl` from :func:`generate_trace` holds ints only.
    """
    p = Path(path)
    expected = "expected a JSONL file with one JSON list of block ids (ints >= 0) per line"
    if p.is_dir():
        raise WorkloadError(f"workload {p} is a directory; {expected}")
    trace: list[list[int]] = []
    try:
        with p.open(encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                trace.append(_parse_line(line, f"{p}:{lineno}"))
    except OSError as exc:
        raise WorkloadError(f"cannot read workload {p}: {exc.strerror or exc}; {expected}") from exc
    except UnicodeDecodeError as exc:
        raise WorkloadError(f"workload {p} is not UTF-8 text ({exc.reason}); {expected}") from exc
    if not trace:
        raise WorkloadError(f"workload {p} holds no requests; {expected}")
    return trace


_JSON_TYPES: dict[type, str] = {
    dict: "object",
    str: "string",
    int: "number",
    float: "number",
    bool: "boolean",
    type(None): "null",
}


def _parse_line(line: str, where: str) -> list[int]:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{where}: not valid JSON ({exc.msg}); expected a list of block ids") from exc
    if not isinstance(value, list):
        raise WorkloadError(
            f"{where}: got a JSON {_JSON_TYPES.get(type(value), 'value')}; expected a JSON list of block ids"
        )
    if not value:
        raise WorkloadError(f"{where}: an empty list; expected a request with at least one block id")
    for block in value:
        if isinstance(block, str):
            raise WorkloadError(f"{where}: block id {block!r} is a string; expected an int >= 0")
        _block_bytes(block, where)  # validate every id now, with the line number
    return value
