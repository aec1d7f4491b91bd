"""Host buffers for the data plane: aligned, and backed by transparent huge pages where the OS allows.

Scattered block copies touch a new page for nearly every block; with 4 KiB pages every block is a TLB miss and a
page walk on both sides, which costs scattered copies a third or more of their bandwidth on large buffers. The CPU
slot pool and host-resident KV caches therefore ask for 2 MiB pages (``madvise(MADV_HUGEPAGE)``, honoured when
``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``). Anything that fails is ignored:
the buffer is then ordinary memory.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

import torch

__all__ = ["HUGE_PAGE", "host_buffer"]

HUGE_PAGE = 2 << 20
_PAGE = 4096
_MADV_HUGEPAGE = 14

_madvise: Callable[[int, int, int], int] | None = None
if sys.platform.startswith("linux"):
    try:
        _fn = ctypes.CDLL(None, use_errno=True).madvise
        _fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        _fn.restype = ctypes.c_int
        _madvise = _fn
    except (OSError, AttributeError):  # pragma: no cover - exotic libc
        _madvise = None


def host_buffer(nbytes: int, align: int = HUGE_PAGE, huge: bool = True) -> torch.Tensor:
    """``nbytes`` of uninitialised host memory as a uint8 tensor starting on an ``align`` boundary (a page
    boundary below ``HUGE_PAGE`` bytes); a view of a slightly larger allocation, which it keeps alive. With
    ``huge`` the range is advised to use huge pages; call this before the memory is first touched."""
    if nbytes <= 0:
        return torch.empty(0, dtype=torch.uint8)
    align = align if nbytes >= HUGE_PAGE else min(align, _PAGE)  # small buffers: page alignment is plenty
    raw = torch.empty(nbytes + align, dtype=torch.uint8)
    start = (-raw.data_ptr()) % align
    buf = raw[start : start + nbytes]
    if huge and _madvise is not None and nbytes >= HUGE_PAGE:
        _madvise(buf.data_ptr(), nbytes, _MADV_HUGEPAGE)  # best effort: the result is only a hint
    return buf
