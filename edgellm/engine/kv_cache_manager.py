"""KVCacheManager: the one owner of KV memory (vLLM v1's kv_cache_manager.py): the BlockPool, the PrefixTree, the
sliding-window slots (engine/swa.py) and every request's block table.

The scheduler asks and decides; nothing is tried and undone. `lookup(req)` says what the cache holds for a waiting
request and changes nothing; `allocate(req, n_tokens, hit=...)` takes every block needed or nothing (None: memory
is short, the scheduler waits or preempts); `free(req)` gives blocks back, computed ones staying in the tree.
A partly reused block is copied up front (copy-on-write, every layer, window slots included) into a fresh block
of the request; `lookup` offers a copy only if it will succeed: the source still holds its window K/V, a slot no
running request (nor this one) attends to can take the copy, and a block is free besides the revived ones.

With a prompt cache on disk (`disk`, engine/prompt_cache.py), `free` saves the request's full prompt blocks (rows
copied out here, written by the cache's thread) and `lookup` extends a hit past the tree with the blocks on disk
that follow it (`PrefixHit.disk`); `allocate` reads and checks them first (a bad file: None, and the next lookup
offers less), then loads them into fresh blocks and inserts them in the tree. Only blocks whose rows, and every
row before them, were computed as prompt rows are saved, so a restored block equals a cold run's. A restored
prefix is as long as the window K/V its first query needs (saved with each block while it was in its slot).
"""
from __future__ import annotations

from dataclasses import dataclass

from edgellm.engine.block_pool import BlockPool
from edgellm.engine.prefix_tree import PrefixTree
from edgellm.engine.prompt_cache import block_hashes


@dataclass(frozen=True)
class PrefixHit:
    """What the cache holds for a request: shared full blocks, then `n_rows` rows of block `src` to copy into
    a fresh block (src -1: none); `tokens` of the request need no computing."""

    blocks: tuple[int, ...] = ()
    src: int = -1
    n_rows: int = 0
    tokens: int = 0
    disk: tuple[str, ...] = ()  # hashes of the blocks after `blocks` to load from the prompt cache on disk
    disk_missed: int = 0  # prompt blocks after those that the disk lacks (counted when allocated)


NO_HIT = PrefixHit()


