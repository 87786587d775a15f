"""gpt-oss's harmony turns with tools, structured output and a reasoning budget: recorded harmony outputs parsed into
reasoning, content and calls (whole and streamed), tools and tool history rendered by the real template
(tests/chat_templates/openai-gpt-oss-120b.jinja), and a tiny gpt-oss model with harmony's control tokens and that
template, scripted (tests/script_stub.py), through LLM.chat and the OpenAI endpoint: calls parsed (auto) and forced
after free analysis (required, named), a json_schema answer in the final channel, the budget that ends the analysis."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import llguidance  # noqa: F401,E402
import openai  # noqa: E402

from edgellm.chat_template import ChatTemplate  # noqa: E402
from edgellm.tool_calls import FAMILIES, ToolCallStream, family_for_template, parse_output  # noqa: E402
from script_stub import Script  # noqa: E402

SOURCE = (Path(__file__).parent / "chat_templates" / "openai-gpt-oss-120b.jinja").read_text()
HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
                  "<|endoftext|>")
HARMONY = FAMILIES["harmony"]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                         "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]
USER = [{"role": "user", "content": "Weather in Oslo?"}]
THOUGHT = "The user wants the weather; call get_weather."
ARGS = '{"city": "Oslo", "unit": "c"}'
OPENER = "<|channel|>analysis<|message|>"
ANALYSIS = f"{OPENER}{THOUGHT}<|end|>"
CALL = f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}

# harmony outputs as gpt-oss writes them after the generation prompt's `<|start|>assistant` -> (content, calls)
RECORDED = [
    (ANALYSIS + CALL, None, [("get_weather", ARGS)]),
    (ANALYSIS + CALL + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>",
     None, [("get_weather", ARGS), ("get_time", "{}")]),  # parallel, the recipient before the channel too
    (ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>" + CALL, "Checking.",
     [("get_weather", ARGS)]),  # a preamble in the commentary channel
    (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is {sunny} in Oslo.<|return|>",
     "It is {sunny} in Oslo.", []),
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + ARGS[:12], None,
     [("get_weather", ARGS[:12])]),  # cut off by max_tokens: the name and the arguments so far
]


def deltas_of(text: str, size: int) -> list[dict]:
    s = ToolCallStream(HARMONY)
    out = [d for i in range(0, len(text), size) for d in s.feed(text[i:i + size])]
    return out + s.finish()


def rebuilt(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and calls from OpenAI deltas; a call's id and name come once, in index order."""
    content, calls = "", []
    for d in deltas:
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            if tc.get("id"):
                assert tc["index"] == len(calls) and tc["function"]["name"]
                calls.append([tc["function"]["name"], ""])
            else:
                assert "name" not in tc["function"]
            calls[tc["index"]][1] += tc["function"].get("arguments") or ""
    return content or None, [tuple(c) for c in calls]


@pytest.mark.parametrize("text,content,calls", RECORDED)
def test_recorded_harmony_outputs_parse_whole_and_streamed(text, content, calls):
    got_content, got = parse_output(text, HARMONY)
    assert (got_content, [(c["function"]["name"], c["function"]["arguments"]) for c in got]) == (content, calls)
    for size in (1, 5):  # character by character, in chunks
        assert rebuilt(deltas_of(text, size)) == (content, calls)


