"""Tool calls: families read off the real templates (tests/chat_templates, as the models' GGUF files carry them),
outputs of each family parsed (whole and streamed), the grammars of tool_choice, rendering of tools and tool history,
and the acceptance run with the official openai client against the server on the default model."""
from __future__ import annotations

import concurrent.futures as cf
import json
import random
from pathlib import Path

import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import llguidance  # noqa: E402
import openai  # noqa: E402

from edgellm.chat_template import ChatTemplate  # noqa: E402
from edgellm.tool_calls import FAMILIES, ToolCallStream, family_for_template, parse, parse_output  # noqa: E402
from edgellm.tool_prompt import (ToolChoice, ToolSpecError, check_choice, check_tools, generic_messages,  # noqa: E402
                                 native_messages)
from timing import scaled

TEMPLATES = Path(__file__).parent / "chat_templates"
FAMILY_OF = {  # template file -> family
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",  # Hermes 2 Pro ships the same text
    "qwen2_5": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3",  # Llama 3.3 ships the same text
    "llama3_2": "llama3",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "openai-gpt-oss-120b": "harmony",  # its outputs and grammar: tests/test_harmony_tools.py
    "gemma3": "generic",
    "phi3": "generic",
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time now",  # Hermes wants one
                                         "parameters": {"type": "object", "properties": {}}}}
CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_time", {})]

# Outputs in each family's syntax, as the models write them (openers that are control tokens included: the server
# detokenizes tool turns with special tokens shown) -> (content, [(name, arguments)]).
RECORDED = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
         None, CALLS[:1]),
        ('I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "I will check both.", CALLS),
        ('<tool_call>\n{"arguments": {"city": "Paris", "unit": "c"}, "name": "get_weather"}\n</tool_call>',
         None, CALLS[:1]),  # arguments first
        ("The weather is sunny, 3 < 4 and <b>bold</b>.", "The weather is sunny, 3 < 4 and <b>bold</b>.", []),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None, CALLS[:1]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}', None, CALLS[:1]),
        ('<|python_tag|>brave_search.call(query="weather in Paris")', None,
         [("brave_search", {"query": "weather in Paris"})]),
        ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; {"name": "get_time", '
         '"parameters": {}}', None, CALLS),
        ("It is {probably} sunny.", "It is {probably} sunny.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
         '{"name": "get_time", "arguments": {}}]', None, CALLS),
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": "a1b2c3d4e"}]',
         None, CALLS[:1]),
        ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]', None, CALLS[:1]),  # opener hidden
        ("[1] is a citation.", "[1] is a citation.", []),
    ],
    "generic": [
        ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
         '{"name": "get_time", "arguments": {}}]}', None, CALLS),
        ('{"answer": 42}', '{"answer": 42}', []),
        ("Plain text.", "Plain text.", []),
    ],
}


def template(file: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{file}.jinja").read_text(), bos_token="<s>", eos_token="</s>")


def calls_of(tool_calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


def reassemble(deltas: list[dict]) -> tuple[str | None, list[tuple[str, str]]]:
    """Content and calls from streamed deltas, checking OpenAI's rules: id, type and name once per index,
    indices in order."""
    content, calls = "", {}
    for d in deltas:
        content += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if "id" in tc:
                assert i not in calls and i == len(calls), "a call's header comes once, in index order"
                assert tc["type"] == "function" and tc["function"]["name"]
                calls[i] = [tc["function"]["name"], ""]
            else:
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[i][1] += tc["function"]["arguments"]
    return content or None, [tuple(calls[i]) for i in sorted(calls)]


def stream_in_pieces(text: str, fam, sizes) -> list[dict]:
    s, deltas, i = ToolCallStream(fam), [], 0
    while i < len(text):
        n = next(sizes)
        deltas += s.feed(text[i:i + n])
        i += n
    return deltas + s.finish()


# -- families and parsing --------------------------------------------------------------------------------------
@pytest.mark.parametrize("file", sorted(FAMILY_OF))
def test_family_of_real_templates(file):
    assert family_for_template(template(file).source).name == FAMILY_OF[file]


@pytest.mark.parametrize("fam,text,content,calls",
                         [(f, *case) for f, cases in RECORDED.items() for case in cases])
def test_recorded_outputs_parse_whole_and_streamed(fam, text, content, calls):
    family = FAMILIES[fam]
    got_content, got_calls = parse_output(text, family)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert all(c["id"] and c["type"] == "function" for c in got_calls)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls]
    rng = random.Random(len(text))
    for sizes in (iter(lambda: 1, None), iter(lambda: rng.randint(1, 7), None)):  # char by char, random chunks
        assert reassemble(stream_in_pieces(text, family, sizes)) == (content, whole)


def test_arguments_stream_in_pieces_before_the_call_ends():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
    deltas = stream_in_pieces(text, FAMILIES["hermes"], iter(lambda: 3, None))
    pieces = [tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []) if "id" not in tc]
    assert len(pieces) > 5 and "".join(pieces) == '{"city": "Paris", "unit": "c"}'


