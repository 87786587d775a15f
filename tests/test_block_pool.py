"""BlockPool, PrefixTree and the KV cache manager: exact block ids, LRU eviction order, ref counts, lookup without
side effects, all-or-nothing allocation."""
from __future__ import annotations

import itertools

import pytest

from edgellm.engine.block_pool import BlockPool
from edgellm.engine.kv_cache_manager import KVCacheManager, PrefixHit


class FakeReq:
    _ids = itertools.count()

    def __init__(self, ids):
        self.id = next(self._ids)
        self.all_ids = list(ids)
        self.n_computed = 0


def computed(mgr, ids) -> FakeReq:
    """A request holding fresh blocks for all of ids, computed (not yet freed)."""
    r = FakeReq(ids)
    assert mgr.allocate(r, len(ids)) is not None
    r.n_computed = len(ids)
    return r


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
    mgr = KVCacheManager(8, block_size=2)
    pool = mgr.pool
    r1 = FakeReq([1, 2, 3, 4, 5])
    assert mgr.lookup(r1) == PrefixHit()
    assert mgr.allocate(r1, 5) == [0, 1, 2]
    r1.n_computed = 5
    mgr.free(r1)  # blocks 0, 1 are full -> cached; block 2 (partly filled) -> cached as a partial leaf
    assert len(mgr.prefix) == 3 and mgr.cached_blocks() == {0, 1, 2} and pool.n_free == 8
    r2 = FakeReq([1, 2, 3, 4, 9, 9, 9])
    hit = mgr.lookup(r2)  # the partial leaf (5,) does not match 9: full blocks only
    assert hit == PrefixHit((0, 1), -1, 0, 4)
    assert mgr.allocate(r2, 0, hit=hit) == [] and mgr.block_table(r2) == [0, 1] and pool.ref[0] == 1
    assert mgr.cached_blocks() == {2}
    assert mgr.hit_tokens == 4


def test_lookup_changes_nothing_and_allocate_is_all_or_nothing():
    mgr = KVCacheManager(4, block_size=2)
    pool = mgr.pool
    mgr.free(computed(mgr, [1, 2, 3, 4, 5]))  # 0, 1 full, 2 = (5,); free queue: 3, 2, 1, 0
    state = lambda: (list(pool.ref), pool.n_free, mgr.cached_blocks(), set(mgr.prefix.by_block), mgr.hit_tokens)
    before = state()
    r = FakeReq([1, 2, 3, 4, 5, 6, 7, 8])
    hit = mgr.lookup(r)
    assert hit == PrefixHit((0, 1), 2, 1, 5) and state() == before  # nothing taken, touched or counted
    # 8 tokens need 4 blocks: 0 and 1 revived, 2 fresh ones (the copy's and one more); 2 more tokens: too many
    assert mgr.allocate(r, 3, hit=hit, lookahead=2) is None and state() == before
    assert mgr.allocate(r, 3, hit=hit) == [3, 2] and mgr.block_table(r) == [0, 1, 3, 2]
    assert pool.ref == [1, 1, 1, 1] and mgr.cow_copies == 1 and mgr.hit_tokens == 5
    assert set(mgr.prefix.by_block) == {0, 1}  # block 2 (the copy's source) was handed out after the copy
    r.n_computed = 8
    assert mgr.allocate(r, 1) is None and mgr.block_table(r) == [0, 1, 3, 2]  # position 8 needs a 5th block


def test_admit_leaves_one_token_to_compute():
    mgr = KVCacheManager(4, block_size=2)
    mgr.free(computed(mgr, [1, 2, 3, 4]))
    hit = mgr.lookup(FakeReq([1, 2, 3, 4]))
    assert hit == PrefixHit((0,), 1, 1, 3)  # the last token is recomputed for logits: block 0 + 1 row of block 1


def test_lru_eviction_order_and_subtree_removal():
    mgr = KVCacheManager(4, block_size=1)
    a = computed(mgr, [7, 8])  # [0, 1]
    b = computed(mgr, [5])  # [2]
    mgr.free(a)  # free queue: 3, 1, 0   (child 1 queued before parent 0)
    mgr.free(b)  # free queue: 3, 1, 0, 2
    take = lambda: mgr.allocate(FakeReq([0]), 1)
    assert take() == [3]  # never-cached block first
    assert take() == [1]  # then LRU cached: the leaf of a's path
    assert mgr.evictions == 1 and mgr.prefix.match([7, 8]) == [0]
    assert take() == [0]  # evicting the parent drops the path
    assert mgr.prefix.match([7, 8]) == [] and mgr.prefix.match([5]) == [2]


def test_blocks_taken_for_direct_model_use_leave_the_tree():
    """Direct model use (LLM.scratch: a holder that is no request, freed uncached) takes cached blocks through the
    manager: lookup must not offer them afterwards."""
    mgr = KVCacheManager(2, block_size=2)
    mgr.free(computed(mgr, [1, 2, 3, 4]))  # free queue: 1, 0
    scratch = FakeReq([])
    assert mgr.allocate(scratch, 4) == [1, 0]
    mgr.free(scratch, cache=False)
    assert mgr.lookup(FakeReq([1, 2, 3])) == PrefixHit() and len(mgr.prefix) == 0 and not mgr.cached_blocks()
