"""Sliding-window trimming of the KV cache: local-attention layers (Gemma 3: 5 of every 6) keep K/V only for
the blocks some query can still attend to, in a smaller array indexed by *slot*.

Global layers index their K/V by block id. For a local layer, slot[b] is the slot that holds block b's K/V
(0 = none: slot 0 is a zero block that is never written, so a table entry pointing at it is safe to read; the
window mask hides it anyway). Each step pins the blocks that running requests can still attend to (their last
`window - 1` positions) and the blocks this step's rows attend to or write; every other slot is a cache (its
block may come back through a prefix-tree match) and is reused least recently used first. A prefix match is
cut back to where all the local K/V its first query needs is still present. A copy-on-write of a partly reused
block (engine/kv_cache_manager.py) copies slot to slot: only while the source's slot still holds it, and the copy's
slot is never one whose block a running request (or the one being admitted) still attends to.

With n_slots = ~max_batch windows, memory for local layers no longer grows with the context: Gemma 3 at a
32k context keeps ~5k tokens of local K/V instead of 32k.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np


def slots_needed(max_batch: int, window: int, block_size: int, token_budget: int) -> int:
    """Slots that the pinned blocks of one step can need at most: per running request its window plus the
    block it writes into and one partial block, plus the blocks of this step's new tokens."""
    return max_batch * (-(-window // block_size) + 3) + -(-token_budget // block_size)


class WindowSlots:
    """block -> slot map of the local (sliding-window) layers, with pinning and LRU reuse."""

    def __init__(self, n_blocks: int, n_slots: int, block_size: int, window: int):
        if n_slots <= 0 or window <= 0:
            raise ValueError("n_slots and window must be positive")
        self.n_slots, self.bs, self.window = n_slots, block_size, window
        self.slot = np.zeros(n_blocks, dtype=np.int64)  # (NB,) block -> slot, 0 = no local K/V
        self.owner = np.full(n_slots + 1, -1, dtype=np.int64)  # (n_slots + 1,) slot -> block, -1 = free
        self._lru: OrderedDict[int, None] = OrderedDict((s, None) for s in range(1, n_slots + 1))  # unpinned
        self._running: dict[int, None] = {}  # blocks pinned for the running requests (set by pin_running)
        self.reused = 0  # slots taken from another block (its local K/V dropped)

    def holds(self, b: int) -> bool:
        """Whether block b's local K/V is (still) in its slot."""
        s = int(self.slot[b])
        return s != 0 and int(self.owner[s]) == b

    def _give(self, s: int, b: int) -> None:
        """Slot s now holds block b; the block it held before (if another) loses its local K/V."""
        old = int(self.owner[s])
        if old >= 0 and old != b:
            self.slot[old] = 0
            self.reused += 1
        self.owner[s], self.slot[b] = b, s

    # -- pins -----------------------------------------------------------------------------------------
    def _window_blocks(self, table, first_query: int, end: int) -> list[int]:
        """Blocks of `table` holding positions a query at >= first_query can see, up to position end - 1."""
        lo = max(0, first_query - self.window + 1)
        if end <= lo:
            return []
        return [int(b) for b in table[lo // self.bs:(end - 1) // self.bs + 1] if b >= 0]

    def seen(self, table, query: int) -> list[int]:
        """Blocks of `table` holding the positions before `query` that a query there attends to."""
        return self._window_blocks(table, query, query)

    def pin_running(self, tables) -> None:
        """Pin, for every running request given as (block table, n_computed), the blocks its next query can
        attend to."""
        pins: dict[int, None] = {}
        for table, n_computed in tables:
            pins.update(dict.fromkeys(self.seen(table, n_computed)))
        self._running = pins

    def tables(self, block_tables: np.ndarray, positions: np.ndarray, row_seq: np.ndarray) -> np.ndarray:
        """Slot tables (S, MB) for one forward: gives a slot to every block this step writes and checks that
        every block its rows can attend to still has its local K/V. Entries -1 stay -1."""
        pinned, new = dict(self._running), []  # ordered: slots go back to the LRU queue in this order
        for s in np.unique(row_seq):
            pos = positions[row_seq == s]
            first, end = int(pos.min()), int(pos.max()) + 1
            for b in self._window_blocks(block_tables[s], first, end):
                pinned[b] = None
                if not self.holds(b):
                    new.append(b)
            # blocks holding positions < first that these rows see must still have them: never read lost K/V
            for b in self._window_blocks(block_tables[s], first, first):
                if b in new:
                    raise RuntimeError(f"sliding-window K/V of block {b} was dropped while still needed")
        for b in pinned:  # pinned slots leave the LRU queue for this step
            if self.holds(b):
                self._lru.pop(int(self.slot[b]), None)
        for b in dict.fromkeys(new):
            if not self._lru:
                raise RuntimeError("no free sliding-window slot (n_slots too small for this batch)")
            self._give(self._lru.popitem(last=False)[0], b)
        for b in pinned:  # back to the queue as the most recently used
            s = int(self.slot[b])
            if s:
                self._lru[s] = None
        out = np.where(block_tables >= 0, self.slot[np.maximum(block_tables, 0)], -1)
        return out

    # -- prefix reuse ---------------------------------------------------------------------------------
    def usable_prefix(self, blocks: list[int]) -> int:
        """How many leading blocks of a cached prefix can be reused: the first query after them must find
        the local K/V of every block in its window."""
        ok = [self.holds(b) for b in blocks]
        for m in range(len(blocks), 0, -1):
            lo = max(0, m * self.bs - self.window + 1) // self.bs
            if all(ok[lo:m]):
                return m
        return 0

    def can_copy(self, src: int, keep) -> bool:
        """Whether prepare_copy(src, dst, keep) succeeds for any dst (no side effects)."""
        return self.holds(src) and self._spare(int(self.slot[src]), keep) != 0

    def _spare(self, s: int, keep) -> int:
        """The least recently used slot other than s whose block is not in keep (0: none)."""
        return next((x for x in self._lru if x != s and int(self.owner[x]) not in keep), 0)

    def prepare_copy(self, src: int, dst: int, keep) -> tuple[int, int] | None:
        """(src slot, dst slot) for copying block src's local K/V into block dst, giving dst a slot if it has
        none: the least recently used one whose block is not in `keep` (blocks some query still needs). None if
        src's local K/V was dropped or every slot holds a kept block."""
        if not self.holds(src):
            return None
        s = int(self.slot[src])
        if not self.holds(dst):
            d = self._spare(s, keep)
            if not d:
                return None
            self._give(d, dst)
        d = int(self.slot[dst])
        self._lru.pop(d, None)
        self._lru[d] = None  # most recently used
        return s, d

    # -- blocks restored from disk (engine/prompt_cache.py) ---------------------------------------------------
    def n_spare(self, keep) -> int:
        """Slots whose block (if any) is not in keep: how many blocks give_slots(..., keep) can place at least."""
        return sum(int(self.owner[s]) not in keep for s in self._lru)

    def give_slots(self, blocks: list[int], keep) -> bool:
        """Give every block of `blocks` a slot for its local K/V (one it holds stays its own), taking the least
        recently used slots whose block is not in keep; False, nothing changed, if too few."""
        need = [b for b in blocks if not self.holds(b)]
        mine = set(blocks) | set(keep)
        spare = [s for s in self._lru if int(self.owner[s]) not in mine][:len(need)]
        if len(spare) < len(need):
            return False
        for s, b in zip(spare, need):
            self._give(s, b)
        for b in blocks:
            self._lru.move_to_end(int(self.slot[b]))  # most recently used
        return True

    def drop(self, b: int) -> None:
        """Block b holds no local K/V any more (its slot, if any, is reused first)."""
        if self.holds(b):
            s = int(self.slot[b])
            self.owner[s], self.slot[b] = -1, 0
            self._lru.move_to_end(s, last=False)
        self.slot[b] = 0

    def stats(self) -> dict:
        held = int(np.count_nonzero(self.owner[1:] >= 0))
        return {"swa_slots_total": self.n_slots, "swa_slots_held": held, "swa_slots_reused": self.reused}
