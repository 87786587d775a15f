"""Sliding-window trimming of the KV cache (engine/swa.py): slot assignment, LRU reuse, prefix cut-back, and
engine outputs identical to keeping every block."""
from __future__ import annotations

import numpy as np
import pytest

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.swa import WindowSlots, slots_needed

GREEDY = dict(temperature=0, ignore_eos=True)


def tables(ws, table, start, n):
    pos = np.arange(start, start + n)
    return ws.tables(np.array([table]), pos, np.zeros(n, np.int64))[0].tolist()


def test_slots_assigned_pinned_and_reused_lru():
    ws = WindowSlots(n_blocks=10, n_slots=4, block_size=4, window=8)
    assert tables(ws, [5, 6, 7], 0, 10) == [1, 2, 3]  # fresh slots in order
    ws.pin_running([([5, 6, 7], 10)])  # next query at 10 sees positions 3..9: blocks 5, 6, 7
    assert tables(ws, [8], 0, 4) == [4]
    assert tables(ws, [9], 0, 4) == [4]  # no free slot: the LRU unpinned one (block 8's) is reused
    assert ws.slot[8] == 0 and ws.reused == 1
    ws.pin_running([([5, 6, 7], 14)])  # window moved: block 5 (positions 0..3) is no longer pinned
    assert tables(ws, [1, 2], 0, 8) == [1, 4]  # block 5's slot (least recently used) and block 9's
    assert ws.slot[5] == 0 and ws.slot[9] == 0
    assert ws.stats() == {"swa_slots_total": 4, "swa_slots_held": 4, "swa_slots_reused": 3}


def test_dropped_window_is_never_read():
    ws = WindowSlots(n_blocks=10, n_slots=2, block_size=4, window=8)
    assert tables(ws, [0, 1], 0, 8) == [1, 2]
    assert tables(ws, [3], 0, 4) == [1]  # nothing pinned: block 0's slot is reused
    with pytest.raises(RuntimeError, match="dropped"):
        tables(ws, [0, 1, 2], 8, 1)  # a query at 8 needs positions 1..7 of block 0


def test_usable_prefix_cuts_back_to_present_window():
    ws = WindowSlots(n_blocks=10, n_slots=8, block_size=4, window=8)
    tables(ws, [0, 1, 2, 3, 4], 0, 20)
    assert ws.usable_prefix([0, 1, 2, 3, 4]) == 5
    ws.slot[1] = 0  # block 1's local K/V lost
    # reusing 5 blocks (next query at 20) needs positions 13..19 = blocks 3, 4 only; 2 blocks need 0..7
    assert ws.usable_prefix([0, 1, 2, 3, 4]) == 5
    assert ws.usable_prefix([0, 1, 2]) == 1  # next query at 12 needs blocks 1, 2: fall back to 1 block
    assert ws.usable_prefix([1, 0]) == 0


@pytest.fixture(scope="module")
def tiny_gemma(tiny_model):
    return LLM(tiny_model("gemma3"), ctx_size=512, progress=False)


def run(llm, prompts, n, **kw):
    eng = Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=512, max_batch=2,
                 token_budget=16, block_size=4, **kw)
    reqs = [eng.add_request(p, SamplingParams(max_tokens=n, **GREEDY)) for p in prompts]
    while eng.has_work():
        eng.step()
    eng.step()
    return eng, [r.output().token_ids for r in reqs]


def test_trimmed_engine_equals_full_kv(tiny_gemma):
    cfg = tiny_gemma.loaded.config
    assert cfg.sliding_window == 8 and any(cfg.swa_layers)
    rng = np.random.default_rng(3)
    base = [1] + rng.integers(3, 500, 30).tolist()
    prompts = [base + rng.integers(3, 500, int(rng.integers(2, 20))).tolist() for _ in range(5)] + [base[:20]]
    n_slots = slots_needed(2, 8, 4, 16)
    full, want = run(tiny_gemma, prompts, 12, swa_slots=0)
    trimmed, got = run(tiny_gemma, prompts, 12, swa_slots=n_slots)
    assert full.kv.windows is None and trimmed.kv.windows is not None
    assert got == want
    st = trimmed.stats()
    assert st["swa_slots_reused"] > 0  # windows moved on and their old slots were reused
    # shared prefixes still reused where their window K/V was kept, cut back where it was dropped
    assert 0 < st["prefix_hit_tokens"] < full.stats()["prefix_hit_tokens"]
    assert all(c == 0 for c in trimmed.pool.ref) and not trimmed.has_work()
    local = [i for i, t in enumerate(trimmed.kv.trimmed) if t]
    assert local and all(trimmed.kv.k[i].shape[0] == n_slots + 1 < full.kv.k[i].shape[0] for i in local)
    assert trimmed.kv.nbytes < full.kv.nbytes


def test_one_off_forward_on_a_trimmed_cache_goes_through_the_manager(tiny_gemma):
    """LLM.scratch's forwards get their sliding-window slots from the KV cache manager, which keeps the scratch's
    window pinned across the engine steps run between them; a batch the manager did not prepare is refused."""
    from edgellm.api import Scratch
    from edgellm.models.common import ForwardBatch

    rng = np.random.default_rng(5)
    ids = [1] + rng.integers(3, 500, 23).tolist()

    def engine(swa_slots):
        return Engine(tiny_gemma.loaded, tiny_gemma.model, tiny_gemma.tokenizer, ctx_size=tiny_gemma.ctx_size,
                      kv_cache_tokens=512, max_batch=2, token_budget=16, block_size=4, swa_slots=swa_slots)

    def scratch_logits(eng):
        sc = Scratch(tiny_gemma.model, eng.kv, eng.kv_manager)
        assert eng.kv_manager.allocate(sc, len(ids)) is not None
        out = []
        for s in range(0, len(ids), 4):
            out.append(sc.forward(ids[s:s + 4], s, all_logits=True))
            for _ in range(6):  # the engine's requests move their windows on between the scratch's forwards
                eng.step()
        eng.kv_manager.free(sc, cache=False)
        return np.concatenate(out)  # (len(ids), V)

    full, trimmed = engine(0), engine(slots_needed(2, 8, 4, 16))
    for eng in (full, trimmed):
        for _ in range(2):
            eng.add_request([1] + rng.integers(3, 500, 200).tolist(), SamplingParams(max_tokens=8, **GREEDY))
    np.testing.assert_array_equal(scratch_logits(trimmed), scratch_logits(full))
    assert trimmed.stats()["swa_slots_reused"] > 0  # slots did cycle while the scratch was held
    with pytest.raises(RuntimeError, match="prepare"):
        tiny_gemma.model.forward(ForwardBatch.single(ids[:4], 0, [0]), trimmed.kv)
