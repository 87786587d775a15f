"""Constrained decoding (llguidance): JSON schemas, regex, choices, grammars on the default model; named errors."""
from __future__ import annotations

import json
import re
import time

import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import llguidance  # noqa: F401,E402

from edgellm import InvalidRequestError, SamplingParams  # noqa: E402
from timing import scaled

SCHEMAS = [  # (prompt, schema): nested objects, arrays, enums, bounded numbers, required fields
    ("A user profile as JSON:\n", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120},
                       "address": {"type": "object",
                                   "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "age", "address"], "additionalProperties": False}),
    ("Shopping list in JSON:\n", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 3,
                                 "items": {"type": "string", "maxLength": 10}},
                       "total": {"type": "number", "minimum": 0, "maximum": 100,
                                 "multipleOf": 0.25}},
        "required": ["items", "total"], "additionalProperties": False}),
    ("Weather report JSON:\n", {
        "type": "object",
        "properties": {"sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "temp_c": {"type": "integer", "minimum": -40, "maximum": 50},
                       "windy": {"type": "boolean"}},
        "required": ["sky", "temp_c", "windy"], "additionalProperties": False}),
    ("A list of points:\n", {
        "type": "array", "minItems": 1, "maxItems": 3,
        "items": {"type": "object",
                  "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                 "y": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x", "y"], "additionalProperties": False}}),
    ("Book record:\n", {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20},
                       "genre": {"type": "string", "enum": ["fiction", "science", "history"]},
                       "rating": {"type": "number", "minimum": 1, "maximum": 5, "multipleOf": 0.5},
                       "authors": {"type": "array", "maxItems": 2,
                                   "items": {"type": "object", "properties": {"last": {"type": "string",
                                                                                       "maxLength": 12}},
                                             "required": ["last"], "additionalProperties": False}}},
        "required": ["title", "genre", "rating", "authors"], "additionalProperties": False}),
]


def test_json_schema_generations_validate(gemma_llm):
    prompts, params, schemas = [], [], []
    for rep in range(2):
        for i, (prompt, schema) in enumerate(SCHEMAS):
            prompts.append(prompt)
            params.append(SamplingParams(json_schema=schema, temperature=0.8, max_tokens=120, seed=10 * i + rep))
            schemas.append(schema)
    outs = gemma_llm.generate(prompts, params)
    for out, schema in zip(outs, schemas):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)  # the whole output is the JSON: nothing after it


def test_json_object_regex_choices_grammars(gemma_llm):
    outs = gemma_llm.generate(
        # json_object mode: a free object sampled at T=0.8 may ramble inside a string past any max_tokens (the
        # grammar cannot end a string for the model), so this case is greedy after two example objects
        ['{"name": "Ann", "age": 31}\n{"name": "Bob", "age": 45}\n', "Phone number: ", "Is the sky blue? Answer:",
         "Numbers:", "Numbers:"],
        [SamplingParams(json_schema=True, max_tokens=60, temperature=0),
         SamplingParams(regex=r"\d{3}-\d{4}", max_tokens=20, seed=2),
         SamplingParams(choices=[" yes", " no", " maybe"], max_tokens=20, seed=3),
         SamplingParams(grammar='root ::= " " [0-9] [0-9]? ("," [0-9] [0-9]?){0,3}', max_tokens=20, seed=4),  # GBNF
         SamplingParams(grammar='start: " " NUM ("," NUM)~0..3\nNUM: /[0-9]{1,2}/', max_tokens=20, seed=5)])  # Lark
    obj = json.loads(outs[0].text)
    assert isinstance(obj, dict) and outs[0].finish_reason == "stop"
    assert re.fullmatch(r"\d{3}-\d{4}", outs[1].text) and outs[1].finish_reason == "stop"
    assert outs[2].text in (" yes", " no", " maybe")
    for o in outs[3:]:
        assert re.fullmatch(r" \d\d?(,\d\d?){0,3}", o.text), o.text


@pytest.mark.parametrize("kw", [
    {"json_schema": {"type": "frobnicate"}},
    {"json_schema": "{not json"},
    {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
    {"regex": "(ab"},
    {"choices": []},
    {"grammar": "start: undefined_rule"},
    {"grammar": "root ::= foo"},
    {"regex": "a", "choices": ["a"]},
])
def test_invalid_constraint_is_a_named_error_at_once(kw):
    t0 = time.perf_counter()
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)
    assert time.perf_counter() - t0 < 1.0


# -- server and CLI ------------------------------------------------------------------------------------------------
def test_server_response_format_grammar_and_400(gemma_llm):
    import httpx
    from server_thread import ServerThread

    from edgellm.server.app import create_app

    srv = ServerThread(create_app(gemma_llm))
    try:
        url = srv.url + "/v1/chat/completions"
        msgs = [{"role": "user", "content": "Give the weather as JSON."}]
        schema = SCHEMAS[2][1]
        r = httpx.post(url, timeout=scaled(120), json={"messages": msgs, "max_tokens": 60, "seed": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}})
        assert r.status_code == 200, r.text
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
        r = httpx.post(url, timeout=scaled(120), json={"messages": msgs, "max_tokens": 40, "seed": 2,
                                                "response_format": {"type": "json_object"}})
        assert r.status_code == 200 and isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
        r = httpx.post(srv.url + "/v1/completions", timeout=scaled(120), json={
            "prompt": "Answer:", "max_tokens": 10, "grammar": 'root ::= " " ("yes" | "no")'})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] in (" yes", " no")
        for body in ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
                     {"response_format": {"type": "json_schema"}}, {"grammar": "root ::= undefined"},
                     {"response_format": {"type": "json_object"}, "grammar": 'root ::= "a"'}):
            r = httpx.post(url, timeout=scaled(30), json={"messages": msgs, "max_tokens": 5, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] in ("response_format", "grammar")
    finally:
        srv.stop()


def test_cli_generate_json_schema(tmp_path):
    from click.testing import CliRunner

    from edgellm.cli import main

    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "frobnicate"}')
    res = CliRunner().invoke(main, ["generate", "-p", "x", "--json-schema", str(bad)])
    assert res.exit_code == 2 and "json_schema" in res.output
