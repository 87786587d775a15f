"""Copy-on-write reuse of partly filled KV blocks (engine/prefix_tree.py, engine/kv_cache_manager.py): partial leaves, the longest partial match,
the shared block never written, eviction, leak-free accounting, and outputs identical to cold runs (also with
trimmed sliding-window layers)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.kv_cache_manager import KVCacheManager, PrefixHit
from edgellm.engine.swa import WindowSlots, slots_needed

GREEDY = dict(temperature=0, ignore_eos=True, logprobs=0)


class FakeReq:
    _ids = itertools.count()

    def __init__(self, ids):
        self.id = next(self._ids)
        self.all_ids = list(ids)
        self.n_computed = self.n_cached = 0


class Cache(KVCacheManager):
    """A KV cache manager without tensors that records its copies as (src, dst, n rows)."""

    def __init__(self, n_blocks=16, bs=4):
        super().__init__(n_blocks, bs)
        self.copies = []

    def admit(self, r: FakeReq) -> PrefixHit:
        """lookup + allocate the hit alone (nothing to compute yet), as the scheduler admits."""
        hit = self.lookup(r)
        fresh = self.allocate(r, 0, hit=hit)
        assert fresh is not None
        if hit.n_rows:
            self.copies.append((hit.src, fresh[0], hit.n_rows))
        r.n_computed = r.n_cached = hit.tokens
        return hit


def finished(mgr, ids, n_computed=None) -> FakeReq:
    """A request admitted (full blocks only), computed up to n_computed in fresh blocks, then freed."""
    r = FakeReq(ids)
    hit = mgr.lookup(r)
    hit = PrefixHit(hit.blocks, tokens=len(hit.blocks) * mgr.bs)
    n = len(ids) if n_computed is None else n_computed
    assert mgr.allocate(r, n - hit.tokens, hit=hit) is not None
    r.n_computed = n
    mgr.free(r)
    return r


class Windows:
    """Sliding-window answers for the manager: how many matched blocks are usable, whether a copy can be made."""

    def __init__(self, usable=None, copy=True):
        self.usable, self.copy = usable, copy

    def usable_prefix(self, blocks):
        return len(blocks) if self.usable is None else self.usable

    def can_copy(self, src, keep):
        return self.copy

    def seen(self, table, query):
        return []


# -- the tree and the manager alone (exact block ids) -------------------------------------------------------
def test_partial_leaf_inserted_and_cached():
    mgr = Cache()
    tree = mgr.prefix
    finished(mgr, [1, 2, 3, 4, 5, 6])  # blocks 0 (full) and 1 (2 of 4 rows)
    leaf = tree.by_block[1]
    assert leaf.key == (5, 6) and leaf.parent is tree.by_block[0] and not leaf.children
    assert mgr.cached_blocks() == {0, 1} and mgr.pool.n_free == 16 and len(tree) == 2
    finished(mgr, [1, 2, 3, 4, 5, 6])  # same tokens again (0 shared, the last block in block 2): 1 stays
    assert set(tree.by_block) == {0, 1} and mgr.cached_blocks() == {0, 1}
    finished(mgr, [7, 8])  # a partial leaf right under the root
    assert tree.by_block[3].key == (7, 8) and tree.by_block[3].parent is tree.root


def test_partial_match_copies_the_longest_prefix_into_a_fresh_block():
    mgr = Cache()
    tree, pool = mgr.prefix, mgr.pool
    finished(mgr, [1, 2, 3, 4, 5])  # 0 full, 1 = (5,)
    finished(mgr, [1, 2, 3, 4, 5, 6, 7])  # 0 shared, 2 = (5, 6, 7)
    assert set(tree.by_block) == {0, 1, 2}
    r = FakeReq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.admit(r)
    assert mgr.copies == [(2, 3, 3)]  # the longest of (5,) and (5, 6, 7); block 3 is the next free one
    assert mgr.block_table(r) == [0, 3] and r.n_computed == r.n_cached == 7 and mgr.hit_tokens == 4 + 7
    assert pool.ref[0] == 1 and pool.ref[2] == 0 and 2 in mgr.cached_blocks()  # source: still cached
    assert tree.match_partial([1, 2, 3, 4, 5, 6, 9], [0]) == (2, 2)  # a prefix of a leaf is enough
    # a second request on the same prefix gets its own copy: no block is ever shared for writing
    r2 = FakeReq([1, 2, 3, 4, 5, 6, 7, 1])
    mgr.admit(r2)
    assert mgr.copies[-1] == (2, 4, 3) and mgr.block_table(r2) == [0, 4] and pool.ref[0] == 2
    mgr.free(r)
    mgr.free(r2)
    assert all(c == 0 for c in pool.ref) and pool.n_free == 16 and mgr.cached_blocks() <= set(tree.by_block)


def test_partial_match_from_a_full_block_and_one_token_left():
    mgr = Cache()
    finished(mgr, [1, 2, 3, 4, 5, 6, 7, 8, 9])  # 0, 1 full, 2 = (9,)
    r = FakeReq([1, 2, 3, 4, 5, 6, 0, 0])
    mgr.admit(r)  # rows 0-1 of the full block 1
    assert mgr.copies == [(1, 3, 2)] and mgr.block_table(r) == [0, 3] and r.n_cached == 6
    same = FakeReq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    mgr.admit(same)  # the whole prompt is cached: its last token is still computed, for logits
    assert mgr.block_table(same)[:2] == [0, 1] and same.n_cached == 8 and len(mgr.copies) == 1
    r3 = FakeReq([1, 2, 3, 4, 5, 6, 7])
    mgr.admit(r3)
    assert mgr.copies[-1] == (1, 4, 2) and r3.n_cached == 6  # 3 rows match, 1 token is left to compute


def test_no_partial_reuse_when_cut_back_refused_or_out_of_blocks():
    mgr = Cache(n_blocks=3)
    pool = mgr.pool
    finished(mgr, [1, 2, 3, 4, 5, 6])  # 0 full, 1 = (5, 6)
    mgr.windows = Windows(usable=0)  # sliding-window K/V lost: the full match is cut back, so no partial either
    r = FakeReq([1, 2, 3, 4, 5, 6, 7])
    assert mgr.admit(r) == PrefixHit() and mgr.block_table(r) == [] and mgr.copies == []
    mgr.windows = Windows(copy=False)  # the window's K/V of the source is gone: full blocks only
    mgr.admit(r)
    assert mgr.block_table(r) == [0] and r.n_cached == 4 and pool.ref == [1, 0, 0]
    mgr.free(r)
    r.n_computed = 0  # as after a preemption
    mgr.windows = None
    pool.touch([2])  # held elsewhere: the only free blocks left are the tree's
    mgr.admit(r)
    assert mgr.block_table(r) == [0] and r.n_cached == 4 and pool.ref == [1, 0, 1] and 1 in mgr.prefix.by_block
    mgr.free(r)
    pool.free([2])
    assert all(c == 0 for c in pool.ref) and pool.n_free == 3 and mgr.cached_blocks() == {0, 1}


def test_copy_takes_every_matching_row():
    mgr = Cache()
    finished(mgr, [1, 2, 3, 4, 5, 6, 7])  # a prompt of 5 and 2 generated tokens: all rows alike
    r = FakeReq([1, 2, 3, 4, 5, 6, 7, 8])  # a follow-up that repeats the answer
    mgr.admit(r)
    assert mgr.copies == [(1, 2, 3)] and r.n_cached == 7


def test_partial_leaf_evicted_alone_or_with_its_parent():
    mgr = Cache(n_blocks=4)
    tree, pool = mgr.prefix, mgr.pool
    take = lambda: mgr.allocate(FakeReq([0]), 1)
    finished(mgr, [1, 2, 3, 4, 5, 6])  # free queue: 2, 3, 1, 0 (the leaf before its parent)
    finished(mgr, [9, 9])  # block 2: a partial leaf under the root; queue 3, 1, 0, 2
    assert take() == [3]
    assert take() == [1]  # the LRU cached block: the partial leaf, alone
    assert set(tree.by_block) == {0, 2} and not tree.by_block[0].children and mgr.evictions == 1
    assert tree.match_partial([1, 2, 3, 4, 5, 6], [0]) == (-1, 0)
    pool.free([1, 3])  # queue 0, 2, 3, 1
    finished(mgr, [1, 2, 3, 4, 5])  # revives 0, takes block 2 (evicting the (9, 9) leaf): leaf (5,)
    assert set(tree.by_block) == {0, 2} and tree.by_block[2].key == (5,) and tree.by_block[2].parent.block == 0
    tree.evict(0)  # the parent is reused: its partial leaf leaves too
    assert len(tree) == 0 and not tree.root.children


# -- engine on a tiny random model ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


def make_engine(llm, kv_tokens=1024, **kw) -> Engine:
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=kv_tokens, **kw)


def run(eng, prompts, n):
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p in prompts]
    while eng.has_work():
        eng.step()
    eng.step()
    return reqs


def cold(llm, prompt, n, **kw):
    (r,) = run(make_engine(llm, **kw), [prompt], n)
    return r.output_ids, r.logprobs


def assert_no_leaks(eng):
    assert all(c == 0 for c in eng.pool.ref) and eng.pool.n_free == eng.pool.n_blocks
    assert eng.kv_manager.cached_blocks() == set(eng.prefix.by_block) and not eng.has_work()


def block_bytes(eng, b):
    return [(k[b].tobytes(), v[b].tobytes()) for k, v in zip(eng.kv.k, eng.kv.v)]


def test_non_aligned_prefix_reused_and_shared_block_never_written(tiny_llm):
    rng = np.random.default_rng(5)
    shared = [1] + rng.integers(3, 500, 36).tolist()  # 37 tokens: 2 full blocks + 5 rows
    eng = make_engine(tiny_llm)
    (a,) = run(eng, [shared], 1)  # computes exactly the 37 prompt tokens
    (src,) = [b for b, node in eng.prefix.by_block.items() if node.key == tuple(shared[32:])]  # the partial leaf
    before = block_bytes(eng, src)
    prompts = [shared + rng.integers(3, 500, k).tolist() for k in (3, 20)]
    b, c = run(eng, prompts, 10)  # running together: each gets its own copy of the partial block
    assert [r.output().metrics["cached_tokens"] for r in (b, c)] == [37, 37]
    assert eng.kv_manager.cow_copies == 2 and eng.stats()["prefix_hit_tokens"] == 74
    assert block_bytes(eng, src) == before  # the shared block was never written
    for r, p in zip((b, c), prompts):
        assert (r.output_ids, r.logprobs) == cold(tiny_llm, p, 10)  # copied K/V == recomputed K/V, bit for bit
    assert_no_leaks(eng)


def test_generated_rows_are_reused_as_prompt_rows(tiny_llm):
    rng = np.random.default_rng(6)
    prompt = [1] + rng.integers(3, 500, 19).tolist()  # 20 tokens: block 1 holds 4 prompt rows, then outputs
    eng = make_engine(tiny_llm)
    (a,) = run(eng, [prompt], 8)
    follow = prompt + a.output_ids[:6] + [7, 8]  # a chat-like follow-up that repeats the answer
    (b,) = run(eng, [follow], 6)
    # rows 16-25 copied: the prompt's last 4 and the 6 answer tokens, computed as decode rows; a cold run computes
    # them as prompt rows, with the same K/V bit for bit
    assert b.output().metrics["cached_tokens"] == 26
    assert (b.output_ids, b.logprobs) == cold(tiny_llm, follow, 6)
    assert_no_leaks(eng)


@pytest.mark.parametrize("kv_dtype", ["f32", "q8_0"])
def test_preempted_request_resumes_from_its_own_partial_block(tiny_llm, kv_dtype):
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 500, 37).tolist() for _ in range(3)]
    eng = make_engine(tiny_llm, 160, kv_dtype=kv_dtype)
    eng.scheduler.output_estimate = 1  # admit optimistically: running requests get preempted
    reqs = run(eng, prompts, 30)
    assert eng.scheduler.preemptions > 0 and eng.kv_manager.cow_copies > 0
    for r, p in zip(reqs, prompts):
        assert (r.output_ids, r.logprobs) == cold(tiny_llm, p, 30, kv_dtype=kv_dtype)
    assert_no_leaks(eng)


# -- trimmed sliding-window layers (gemma3: window 8, block size 4) ----------------------------------------
@pytest.fixture(scope="module")
def tiny_gemma(tiny_model):
    return LLM(tiny_model("gemma3"), ctx_size=512, progress=False)


def gemma_engine(llm, swa_slots):
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=512, max_batch=2,
                  token_budget=16, block_size=4, swa_slots=swa_slots)


def test_trimmed_window_layers_copy_their_slots(tiny_gemma):
    rng = np.random.default_rng(8)
    shared = [1] + rng.integers(3, 500, 21).tolist()  # 22 tokens: 5 full blocks + 2 rows
    prompt = shared + rng.integers(3, 500, 5).tolist()
    eng = gemma_engine(tiny_gemma, slots_needed(2, 8, 4, 16))
    assert eng.kv.windows is not None and any(eng.kv.trimmed)
    run(eng, [shared], 1)
    (b,) = run(eng, [prompt], 8)
    assert b.output().metrics["cached_tokens"] == 22 and eng.kv_manager.cow_copies == 1
    want = run(gemma_engine(tiny_gemma, 0), [prompt], 8)[0]  # cold, every block kept
    assert (b.output_ids, b.logprobs) == (want.output_ids, want.logprobs)
    assert_no_leaks(eng)


def test_trimmed_window_dropped_source_is_not_copied(tiny_gemma):
    rng = np.random.default_rng(9)
    shared = [1] + rng.integers(3, 500, 21).tolist()
    prompt = shared + rng.integers(3, 500, 5).tolist()
    eng = gemma_engine(tiny_gemma, slots_needed(2, 8, 4, 16))
    run(eng, [shared], 1)
    (src,) = [b for b, node in eng.prefix.by_block.items() if node.key == tuple(shared[20:])]
    ws = eng.kv.windows
    ws.owner[ws.slot[src]] = -1  # its local K/V was taken by another block
    (b,) = run(eng, [prompt], 8)
    assert b.output().metrics["cached_tokens"] == 20 and eng.kv_manager.cow_copies == 0  # full blocks only
    want = run(gemma_engine(tiny_gemma, 0), [prompt], 8)[0]
    assert (b.output_ids, b.logprobs) == (want.output_ids, want.logprobs)
    assert_no_leaks(eng)


def test_window_slot_for_a_copy_spares_src_and_kept_blocks():
    ws = WindowSlots(n_blocks=10, n_slots=3, block_size=4, window=8)
    ws.tables(np.array([[5, 6, 7]]), np.arange(12), np.zeros(12, np.int64))  # slots 1, 2, 3; LRU order 1, 2, 3
    assert ws.prepare_copy(5, 8, keep={6}) == (1, 3)  # not src's slot 1, not kept block 6's: block 7's
    assert ws.slot[7] == 0 and ws.owner[3] == 8 and ws.reused == 1
    assert ws.prepare_copy(5, 8, keep={6}) == (1, 3)  # dst already holds a slot
    assert ws.prepare_copy(7, 9, keep=set()) is None  # src's local K/V is gone
    assert ws.prepare_copy(5, 9, keep={6, 8}) is None  # every other slot is still needed


@pytest.mark.parametrize("seed", range(4))
def test_trimmed_engine_with_copies_equals_full_kv(tiny_gemma, seed):
    rng = np.random.default_rng(seed)
    base = [1] + rng.integers(3, 500, 30).tolist()
    prompts = [base[:int(rng.integers(2, 31))] + rng.integers(3, 500, int(rng.integers(0, 8))).tolist()
               for _ in range(6)]
    n = [int(rng.integers(1, 10)) for _ in prompts]

    def outputs(swa_slots):
        eng = gemma_engine(tiny_gemma, swa_slots)
        reqs = [eng.add_request(p, SamplingParams(max_tokens=k, **GREEDY)) for p, k in zip(prompts, n)]
        while eng.has_work():
            eng.step()
        eng.step()
        assert_no_leaks(eng)
        return eng, [(r.output_ids, r.logprobs) for r in reqs]

    # 12 slots, 2 fewer than slots_needed(2, 8, 4, 16): with slots this tight, a copy that took the slot of a block
    # a running request still reads would fail (seed 0) — KVCacheManager._keep spares those
    trimmed, got = outputs(12)
    assert trimmed.kv_manager.cow_copies > 0
    assert got == outputs(0)[1]