def test_family_and_rendering_of_tools_and_history():
    """The template's family is harmony; tools go into its developer message; a past turn of two parallel calls
    becomes one message per call, each followed by its result (the template names a result by the call before it),
    and the call the template renders parses back."""
    from types import SimpleNamespace

    from edgellm.chat_turn import ChatTurn

    tpl = ChatTemplate(SOURCE)
    assert family_for_template(SOURCE) is HARMONY
    llm = SimpleNamespace(chat_template=tpl, tokenizer=None, render_chat=lambda m, **kw: tpl.render(m, **kw))
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Two calls.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    prompt = ChatTurn(llm, history, tools=TOOLS).prompt
    assert "namespace functions {" in prompt and "type get_weather = " in prompt and "type get_time = " in prompt
    weather = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
               '{"city": "Oslo", "unit": "c"}<|call|>')
    assert ("<|start|>assistant<|channel|>analysis<|message|>Two calls.<|end|>" + weather
            + '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"sunny"<|end|>'
            + "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>"
            + '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"12:00"<|end|>') in prompt
    assert prompt.endswith("<|start|>assistant")
    bare = [{"type": "function", "function": {"name": "ping"}}]  # OpenAI's tools need no description
    assert "type ping = () => any;" in ChatTurn(llm, USER, tools=bare).prompt
    _, calls = parse_output(weather[len("<|start|>assistant"):], HARMONY)
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == \
        [("get_weather", json.loads(ARGS))]


# -- the tiny gpt-oss model, scripted --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_dir):
    from tiny_models import tiny_spec, write_spec

    from edgellm import LLM

    path = write_spec(tiny_dir / "gpt-oss-harmony.gguf", tiny_spec("gpt-oss", context_length=2048),
                      strings={"tokenizer.chat_template": SOURCE}, control_tokens=HARMONY_TOKENS, space_prefix=False)
    model = LLM(str(path), ctx_size=2048, progress=False)
    yield model
    model.shutdown()


@pytest.fixture
def script(llm):
    s = Script(llm)
    yield s
    s.close()


def params(**kw):
    from edgellm import SamplingParams

    return SamplingParams(**{"temperature": 0, "max_tokens": 200, **kw})


def test_required_and_named_grammars_are_one_call_that_validates(llm):
    """Harmony's grammar is the call message after the analysis (the phases force `<|start|>assistant` before it);
    `auto` leaves the model free."""
    from edgellm.structured import ll_tokenizer
    from edgellm.tool_grammar import tool_grammar
    from edgellm.tool_prompt import ToolChoice, check_tools

    tok, tools = llm.tokenizer, check_tools(TOOLS)

    def accepts(grammar: str, text: str) -> bool:
        m = llguidance.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
        return m.consume_tokens(tok.encode(text, add_bos=False, special=True)) and m.is_accepting()

    call = CALL[len("<|start|>assistant"):-len("<|call|>")]
    time_call = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}"
    required = tool_grammar(HARMONY, tools, ToolChoice("required"), tokenizer=tok)
    named = tool_grammar(HARMONY, tools, ToolChoice("required", "get_time"), tokenizer=tok)
    assert accepts(required, call) and accepts(required, time_call) and accepts(named, time_call)
    assert not accepts(named, call) and not accepts(required, call.replace('"c"', '"kelvin"'))
    assert not accepts(required, "<|channel|>final<|message|>Sunny.")
    assert tool_grammar(HARMONY, tools, ToolChoice("auto"), tokenizer=tok) is None


def test_auto_call_is_parsed_after_the_analysis(llm, script):
    script.set(USER, ANALYSIS + CALL, special=True, tools=TOOLS)
    r = llm.chat(USER, params(), tools=TOOLS)
    assert r.finish_reason == "tool_calls" and r.content is None and r.reasoning_content == THOUGHT
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in r.tool_calls] == [("get_weather", ARGS)]


def test_required_and_named_calls_are_forced_after_free_analysis(llm, script):
    """The script answers in the final channel (or calls another function): the grammar, applied only after the
    analysis, makes it a call that validates; the analysis stays the script's."""
    text = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>No call needed.<|return|>"
    script.set(USER, text, special=True, tools=TOOLS, tool_choice="required")
    r = llm.chat(USER, params(), tools=TOOLS, tool_choice="required")
    assert r.finish_reason == "tool_calls" and r.reasoning_content == THOUGHT and len(r.tool_calls) == 1
    fn = r.tool_calls[0]["function"]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[fn["name"]]
    jsonschema.validate(json.loads(fn["arguments"]), schema)
    named = {"type": "function", "function": {"name": "get_time"}}
    script.set(USER, ANALYSIS + CALL, special=True, tools=TOOLS, tool_choice=named)
    r = llm.chat(USER, params(), tools=TOOLS, tool_choice=named)
    assert r.reasoning_content == THOUGHT and [c["function"]["name"] for c in r.tool_calls] == ["get_time"]
    assert json.loads(r.tool_calls[0]["function"]["arguments"]) == {}
    cut = llm.chat(USER, params(), tools=TOOLS, tool_choice=named, reasoning_effort=4)  # the budget, then the call
    assert cut.reasoning_content == llm.detokenize(script.ids[len(llm.tokenize(OPENER)):][:4])
    assert [c["function"]["name"] for c in cut.tool_calls] == ["get_time"] and cut.finish_reason == "tool_calls"


