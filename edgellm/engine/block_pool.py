"""BlockPool: fixed-size KV blocks with ref counts and a free queue kept in LRU order.

A block whose ref count drops to zero goes to the tail of the free queue; if it still holds a cached
prefix (the prefix tree knows it) it can be revived until it is reused, so the least recently used
cached blocks are evicted first — vLLM v1's design. Whether a free block is cached is the prefix tree's
knowledge, not the pool's: the KV cache manager (engine/kv_cache_manager.py) drops the tree entry of a cached
block it takes.
"""
from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Allocator of `n_blocks` block ids. Resource calls return None on shortage; callers decide."""

    def __init__(self, n_blocks: int):
        if n_blocks <= 0:
            raise ValueError("n_blocks must be positive")
        self.n_blocks = n_blocks
        self.ref = [0] * n_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(n_blocks))  # LRU first

    @property
    def n_free(self) -> int:
        return len(self._free)

    @property
    def n_used(self) -> int:
        return self.n_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """n fresh blocks (ref count 1) from the LRU end of the free queue, or None if too few are free."""
        if n > len(self._free):
            return None
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self.ref[b] = 1
            out.append(b)
        return out

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on blocks (shared prefix); revives cached free blocks."""
        for b in blocks:
            if self.ref[b] == 0:
                del self._free[b]
            self.ref[b] += 1

    def free(self, blocks: list[int], *, front: bool = False) -> None:
        """Drop one reference on each block; blocks reaching zero return to the free queue's tail
        (in reverse so a sequence's last block is evicted before its first). front=True: to its head instead,
        handed out first (blocks holding nothing worth caching, e.g. rolled-back draft rows)."""
        for b in reversed(blocks):
            if self.ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self._free[b] = None
                if front:
                    self._free.move_to_end(b, last=False)
