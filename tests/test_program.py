"""Program frontend: select by model log-probability (checked with a direct forward), fork sharing the prefix
tree, run_batch, regex gen, and the OpenAI-compatible backend against our own server."""
from __future__ import annotations

import re

import numpy as np
import pytest

import edgellm
from edgellm import assistant, gen, select, system, user  # noqa: F401

import llguidance  # noqa: F401,E402 (the dev extra installs it)


def direct_logprob_sums(llm, ctx: list[int], conts: list[list[int]]) -> list[float]:
    """Sum of log p(cont tokens | ctx) from one full forward per choice on a private KV cache."""
    from edgellm.engine.kv_cache import PagedKVCache
    from edgellm.models.common import ForwardBatch
    from edgellm.sampling import logprobs

    out = []
    for cont in conts:
        ids = ctx + cont
        n_blocks = -(-len(ids) // 16)
        kv = PagedKVCache(llm.config, n_blocks, 16)
        batch = ForwardBatch.single(np.asarray(ids), 0, np.arange(n_blocks), all_logits=True)
        logits = llm.model.forward(batch, kv)  # (len(ids), V)
        out.append(sum(float(logprobs(logits[len(ctx) - 1 + j])[t]) for j, t in enumerate(cont)))
    return out


def test_select_picks_highest_model_logprob(gemma_llm):
    @edgellm.program
    def colour(s):
        s += "The colour of the clear daytime sky is"
        s += select("c", choices=[" blue", " green", " purple sky", " red"])

    st = colour.run(backend=gemma_llm)
    from edgellm.program import LLMBackend

    ctx, conts, scores = LLMBackend(gemma_llm).score("The colour of the clear daytime sky is",
                                                     [" blue", " green", " purple sky", " red"])
    direct = direct_logprob_sums(gemma_llm, ctx, conts)
    np.testing.assert_allclose(st.scores["c"], direct, atol=2e-3)
    assert st["c"] == [" blue", " green", " purple sky", " red"][int(np.argmax(direct))]
    assert st.text().endswith(st["c"])


def test_fork_shares_prefix_blocks_and_regex_gen(gemma_llm):
    shared = ("Here is a list of facts about the solar system, written for students. Each fact is short and "
              "clear, and each one is numbered. The facts are about planets, moons and the sun.\n")

    @edgellm.program
    def facts(s):
        s += shared
        branches = s.fork(4)
        for i, f in enumerate(branches):
            f += f"Fact {i + 1}:" + gen("fact", max_tokens=8, stop="\n")
        s.vars["facts"] = [f["fact"] for f in branches]
        s += "Year: " + gen("year", max_tokens=6, regex=r"(19|20)\d\d")

    assert len(gemma_llm.tokenize(shared)) >= 32
    before = gemma_llm.stats()["prefix_hit_tokens"]
    st = facts.run(backend=gemma_llm)
    hits = gemma_llm.stats()["prefix_hit_tokens"] - before
    n_full = len(gemma_llm.tokenize(shared, add_bos=True)) // 16 * 16
    assert hits >= 4 * n_full, (hits, n_full)  # every branch reuses the shared text's full blocks
    assert len(st["facts"]) == 4
    assert re.fullmatch(r"(19|20)\d\d", st["year"])


def test_run_batch_roles(gemma_llm):
    @edgellm.program
    def qa(s, q):
        s += system("Answer with one word.")
        s += user(q)
        s += assistant(select("a", choices=["Paris", "London"]))

    states = qa.run_batch([{"q": "Capital of France?"}, {"q": "Capital of the UK?"}], backend=gemma_llm)
    assert [s["a"] for s in states] == ["Paris", "London"]
    assert "<start_of_turn>" in states[0].text()


def test_openai_backend_against_our_server(gemma_llm):
    import openai  # noqa: F401
    from server_thread import ServerThread

    from edgellm.program import OpenAIBackend
    from edgellm.server.app import create_app

    srv = ServerThread(create_app(gemma_llm))
    try:
        backend = OpenAIBackend(srv.url + "/v1")

        @edgellm.program
        def prog(s):
            s += user("Pick a number.")
            s += assistant(gen("n", max_tokens=5, regex=r"[0-9]{1,3}"))

        @edgellm.program
        def plain(s):
            s += "The sky is"
            s += select("c", choices=[" blue", " green"])

        st = prog.run(backend=backend)
        assert re.fullmatch(r"[0-9]{1,3}", st["n"])
        assert plain.run(backend=backend)["c"] in (" blue", " green")
    finally:
        srv.stop()


# -- role marks, template errors and scoring checks (issue 17) ----------------------------------------------------
def test_gemma_roles_are_rendered_by_its_template(gemma_llm):
    """Gemma's template rejects a lone assistant message and has no system turn: the marks come from where the
    template accepts them (no silent 'Assistant: ' / 'System: ' text)."""
    from edgellm.program import LLMBackend

    b = LLMBackend(gemma_llm)
    assert b.role_marks("user") == ("<start_of_turn>user\n", "<end_of_turn>\n")
    assert b.role_marks("assistant") == ("<start_of_turn>model\n", "<end_of_turn>\n")
    assert b.role_marks("system") == ("", "\n\n")  # folded into the first user turn, as the template does


class _TemplateLLM:
    """Just enough of an LLM for LLMBackend.role_marks: a metadata template, rendered by the real ChatTemplate."""

    def __init__(self, source: str):
        from types import SimpleNamespace

        self.loaded = SimpleNamespace(metadata={"tokenizer.chat_template": source})
        self.tokenizer = SimpleNamespace(tokens=["<s>", "</s>"], bos_id=0, eos_id=1, add_bos=True)

    @property
    def chat_template(self):
        from edgellm.chat_template import ChatTemplate

        return ChatTemplate.for_model(self.loaded.metadata, self.tokenizer)

    def render_chat(self, messages, *, add_generation_prompt=True):
        return self.chat_template.render_prompt(messages, add_generation_prompt=add_generation_prompt,
                                                tokenizer_adds_bos=True)


def test_a_template_error_is_a_named_error_not_a_plain_text_fallback():
    from edgellm.errors import InvalidRequestError
    from edgellm.program import LLMBackend

    broken = LLMBackend(_TemplateLLM("{{ raise_exception('this template renders nothing') }}"))
    with pytest.raises(InvalidRequestError, match="renders nothing"):
        broken.role_marks("user")
    silent = LLMBackend(_TemplateLLM("{% for m in messages %}{% if m.role == 'user' %}[U]{{ m.content }}"
                                     "{% endif %}{% endfor %}"))
    assert silent.role_marks("user") == ("[U]", "")
    with pytest.raises(InvalidRequestError, match="cannot render a lone 'assistant'"):
        silent.role_marks("assistant")  # dropped by the template: no guessed 'Assistant: ' either


def test_select_choice_cut_by_the_context_is_a_named_error(tiny_model):
    from edgellm import LLM
    from edgellm.errors import ContextOverflowError
    from edgellm.program import LLMBackend

    llm = LLM(tiny_model("llama"), ctx_size=64, progress=False)
    prefix = "hello world " * 8
    assert 48 < len(llm.prompt_ids(prefix)) < 64
    with pytest.raises(ContextOverflowError, match="could not be scored"):
        LLMBackend(llm).score(prefix, [" hello world hello world hello world", " world"])