def test_partial_text_holds_back_what_may_become_a_call():
    hermes = FAMILIES["hermes"]
    assert parse("Let me look.\n<tool_", hermes, final=False).content == "Let me look."
    assert parse("Let me look.\n<tool_", hermes, final=True).content == "Let me look.\n<tool_"
    generic = FAMILIES["generic"]
    assert parse('{"tool_calls": [{"na', generic, final=False).content == ""
    p = parse('{"tool_calls": [{"name": "get_weather", "arguments": {"ci', generic, final=False)
    assert p.content == "" and p.calls[0].name == "get_weather" and p.calls[0].arguments == '{"ci'


def test_truncated_call_keeps_its_name_and_partial_arguments():
    content, calls = parse_output('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Par', FAMILIES["generic"])
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}


@pytest.mark.parametrize("file", [f for f, fam in FAMILY_OF.items() if fam != "generic"])
def test_template_rendered_calls_parse_back(file):
    """The model's own training format: an assistant turn with calls, as its template renders it, parses back."""
    fam = FAMILIES[FAMILY_OF[file]]
    tpl = template(file)
    calls = CALLS[:1] if fam.name == "llama3" else CALLS  # Llama 3.1's template takes one call per turn
    assistant = {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)]}
    user = [{"role": "user", "content": "Weather in Paris and the time?"}]
    kw = {"tools": check_tools([WEATHER, TIME]), "date_string": "26 Jul 2024"}
    before = tpl.render(native_messages(user, fam), add_generation_prompt=True, **kw)
    after = tpl.render(native_messages(user + [assistant], fam), add_generation_prompt=False, **kw)
    if fam.name == "mistral":  # the calls follow the last [/INST]
        before = after[:after.rindex("[/INST]") + len("[/INST]")]
    assert after.startswith(before)
    turn = after[len(before):]
    for end in ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "</s>"):  # end-of-turn tokens are stop tokens
        turn = turn.split(end)[0]
    if "<think>" in turn:  # Qwen3 writes an empty thinking block first: the reasoning split takes it off
        from edgellm.reasoning import ReasoningSplitter

        thought, turn = ReasoningSplitter("maybe").feed(turn, final=True)
        assert thought == ""
    content, got = parse_output(turn, fam)
    assert not content and calls_of(got) == calls


# -- tool_choice grammars ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tok(tiny_model):
    from edgellm.loader import load_gguf
    from edgellm.tokenizer import Tokenizer

    return Tokenizer.from_metadata(load_gguf(tiny_model("gemma3")).metadata)  # no space prefix


def accepts(grammar: str, tok, text: str) -> bool:
    from edgellm.structured import ll_tokenizer

    m = llguidance.LLMatcher(ll_tokenizer(tok), grammar, log_level=0)
    return m.consume_tokens(tok.encode(text, add_bos=False, special=False)) and m.is_accepting()


