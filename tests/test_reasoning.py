"""Reasoning models: `<think>` split into reasoning_content (whole and streamed), the budget that inserts the closing
tag, and structured output after free thinking. A tiny random model gets a `<think>` chat template written here, and
a stub on its forward pushes a scripted token sequence (the "thinking"), so what the model thinks is known."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import llguidance  # noqa: F401,E402
import openai  # noqa: E402

from edgellm.reasoning import ReasoningSplitter, budget_tokens, reasoning_mode  # noqa: E402
from script_stub import Script  # noqa: E402

TEMPLATES = Path(__file__).parent / "chat_templates"
# R1-distill style: the generation prompt opens the thinking; Qwen3 style: the model opens it itself
OPEN_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|><think>\n{% endif %}")
MAYBE_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}{# may write <think> #}")
THOUGHT = "The user wants a small JSON object; I will answer with one."
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}
USER = [{"role": "user", "content": "Give me JSON."}]


def split_whole_and_streamed(text: str, start, make=ReasoningSplitter) -> tuple[str, str]:
    whole = make(start).feed(text, final=True)
    s, r, c = make(start), "", ""
    for ch in text:
        a, b = s.feed(ch)
        r, c = r + a, c + b
    a, b = s.feed("", final=True)
    assert (r + a, c + b) == whole
    return whole


@pytest.mark.parametrize("text,start,want", [
    ("<think>\nhmm, 3 < 4\n</think>\n\nThe answer.", "maybe", ("hmm, 3 < 4", "The answer.")),
    ("hmm\n</think>\n\nThe answer.", "open", ("hmm", "The answer.")),
    ("The answer without thinking.", "maybe", ("", "The answer without thinking.")),
    ("  <think>a</think>b", "maybe", ("a", "b")),
    ("<think>\ncut off by max_tokens", "maybe", ("cut off by max_tokens", "")),
    ("<thin", "maybe", ("", "<thin")),
])
def test_splitter_whole_equals_streamed(text, start, want):
    assert split_whole_and_streamed(text, start) == want


def test_modes_of_real_templates():
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    r1 = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja").read_text()
    from edgellm.chat_template import ChatTemplate

    def prompt(src, **kw):
        return ChatTemplate(src).render(USER, add_generation_prompt=True, **kw)

    assert reasoning_mode(r1, prompt(r1)).start == "open"
    assert reasoning_mode(qwen3, prompt(qwen3)).start == "maybe"
    assert reasoning_mode(qwen3, prompt(qwen3, enable_thinking=False)) is None  # an empty block closes it
    gemma = (TEMPLATES / "gemma3.jinja").read_text()
    assert reasoning_mode(gemma, prompt(gemma)) is None
    assert budget_tokens("low") == 256 and budget_tokens(12) == 12 and budget_tokens("high") is None
    with pytest.raises(Exception):
        budget_tokens("extreme")


HARMONY = ("<|channel|>analysis<|message|>User wants 1+1 <2.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>2<|return|>")


@pytest.mark.parametrize("text,want", [
    (HARMONY, ("User wants 1+1 <2.", "2")),
    ("<|channel|>final<|message|>Only an answer.<|end|>", ("", "Only an answer.")),
    ("<|channel|>analysis<|message|>cut off by max_tokens", ("cut off by max_tokens", "")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", ("a", "bc")),
    ("Plain text, no header.", ("", "Plain text, no header.")),
    ("<|channel|>analys", ("", "")),
])
def test_harmony_channels_split_whole_equals_streamed(text, want):
    """gpt-oss's analysis channel is the reasoning, the other channels the answer; streamed character by character
    the same (partial tags held back)."""
    from edgellm.reasoning import ReasoningMode, make_splitter

    assert split_whole_and_streamed(text, ReasoningMode("header", format="harmony"), make_splitter) == want


def test_harmony_template_mode_and_effort():
    """The official gpt-oss template (tests/chat_templates/openai-gpt-oss-120b.jinja): a harmony turn whose
    generation prompt opens the assistant's header; reasoning_effort reaches its system message; the turn keeps
    special tokens in its text."""
    from types import SimpleNamespace

    from edgellm.chat_template import ChatTemplate
    from edgellm.chat_turn import ChatTurn
    from edgellm.reasoning import ReasoningGrammar
    from edgellm.sampling import SamplingParams

    src = (TEMPLATES / "openai-gpt-oss-120b.jinja").read_text()
    tpl = ChatTemplate(src)
    fake = SimpleNamespace(chat_template=tpl, tokenizer=None,
                           render_chat=lambda m, **kw: tpl.render(m, **kw))
    turn = ChatTurn(fake, USER, reasoning_effort="high")
    assert turn.prompt.endswith("<|start|>assistant") and "Reasoning: high" in turn.prompt
    assert turn.reasoning.format == "harmony" and turn.reasoning.start == "header"
    p = turn.sampling(SamplingParams(max_tokens=5))
    assert p.skip_special_tokens is False and p.compiled_grammar is None
    g = turn.sampling(SamplingParams(max_tokens=5, json_schema=SCHEMA)).compiled_grammar
    assert isinstance(g, ReasoningGrammar) and g.header and g.mode.budget is None  # the schema binds the final channel
    assert ChatTurn(fake, USER, reasoning_effort=7).reasoning.budget == 7
    r = turn.result(HARMONY, "stop")
    assert (r.reasoning_content, r.content) == ("User wants 1+1 <2.", "2")
    assert "Reasoning: medium" in ChatTurn(fake, USER).prompt  # the template's default
    qwen3 = (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()
    assert reasoning_mode(qwen3, ChatTemplate(qwen3).render(USER, add_generation_prompt=True)).format == "think"


# -- a tiny model thinking a scripted thought --------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model):
    from edgellm import LLM

    llm = LLM(tiny_model("gemma3"), ctx_size=256, progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture
def script(tiny):
    s = Script(tiny, OPEN_TEMPLATE)
    yield s
    s.close()


def test_reasoning_content_is_split_from_the_answer(tiny, script):
    from edgellm import SamplingParams

    script.set(USER, THOUGHT + "\n</think>\n\nDone.")
    r = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=120))
    assert r.reasoning_content == THOUGHT
    assert r.content.startswith("Done.") and "</think>" not in r.content
    assert r.output.text.startswith(THOUGHT)  # the raw output holds both


def test_json_schema_answer_after_free_thinking(tiny, script):
    from edgellm import SamplingParams

    script.set(USER, THOUGHT + "\n</think>\n\n")
    r = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=150, json_schema=SCHEMA))
    assert r.reasoning_content == THOUGHT  # the schema did not block the thinking (nor its closing tag)
    jsonschema.validate(json.loads(r.content), SCHEMA)
    assert r.finish_reason == "stop"


def test_budget_cuts_the_thinking_with_the_closing_tag(tiny, script):
    from edgellm import SamplingParams

    long_thought = " ".join(["thinking"] * 40)
    script.set(USER, long_thought)  # never closes by itself
    budget = 6
    r = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA), reasoning_effort=budget)
    assert r.reasoning_content == tiny.detokenize(script.ids[:budget]).strip()
    assert "</think>" in r.output.text  # inserted
    jsonschema.validate(json.loads(r.content), SCHEMA)
    free = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=30), reasoning_effort=0)
    assert free.reasoning_content is None and free.output.text.startswith("</think>")


def test_maybe_template_opens_the_thinking_for_a_constraint(tiny):
    from edgellm import SamplingParams

    s = Script(tiny, MAYBE_TEMPLATE)
    try:
        s.set(USER, THOUGHT + "\n</think>\n\n", after=len(tiny.tokenize("<think>\n", special=True)))
        r = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=150, json_schema=SCHEMA))
        assert r.output.text.startswith("<think>\n")
        assert r.reasoning_content == THOUGHT
        jsonschema.validate(json.loads(r.content), SCHEMA)
    finally:
        s.close()


def test_server_streams_reasoning_content(tiny, script):
    from server_thread import ServerThread

    from edgellm.server.app import create_app

    script.set(USER, THOUGHT + "\n</think>\n\n")
    srv = ServerThread(create_app(tiny))
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        kw = dict(model=None, messages=USER, temperature=0, max_tokens=150,
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        whole = cl.chat.completions.create(**kw).choices[0].message
        assert whole.reasoning_content == THOUGHT
        jsonschema.validate(json.loads(whole.content), SCHEMA)
        reasoning, content, n_r = "", "", 0
        for ch in cl.chat.completions.create(stream=True, **kw):
            d = ch.choices[0].delta if ch.choices else None
            if d is not None and getattr(d, "reasoning_content", None):
                reasoning += d.reasoning_content
                n_r += 1
            if d is not None and d.content:
                content += d.content
        assert (reasoning, content) == (THOUGHT, whole.content)
        assert n_r > 3  # the reasoning arrives in pieces, not at the end
        budget = cl.chat.completions.create(**{**kw, "reasoning_effort": "low"}).choices[0].message
        assert budget.reasoning_content == THOUGHT  # low (256 tokens) does not cut this short thought
        script.set(USER, " ".join(["thinking"] * 40))  # never closes by itself: a budget of 6 tokens cuts it
        cut = {**kw, "max_tokens": 60, "extra_body": {"reasoning_effort": 6}}
        whole = cl.chat.completions.create(**cut).choices[0].message
        assert whole.reasoning_content == tiny.detokenize(script.ids[:6]).strip()
        jsonschema.validate(json.loads(whole.content), SCHEMA)
        deltas = [ch.choices[0].delta for ch in cl.chat.completions.create(stream=True, **cut) if ch.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
        assert "".join(d.content or "" for d in deltas) == whole.content
    finally:
        srv.stop()


def test_stub_really_forces(tiny, script):
    """Without the script, the tiny model does not write the thought (the tests above are not vacuous)."""
    from edgellm import SamplingParams

    script.ids = []
    r = tiny.chat(USER, SamplingParams(temperature=0, max_tokens=20))
    assert THOUGHT[:10] not in r.output.text
