"""The OpenAI-compatible server, started for real on loopback and driven with the official `openai` client.

One model load for the file (the session's `gemma_llm`, or $EDGELLM_SERVER_TEST_MODEL); every app shares it.
Generations are short (a few tokens) and greedy unless the test is about sampling.
"""
from __future__ import annotations

import json
import os
import threading
import time

import pytest

import httpx  # noqa: E402 (the dev extra installs the server, its clients and the default model)
import openai  # noqa: E402

from edgellm.sampling import SamplingParams  # noqa: E402
from server_thread import ServerThread  # noqa: E402
from edgellm.server.app import create_app  # noqa: E402
from timing import scaled

KEY = "sekret-key"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def llm(request):
    path = os.environ.get("EDGELLM_SERVER_TEST_MODEL")
    if path:
        from edgellm import LLM

        return LLM(path, ctx_size=512, progress=False)
    return request.getfixturevalue("gemma_llm")  # the default model: a missing one fails the tests


@pytest.fixture(scope="module")
def server(llm):
    s = ServerThread(create_app(llm))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def keyed(llm):
    s = ServerThread(create_app(llm, api_key=KEY))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=scaled(120))


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def greedy(llm, ids, n):
    return llm.generate(ids, SamplingParams(max_tokens=n, temperature=0)).text


def chat_ids(server, messages):
    r = httpx.post(server.url + "/tokenize", json={"messages": messages})
    assert r.status_code == 200
    return r.json()["tokens"]


def sse_events(response) -> list[str]:
    return [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]


def blocks_used(url) -> float:
    text = httpx.get(url + "/metrics").text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("edgellm_kv_blocks_used "))


def assert_error(r, status, code=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    return err


# -- service routes -----------------------------------------------------------------------------------------------
def test_health_models_openapi(server, client, llm):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "edgellm"
    assert client.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    spec = httpx.get(server.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in spec["paths"]


def test_health_is_503_while_loading(llm):
    gate = threading.Event()
    app = create_app(model="unused.gguf")
    app.state.server.load = gate.wait  # the load thread blocks until the test lets it go
    s = ServerThread(app)
    try:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json() == {"status": "loading"}
        assert_error(httpx.get(s.url + "/v1/models"), 503)
    finally:
        gate.set()
        s.stop()


def test_tokenize_detokenize(server, llm):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world"}).json()
    assert r["tokens"] == llm.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False}).json()
    assert plain["tokens"] == llm.tokenizer.encode("Hello world", add_bos=False)
    back = httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()
    assert back["prompt"] == "Hello world"