@pytest.mark.parametrize("fam", sorted(set(FAMILIES) - {"harmony"}))  # harmony's: tests/test_harmony_tools.py
def test_grammars_accept_the_family_syntax_and_validate_arguments(fam, tiny_tok):
    from edgellm.tool_grammar import tool_grammar

    family, tools = FAMILIES[fam], check_tools([WEATHER, TIME])
    good = {"hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
            "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
            "llama3": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
            "generic": '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]}'}[fam]
    bad_args = good.replace('"c"', '"kelvin"')
    time_call = good.replace('"get_weather"', '"get_time"').replace('{"city": "Paris", "unit": "c"}', "{}")
    required = tool_grammar(family, tools, ToolChoice("required"), tokenizer=tiny_tok)
    named = tool_grammar(family, tools, ToolChoice("required", "get_time"), tokenizer=tiny_tok)
    auto = tool_grammar(family, tools, ToolChoice("auto"), tokenizer=tiny_tok)
    assert accepts(required, tiny_tok, good) and accepts(required, tiny_tok, time_call)
    assert not accepts(required, tiny_tok, bad_args)  # arguments validate against the schema
    assert not accepts(required, tiny_tok, "Sure, it is sunny.")
    assert accepts(named, tiny_tok, time_call) and not accepts(named, tiny_tok, good)
    assert accepts(auto, tiny_tok, good) and accepts(auto, tiny_tok, "Sure, it is sunny.")
    assert not accepts(auto, tiny_tok, bad_args)
    assert parse_output(good, family)[1] and parse_output(time_call, family)[1]
    assert tool_grammar(family, tools, ToolChoice("none"), tokenizer=tiny_tok) is None


def test_auto_grammar_allows_text_before_a_call(tiny_tok):
    from edgellm.tool_grammar import tool_grammar

    g = tool_grammar(FAMILIES["hermes"], check_tools([WEATHER]), ToolChoice("auto"), tokenizer=tiny_tok)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert accepts(g, tiny_tok, "Let me check.\n" + call)
    assert not accepts(g, tiny_tok, 'Let me check.\n<tool_call>\n{"name": "nope"')


def test_parallel_false_allows_one_call(tiny_tok):
    from edgellm.tool_grammar import tool_grammar

    g = tool_grammar(FAMILIES["generic"], check_tools([WEATHER, TIME]), ToolChoice("required"), parallel=False,
                     tokenizer=tiny_tok)
    one = '{"tool_calls": [{"name": "get_time", "arguments": {}}]}'
    assert accepts(g, tiny_tok, one)
    assert not accepts(g, tiny_tok, one.replace("}]}", "}, " + one[16:-2] + "]}"))


# -- rendering and validation ----------------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0123456789abcdef", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "sunny, 21 C"},
    {"role": "assistant", "content": "It is sunny."},
    {"role": "user", "content": "And tomorrow?"},
]


