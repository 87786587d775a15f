"""Engine: continuous batching, prefix reuse, preemption, cancellation — block accounting and batch invariance."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.errors import ContextOverflowError
from timing import scaled

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


def make_engine(llm, kv_tokens: int, **kw) -> Engine:
    return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=kv_tokens, **kw)


def run_all(engine: Engine, reqs, cancel_at: dict | None = None, max_steps: int = 10_000, check_refs=False):
    cancel_at = cancel_at or {}
    for step in range(max_steps):
        for r in reqs:
            if cancel_at.get(r.id) == step:
                engine.cancel(r)
        if not engine.has_work() and all(r.finished for r in reqs):
            break
        engine.step()
        if check_refs:
            assert_refs_exact(engine, reqs)
    engine.step()  # reap
    return [r.output() for r in reqs]


def assert_refs_exact(engine: Engine, reqs):
    """Every block's ref count is the number of block tables holding it; only running requests hold blocks,
    and a table covers exactly what the request has computed or is about to compute."""
    tables = {r.id: engine.kv_manager.block_table(r) for r in reqs}
    holders = [0] * engine.pool.n_blocks
    for t in tables.values():
        for b in t:
            holders[b] += 1
    assert engine.pool.ref == holders
    running = {r.id for r in engine.scheduler.running}
    assert {i for i, t in tables.items() if t} <= running
    for r in engine.scheduler.running:
        assert -(-r.n_computed // engine.block_size) <= len(tables[r.id]) <= -(-r.n_tokens // engine.block_size) + 1


def assert_no_leaks(engine: Engine):
    pool = engine.pool
    assert all(c == 0 for c in pool.ref), "a block is still referenced after every request ended"
    assert pool.n_free == pool.n_blocks
    assert engine.kv_manager.cached_blocks() == set(engine.prefix.by_block)  # the tree names only free blocks
    assert not engine.has_work()


def alone(llm, ids, n):
    eng = make_engine(llm, 512)
    (out,) = run_all(eng, [eng.add_request(ids, SamplingParams(max_tokens=n, **GREEDY))])
    return out.token_ids


def test_batch_of_8_equals_alone(tiny_llm):
    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 500, int(rng.integers(3, 40))).tolist() for _ in range(8)]
    eng = make_engine(tiny_llm, 1024)
    outs = run_all(eng, [eng.add_request(p, SamplingParams(max_tokens=12, **GREEDY)) for p in prompts])
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(tiny_llm, p, 12)
    assert_no_leaks(eng)


def test_step_budget_below_prefill_chunk_still_runs_prompts(tiny_llm):
    """A token budget smaller than the prefill chunk (256) used to leave every prompt waiting forever."""
    rng = np.random.default_rng(1)
    prompts = [[1] + rng.integers(3, 500, 30).tolist() for _ in range(3)]
    eng = make_engine(tiny_llm, 1024, token_budget=8, max_batch=2)
    outs = run_all(eng, [eng.add_request(p, SamplingParams(max_tokens=6, **GREEDY)) for p in prompts], max_steps=200)
    assert all(o.finish_reason == "length" for o in outs)
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(tiny_llm, p, 6)  # prompt split into chunks of 8: the same tokens
    assert_no_leaks(eng)


def test_prefix_hit_reuses_blocks_and_same_output(tiny_llm):
    rng = np.random.default_rng(1)
    shared = [1] + rng.integers(3, 500, 70).tolist()
    eng = make_engine(tiny_llm, 1024)
    first = run_all(eng, [eng.add_request(shared + [7, 8], SamplingParams(max_tokens=6, **GREEDY))])[0]
    second_req = eng.add_request(shared + [9, 10, 11], SamplingParams(max_tokens=6, **GREEDY))
    second = run_all(eng, [second_req])[0]
    # the 4 full 16-token blocks of the shared 71 tokens, and 7 rows copied from the first request's 5th block
    assert second.metrics["cached_tokens"] == 71
    assert second.token_ids == alone(tiny_llm, shared + [9, 10, 11], 6)
    assert first.token_ids == alone(tiny_llm, shared + [7, 8], 6)
    assert eng.stats()["prefix_hit_tokens"] == 71 and eng.stats()["prefix_cow_copies"] == 1
    assert_no_leaks(eng)


def test_preemption_keeps_outputs(tiny_llm):
    rng = np.random.default_rng(2)
    prompts = [[1] + rng.integers(3, 500, 40).tolist() for _ in range(4)]
    eng = make_engine(tiny_llm, 160)  # 10 blocks: 4 requests of 40 + 40 tokens cannot all stay
    eng.scheduler.output_estimate = 1  # admit optimistically so that running requests must be preempted
    schedule, chunks = eng.scheduler.schedule, []

    def watched():
        items = schedule()
        # generated tokens each item computes (recomputed after a preemption, or the next one)
        chunks.extend(it.request.n_computed + it.n_new - max(it.request.n_computed, len(it.request.prompt_ids))
                      for it in items)
        return items
    eng.scheduler.schedule = watched
    outs = run_all(eng, [eng.add_request(p, SamplingParams(max_tokens=40, **GREEDY)) for p in prompts])
    assert eng.scheduler.preemptions > 0
    assert max(chunks) > 1  # a preempted request recomputed its generated tokens in chunks, not one per step
    for p, o in zip(prompts, outs):
        assert o.token_ids == alone(tiny_llm, p, 40)
    assert_no_leaks(eng)


def test_request_that_cannot_fit_is_rejected(tiny_llm):
    eng = make_engine(tiny_llm, 64)
    with pytest.raises(ContextOverflowError):
        eng.add_request([1] * 100, SamplingParams(max_tokens=4))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_streams_no_leaks_and_same_outputs(tiny_llm, data):
    rng_seed = data.draw(st.integers(0, 10_000))
    rng = np.random.default_rng(rng_seed)
    n = data.draw(st.integers(1, 7))
    base = [1] + rng.integers(3, 500, 48).tolist()
    prompts = []
    for _ in range(n):
        share = int(rng.integers(0, 49))  # shared prefixes of random length
        prompts.append(base[:max(1, share)] + rng.integers(3, 500, int(rng.integers(1, 30))).tolist())
    max_toks = [int(rng.integers(1, 20)) for _ in range(n)]
    kv = data.draw(st.sampled_from([96, 160, 1024]))  # small budgets force preemption
    eng = make_engine(tiny_llm, kv, max_batch=data.draw(st.integers(1, 8)))
    reqs = [eng.add_request(p, SamplingParams(max_tokens=m, **GREEDY)) for p, m in zip(prompts, max_toks)]
    cancelled = {r.id: int(rng.integers(0, 30)) for r in reqs if rng.random() < 0.25}
    outs = run_all(eng, reqs, cancel_at=cancelled, check_refs=True)
    assert_no_leaks(eng)
    for r, p, m, o in zip(reqs, prompts, max_toks, outs):
        if o.finish_reason == "cancelled":
            continue
        assert o.finish_reason == "length"
        assert o.token_ids == alone(tiny_llm, p, m)


def test_a_failing_request_does_not_take_the_batch_down(tiny_llm):
    eng = make_engine(tiny_llm, 512)
    good = eng.add_request([1, 5, 6, 7], SamplingParams(max_tokens=5, **GREEDY))
    bad = eng.add_request([1, 8, 9], SamplingParams(max_tokens=5, **GREEDY))

    def boom(logits, history):
        raise RuntimeError("sampler exploded")

    bad.sampler = boom
    outs = run_all(eng, [good, bad])
    assert outs[1].finish_reason == "error" and isinstance(bad.error, RuntimeError)
    assert outs[0].finish_reason == "length" and outs[0].token_ids == alone(tiny_llm, [1, 5, 6, 7], 5)
    assert_no_leaks(eng)


def test_loop_reports_the_error_to_its_caller_only(tiny_llm, monkeypatch):
    from edgellm.sampling import Sampler

    real = Sampler.__call__

    def flaky(self, logits, history):
        if list(history[:3]) == [1, 8, 9]:
            raise ZeroDivisionError("bad request")
        return real(self, logits, history)

    monkeypatch.setattr(Sampler, "__call__", flaky)
    h_bad = tiny_llm.loop.submit([1, 8, 9], SamplingParams(max_tokens=3, **GREEDY))
    h_good = tiny_llm.loop.submit([1, 5, 6], SamplingParams(max_tokens=3, **GREEDY))
    with pytest.raises(ZeroDivisionError):
        h_bad.result(timeout=scaled(60))
    assert h_good.result(timeout=scaled(60)).finish_reason == "length"


def test_direct_model_use_runs_on_the_engine_thread(tiny_llm):
    """logits() and loop.call() run on the engine thread between steps (one OpenMP team per process),
    interleaved with generation, and hand results and exceptions back to the caller."""
    import threading

    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = tiny_llm.generate([3, 4, 5], p).token_ids
    h = tiny_llm.loop.submit([3, 4, 5], p)
    where = tiny_llm.loop.call(lambda: threading.current_thread().name)
    assert where == "edgellm-engine"
    before = tiny_llm.logits([1, 2, 3])
    assert h.result(60).token_ids == alone
    np.testing.assert_array_equal(tiny_llm.logits([1, 2, 3]), before)
    with pytest.raises(ZeroDivisionError):
        tiny_llm.loop.call(lambda: 1 / 0)
    assert tiny_llm.generate([3, 4, 5], p).token_ids == alone  # the loop still serves


def test_call_after_shutdown_runs_in_the_caller():
    """After shutdown, call() still runs fn (a restarted loop thread runs queued calls, then stops)."""
    import threading

    from edgellm.engine.loop import EngineLoop

    class Idle:
        def has_work(self):
            return False

    loop = EngineLoop(Idle())
    assert loop.call(lambda: 7) == 7  # on the engine thread
    loop.shutdown()
    loop._thread.join(5)
    assert not loop._thread.is_alive()
    got = []
    t = threading.Thread(target=lambda: got.append(loop.call(lambda: 8)), daemon=True)
    t.start()
    t.join(10)
    assert got == [8], "call() after shutdown did not return"