class KVCacheManager:
    """Blocks, prefix cache and sliding-window slots behind lookup / allocate / free.

    kv: the PagedKVCache whose rows the blocks index; None simulates one without tensors (allocator tests:
    copies are then only counted)."""

    def __init__(self, n_blocks: int, block_size: int, kv=None, disk=None):
        self.pool = BlockPool(n_blocks)
        self.prefix = PrefixTree(block_size)
        self.bs, self.kv = block_size, kv
        self.windows = kv.windows if kv is not None else None
        self.disk = disk  # a PromptCache (engine/prompt_cache.py) or None
        self._held: dict[object, list[int]] = {}  # holder (a request, a Scratch) -> its blocks: position p in [p // bs]
        self.hit_tokens = 0  # tokens served from the prefix tree (counted once, when allocated)
        self.evictions = 0  # cached blocks taken for other use (their tree entries dropped)
        self.cow_copies = 0  # partly reused blocks copied into a request's own block
        self.disk_hits = self.disk_misses = 0  # admitted prompt blocks loaded from disk / computed with a disk cache

    # -- public API ---------------------------------------------------------------------------------
    def block_table(self, req) -> list[int]:
        """req's block ids (a copy; empty if it holds none)."""
        return list(self._held.get(req, ()))

    def lookup(self, req) -> PrefixHit:
        """The longest reusable cached prefix of req's tokens, always leaving >= 1 token to compute (its logits
        are needed): blocks of the tree, then blocks on disk if a prompt cache holds more. Allocates, references,
        copies and reads nothing."""
        ids = req.all_ids
        blocks = self.prefix.match(ids, max_blocks=(len(ids) - 1) // self.bs)
        if blocks and self.windows is not None:  # a prefix is only as long as its sliding-window K/V reaches
            m = self.windows.usable_prefix(blocks)
            if m < len(blocks):
                return self._hit(blocks[:m])
        disk, missed = self._disk_extension(req, blocks)
        if disk:
            return self._hit(blocks, disk=disk, missed=missed)
        src, n = self.prefix.match_partial(ids[:len(ids) - 1], blocks)
        if n and self._can_copy(src, blocks, len(blocks) * self.bs + n):
            return self._hit(blocks, src, n, missed=missed)
        return self._hit(blocks, missed=missed)

    def allocate(self, req, n_tokens: int, *, hit: PrefixHit = NO_HIT, lookahead: int = 0) -> list[int] | None:
        """Make req's block table cover positions < req.n_computed + hit.tokens + n_tokens, reusing `hit` (from
        lookup, for a request that holds no blocks yet). All or nothing: None, with nothing changed, unless
        blocks for `lookahead` more tokens would be free as well and hit.disk's files are all good (a bad one is
        forgotten: the next lookup offers less). Returns the fresh blocks.
        Any holder with an `n_computed` works (LLM.scratch holds blocks this way for one-off forwards)."""
        table = self._held.get(req, [])
        have = len(table) + len(hit.blocks)
        end = req.n_computed + hit.tokens + n_tokens
        need = max(0, -(-end // self.bs) - have)
        revived = sum(self.pool.ref[b] == 0 for b in hit.blocks)  # cached free blocks leave the free queue
        if max(need, -(-(end + lookahead) // self.bs) - have) > self.pool.n_free - revived:
            return None
        loaded = self._read_disk(req, hit) if hit.disk else None
        if hit.disk and loaded is None:
            return None  # a file was bad (now forgotten): the scheduler asks again and is offered less
        self.disk_hits += len(hit.disk)
        self.disk_misses += hit.disk_missed
        self._held[req] = table
        self.pool.touch(hit.blocks)
        table += hit.blocks
        fresh = self._copy_partial(req, hit) if hit.n_rows else []
        fresh += self._take(need - len(fresh))
        table += fresh
        if loaded:
            self._restore(req, table, hit, loaded)
        self.hit_tokens += hit.tokens
        return fresh

    def free(self, req, *, cache: bool = True) -> None:
        """Give req's blocks back. cache=True: its computed blocks stay in the prefix tree (the last one as a
        partial leaf if partly filled); False (a failed step, a scratch): only blocks already in the tree stay
        cached."""
        table = self._held.pop(req, [])
        if table and cache:
            if self.disk is not None:
                self._save(req, table)
            self.prefix.insert(req.all_ids[:req.n_computed], table)
        self.pool.free(table)

    def trim(self, req, n_tokens: int) -> list[int]:
        """Roll req's block table back to the blocks holding positions < n_tokens (speculative rows that were
        rejected); the freed blocks go to the head of the free queue. Only req's own unshared blocks past its
        computed tokens can go: shared (prefix-tree) blocks hold prompt positions, never past n_tokens. Returns
        the freed block ids."""
        table = self._held.get(req)
        keep = -(-n_tokens // self.bs)
        if not table or len(table) <= keep:
            return []
        gone = table[keep:]
        if any(self.pool.ref[b] != 1 or b in self.prefix.by_block for b in gone):
            raise RuntimeError(f"trim would free a shared block of {gone}")
        del table[keep:]
        for b in gone if self.windows is not None else ():
            self.windows.drop(b)  # its slot holds nothing anyone reads: reused first
        self.pool.free(gone, front=True)
        return gone

    def prepare(self, batch) -> None:
        """Before a forward: pin the sliding-window blocks every holder's next query attends to and set
        batch.slot_tables (S, MB), giving a slot to every block the batch writes (no-op without trimmed layers)."""
        if self.windows is None:
            return
        self.windows.pin_running((t, r.n_computed) for r, t in self._held.items())
        batch.slot_tables = self.windows.tables(batch.block_tables, batch.positions, batch.row_seq)

    def cached_blocks(self) -> set[int]:
        """Free blocks that still hold a cached prefix (a lookup can revive them)."""
        return {b for b in self.prefix.by_block if self.pool.ref[b] == 0}

    def stats(self) -> dict:
        """Block, prefix-cache and sliding-window counters."""
        p = self.pool
        return {"blocks_total": p.n_blocks, "blocks_used": p.n_used, "blocks_free": p.n_free,
                "blocks_cached": len(self.cached_blocks()), "evictions": self.evictions,
                "prefix_hit_tokens": self.hit_tokens, "prefix_tree_blocks": len(self.prefix),
                "prefix_cow_copies": self.cow_copies,
                **({"disk_hit_blocks": self.disk_hits, "disk_miss_blocks": self.disk_misses,
                    **self.disk.stats()} if self.disk is not None else {}),
                **(self.windows.stats() if self.windows is not None else {})}

    # -- helpers ------------------------------------------------------------------------------------
    def _hit(self, blocks: list[int], src: int = -1, n: int = 0, disk: tuple = (), missed: int = 0) -> PrefixHit:
        return PrefixHit(tuple(blocks), src, n, (len(blocks) + len(disk)) * self.bs + n, tuple(disk), missed)

    def _keep(self, blocks, query: int) -> set[int]:
        """Blocks some query still attends to: every holder's next one, and one at `query` over `blocks`."""
        if self.windows is None:
            return set()
        keep = set(self.windows.seen(blocks, query))
        for r, t in self._held.items():
            keep.update(self.windows.seen(t, r.n_computed))
        return keep

    def _can_copy(self, src: int, blocks: list[int], query: int) -> bool:
        revived = sum(self.pool.ref[b] == 0 for b in {*blocks, src})
        if self.pool.n_free - revived < 1:
            return False
        return self.windows is None or self.windows.can_copy(src, self._keep(blocks, query))

    def _copy_partial(self, req, hit: PrefixHit) -> list[int]:
        """Copy-on-write: a fresh block holding hit.n_rows rows of hit.src (lookup checked that it succeeds)."""
        self.pool.touch([hit.src])  # src may sit in the free queue: do not let _take() hand it out
        (dst,) = self._take(1)
        keep = self._keep(hit.blocks, len(hit.blocks) * self.bs + hit.n_rows)
        if self.kv is not None and not self.kv.copy_block(hit.src, dst, hit.n_rows, keep):
            raise RuntimeError(f"copy of block {hit.src} refused after lookup offered it")
        self.pool.free([hit.src])
        self.cow_copies += 1
        return [dst]

    def _take(self, n: int) -> list[int]:
        """n fresh blocks (allocate() checked they are free); cached ones handed out leave the tree (with their
        free subtrees). Every block is taken here, so the tree never names a block in another use."""
        got = self.pool.allocate(n)
        evicted = [b for b in got if b in self.prefix.by_block]
        for b in evicted:
            self.prefix.evict(b)
        self.evictions += len(evicted)
        return got

    # -- the prompt cache on disk ------------------------------------------------------------------------------
    def _disk_extension(self, req, blocks: list[int]) -> tuple[tuple[str, ...], int]:
        """(hashes of the blocks on disk that extend the tree's match `blocks`: as many as have the window K/V
        the next query needs and slots to put it in, full blocks left to compute); lookup: no side effects."""
        if self.disk is None:
            return (), 0
        m, limit = len(blocks), (len(req.all_ids) - 1) // self.bs
        if limit <= m:
            return (), 0
        hashes = block_hashes(req.all_ids, limit, self.bs)
        found = self.disk.find(hashes[m:])
        n = m + len(found)
        while self.windows is not None and n > m:
            lo = max(m, max(0, n * self.bs - self.windows.window + 1) // self.bs)  # disk blocks in the window
            if all(found[lo - m:n - m]) and n - lo <= self.windows.n_spare(self._keep(blocks, n * self.bs)):
                break
            n -= 1
        return tuple(hashes[m:n]), limit - n

    def _read_disk(self, req, hit: PrefixHit) -> list | None:
        """The rows of hit.disk's blocks from their files, all checked; None if any is missing or bad."""
        m, ids = len(hit.blocks), req.all_ids
        lo = self._window_start(hit)
        if self.windows is not None and len(hit.disk) + m - max(lo, m) > self.windows.n_spare(
                self._keep(hit.blocks, hit.tokens)):
            raise RuntimeError("no sliding-window slots for a disk hit that lookup offered")
        out = self.disk.load_many([(h, ids[i * self.bs:(i + 1) * self.bs], i >= lo) for i, h in enumerate(hit.disk, m)])
        return None if any(rows is None for rows in out) else out

    def _window_start(self, hit: PrefixHit) -> int:
        """First block the query after hit attends to in sliding-window layers (len of the hit: none)."""
        if self.windows is None:
            return len(hit.blocks) + len(hit.disk)
        return max(0, hit.tokens - self.windows.window + 1) // self.bs

    def _restore(self, req, table: list[int], hit: PrefixHit, loaded: list) -> None:
        """Load hit.disk's rows (read by _read_disk) into their fresh blocks table[m:n], the window ones given
        slots, and insert the prefix in the tree."""
        m, n = len(hit.blocks), len(hit.blocks) + len(hit.disk)
        lo = self._window_start(hit)
        if self.windows is not None:
            for b in table[m:max(lo, m)]:
                self.windows.drop(b)  # a fresh block's slot may hold stale rows: outside the window, none
            if not self.windows.give_slots(table[max(lo, m):n], self._keep(hit.blocks, hit.tokens)):
                raise RuntimeError("no sliding-window slots for restored blocks after allocate checked")
        for b, rows in zip(table[m:n], loaded):
            self.kv.import_block(b, rows)
        self.prefix.insert(req.all_ids[:n * self.bs], table[:n])
        self.disk.touch(block_hashes(req.all_ids, n, self.bs))

    def _save(self, req, table: list[int]) -> None:
        """Queue req's computed full blocks that the disk lacks (free(): their rows are still in place); blocks of
        generated tokens too (a chat's next turn repeats the answer)."""
        n = min(req.n_computed // self.bs, len(table))
        ids = req.all_ids
        todo = [(h, ids[i * self.bs:(i + 1) * self.bs], table[i]) for i, h in enumerate(block_hashes(ids, n, self.bs))
                if self.disk.wants(h, self.windows is None or self.windows.holds(table[i]))]
        if todo:
            self.disk.save(todo, self.kv.export_block)
