"""BlockPool and PrefixTree: exact block ids, LRU eviction order, ref counts."""
from __future__ import annotations

import pytest

from edgellm.engine.block_pool import BlockPool
from edgellm.engine.prefix_tree import PrefixTree


class FakeReq:
    def __init__(self, ids):
        self.all_ids = list(ids)
        self.block_table: list[int] = []
        self.n_computed = self.n_cached = 0
        self.prompt_rows = len(ids)  # every row computed as a prompt row


def test_allocate_in_order_and_none_on_shortage():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None  # only one left: nothing taken
    assert pool.n_free == 1
    assert pool.allocate(1) == [3]


def test_free_returns_to_tail_in_reverse():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.free(a)  # tail gets 1 then 0 -> free queue: 2, 3, 1, 0
    assert pool.allocate(4) == [2, 3, 1, 0]


def test_double_free_raises():
    pool = BlockPool(2)
    a = pool.allocate(1)
    pool.free(a)
    with pytest.raises(RuntimeError):
        pool.free(a)


def test_touch_shares_and_refcounts():
    pool = BlockPool(3)
    a = pool.allocate(1)
    pool.touch(a)
    assert pool.ref[a[0]] == 2
    pool.free(a)
    assert pool.n_free == 2 and pool.ref[a[0]] == 1
    pool.free(a)
    assert pool.n_free == 3


def test_prefix_tree_match_insert_release_reuse():
    pool = BlockPool(8)
    tree = PrefixTree(pool, block_size=2)
    r1 = FakeReq([1, 2, 3, 4, 5])
    tree.admit(r1)
    assert r1.block_table == [] and r1.n_cached == 0
    r1.block_table = pool.allocate(3)  # [0, 1, 2]
    r1.n_computed = 5
    tree.release(r1)  # blocks 0, 1 are full -> cached; block 2 (partly filled) -> cached as a partial leaf
    assert len(tree) == 3 and pool.cached == {0, 1, 2} and pool.n_free == 8
    r2 = FakeReq([1, 2, 3, 4, 9, 9, 9])
    tree.admit(r2)  # no copy callback: partial blocks are not reused (see tests/test_prefix_cow.py)
    assert r2.block_table == [0, 1] and r2.n_cached == 4 and pool.ref[0] == 1
    assert pool.cached == {2}
    assert tree.hit_tokens == 4


def test_admit_leaves_one_token_to_compute():
    pool = BlockPool(4)
    tree = PrefixTree(pool, block_size=2)
    r = FakeReq([1, 2, 3, 4])
    r.block_table, r.n_computed = pool.allocate(2), 4
    tree.release(r)
    r2 = FakeReq([1, 2, 3, 4])
    tree.admit(r2)
    assert r2.block_table == [0] and r2.n_cached == 2  # the last block is recomputed for logits


def test_lru_eviction_order_and_subtree_removal():
    pool = BlockPool(4)
    tree = PrefixTree(pool, block_size=1)
    a = FakeReq([7, 8])
    a.block_table, a.n_computed = pool.allocate(2), 2  # [0, 1]
    b = FakeReq([5])
    b.block_table, b.n_computed = pool.allocate(1), 1  # [2]
    tree.release(a)  # free queue: 3, 1, 0   (child 1 queued before parent 0)
    tree.release(b)  # free queue: 3, 1, 0, 2
    assert pool.allocate(1) == [3]  # never-cached block first
    assert pool.allocate(1) == [1]  # then LRU cached: the leaf of a's path
    assert pool.evictions == 1 and tree.match([7, 8]) == [0]
    assert pool.allocate(1) == [0]  # evicting the parent drops the path
    assert tree.match([7, 8]) == [] and tree.match([5]) == [2]
