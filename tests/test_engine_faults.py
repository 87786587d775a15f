"""Failures stay contained: a forward that raises fails only the requests of its step (EngineStepError), the
others (waiting ones included) finish with the tokens of an undisturbed run, and no KV block leaks. Also the
prefix-hit statistic: exact, however often a waiting request is retried."""
from __future__ import annotations

import numpy as np
import pytest

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.request import RequestState
from edgellm.errors import EngineStepError

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


def make_engine(llm, kv_tokens=1024, **kw) -> Engine:
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=kv_tokens, **kw)


def drain(eng, max_steps=10_000):
    for _ in range(max_steps):
        if not eng.has_work():
            return
        eng.step()  # never raises for a failed forward
    raise AssertionError("the engine did not finish its work")


def assert_no_leaks(eng):
    assert eng.pool.ref == [0] * eng.pool.n_blocks and eng.pool.n_free == eng.pool.n_blocks
    assert eng.kv_manager.cached_blocks() == set(eng.prefix.by_block) and not eng.has_work()


@pytest.mark.parametrize("fault_step", [0, 3, 9])
def test_a_failed_step_fails_only_its_requests(tiny_llm, fault_step):
    rng = np.random.default_rng(11)
    base = [1] + rng.integers(3, 500, 20).tolist()
    prompts = [base[:int(rng.integers(1, 21))] + rng.integers(3, 500, int(rng.integers(1, 25))).tolist()
               for _ in range(16)]  # 16 concurrent requests, some sharing prefixes
    n_new = [int(rng.integers(2, 12)) for _ in prompts]

    def run(fault_steps=()):
        eng = make_engine(tiny_llm, 640, max_batch=6, token_budget=64)  # 40 blocks: some requests must wait
        eng.runner.fail_steps = set(fault_steps)
        reqs = [eng.add_request(p, SamplingParams(max_tokens=k, **GREEDY)) for p, k in zip(prompts, n_new)]
        in_step: set[int] = set()
        waiting: set[int] = set()
        real = eng.runner.run

        def spy(items):  # which requests the faulty step ran, and which were waiting then
            if eng.runner.steps == fault_step:
                in_step.update(it.request.id for it in items)
                waiting.update(r.id for r in eng.scheduler.waiting)
            return real(items)

        eng.runner.run = spy
        drain(eng)
        assert_no_leaks(eng)
        return eng, reqs, in_step, waiting

    want = run()[1]
    eng, got, in_step, waiting = run([fault_step])
    assert in_step and waiting  # some requests ran in the faulty step, others were waiting
    for w, g in zip(want, got):
        if g.id in in_step:
            assert g.finish_reason == "error" and isinstance(g.error, EngineStepError)
            assert "injected fault" in str(g.error.__cause__)
        else:
            assert g.finish_reason == "length" and g.error is None
            assert g.output_ids == w.output_ids
    assert eng.stats()["running"] == eng.stats()["waiting"] == 0


def test_engine_goes_on_after_a_failed_step(tiny_llm):
    eng = make_engine(tiny_llm)
    eng.runner.fail_steps = {0}
    first = eng.add_request([1, 5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    drain(eng)
    assert isinstance(first.error, EngineStepError)
    again = eng.add_request([1, 5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    drain(eng)
    alone = make_engine(tiny_llm)
    want = alone.add_request([1, 5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))
    drain(alone)
    assert again.finish_reason == "length" and again.output_ids == want.output_ids
    assert again.output().metrics["cached_tokens"] == 0  # a failed step's K/V is never offered for reuse
    assert_no_leaks(eng)


def test_prefix_hit_tokens_exact_while_a_request_waits(tiny_llm):
    """A request that does not fit waits for several steps: its cached prefix is counted once, when it is
    admitted, and waiting neither evicts nor copies anything."""
    rng = np.random.default_rng(12)
    shared = [1] + rng.integers(3, 500, 39).tolist()  # 40 tokens: blocks 0, 1 full, block 2 holds 8 rows
    eng = make_engine(tiny_llm, 160)  # 10 blocks
    first = eng.add_request(shared, SamplingParams(max_tokens=1, **GREEDY))
    drain(eng)
    long = eng.add_request([2] + rng.integers(3, 500, 89).tolist(), SamplingParams(max_tokens=20, **GREEDY))
    eng.step()  # 7 never-cached blocks for 90 + 20 tokens: the cached prefix stays in the tree
    late = eng.add_request(shared + rng.integers(3, 500, 30).tolist(), SamplingParams(max_tokens=4, **GREEDY))
    waited = 0
    while eng.step() is not None and late.state is RequestState.WAITING:
        waited += 1
        assert eng.stats()["prefix_hit_tokens"] == 0 and eng.stats()["evictions"] == 0
        assert eng.stats()["prefix_cow_copies"] == 0
    drain(eng)
    assert waited >= 5 and long.finish_reason == late.finish_reason == "length"
    cached = [r.output().metrics["cached_tokens"] for r in (first, long, late)]
    assert cached == [0, 0, 40]  # 2 shared blocks + 8 rows copied from the partial block
    assert eng.stats()["prefix_hit_tokens"] == sum(cached) and eng.stats()["prefix_cow_copies"] == 1
    assert_no_leaks(eng)
