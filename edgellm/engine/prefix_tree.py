"""Prefix tree: a radix tree over KV blocks (block_size token ids per edge), SGLang-style, with copy-on-write
reuse of partly filled blocks.

The tree owns no references and no K/V: it maps token paths to block ids. A block in the tree with ref count 0
sits in the BlockPool's free queue and is *cached*; a later match can revive it until the pool hands it out
again, and then the KV cache manager calls `evict(block)`: the node and its subtree leave the tree (descendants
are free too: whoever holds a child block also holds its parent). Eviction order is the pool's LRU order.

Partly filled blocks. When a request ends with its last computed block partly filled, that block enters the
tree as a *partial leaf*: key = its tokens (fewer than block_size, so it never collides with a full key), no
children, cached like a full block. A block in the tree is never written again, and a partial one is never
handed to a request as is: `match_partial` finds, after the longest run of full blocks, the child of the last
matched node (partial leaves and full blocks alike) with the longest common prefix with the request's next
tokens, and the KV cache manager copies those rows into a fresh block of the request (copy-on-write).

Batch invariance: a row's K/V depends only on its sequence's tokens up to it, never on how it was computed (a
prompt row in a chunk of any size, a generated token fed back, a cache hit: kernels_cpu.attention sums every
row in one order), so a block of generated tokens is reused like a prompt's (a chat's next turn repeats the
last answer) and every reused row equals what the request would compute itself.
"""
from __future__ import annotations


class Node:
    __slots__ = ("key", "block", "children", "parent")

    def __init__(self, key: tuple, block: int, parent: "Node | None"):
        self.key, self.block, self.parent = key, block, parent
        self.children: dict[tuple, Node] = {}


def _common(a: tuple, b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixTree:
    """match / match_partial / insert / evict over token blocks (block_size token ids per full edge)."""

    def __init__(self, block_size: int):
        self.bs = block_size
        self.root = Node((), -1, None)
        self.by_block: dict[int, Node] = {}

    # -- public API ---------------------------------------------------------------------------------
    def match(self, ids: list[int], max_blocks: int | None = None) -> list[int]:
        """Block ids caching the longest run of full blocks that prefixes `ids`."""
        return [n.block for n in self._walk(ids, max_blocks)]

    def match_partial(self, ids: list[int], blocks: list[int]) -> tuple[int, int]:
        """(block, n): the cached block whose first n > 0 rows hold ids[len(blocks) * bs:][:n], for the longest
        such n < block_size; (-1, 0) if none. `blocks` must be a full-block match of ids."""
        node = self.by_block[blocks[-1]] if blocks else self.root
        start = len(blocks) * self.bs
        rest = ids[start:start + self.bs - 1]
        best = (-1, 0)
        for child in node.children.values():
            n = _common(child.key, rest)
            if n > best[1]:
                best = (child.block, n)
        return best

    def insert(self, ids: list[int], blocks: list[int]) -> set[int]:
        """Record that blocks[i] holds the K/V of ids' i-th block (the last one may be partly filled: a partial
        leaf)."""
        node = self.root
        for i in range(min(-(-len(ids) // self.bs), len(blocks))):
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
            node = child

    def evict(self, block: int) -> None:
        """`block` was handed out again: drop its node and the (free) subtree below it, whose blocks then hold
        no cached prefix any more."""
        node = self.by_block.pop(block, None)
        if node is None:
            return
        del node.parent.children[node.key]
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            del self.by_block[n.block]
            stack.extend(n.children.values())

    def __len__(self) -> int:
        return len(self.by_block)

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
