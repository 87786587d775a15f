"""Embeddings: LLM.embed equals the pooled final hidden states computed directly, a batch equals one input at a
time, pooling follows the GGUF metadata; /v1/embeddings with the openai client (float and base64, dimensions) and
OpenAI-shaped 400s."""
from __future__ import annotations

import base64

import numpy as np
import openai
import pytest
from timing import scaled

TEXTS = ["The cat sat on the mat.", "A", "Embeddings of several lengths, batched together in one forward pass.",
         "the cat sat on the mat", "x" * 3]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    from edgellm import LLM

    llm = LLM(tiny_model("llama"), ctx_size=256, progress=False)
    yield llm
    llm.shutdown()


def direct(llm, text: str, kind: str = "mean") -> np.ndarray:
    """The reference: one sequence's final hidden states from a one-off forward, pooled in float64, normalised."""
    ids = llm.prompt_ids(text)

    def run():
        with llm.scratch(len(ids)) as s:
            return s.hidden(ids, 0, range(len(ids)))

    h = llm.call(run).astype(np.float64)  # (n, D)
    v = {"mean": h.mean(axis=0), "cls": h[0], "last": h[-1]}[kind]
    return v / np.linalg.norm(v)


def test_embed_equals_pooled_hidden_states(tiny):
    got = tiny.embed(TEXTS)
    assert got.shape == (len(TEXTS), tiny.config.d_model) and got.dtype == np.float32
    for v, t in zip(got, TEXTS):
        np.testing.assert_allclose(v, direct(tiny, t), atol=1e-5)
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-6)
    assert not np.allclose(got[0], got[3], atol=1e-3)  # different texts, different vectors


def test_batch_equals_one_by_one(tiny):
    batch = tiny.embed(TEXTS)
    single = np.stack([tiny.embed(t)[0] for t in TEXTS])
    np.testing.assert_allclose(batch, single, atol=1e-5)


def test_long_input_in_chunks(tiny):
    """An input longer than the token budget runs in chunks and still equals the direct forward."""
    from edgellm.embeddings import embed_ids

    text = " ".join(["word"] * 60)
    ids = tiny.prompt_ids(text)
    budget = tiny.capacity.token_budget
    tiny.__dict__["capacity"] = type(tiny.capacity)(**{**tiny.capacity.__dict__, "token_budget": 32})
    try:
        assert len(ids) > 32
        got = embed_ids(tiny, [ids])[0]
    finally:
        tiny.__dict__["capacity"] = type(tiny.capacity)(**{**tiny.capacity.__dict__, "token_budget": budget})
    np.testing.assert_allclose(got, direct(tiny, text), atol=1e-5)


@pytest.mark.parametrize("value,kind", [(None, "mean"), (1, "mean"), (2, "cls"), (3, "last")])
def test_pooling_from_metadata(tiny, value, kind):
    from edgellm.embeddings import pooling_type

    meta = {"general.architecture": "llama", **({} if value is None else {"llama.pooling_type": value})}
    assert pooling_type(meta) == kind
    np.testing.assert_allclose(tiny.embed(TEXTS[0], pooling=kind)[0], direct(tiny, TEXTS[0], kind), atol=1e-5)


def test_rank_pooling_and_bad_inputs_are_named_errors(tiny):
    from edgellm.embeddings import pooling_type
    from edgellm.errors import ContextOverflowError, InvalidRequestError, UnsupportedModelError

    with pytest.raises(UnsupportedModelError):
        pooling_type({"general.architecture": "llama", "llama.pooling_type": 4})
    with pytest.raises(ContextOverflowError):
        tiny.embed([" ".join(["word"] * 400)])
    with pytest.raises(InvalidRequestError):
        tiny.embed([[]])


@pytest.fixture(scope="module")
def client(tiny):
    from server_thread import ServerThread

    from edgellm.server.app import create_app

    srv = ServerThread(create_app(tiny))
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    srv.stop()


def test_openai_embeddings_float_and_base64(client, tiny):
    want = tiny.embed(TEXTS)
    r = client.embeddings.create(model=None, input=TEXTS, encoding_format="float")
    assert [d.index for d in r.data] == list(range(len(TEXTS)))
    np.testing.assert_allclose(np.array([d.embedding for d in r.data]), want, atol=1e-6)
    assert r.usage.prompt_tokens == sum(len(tiny.prompt_ids(t)) for t in TEXTS) == r.usage.total_tokens
    b = client.embeddings.create(model=None, input=TEXTS[0], encoding_format="base64")
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(b.data[0].embedding), "<f4"), want[0], atol=1e-6)
    default = client.embeddings.create(model=None, input=TEXTS[0])  # the client asks for base64 and decodes it
    np.testing.assert_allclose(np.array(default.data[0].embedding), want[0], atol=1e-6)
    ids = client.embeddings.create(model=None, input=[tiny.prompt_ids(TEXTS[1])])
    np.testing.assert_allclose(ids.data[0].embedding, want[1], atol=1e-6)


def test_dimensions_truncate_and_renormalise(client, tiny):
    r = client.embeddings.create(model=None, input=TEXTS[0], dimensions=16)
    v = np.array(r.data[0].embedding)
    full = tiny.embed(TEXTS[0])[0][:16]
    np.testing.assert_allclose(v, full / np.linalg.norm(full), atol=1e-6)


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "dimensions": 100000}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[1, 2], [99999999]]}, "input"),
    ({"input": " ".join(["word"] * 400)}, "input"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_embedding_requests_are_openai_400s(client, body, param):
    import httpx

    r = httpx.post(str(client.base_url) + "embeddings", json=body, timeout=scaled(60))
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["message"] and (err["param"] or "").split(".")[0].split("[")[0] == param, err
