"""The GPU block pool with prefix caching: free blocks keep their hash until they are re-allocated."""

from __future__ import annotations

from collections import OrderedDict

from kvfsm.errors import ConfigError, KvfsmError

__all__ = ["BlockPool"]


class BlockPool:
    """Reference-counted GPU blocks. Freed blocks go to the back of an LRU free queue and stay in the
    prefix cache until they are handed out again."""

    __slots__ = ("_block_hash", "_cached", "_free", "_ref", "num_blocks")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ConfigError(f"num_gpu_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._block_hash: dict[int, bytes] = {}
        self._cached: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref[block_id]

    def cached_prefix(self, hashes: list[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``."""
        out = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for b in blocks:
            if self._ref[b] == 0:
                del self._free[b]
            self._ref[b] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (evicting their old prefix-cache entries), or None if too few are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _none = self._free.popitem(last=False)
            old = self._block_hash.pop(b, None)
            if old is not None and self._cached.get(old) == b:
                del self._cached[old]
            self._ref[b] = 1
            out.append(b)
        return out

    def free(self, blocks: list[int]) -> None:
        # Reverse order: a request's tail blocks are the first to be reused.
        for b in reversed(blocks):
            if self._ref[b] <= 0:
                raise KvfsmError(f"block {b} freed with reference count {self._ref[b]}; expected >= 1")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free[b] = None

    def cache(self, block_id: int, block_hash: bytes) -> None:
        if block_hash in self._cached or block_id in self._block_hash:
            return
        self._block_hash[block_id] = block_hash
        self._cached[block_hash] = block_id

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (vLLM's reset_prefix_cache); block contents stay as they are."""
        self._block_hash.clear()
        self._cached.clear()