def test_generic_rendering_on_a_template_without_tools():
    tpl = template("gemma3")
    assert not tpl.uses_tools
    text = tpl.render(generic_messages(HISTORY, check_tools([WEATHER])), add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "Current weather of a city" in text  # the tools, in the system part
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text  # the past call
    assert "sunny, 21 C" in text and "And tomorrow?" in text  # the result and the next question
    with pytest.raises(Exception):  # the roles as given break the template's alternation: why merging is needed
        tpl.render(HISTORY, add_generation_prompt=True)


@pytest.mark.parametrize("file", [f for f, fam in FAMILY_OF.items() if fam != "generic"])
def test_native_rendering_of_tool_history(file):
    fam = FAMILIES[FAMILY_OF[file]]
    text = template(file).render(native_messages(HISTORY, fam), add_generation_prompt=True,
                                 tools=check_tools([WEATHER]), date_string="26 Jul 2024")
    assert "get_weather" in text and "sunny, 21 C" in text and "Paris" in text
    assert '"{\\"city' not in text  # arguments rendered as an object, not a JSON string inside a string


def test_mistral_ids_become_nine_characters():
    msgs = native_messages(HISTORY, FAMILIES["mistral"])
    cid = msgs[1]["tool_calls"][0]["id"]
    assert len(cid) == 9 and cid.isalnum() and msgs[2]["tool_call_id"] == cid
    assert len(FAMILIES["mistral"].new_id()) == 9


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name"}}], None, "tools"),
    ([WEATHER, WEATHER], None, "tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": "nope"}}], None, "tools"),
    ([WEATHER], "always", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tool_specs_name_the_field(tools, choice, param):
    with pytest.raises(ToolSpecError) as e:
        check_choice(choice, check_tools(tools))
    assert e.value.param == param


# -- the default model through LLM.chat and the openai client -------------------------------------------------
SCHEMAS = [  # short schemas: every call is a few tokens
    {"type": "function", "function": {"name": "set_alarm", "parameters": {
        "type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23},
                                         "repeat": {"type": "boolean"}}, "required": ["hour", "repeat"]}}},
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "add_item", "parameters": {
        "type": "object", "properties": {"item": {"enum": ["milk", "eggs", "bread"]},
                                         "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["item", "count"]}}},
]
PROMPTS = ["Wake me at seven.", "Is it cold in Oslo?", "We need milk."]


def validate_call(call, tools: list[dict], name: str | None = None) -> None:
    fn = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id
    assert call.function.name in fn and (name is None or call.function.name == name)
    jsonschema.validate(json.loads(call.function.arguments), fn[call.function.name])


def test_llm_chat_required_call(gemma_llm):
    from edgellm import SamplingParams

    r = gemma_llm.chat([{"role": "user", "content": PROMPTS[1]}], SamplingParams(temperature=0, max_tokens=40),
                       tools=SCHEMAS, tool_choice="required", parallel_tool_calls=False)
    assert r.finish_reason == "tool_calls" and r.content is None and len(r.tool_calls) == 1
    fn = r.tool_calls[0]["function"]
    jsonschema.validate(json.loads(fn["arguments"]),
                        next(t for t in SCHEMAS if t["function"]["name"] == fn["name"])["function"]["parameters"])


@pytest.fixture(scope="module")
def client(gemma_server):
    return openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="unused", max_retries=0, timeout=scaled(600))


def test_openai_required_and_named_calls_always_validate(client):
    """50 requests at temperature 0.8 over 3 schemas: every call parses and its arguments validate."""
    jobs = []
    for i in range(50):
        tools = [SCHEMAS[i % 3]] if i % 2 else SCHEMAS  # one tool, or all three to choose from
        named = i % 5 == 0
        choice = {"type": "function", "function": {"name": SCHEMAS[i % 3]["function"]["name"]}} if named else "required"
        jobs.append((tools, choice, SCHEMAS[i % 3]["function"]["name"] if named else None, PROMPTS[i % 3], i))

    def run(job):
        tools, choice, name, prompt, seed = job
        r = client.chat.completions.create(model=None, messages=[{"role": "user", "content": prompt}],
                                           tools=tools, tool_choice=choice, parallel_tool_calls=False,
                                           temperature=0.8, seed=seed, max_tokens=48)
        return job, r

    with cf.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, jobs))
    for (tools, _, name, _, _), r in results:
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls", ch
        assert len(ch.message.tool_calls) == 1 and not ch.message.content
        validate_call(ch.message.tool_calls[0], tools, name)


def test_openai_streamed_calls_reassemble_to_the_non_streamed_ones(client):
    kw = dict(model=None, messages=[{"role": "user", "content": "Wake me at seven and check Oslo."}],
              tools=SCHEMAS, tool_choice="required", temperature=0.8, seed=11, max_tokens=64)
    whole = client.chat.completions.create(**kw).choices[0]
    deltas, reasons = [], []
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            d = c.delta.model_dump(exclude_none=True)
            d.pop("role", None)
            if d.get("content") == "":
                d.pop("content")
            deltas.append(d)
            reasons.append(c.finish_reason)
    content, calls = reassemble(deltas)
    assert reasons[-1] == whole.finish_reason
    assert calls == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert content == whole.message.content
    assert len(calls) >= 1 and sum(1 for d in deltas if d.get("tool_calls")) > len(calls)  # arguments in pieces


def test_openai_tool_history_and_auto(client):
    r = client.chat.completions.create(model=None, messages=HISTORY, tools=SCHEMAS[1:2], tool_choice="auto",
                                       temperature=0, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=None, messages=HISTORY, tools=SCHEMAS[1:2], tool_choice="none",
                                          temperature=0, max_tokens=4)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
    ({"tools": SCHEMAS[:1], "tool_choice": {"type": "function", "function": {"name": "zzz"}}}, "tool_choice"),
    ({"tools": SCHEMAS[:1], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties":
                                                                             {"a": {"type": "nonsense"}}}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
])
def test_bad_tools_are_openai_400s(client, body, param):
    import httpx

    r = httpx.post(str(client.base_url) + "chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body}, timeout=scaled(60))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param or (err["param"] or "").startswith(param)
