"""The device API the CUDA backend is written against, and :class:`CudaDevice`, the real CUDA one.

Also the ctypes ``cudaMemcpyAsync`` entry point (verified once by a self-test) that the ``dma`` and ``runs``
copy paths issue row copies through.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np
import torch

from kvfsm.data.plan import IndexArray
from kvfsm.errors import ConfigError, KvfsmError

logger = logging.getLogger(__name__)

CUDA_COPY_PATHS = ("dma", "runs", "kernel")

#: Row-range copies as three parallel lists: destination rows, source rows, row counts.
Runs = tuple[list[int], list[int], list[int]]
KERNEL_PATH_ENV = "KVFSM_CUDA_KERNEL_COPY"
CTYPES_MEMCPY_ENV = "KVFSM_CUDA_CTYPES_MEMCPY"
#: Device staging per direction (the dma path); a job larger than this is copied in pieces on its stream.
DEFAULT_STAGING_BYTES = 64 << 20

_TYPESTR = {
    torch.complex128: "<c16",
    torch.int64: "<i8",
    torch.int32: "<i4",
    torch.int16: "<i2",
    torch.uint8: "|u1",
}


# ---------------------------------------------------------------------------------------------- device API


class DeviceAPI(Protocol):
    """Streams, events and memory of one device, as the backend uses them."""

    device: torch.device

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any:
        """The stream the engine computes on (whose queued work a copy must wait for)."""
        ...

    def wait_stream(self, stream: Any, other: Any) -> None:
        """Work queued on ``stream`` from now on waits for everything queued on ``other`` so far."""
        ...

    def new_event(self) -> Any: ...

    def record(self, event: Any, stream: Any) -> None: ...

    def wait_event(self, stream: Any, event: Any) -> None: ...

    def query(self, event: Any) -> bool:
        """Non-blocking: has the work before ``event`` finished?"""
        ...

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""
        ...

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        """Queue the device work ``fn`` issues on ``stream`` (``fn`` runs with ``stream`` current)."""
        ...

    def upload(self, a: IndexArray) -> torch.Tensor:
        """An int64 index array as a device tensor, copied on the current stream (call inside ``launch``)."""
        ...

    def host_alias(self, t: torch.Tensor) -> torch.Tensor | None:
        """A device tensor aliasing pinned host tensor ``t`` (zero-copy), or None where unsupported."""
        ...

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        """``t``'s memory is not reused before the work queued on ``stream`` when it is freed has run."""
        ...

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, runs: Runs) -> None:
        """Asynchronous copies of row ranges between two row tensors (rows on dim 0, one of them pinned host
        memory): ``runs`` is ``(dst rows, src rows, counts)``, on the current stream (call inside ``launch``)."""
        ...


class _Interface:
    """Exposes a host tensor's memory through ``__cuda_array_interface__`` (for :meth:`CudaDevice.host_alias`)."""

    def __init__(self, t: torch.Tensor) -> None:
        self.__cuda_array_interface__ = {
            "shape": tuple(t.shape),
            "strides": tuple(s * t.element_size() for s in t.stride()),
            "typestr": _TYPESTR[t.dtype],
            "data": (t.data_ptr(), False),
            "version": 3,
        }


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the pointers (unified addressing)
_MemcpyAsync = Callable[[int, int, int, int, int], int]
_memcpy_state: list[_MemcpyAsync | None] = []
_memcpy_lock = threading.Lock()


