"""Prefix tree: a radix tree over full KV blocks (block_size token ids per edge), SGLang-style.

The tree does not own references: a block in the tree with ref count 0 sits in the BlockPool's free queue
marked *cached*; it can be revived by a later match until the pool hands it out again, at which point the
pool calls `evict(block)` and the node and its subtree leave the tree (descendants are free too: whoever
holds a child block also holds its parent). Eviction order is the pool's LRU order.
"""
from __future__ import annotations

from edgellm.engine.block_pool import BlockPool


class Node:
    __slots__ = ("key", "block", "children", "parent")

    def __init__(self, key: tuple, block: int, parent: "Node | None"):
        self.key, self.block, self.parent = key, block, parent
        self.children: dict[tuple, Node] = {}


class PrefixTree:
    """match / insert / evict over token blocks; `admit` and `release` connect it to requests."""

    def __init__(self, pool: BlockPool, block_size: int):
        self.pool, self.bs = pool, block_size
        self.root = Node((), -1, None)
        self.by_block: dict[int, Node] = {}
        self.hit_tokens = 0  # total prompt tokens served from the tree
        self.usable = None  # optional: blocks -> how many leading ones can be reused (sliding-window K/V)
        pool.on_evict = self.evict

    # -- public API ---------------------------------------------------------------------------------
    def match(self, ids: list[int], max_blocks: int | None = None) -> list[int]:
        """Block ids caching the longest run of full blocks that prefixes `ids`."""
        node, out = self.root, []
        n = len(ids) // self.bs if max_blocks is None else min(max_blocks, len(ids) // self.bs)
        for i in range(n):
            child = node.children.get(tuple(ids[i * self.bs:(i + 1) * self.bs]))
            if child is None:
                break
            out.append(child.block)
            node = child
        return out

    def insert(self, ids: list[int], blocks: list[int]) -> set[int]:
        """Record that blocks[i] holds the K/V of ids' i-th full block; returns the blocks now in the tree."""
        node, kept = self.root, set()
        for i in range(min(len(ids) // self.bs, len(blocks))):
            key = tuple(ids[i * self.bs:(i + 1) * self.bs])
            child = node.children.get(key)
            if child is None:
                if blocks[i] in self.by_block:  # block already caches another path (cannot happen twice)
                    break
                child = Node(key, blocks[i], node)
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
        """Reuse the longest cached prefix of req's tokens (always leaving >= 1 token to compute)."""
        ids = req.all_ids
        blocks = self.match(ids, max_blocks=(len(ids) - 1) // self.bs)
        if blocks and self.usable is not None:
            blocks = blocks[:self.usable(blocks)]
        if blocks:
            self.pool.touch(blocks)
        req.block_table = list(blocks)
        req.n_computed = req.n_cached = len(blocks) * self.bs
        self.hit_tokens += req.n_cached

    def release(self, req) -> None:
        """Leave req's full computed blocks in the tree and drop its references."""
        ids = req.all_ids[:req.n_computed]
        kept = self.insert(ids, req.block_table)
        self.pool.free(req.block_table, cached=kept)
