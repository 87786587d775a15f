"""Prefix tree: a radix tree over KV blocks (block_size token ids per edge), SGLang-style, with copy-on-write
reuse of partly filled blocks.

The tree does not own references: a block in the tree with ref count 0 sits in the BlockPool's free queue
marked *cached*; it can be revived by a later match until the pool hands it out again, at which point the
pool calls `evict(block)` and the node and its subtree leave the tree (descendants are free too: whoever
holds a child block also holds its parent). Eviction order is the pool's LRU order.

Partly filled blocks. When a request ends with its last computed block partly filled, that block enters the
tree as a *partial leaf*: key = its tokens (fewer than block_size, so it never collides with a full key), no
children, cached like a full block. A block in the tree is never written again, and a partial one is never
handed to a request as is: `admit`, after the longest run of full blocks, looks among the children of the last
matched node (partial leaves and full blocks alike) for the longest common prefix with the request's next
tokens, takes a fresh block and copies those n rows of K/V into it (`copy`, set by the Engine: every layer,
sliding-window slots included) — copy-on-write, done up front. The request owns the copy and writes its next
rows there; two requests reusing the same partial block get a copy each. The copy is skipped when the full
match was cut back by `usable`, when `copy` refuses (a trimmed sliding-window layer no longer holds the
source) or when no block is free.

Batch invariance: rows computed as decode rows (generated tokens) have K/V that differ in the last bits from
the same tokens computed as prompt rows (see Request.prompt_rows), so a copy stops where the row kinds of the
source and of the new request differ; every copied row then equals what the request would compute itself.
"""
from __future__ import annotations

from edgellm.engine.block_pool import BlockPool


class Node:
    __slots__ = ("key", "block", "children", "parent", "prompt_rows")

    def __init__(self, key: tuple, block: int, parent: "Node | None", prompt_rows: int = 0):
        self.key, self.block, self.parent = key, block, parent
        self.prompt_rows = prompt_rows  # leading rows of the block that were computed as prompt rows
        self.children: dict[tuple, Node] = {}


def _common(a: tuple, b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixTree:
    """match / insert / evict over token blocks; `admit` and `release` connect it to requests."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.bs = pool, block_size
        self.root = Node((), -1, None)
        self.by_block: dict[int, Node] = {}
        self.hit_tokens = 0  # total prompt tokens served from the tree
        self.cow_copies = 0  # partly reused blocks copied into a request's own block
        self.usable = None  # optional: blocks -> how many leading ones can be reused (sliding-window K/V)
        self.copy = None  # optional: (src, dst, n rows, request) -> bool; without it no block is reused partly
        pool.on_evict = self.evict

    # -- public API ---------------------------------------------------------------------------------
    def match(self, ids: list[int], max_blocks: int | None = None) -> list[int]:
        """Block ids caching the longest run of full blocks that prefixes `ids`."""
        return [n.block for n in self._walk(ids, max_blocks)]

    def match_partial(self, ids: list[int], blocks: list[int], prompt_rows: int = 0) -> tuple[int, int]:
        """(block, n): the cached block whose first n > 0 rows hold ids[len(blocks) * bs:][:n], for the longest
        such n < block_size whose row kinds agree (rows < prompt_rows are prompt rows); (-1, 0) if none.
        `blocks` must be a full-block match of ids."""
        node = self.by_block[blocks[-1]] if blocks else self.root
        start = len(blocks) * self.bs
        rest, mine = ids[start:start + self.bs - 1], min(max(prompt_rows - start, 0), self.bs)
        best = (-1, 0)
        for child in node.children.values():
            n = _common(child.key, rest)
            if child.prompt_rows != mine:  # row kinds agree on rows < min of the two boundaries only
                n = min(n, child.prompt_rows, mine)
            if n > best[1]:
                best = (child.block, n)
        return best

    def insert(self, ids: list[int], blocks: list[int], prompt_rows: int = 0) -> set[int]:
        """Record that blocks[i] holds the K/V of ids' i-th block (the last one may be partly filled: a partial
        leaf); rows < prompt_rows were computed as prompt rows. Returns the blocks now in the tree."""
        node, kept = self.root, set()
        for i in range(min(-(-len(ids) // self.bs), len(blocks))):
            key = tuple(ids[i * self.bs:(i + 1) * self.bs])
            child = node.children.get(key)
            if child is None:
                if blocks[i] in self.by_block:  # block already caches another path (cannot happen twice)
                    break
                rows = min(max(prompt_rows - i * self.bs, 0), self.bs)
                child = Node(key, blocks[i], node, rows)
                node.children[key] = child
                self.by_block[blocks[i]] = child
            if child.block != blocks[i]:
                break  # same tokens computed twice: the older block stays cached, this one is freed
            kept.add(blocks[i])
            node = child
        return kept

    def evict(self, block: int) -> None:
        """The pool reuses `block`: drop its node and the (free) subtree below it."""
        node = self.by_block.pop(block, None)
        if node is None:
            return
        del node.parent.children[node.key]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            self.by_block.pop(n.block, None)
            self.pool.cached.discard(n.block)
            stack.extend(n.children.values())

    def __len__(self) -> int:
        return len(self.by_block)

    # -- requests -----------------------------------------------------------------------------------
    def admit(self, req) -> None:
        """Reuse the longest cached prefix of req's tokens (always leaving >= 1 token to compute): shared full
        blocks, then the rows of one more block, copied into a block of req's own."""
        ids = req.all_ids
        blocks = self.match(ids, max_blocks=(len(ids) - 1) // self.bs)
        whole = True
        if blocks and self.usable is not None:
            whole = (m := self.usable(blocks)) == len(blocks)
            blocks = blocks[:m]
        if blocks:
            self.pool.touch(blocks)
        req.block_table = list(blocks)
        req.n_computed = req.n_cached = len(blocks) * self.bs
        if whole and self.copy is not None:
            self._copy_partial(req, ids[:len(ids) - 1])
        self.hit_tokens += req.n_cached

    def release(self, req) -> None:
        """Leave req's computed blocks in the tree (the last one as a partial leaf if partly filled) and drop
        its references."""
        ids = req.all_ids[:req.n_computed]
        kept = self.insert(ids, req.block_table, req.prompt_rows)
        self.pool.free(req.block_table, cached=kept)

    # -- helpers ------------------------------------------------------------------------------------
    def _walk(self, ids: list[int], max_blocks: int | None) -> list[Node]:
        """Nodes of the longest run of full blocks that prefixes ids (at most max_blocks)."""
        node, out = self.root, []
        n = len(ids) // self.bs if max_blocks is None else min(max_blocks, len(ids) // self.bs)
        for i in range(n):
            node = node.children.get(tuple(ids[i * self.bs:(i + 1) * self.bs]))
            if node is None:
                break
            out.append(node)
        return out

    def _copy_partial(self, req, ids: list[int]) -> None:
        """Copy-on-write: give req a fresh block holding the longest reusable rows after its full blocks."""
        src, n = self.match_partial(ids, req.block_table, req.prompt_rows)
        if n == 0:
            return
        self.pool.touch([src])  # src may sit in the free queue: do not let allocate() hand it out
        got = self.pool.allocate(1)
        ok = got is not None and self.copy(src, got[0], n, req)
        self.pool.free([src], cached={src})
        if not ok:
            if got is not None:
                self.pool.free(got)
            return
        req.block_table.append(got[0])
        req.n_computed = req.n_cached = req.n_computed + n
        self.cow_copies += 1