def _find_cudart() -> _MemcpyAsync | None:
    """``cudaMemcpyAsync`` of the CUDA runtime torch has loaded (found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as fh:
            paths = sorted({line.split()[-1] for line in fh if "libcudart.so" in line and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            fn = ctypes.CDLL(path).cudaMemcpyAsync
        except (OSError, AttributeError):
            continue
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        return cast("_MemcpyAsync", fn)
    return None


def _self_test(memcpy: _MemcpyAsync) -> bool:
    """Both directions through ``memcpy`` on a side stream, compared byte for byte."""
    host = torch.arange(1 << 16, dtype=torch.int32).pin_memory()
    back = torch.zeros_like(host).pin_memory()
    dev = torch.zeros(host.shape, dtype=torch.int32, device="cuda")
    stream = torch.cuda.Stream()
    n = host.numel() * host.element_size()
    with torch.cuda.stream(stream):
        h = stream.cuda_stream
        ok = memcpy(dev.data_ptr(), host.data_ptr(), n, _CUDA_MEMCPY_DEFAULT, h) == 0
        ok = ok and memcpy(back.data_ptr(), dev.data_ptr(), n, _CUDA_MEMCPY_DEFAULT, h) == 0
    stream.synchronize()
    return ok and torch.equal(back, host)


def _memcpy_async() -> _MemcpyAsync | None:
    """The verified ctypes ``cudaMemcpyAsync`` (once per process), or None: copies then go through ``copy_``.
    ``KVFSM_CUDA_CTYPES_MEMCPY=0`` turns it off."""
    with _memcpy_lock:
        if not _memcpy_state:
            fn = None
            if os.environ.get(CTYPES_MEMCPY_ENV, "1") != "0":
                try:
                    fn = _find_cudart()
                    if fn is not None and not _self_test(fn):
                        logger.warning("cudaMemcpyAsync through ctypes failed its self-test; using copy_")
                        fn = None
                except Exception as exc:
                    logger.warning("cudaMemcpyAsync through ctypes unavailable (%r); using copy_", exc)
                    fn = None
            _memcpy_state.append(fn)
        return _memcpy_state[0]


class CudaDevice:
    """The real device API over ``torch.cuda``."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ConfigError(f"CudaDevice needs a CUDA device, got {device}")
        if not torch.cuda.is_available():
            raise ConfigError("CUDA is not available; expected a machine with a CUDA GPU")
        index = cast("int | None", device.index)  # the stubs say int; an index-less device has None
        self.device = torch.device("cuda", index if index is not None else torch.cuda.current_device())

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def new_event(self) -> Any:
        return torch.cuda.Event()

    def record(self, event: Any, stream: Any) -> None:
        event.record(stream)

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def query(self, event: Any) -> bool:
        return bool(event.query())

    def synchronize(self, event: Any) -> None:
        event.synchronize()

    def launch(self, stream: Any, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def upload(self, a: IndexArray) -> torch.Tensor:
        # Pinned (caching host allocator), so the copy is asynchronous and the buffer is not reused before the
        # copy has read it (the allocator records an event on the current stream).
        host = torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).pin_memory()
        return host.to(self.device, non_blocking=True)

    def host_alias(self, t: torch.Tensor) -> torch.Tensor | None:
        if t.dtype not in _TYPESTR:
            return None
        try:
            alias = torch.as_tensor(_Interface(t), device=self.device)
        except (RuntimeError, TypeError, ValueError) as exc:
            logger.info("no zero-copy device view of the pool: %r", exc)
            return None
        # A copy instead of an alias (wrong device, unmapped memory) would silently lose every write.
        if alias.data_ptr() != t.data_ptr() or alias.device != self.device or alias.shape != t.shape:
            return None
        return alias

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def copy_rows(self, dst: torch.Tensor, src: torch.Tensor, runs: Runs) -> None:
        memcpy = _memcpy_async()
        d_rows, s_rows, counts = runs
        if memcpy is None or not (dst.is_contiguous() and src.is_contiguous()) or dst.dtype != src.dtype:
            for d0, s0, n in zip(d_rows, s_rows, counts, strict=True):
                dst[d0 : d0 + n].copy_(src[s0 : s0 + n], non_blocking=True)
            return
        # The runtime's cudaMemcpyAsync straight from Python: a few hundred ns per copy instead of the microseconds
        # of a tensor slice and copy_ - what a job of many small runs is made of.
        row = int(src[0].numel()) * src.element_size() if src.shape[0] else 0
        dbase, sbase = dst.data_ptr(), src.data_ptr()
        stream = torch.cuda.current_stream(self.device).cuda_stream
        kind = _CUDA_MEMCPY_DEFAULT
        for d0, s0, n in zip(d_rows, s_rows, counts, strict=True):
            err = memcpy(dbase + d0 * row, sbase + s0 * row, n * row, kind, stream)
            if err:
                raise KvfsmError(f"cudaMemcpyAsync of {n * row} bytes failed with CUDA error {err}")
