"""Secondary tiers below the CPU primary, and the I/O machinery they share.

- :mod:`kvfsm.tiers.fs`: the file-system tier (atomic checksummed block files, persistent index).
- :mod:`kvfsm.tiers.pool`: a thread pool with separate read and write queues.
- :mod:`kvfsm.tiers.lookup`: asynchronous lookups (RETRY until the answer is in).
- :mod:`kvfsm.tiers.blockfile`: the block-file format and its I/O.
- :mod:`kvfsm.tiers.slotio`: slot bytes across every rank's pool.
- :mod:`kvfsm.tiers.redis` (extra ``kvfsm[redis]``, not imported here): the shared remote tier on Redis or
  a Redis Cluster; :mod:`kvfsm.tiers.redis_codec`: its value format and key namespace.

None of it needs torch.
"""

from __future__ import annotations

from kvfsm.tiers.blockfile import CorruptBlockError
from kvfsm.tiers.fs import FileSystemTier, ScanState
from kvfsm.tiers.lookup import AsyncLookup
from kvfsm.tiers.pool import DualQueuePool
from kvfsm.tiers.slotio import CompositeSlotIO, DictSlotIO

__all__ = [
    "AsyncLookup",
    "CompositeSlotIO",
    "CorruptBlockError",
    "DictSlotIO",
    "DualQueuePool",
    "FileSystemTier",
    "ScanState",
]
