"""Helpers for tests that step an Engine by hand over a loaded LLM's model (own KV cache per engine)."""
from __future__ import annotations

from edgellm.engine.engine import Engine

GREEDY = dict(temperature=0, ignore_eos=True)


def make_engine(llm, kv_tokens: int = 1024, **kw) -> Engine:
    """An Engine over llm's weights with its own KV cache of kv_tokens tokens (kw: Engine's options)."""
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=kv_tokens, **kw)


def assert_no_leaks(eng: Engine) -> None:
    """Every block is back in the pool and the prefix tree names only free blocks."""
    assert all(c == 0 for c in eng.pool.ref) and eng.pool.n_free == eng.pool.n_blocks
    assert eng.kv_manager.cached_blocks() == set(eng.prefix.by_block)