def test_json_schema_binds_only_the_final_channel(llm, script):
    script.set(USER, ANALYSIS, special=True)
    r = llm.chat(USER, params(json_schema=SCHEMA))
    assert r.reasoning_content == THOUGHT and r.finish_reason == "stop"
    jsonschema.validate(json.loads(r.content), SCHEMA)
    assert f"{THOUGHT}<|end|><|start|>assistant<|channel|>final<|message|>{r.content}" in r.output.text


def test_budget_ends_the_analysis_with_the_final_header(llm, script):
    long = " ".join(["thinking"] * 40)
    script.set(USER, OPENER + long, special=True)  # never ends by itself
    opener = len(llm.tokenize(OPENER))
    r = llm.chat(USER, params(json_schema=SCHEMA), reasoning_effort=6)
    assert r.reasoning_content == llm.detokenize(script.ids[opener:opener + 6])
    assert "<|end|><|start|>assistant<|channel|>final<|message|>" in r.output.text
    jsonschema.validate(json.loads(r.content), SCHEMA)
    free = llm.chat(USER, params(), reasoning_effort=0)  # no schema: the budget alone still cuts
    assert free.output.text.startswith(OPENER + "<|end|><|start|>assistant<|channel|>final<|message|>")
    from edgellm.chat_turn import ChatTurn

    assert "Reasoning: low" in ChatTurn(llm, USER, reasoning_effort="low").prompt


def test_openai_calls_and_schema_whole_and_streamed(llm, script):
    from server_thread import ServerThread

    from edgellm.server.app import create_app

    srv = ServerThread(create_app(llm))
    try:
        cl = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        script.set(USER, ANALYSIS + CALL, special=True, tools=TOOLS, tool_choice="required")
        kw = dict(model=None, messages=USER, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
        whole = cl.chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.reasoning_content == THOUGHT
        calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert calls == [("get_weather", ARGS)]
        deltas, reasons, reasoning = [], [], ""
        for ch in cl.chat.completions.create(stream=True, **kw):
            for c in ch.choices:
                deltas.append(c.delta.model_dump(exclude_none=True))
                reasons.append(c.finish_reason)
                reasoning += getattr(c.delta, "reasoning_content", None) or ""
        assert rebuilt(deltas) == (None, calls) and reasons[-1] == "tool_calls" and reasoning == THOUGHT
        assert sum(1 for d in deltas if d.get("tool_calls")) > 2  # the arguments arrive in pieces

        script.set(USER, ANALYSIS, special=True)
        kw = dict(model=None, messages=USER, temperature=0, max_tokens=200,
                  response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}})
        msg = cl.chat.completions.create(**kw).choices[0].message
        assert msg.reasoning_content == THOUGHT
        jsonschema.validate(json.loads(msg.content), SCHEMA)
        parts = [ch.choices[0].delta for ch in cl.chat.completions.create(stream=True, **kw) if ch.choices]
        assert "".join(d.content or "" for d in parts) == msg.content
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in parts) == THOUGHT
    finally:
        srv.stop()


def test_stub_really_forces(llm, script):
    """Without the script the tiny model writes no harmony of its own (the tests above are not vacuous)."""
    script.ids = []
    r = llm.chat(USER, params(max_tokens=40), tools=TOOLS)
    assert THOUGHT[:10] not in r.output.text and not r.tool_calls
