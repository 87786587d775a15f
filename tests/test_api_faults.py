"""Failures stay contained, seen from the API and the HTTP server: a killed engine thread is reported (/health 503
within a second, callers get named errors instead of hanging); a forward that fails at one step, under 16
concurrent requests, fails only that step's requests with an OpenAI-shaped error, and the server stays healthy.

Each test loads its own tiny model (a killed engine serves no one after it). Fault injection uses the engine's
hook `Engine.runner.fail_steps` (a set of forward numbers that raise; branch i17-engine) when it exists, and
raises from a wrapped model forward otherwise."""
from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

import fastapi  # noqa: F401,E402 (the dev extra installs the server and its clients)
import httpx  # noqa: E402
import uvicorn  # noqa: F401,E402

from edgellm import LLM, SamplingParams  # noqa: E402
from edgellm.errors import EngineDeadError  # noqa: E402
from edgellm.server.app import create_app  # noqa: E402
from server_thread import ServerThread  # noqa: E402
from timing import scaled

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture
def fresh_llm(tiny_model):
    llm = LLM(tiny_model("llama"), ctx_size=256, kv_cache_tokens=1024, progress=False)
    yield llm
    llm.shutdown()


@pytest.fixture
def server(fresh_llm):
    s = ServerThread(create_app(fresh_llm))
    yield s
    s.stop()


def kill_engine(llm, monkeypatch):
    def broken():
        raise RuntimeError("engine bug")

    monkeypatch.setattr(llm.engine, "step", broken)


def test_a_dead_engine_raises_named_errors_from_the_api(fresh_llm, monkeypatch):
    assert fresh_llm.error is None
    fresh_llm.generate([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    kill_engine(fresh_llm, monkeypatch)
    with pytest.raises(EngineDeadError):
        fresh_llm.generate([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY))
    assert isinstance(fresh_llm.error, EngineDeadError)
    t = time.perf_counter()
    with pytest.raises(EngineDeadError):  # at once, not after a timeout
        list(fresh_llm.stream([1, 2, 4]))
    with pytest.raises(EngineDeadError):
        fresh_llm.logits([1, 2, 3])
    assert time.perf_counter() - t < 1.0


def test_killed_engine_thread_gives_503_and_errors_not_hangs(server, fresh_llm, monkeypatch):
    url = server.url
    assert httpx.get(url + "/health").status_code == 200
    with httpx.stream("POST", url + "/v1/completions", timeout=10,
                      json={"prompt": [1, 2, 3], "max_tokens": 200, "stream": True, "ignore_eos": True}) as resp:
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))  # in flight
        kill_engine(fresh_llm, monkeypatch)
        t = time.perf_counter()
        rest = [line[6:] for line in lines if line.startswith("data: ")]  # the stream ends (ReadTimeout if not)
    assert rest[-1] == "[DONE]"
    err = json.loads(rest[-2])["error"]
    assert err["type"] == "service_unavailable" and "engine" in err["message"]
    while httpx.get(url + "/health").status_code != 503:
        assert time.perf_counter() - t < 1.0, "/health still 200 a second after the engine died"
        time.sleep(0.02)
    for body in ({"prompt": [1, 2, 3], "max_tokens": 4}, {"prompt": [1, 2, 3], "max_tokens": 4, "stream": True}):
        r = httpx.post(url + "/v1/completions", json=body, timeout=5)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    assert httpx.get(url + "/health").json() == {"status": "error"}


def has_fault_hook(llm) -> bool:
    return hasattr(llm.engine.runner, "fail_steps")


def inject_fault(llm, monkeypatch, k: int) -> dict:
    """Make the k-th forward from now raise; returns {"n_seqs": sequences in that forward} once it ran."""
    seen: dict = {}
    real, calls = llm.model.forward, [0]
    hook = has_fault_hook(llm)
    if hook:
        llm.engine.runner.fail_steps = {llm.engine.runner.steps + k}

    def spy(batch, kv):
        n, calls[0] = calls[0], calls[0] + 1
        if n == k:
            seen["n_seqs"] = batch.block_tables.shape[0]
            if not hook:
                raise RuntimeError("injected fault")
        return real(batch, kv)

    monkeypatch.setattr(llm.model, "forward", spy)
    return seen


def test_a_fault_at_one_step_fails_only_that_steps_requests(server, fresh_llm, monkeypatch, request):
    if not has_fault_hook(fresh_llm):
        request.applymarker(pytest.mark.xfail(strict=True, reason="needs the engine's step fault containment "
                                              "(Engine.runner.fail_steps, EngineStepError: branch i17-engine)"))
    rng = np.random.default_rng(5)
    prompts = [[1] + rng.integers(3, 500, int(rng.integers(4, 30))).tolist() for _ in range(16)]
    want = [o.text for o in fresh_llm.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))]
    seen = inject_fault(fresh_llm, monkeypatch, k=2)
    results: list = [None] * 16

    def ask(i):
        r = httpx.post(server.url + "/v1/completions", timeout=scaled(60),
                       json={"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        results[i] = (r.status_code, r.json())

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    failed = [i for i, (status, _) in enumerate(results) if status != 200]
    assert seen.get("n_seqs") and len(failed) == seen["n_seqs"], (seen, failed)
    for i, (status, body) in enumerate(results):
        if i in failed:
            assert status == 500 and set(body["error"]) == {"message", "type", "param", "code"}
            assert body["error"]["type"] == "server_error"
        else:
            assert body["choices"][0]["text"] == want[i]
    assert httpx.get(server.url + "/health").status_code == 200
    s = fresh_llm.stats()
    assert s["blocks_used"] == 0 and s["running"] == s["waiting"] == 0  # no KV block leaked
    assert fresh_llm.generate(prompts[0], SamplingParams(max_tokens=8, **GREEDY)).text == want[0]
