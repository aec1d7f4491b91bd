"""A CPU stand-in for a CUDA device: deferred, event-ordered streams, so the CUDA backend's launch, ordering
and completion logic runs (and is race-tested) without a GPU.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvfsm.data.cuda.device import Runs
from kvfsm.data.plan import IndexArray


@dataclass(eq=False)
class _EmuStream:
    name: str
    ops: deque[Callable[[], None] | _EmuEvent] = field(default_factory=deque)
    enqueued: int = 0
    executed: int = 0


@dataclass(eq=False)
class _EmuEvent:
    stream: _EmuStream | None = None
    position: int = 0


class EmulatedDevice:
    """A CPU stand-in for a CUDA device: deferred streams that honour ``wait_event``/``wait_stream``.

    Work queued on a stream runs only when something needs it: :meth:`synchronize` of a later event, :meth:`run`
    / :meth:`run_all`, or (``auto_progress=True``) a :meth:`query`. A stream that reaches a wait first runs the
    awaited stream up to the awaited event. So a copy that forgot to wait for the compute stream, or for the other
    direction, reads or overwrites data in the wrong order - deterministically - and the race tests catch it.

    ``synchronize_calls`` counts blocking waits (the engine path must make none).
    """

    def __init__(self, auto_progress: bool = True) -> None:
        self.device = torch.device("cpu")
        self.auto_progress = auto_progress
        self.compute = _EmuStream("compute")
        self.synchronize_calls = 0
        self.query_calls = 0
        self.launches = 0
        self._streams: list[_EmuStream] = [self.compute]

    def new_stream(self) -> _EmuStream:
        s = _EmuStream(f"copy{len(self._streams)}")
        self._streams.append(s)
        return s

    def current_stream(self) -> _EmuStream:
        return self.compute

    def wait_stream(self, stream: Any, other: Any) -> None:
        self._wait(stream, _EmuEvent(other, other.enqueued))

    def new_event(self) -> _EmuEvent:
        return _EmuEvent()

    def record(self, event: Any, stream: Any) -> None:
        event.stream = stream
        event.position = stream.enqueued

    def wait_event(self, stream: Any, event: Any) -> None:
        self._wait(stream, event)

    def _wait(self, stream: _EmuStream, event: _EmuEvent) -> None:
        if event.stream is None:
            return
        stream.ops.append(_EmuEvent(event.stream, event.position))
        stream.enqueued += 1

    def query(self, event: Any) -> bool:
        self.query_calls += 1
        if event.stream is None:
            return True
        if self.auto_progress:
            self._run_to(event.stream, event.position)
        return bool(event.stream.executed >= event.position)

    def synchronize(self, event: Any) -> None:
        self.synchronize_calls += 1
        if event.stream is not None:
            self._run_to(event.stream, event.position)

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        self.launches += 1
        stream.ops.append(fn)
        stream.enqueued += 1

    def upload(self, a: IndexArray) -> torch.Tensor:
        return torch.from_numpy(np.array(a, dtype=np.int64, copy=True))

    def host_alias(self, t: torch.Tensor) -> torch.Tensor | None:
        return t

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, runs: Runs) -> None:
        for d0, s0, n in zip(*runs, strict=True):
            dst[d0 : d0 + n].copy_(src[s0 : s0 + n])

    # -- test controls --

    def pending(self, stream: Any) -> int:
        return int(stream.enqueued - stream.executed)

    def run(self, stream: Any) -> None:
        """Execute everything queued on ``stream`` (and whatever it waits for)."""
        self._run_to(stream, stream.enqueued)

    def run_all(self) -> None:
        for s in self._streams:
            self.run(s)

    def _run_to(self, stream: _EmuStream, position: int) -> None:
        while stream.executed < position:
            op = stream.ops.popleft()
            if isinstance(op, _EmuEvent):
                if op.stream is not None:
                    self._run_to(op.stream, op.position)
            else:
                op()
            stream.executed += 1


# ---------------------------------------------------------------------------------------------- launches
