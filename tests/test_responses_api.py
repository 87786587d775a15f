"""/v1/responses with the official openai client on the default model: string and message input, instructions,
max_output_tokens, streaming events (their deltas rebuild the non-streamed output), a json_schema text.format,
function tools (required calls validate), function_call / function_call_output input items, errors."""
from __future__ import annotations

import json

import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import openai  # noqa: E402
from timing import scaled

SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]},
                                           "score": {"type": "integer", "minimum": 1, "maximum": 5}},
          "required": ["answer", "score"], "additionalProperties": False}
TOOL = {"type": "function", "name": "set_alarm", "description": "Set an alarm",
        "parameters": {"type": "object", "properties": {"hour": {"type": "integer", "minimum": 0, "maximum": 23}},
                       "required": ["hour"]}}


@pytest.fixture(scope="module")
def client(gemma_server):
    return openai.OpenAI(base_url=gemma_server.url + "/v1", api_key="x", max_retries=0, timeout=scaled(600))


def events_of(stream) -> list:
    evs = list(stream)
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    assert evs[0].type == "response.created" and evs[1].type == "response.in_progress"
    assert evs[-1].type in ("response.completed", "response.incomplete")
    return evs


def test_text_whole_and_streamed(client, gemma_llm):
    kw = dict(model=None, input="Name a colour.", instructions="You are terse.", max_output_tokens=8,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens == 8 and r.usage.input_tokens > 5
    want = gemma_llm.chat([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
                          __import__("edgellm").SamplingParams(temperature=0, max_tokens=8))
    assert r.output_text == want.content
    evs = events_of(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in evs]
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"):
        assert k in kinds, k
    assert "".join(e.delta for e in evs if e.type == "response.output_text.delta") == r.output_text
    assert evs[-1].response.output_text == r.output_text and evs[-1].response.usage.output_tokens == 8


def test_json_schema_format_validates(client):
    for seed in range(2):
        r = client.responses.create(model=None, input="Is the sky blue? Answer as JSON.", temperature=0.8, extra_body={"seed": seed},
                                    max_output_tokens=40, text={"format": {"type": "json_schema", "name": "verdict",
                                                                           "schema": SCHEMA, "strict": True}})
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), SCHEMA)
    evs = events_of(client.responses.create(model=None, input="Is the sky blue? JSON.", temperature=0, stream=True,
                                            max_output_tokens=40, text={"format": {
                                                "type": "json_schema", "name": "verdict", "schema": SCHEMA}}))
    jsonschema.validate(json.loads(evs[-1].response.output_text), SCHEMA)


def test_function_tools(client):
    kw = dict(model=None, input="Wake me at six.", tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
              temperature=0.8, extra_body={"seed": 5}, max_output_tokens=40)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "set_alarm" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), TOOL["parameters"])
    evs = events_of(client.responses.create(stream=True, **kw))
    args = "".join(e.delta for e in evs if e.type == "response.function_call_arguments.delta")
    done = [e for e in evs if e.type == "response.function_call_arguments.done"]
    assert args == done[0].arguments == calls[0].arguments  # same seed: the same call, streamed in pieces
    named = client.responses.create(**{**kw, "tool_choice": {"type": "function", "name": "set_alarm"}})
    assert [o.name for o in named.output if o.type == "function_call"] == ["set_alarm"]


def test_message_and_call_items_as_input(client):
    r = client.responses.create(model=None, temperature=0, max_output_tokens=6, tools=[TOOL], input=[
        {"role": "user", "content": "Wake me at six."},
        {"type": "function_call", "call_id": "call_1", "name": "set_alarm", "arguments": '{"hour": 6}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "alarm set"},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks! Anything else?"}]}])
    assert r.status in ("completed", "incomplete") and r.output


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": ""}, "input"),
    ({"input": [{"type": "reasoning", "content": []}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_errors_are_openai_400s(client, body, param):
    import httpx

    r = httpx.post(str(client.base_url) + "responses", json={"max_output_tokens": 2, **body}, timeout=scaled(60))
    assert r.status_code == 400, r.text
    assert (r.json()["error"]["param"] or "").startswith(param.split(".")[0]), r.text
