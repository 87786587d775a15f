"""Ollama's API on `edgellm serve`, driven with the official `ollama` client on the default model: chat (streamed
and not), generate, embed, list, show, ps, version; a JSON-schema format validates; options apply; an over-long
prompt and an unknown model are Ollama-shaped errors."""
from __future__ import annotations

import json

import numpy as np
import pytest

import jsonschema  # noqa: E402 (the dev extra installs it)
import ollama  # noqa: E402
from timing import scaled

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                           "count": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "count"], "additionalProperties": False}
GREEDY = {"temperature": 0, "num_predict": 8}


@pytest.fixture(scope="module")
def server(gemma_server):
    return gemma_server


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=scaled(600))


@pytest.fixture(scope="module")
def name(client):
    return client.list().models[0].model


def test_list_show_ps_version(client, name, gemma_llm):
    models = client.list().models
    assert len(models) == 1 and name.endswith(":latest") and models[0].size > 0
    assert models[0].details.format == "gguf" and models[0].details.family == "gemma3"
    info = client.show(name)
    assert info.modelinfo["general.architecture"] == "gemma3" and "completion" in info.capabilities
    assert info.details.quantization_level == "Q4_K_M" and info.template
    running = client.ps().models
    assert running[0].model == name and running[0].context_length == gemma_llm.capacity.max_len
    import httpx

    assert httpx.get(client._client.base_url.join("/api/version")).json()["version"]


def test_chat_whole_and_streamed(client, name, gemma_llm):
    msgs = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat(model=name, messages=msgs, options=GREEDY, keep_alive="5m")
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 8 and whole.prompt_eval_count > 3 and whole.total_duration > 0
    parts = list(client.chat(model=name, messages=msgs, options=GREEDY, stream=True))
    assert parts[-1].done and not any(p.done for p in parts[:-1]) and len(parts) > 2
    assert "".join(p.message.content for p in parts) == whole.message.content
    want = gemma_llm.chat(msgs, _params(gemma_llm, GREEDY)).content  # the same turn through the Python API
    assert whole.message.content == want


def _params(llm, opts):
    from edgellm.server.ollama_protocol import Options, sampling

    return sampling(Options(**opts), max_tokens=opts["num_predict"], fmt=None)


def test_generate_whole_streamed_and_raw(client, name):
    g = client.generate(model=name, prompt="The sky is", options=GREEDY)
    assert g.done and g.response and g.context and g.eval_count == 8
    parts = list(client.generate(model=name, prompt="The sky is", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == g.response and parts[-1].context == g.context
    raw = client.generate(model=name, prompt="The sky is", raw=True, options={"temperature": 0, "num_predict": 3})
    assert raw.eval_count == 3 and raw.response
    assert raw.prompt_eval_count < g.prompt_eval_count  # raw: the prompt as sent, no chat template around it


def test_format_schema_validates(client, name):
    for seed in range(3):
        r = client.chat(model=name, messages=[{"role": "user", "content": "Pick a colour and a count as JSON."}],
                        format=SCHEMA, options={"temperature": 0.8, "seed": seed, "num_predict": 40})
        jsonschema.validate(json.loads(r.message.content), SCHEMA)
    j = client.generate(model=name, prompt="A colour and a count in JSON:", format=SCHEMA,
                        options={"temperature": 0, "num_predict": 40})
    jsonschema.validate(json.loads(j.response), SCHEMA)


def test_embed(client, name, gemma_llm):
    r = client.embed(model=name, input=["hello world", "a cat"])
    got = np.array(r.embeddings)
    np.testing.assert_allclose(got, gemma_llm.embed(["hello world", "a cat"]), atol=1e-5)
    assert r.prompt_eval_count > 0
    one = client.embed(model=name, input="hello world")
    np.testing.assert_allclose(one.embeddings[0], got[0], atol=1e-6)


def test_tools_through_ollama(client, name):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 10}},
                                                   "required": ["city"]}}}]
    r = client.chat(model=name, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=tools,
                    options={"temperature": 0, "num_predict": 40})
    assert r.done
    for c in r.message.tool_calls or []:
        assert c.function.name == "get_weather" and isinstance(c.function.arguments["city"], str)


def test_overlong_prompt_is_an_error_not_a_truncation(client, name, gemma_llm):
    long = "word " * (gemma_llm.capacity.max_len + 10)
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name, prompt=long, options={"num_predict": 4})
    assert e.value.status_code == 400 and "context" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=[{"role": "user", "content": "hi " * 40}],
                    options={"num_ctx": 16, "num_predict": 4})
    assert e.value.status_code == 400 and "num_ctx" in e.value.error


def test_errors_are_ollama_shaped(client, server):
    import httpx

    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="nope:1b", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "not found" in e.value.error
    for path, body in (("/api/chat", {"model": "x", "messages": "bad"}), ("/api/generate", "{not json"),
                       ("/api/embed", {"model": "x"}), ("/api/chat", {"model": "x", "options": {"top_k": "a"}})):
        r = httpx.post(server.url + path, content=body if isinstance(body, str) else json.dumps(body))
        assert r.status_code in (400, 404) and set(r.json()) == {"error"}, (path, r.text)


OLLAMA_OPS = {("get", "/api/version"): None, ("get", "/api/tags"): None, ("get", "/api/ps"): None,
              ("post", "/api/show"): "ShowRequest", ("post", "/api/chat"): "ChatRequest",
              ("post", "/api/generate"): "GenerateRequest", ("post", "/api/embed"): "EmbedRequest",
              ("post", "/api/embeddings"): "EmbeddingsRequest"}


def test_openapi_documents_the_ollama_routes(server):
    """Each route with its request body as a schema (what schemathesis generates requests from), its answer's
    schema, NDJSON for the streaming ones, and Ollama's error shape for the statuses it sends."""
    import httpx

    doc = httpx.get(server.url + "/openapi.json").json()
    schemas = doc["components"]["schemas"]
    assert not [k for k in schemas if "__" in k]  # no two models of one name (FastAPI would prefix the module)
    for (method, path), body in OLLAMA_OPS.items():
        op = doc["paths"][path][method]
        assert op["description"], path
        if body:
            ref = op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert ref == f"#/components/schemas/{body}" and schemas[body]["properties"], path
        ok = op["responses"]["200"]["content"]
        assert ok["application/json"]["schema"]["$ref"].startswith("#/components/schemas/"), path
        assert ("application/x-ndjson" in ok) == (path in ("/api/chat", "/api/generate")), path
        for code in ("400", "404", "503"):
            ref = op["responses"][code]["content"]["application/json"]["schema"]["$ref"]
            assert schemas[ref.rsplit("/", 1)[1]]["properties"] == {"error": {"title": "Error", "type": "string"}}
        assert "422" not in op["responses"]
    assert schemas["ChatRequest"]["properties"]["options"]["anyOf"][0]["$ref"].endswith("/Options")