# -- chat ---------------------------------------------------------------------------------------------------------
def test_chat_matches_python_api_greedy(server, client, model_id, llm):
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=6, temperature=0)
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    assert ch.message.content == greedy(llm, chat_ids(server, CHAT), 6)
    assert r.usage.completion_tokens <= 6 and r.usage.prompt_tokens == len(chat_ids(server, CHAT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert ch.finish_reason in ("stop", "length")


def test_chat_stream_equals_non_stream(server, client, model_id):
    kw = dict(model=model_id, messages=CHAT, max_tokens=6, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the wire format: OpenAI-shaped JSON events, then [DONE]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"messages": CHAT, "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_chat_max_tokens_and_max_completion_tokens(client, model_id):
    msgs = [{"role": "user", "content": "Count from one to twenty: one, two,"}]
    r = client.chat.completions.create(model=model_id, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"
    r = client.chat.completions.create(model=model_id, messages=msgs, max_completion_tokens=2, max_tokens=9,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_chat_seed_reproducible_and_n(client, model_id):
    kw = dict(model=model_id, messages=CHAT, max_tokens=5, temperature=1.0, seed=1234, n=2)
    a = client.chat.completions.create(**kw)
    b = client.chat.completions.create(**kw)
    assert [c.index for c in a.choices] == [0, 1]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_chat_logprobs(client, model_id):
    r = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 4
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
        assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
    assert "".join(t.token for t in content) == r.choices[0].message.content


# -- completions --------------------------------------------------------------------------------------------------
def test_completions_prompt_forms_and_stream(server, client, model_id, llm):
    prompt = "The capital of France is"
    expect = greedy(llm, prompt, 5)
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0)
    assert r.choices[0].text == expect and r.object == "text_completion"
    r = client.completions.create(model=model_id, prompt=[prompt, "Paris is"], max_tokens=5, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [expect, expect] + [greedy(llm, "Paris is", 5)] * 2
    ids = llm.tokenizer.encode(prompt)
    for form in (ids, [ids]):
        r = client.completions.create(model=model_id, prompt=form, max_tokens=5, temperature=0)
        assert r.choices[0].text == expect and r.usage.prompt_tokens == len(ids)
    stream = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == expect
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == prompt + expect


def test_completions_stop_sequence(client, model_id, llm):
    prompt = "One, two, three, four, five,"
    text = greedy(llm, prompt, 8)
    stop = text.strip()[2:5] if len(text.strip()) >= 5 else None
    assert stop, f"greedy output too short to cut: {text!r}"
    r = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == text[:text.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0, stop=stop,
                                       stream=True)
    assert "".join(c.choices[0].text for c in chunks) == text[:text.index(stop)]


def test_completions_logprobs_and_seed(client, model_id):
    r = client.completions.create(model=model_id, prompt="Once upon a time", max_tokens=3, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 3
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    assert all(len(t) <= 2 and max(t.values()) == pytest.approx(v) for t, v in zip(lp.top_logprobs, lp.token_logprobs))
    kw = dict(model=model_id, prompt="Once upon a time", max_tokens=6, temperature=1.0, top_p=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


# -- errors -------------------------------------------------------------------------------------------------------
def test_bad_requests_are_400(server):
    url = server.url + "/v1/chat/completions"
    err = assert_error(httpx.post(url, content=b'{"messages": [', headers={"content-type": "application/json"}),
                       400, "invalid_json")
    assert err["type"] == "invalid_request_error"
    assert assert_error(httpx.post(url, json={"messages": CHAT, "max_tokens": "8"}), 400)["param"] == "max_tokens"
    assert_error(httpx.post(url, json={"messages": "hi"}), 400)
    assert_error(httpx.post(url, json={"messages": CHAT, "temperature": -1}), 400)
    assert_error(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}), 400)
    assert_error(httpx.post(url, json={"messages": CHAT, "logit_bias": {"not-a-token": 1}}), 400)
    assert_error(httpx.post(server.url + "/v1/completions", json={"prompt": [10 ** 9]}), 400)
    assert_error(httpx.post(server.url + "/detokenize", json={"tokens": [-1]}), 400)
    assert_error(httpx.get(server.url + "/v1/nothing-here"), 404)


def test_openai_client_errors(client, model_id, llm):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    assert e.value.status_code == 404 and e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens over the context: never truncated
        client.completions.create(model=model_id, prompt="Hello", max_tokens=llm.ctx_size)
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_id, prompt="x " * (llm.ctx_size + 10), max_tokens=1)


def test_api_key(keyed, model_id):
    ok = openai.OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    assert ok.models.list().data[0].id == model_id
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert e.value.status_code == 401
    assert_error(httpx.post(keyed.url + "/v1/completions", json={"prompt": "x"}), 401, "invalid_api_key")
    assert httpx.get(keyed.url + "/health").status_code == 200  # probes need no key


def test_queue_full_is_429(server, client, model_id):
    state = server.server.config.app.state.server
    saved = state.capacity
    state.capacity = 1
    try:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"prompt": "Tell me a long story.", "max_tokens": 400, "stream": True,
                                "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            first = next(lines)  # the first request is in flight
            assert state.n_active == 1
            t = time.perf_counter()
            try:
                client.completions.create(model=model_id, prompt="x", max_tokens=1)
            except openai.RateLimitError:
                pass
            else:
                raise AssertionError(f"no 429 after {time.perf_counter() - t:.3f}s; first={first!r} "
                                     f"n_active={state.n_active} rest={list(lines)[-3:]!r}")
            with pytest.raises(openai.RateLimitError) as e:
                client.completions.create(model=model_id, prompt="x", max_tokens=1)
            assert e.value.response.headers["retry-after"] and e.value.body["code"] == "rate_limit_exceeded"
    finally:
        state.capacity = saved


# -- disconnects and metrics --------------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server, llm):
    for _ in range(6):
        with httpx.stream("POST", server.url + "/v1/chat/completions",
                          json={"messages": CHAT, "max_tokens": 200, "stream": True, "ignore_eos": True}) as resp:
            lines = resp.iter_lines()
            seen = [line for line, _ in zip(lines, range(8)) if line.startswith("data: ")]
            assert seen
            t = time.perf_counter()  # the event loop answers while the engine thread computes
            assert httpx.get(server.url + "/health").status_code == 200
            assert time.perf_counter() - t < 1.0
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up is cancelled too
        httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "ignore_eos": True}, timeout=1.0)
    deadline = time.time() + 30
    while (llm.engine.stats()["running"] or llm.engine.stats()["waiting"]) and time.time() < deadline:
        time.sleep(0.05)
    assert blocks_used(server.url) == 0
    text = httpx.get(server.url + "/metrics").text
    assert 'edgellm_requests_total{finish_reason="cancelled"}' in text


def test_metrics_exposed(server):
    text = httpx.get(server.url + "/metrics").text
    for name in ("edgellm_requests_running", "edgellm_requests_waiting", "edgellm_kv_blocks_used",
                 "edgellm_kv_blocks_free", "edgellm_prefix_cache_hit_tokens_total", "edgellm_prompt_tokens_total",
                 "edgellm_generation_tokens_total", "edgellm_time_to_first_token_seconds_bucket",
                 "edgellm_inter_token_latency_seconds_bucket"):
        assert name in text, name


def test_token_logprobs_matches_numpy():
    import numpy as np

    from edgellm.sampling import token_logprobs

    logits = np.random.default_rng(0).normal(size=50).astype(np.float32)
    ref = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum())
    lp, top = token_logprobs(logits, 7, 3)
    assert lp == pytest.approx(ref[7])
    assert [t for t, _ in top] == list(np.argsort(-ref)[:3])
    assert [v for _, v in top] == pytest.approx(sorted(ref, reverse=True)[:3])
    assert token_logprobs(logits, 7, 0) == (pytest.approx(ref[7]), [])
