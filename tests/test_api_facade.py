"""The LLM facade that the server, chat, program frontend and CLI go through: prompt ids, the chat template,
capacity, submit with a listener, the asyncio bridge and the one-off forward helper (scratch)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from edgellm import LLM, SamplingParams
from edgellm.errors import ContextOverflowError, EngineStoppedError, InvalidRequestError

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=128, kv_cache_tokens=512, progress=False)


def test_prompt_ids(llm):
    assert llm.prompt_ids([1, 2, 3]) == [1, 2, 3]
    text_ids = llm.prompt_ids("hello world")
    assert text_ids == llm.tokenize("hello world", add_bos=llm.tokenizer.add_bos)
    with pytest.raises(InvalidRequestError, match="out of range"):
        llm.prompt_ids([1, llm.config.n_vocab])
    with pytest.raises(InvalidRequestError):
        llm.prompt_ids(3.5)


def test_render_chat_gives_exactly_one_bos(llm):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    text = llm.render_chat(msgs)
    assert text == llm.chat_template.render_prompt(msgs, tokenizer_adds_bos=llm.tokenizer.add_bos)
    assert "hello" in text and text.startswith(llm.render_chat(msgs, add_generation_prompt=False))
    ids = llm.prompt_ids(text)
    bos = llm.tokenizer.bos_id
    assert ids[0] == bos and bos not in ids[1:]
    with pytest.raises(InvalidRequestError):
        llm.render_chat([])


def test_capacity(llm):
    cap, s = llm.capacity, llm.stats()
    assert cap.kv_blocks == s["blocks_total"] and cap.ctx_size == llm.ctx_size == 128
    assert cap.max_len == min(cap.ctx_size, cap.kv_blocks * cap.block_size) and cap.max_batch >= 1


def test_scratch_gives_its_blocks_back_and_matches_logits(llm):
    ids = [1, 5, 9, 13, 17]
    free = llm.stats()["blocks_free"]
    want = llm.logits(ids)

    def direct():
        with llm.scratch(len(ids)) as sc:
            assert llm.stats()["blocks_free"] == free - 1
            return sc.forward(ids, 0, all_logits=True)

    np.testing.assert_array_equal(llm.call(direct), want)
    assert llm.stats()["blocks_free"] == free
    with pytest.raises(ContextOverflowError):
        with llm.scratch(llm.ctx_size + 1):
            pass
    assert llm.stats()["blocks_free"] == free


def test_submit_with_a_listener(llm):
    seen = []
    h = llm.submit([1, 2, 3], GREEDY, listener=lambda h, piece: seen.append(piece))
    out = h.result(60)
    assert seen[-1] is None and "".join(seen[:-1]) == out.text
    assert out.token_ids == llm.generate([1, 2, 3], GREEDY).token_ids


def test_async_bridge(llm):
    want = llm.generate([1, 2, 4], GREEDY)

    async def run():
        pieces = [p async for p in llm.astream([1, 2, 4], GREEDY)]
        out = await llm.agenerate([1, 2, 4], GREEDY)
        return pieces, out

    pieces, out = asyncio.run(run())
    assert "".join(pieces) == want.text and out.token_ids == want.token_ids


def test_with_block_shuts_the_engine_down(tiny_model):
    """`with LLM(...) as llm:` generates inside the block and stops the engine at its end, an error in the block
    included (as llama-cpp-python's Llama closes in a with block)."""
    with LLM(tiny_model("llama"), ctx_size=64, kv_cache_tokens=128, progress=False) as llm:
        assert llm.error is None
        assert len(llm.generate([1, 5, 9], GREEDY).token_ids) == 6
    assert isinstance(llm.error, EngineStoppedError)
    with pytest.raises(EngineStoppedError):
        llm.generate([1, 5, 9], GREEDY)
    with pytest.raises(KeyError):
        with LLM(tiny_model("llama"), ctx_size=64, kv_cache_tokens=128, progress=False) as other:
            raise KeyError("in the block")
    assert isinstance(other.error, EngineStoppedError)
