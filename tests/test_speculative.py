"""Speculative decoding (engine/speculative.py): drafts verified as extra batch rows, greedy outputs equal to plain
decoding, KV rollback without leaks, batch invariance, the sampled rejection rule, adaptive back-off, limits inside
an accepted run, preemption, the draft model."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine_helpers import GREEDY, assert_no_leaks, make_engine

from edgellm import LLM, SamplingParams
from edgellm.engine.engine import Engine
from edgellm.engine.kv_cache_manager import KVCacheManager
from edgellm.engine.speculative import (BACKOFF_MIN, MISS_LIMIT, DraftControl, NgramIndex, SpecConfig,
                                        parse_speculative)
from edgellm.errors import DraftModelError, InvalidRequestError
from edgellm.sampling import Sampler
from timing import scaled


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    return LLM(tiny_model("llama"), ctx_size=256, progress=False)


def run(eng: Engine, prompts, params, *, check=None):
    params = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    while eng.has_work():
        eng.step()
        if check:
            check(eng, reqs)
    assert_no_leaks(eng)
    return reqs


def plain(llm, prompts, params, **kw):
    return [r.output_ids for r in run(make_engine(llm, **kw), prompts, params)]


def assert_tables_cover_computed(eng: Engine, reqs):
    """Every held block is referenced once per table holding it; a running table covers what is computed and at
    most one block past the known tokens (rejected draft rows were rolled back)."""
    holders = [0] * eng.pool.n_blocks
    for r in reqs:
        for b in eng.kv_manager.block_table(r):
            holders[b] += 1
    assert eng.pool.ref == holders
    for r in eng.scheduler.running:
        n = len(eng.kv_manager.block_table(r))
        assert -(-r.n_computed // eng.block_size) <= n <= -(-r.n_tokens // eng.block_size) + 1


class Oracle:
    """A proposer that knows each prompt's plain greedy output and drafts it, corrupting tokens at random (seeded by
    the request's own position, so drafts never depend on the batch): long accepted runs and partial rejections."""

    def __init__(self, expected: dict, wrong: float = 0.25, n_vocab: int = 512):
        self.expected, self.wrong, self.V = expected, wrong, n_vocab

    def propose(self, req, k):
        exp, pos = self.expected[tuple(req.prompt_ids)], len(req.output_ids)
        rng = np.random.default_rng(pos + 1000 * len(req.prompt_ids))
        draft = list(exp[pos:pos + k]) or [3]
        return [(t + 1) % self.V if rng.random() < self.wrong else t for t in draft]

    def release(self, req):
        pass

    def close(self):
        pass


def repetitive(rng, n_seg=2, seg=12, reps=3):
    segs = [rng.integers(3, 500, seg).tolist() for _ in range(n_seg)]
    out = [1]
    for _ in range(reps):
        for s in segs:
            out += s
    return out


# -- units -------------------------------------------------------------------------------------------------------------
def test_ngram_index_latest_longest_match_and_loops():
    idx = NgramIndex()
    ids = [5, 6, 7, 8, 9, 1, 6, 7, 2, 5, 6, 7]
    # "5 6 7" occurred at 0 (then 8 9); "6 7" later at 6 (then 2): the longest n-gram wins
    assert idx.propose(ids, 3) == [8, 9, 1]
    assert idx.propose(ids + [4], 2) == []  # 7 4: never seen; 4: never seen
    assert NgramIndex().propose([1, 2, 3, 2], 3) == [3, 2, 3]  # "2" after position 1, then the loop repeats
    assert NgramIndex().propose([9], 4) == []


def test_draft_control_backs_off_and_probes_again():
    c = DraftControl(4, 8)
    assert c.allowed() == 4
    c.record(4, 4)
    assert c.k == 8  # a fully accepted draft doubles the length
    c.record(8, 2)
    assert c.k == 3  # partial: the accepted run plus one
    for _ in range(MISS_LIMIT):
        c.record(c.allowed(), 0)
    assert [c.allowed() for _ in range(BACKOFF_MIN)] == [0] * BACKOFF_MIN  # paused
    assert c.allowed() == 1  # then a short probe
    c.record(1, 0)
    c.record(c.allowed() or 1, 0)
    assert c.pause == 2 * BACKOFF_MIN  # failing again: a longer pause


def test_parse_speculative():
    assert parse_speculative("off") is None and parse_speculative(None) is None
    assert parse_speculative("ngram") == SpecConfig()
    assert parse_speculative({"draft_model": "x.gguf", "k": 3}) == SpecConfig("draft", 3, 8, "x.gguf")
    for bad in ("eagle", {"k": 0}, {"k": "4"}, {"draft": 1}, {"method": "draft"}):
        with pytest.raises(InvalidRequestError):
            parse_speculative(bad)


def test_trim_frees_unshared_tail_blocks_to_the_front():
    class Holder:
        n_computed = 0
    m = KVCacheManager(8, 4)
    h = Holder()
    assert m.allocate(h, 14) == [0, 1, 2, 3]
    assert m.trim(h, 5) == [2, 3]  # positions < 5 live in blocks 0 and 1
    assert m.block_table(h) == [0, 1] and m.pool.n_free == 6
    assert m.pool.allocate(2) == [2, 3]  # rolled-back blocks are handed out first (no cached block evicted)
    assert m.trim(h, 8) == []
    m.prefix.insert(list(range(8)), [0, 1])
    with pytest.raises(RuntimeError):
        m.trim(h, 0)  # a block named by the prefix tree is never rolled back


def test_greedy_verify_equals_sequential_sampling():
    rng = np.random.default_rng(0)
    s = Sampler(SamplingParams(temperature=0, repeat_penalty=1.3))
    logits = rng.normal(size=(4, 50)).astype(np.float32)
    hist = [1, 2, 3]
    seq = []
    for i in range(4):
        seq.append(s(logits[i], np.asarray(hist + seq)))
    assert s.verify(logits, np.asarray(hist), seq[:3]) == seq  # all accepted, then the bonus token
    wrong = [seq[0], (seq[1] + 1) % 50, seq[2]]
    assert s.verify(logits, np.asarray(hist), wrong) == seq[:2]  # stops at the first mismatch, with the correction


def test_sampled_verify_has_the_target_distribution():
    """Chi-square: the first emitted token is distributed as p, whether the draft token is likely or unlikely;
    after an accepted draft, the next one is distributed as the next row's p."""
    def chi_square(observed, expected):  # Pearson's statistic; 4 degrees of freedom for 5 outcomes
        return float(((observed - expected) ** 2 / expected).sum())

    CHI2_4DF_P001 = 18.4668  # the chi-square(4) quantile with 1e-3 above it (scipy.stats.chi2.isf(1e-3, 4))
    logits = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05], [0.1, 0.1, 0.2, 0.3, 0.3]], dtype=np.float32))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    n = 20000
    for draft_tok in (0, 4):
        s = Sampler(params)
        first, second = np.zeros(5), np.zeros(5)
        for _ in range(n):
            out = s.verify(logits, np.asarray([0]), [draft_tok])
            first[out[0]] += 1
            if len(out) == 2:
                second[out[1]] += 1
        p0, p1 = (np.exp(x.astype(np.float64)) / np.exp(x.astype(np.float64)).sum() for x in logits)
        assert chi_square(first, p0 * n) < CHI2_4DF_P001  # p-value > 1e-3
        assert chi_square(second, p1 * second.sum()) < CHI2_4DF_P001


# -- the engine --------------------------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_prompts_greedy_equals_plain_no_leaks(tiny_llm, data):
    seed = data.draw(st.integers(0, 10_000))
    k = data.draw(st.integers(1, 8))
    rng = np.random.default_rng(seed)
    prompts = [repetitive(rng, seg=int(rng.integers(2, 10)), reps=int(rng.integers(1, 4)))
               for _ in range(data.draw(st.integers(1, 4)))]
    params = [SamplingParams(max_tokens=int(rng.integers(1, 40)), **GREEDY) for _ in prompts]
    eng = make_engine(tiny_llm, speculative={"k": k})
    reqs = run(eng, prompts, params, check=assert_tables_cover_computed)
    assert [r.output_ids for r in reqs] == plain(tiny_llm, prompts, params)


def test_oracle_drafts_long_runs_batch_invariant(tiny_llm):
    """With long accepted runs and partial rejections: outputs equal plain decoding, a request batched with others
    that draft equals itself alone (drafting or not), nothing leaks."""
    rng = np.random.default_rng(7)
    prompts = [[1] + rng.integers(3, 500, int(rng.integers(5, 40))).tolist() for _ in range(5)]
    sp = SamplingParams(max_tokens=50, **GREEDY)
    want = plain(tiny_llm, prompts, sp)
    eng = make_engine(tiny_llm, speculative={"k": 6})
    eng.speculator.proposer = Oracle({tuple(p): w for p, w in zip(prompts, want)})
    reqs = run(eng, prompts, sp, check=assert_tables_cover_computed)
    assert [r.output_ids for r in reqs] == want
    assert sum(r.n_accepted for r in reqs) > 100 and sum(r.n_drafted - r.n_accepted for r in reqs) > 10
    # the first one alone, drafting: the same tokens, from its own drafts
    alone = make_engine(tiny_llm, speculative={"k": 6})
    alone.speculator.proposer = eng.speculator.proposer
    (r0,) = run(alone, prompts[:1], sp)
    assert r0.output_ids == want[0] and (r0.n_drafted, r0.n_accepted) == (reqs[0].n_drafted, reqs[0].n_accepted)


def test_seeded_sampled_requests_are_batch_invariant(tiny_llm):
    rng = np.random.default_rng(8)
    prompts = [repetitive(rng, seg=4, reps=4) for _ in range(3)]
    params = [SamplingParams(max_tokens=30, temperature=0.7, top_k=0, min_p=0.0, seed=i, ignore_eos=True)
              for i in range(3)]
    batched = run(make_engine(tiny_llm, speculative="ngram"), prompts, params)
    for i, p in enumerate(prompts):
        (alone,) = run(make_engine(tiny_llm, speculative="ngram"), [p], [params[i]])
        assert alone.output_ids == batched[i].output_ids
    assert sum(r.n_drafted for r in batched) > 0


def test_max_tokens_eos_and_stop_inside_an_accepted_run(tiny_llm):
    rng = np.random.default_rng(9)
    prompt = [1] + rng.integers(3, 500, 20).tolist()
    want = plain(tiny_llm, [prompt], SamplingParams(max_tokens=40, **GREEDY))[0]
    oracle = Oracle({tuple(prompt): want}, wrong=0.0)
    cases = [SamplingParams(max_tokens=m, **GREEDY) for m in (1, 2, 5, 13, 22)]
    stop_id = want[17]
    cases.append(SamplingParams(max_tokens=40, stop_token_ids=[stop_id], **GREEDY))  # an EOS-like stop token
    piece = tiny_llm.tokenizer.decode([want[11]])
    if piece.strip():
        cases.append(SamplingParams(max_tokens=40, stop=[piece], **GREEDY))
    for sp in cases:
        eng = make_engine(tiny_llm, speculative={"k": 8})
        eng.speculator.proposer = oracle
        (r,) = run(eng, [prompt], sp)
        (ref,) = run(make_engine(tiny_llm), [prompt], sp)
        assert (r.output_ids, r.text, r.finish_reason) == (ref.output_ids, ref.text, ref.finish_reason)
        assert len(r.output_ids) <= 2 or r.n_accepted > 0
    # the tree caches only accepted tokens: a follow-up with the same prompt + output reuses them
    eng = make_engine(tiny_llm, speculative={"k": 8})
    eng.speculator.proposer = oracle
    (r,) = run(eng, [prompt], SamplingParams(max_tokens=13, **GREEDY))
    for node in eng.prefix.by_block.values():
        path, n = [], node
        while n.parent is not None:
            path[:0], n = list(n.key), n.parent
        assert path == (prompt + r.output_ids)[:len(path)]


def test_preemption_with_drafts_keeps_outputs(tiny_llm):
    rng = np.random.default_rng(2)
    prompts = [[1] + rng.integers(3, 500, 40).tolist() for _ in range(4)]
    sp = SamplingParams(max_tokens=40, **GREEDY)
    want = plain(tiny_llm, prompts, sp)
    eng = make_engine(tiny_llm, 160, speculative={"k": 4})  # 10 blocks: 4 requests of 40 + 40 tokens cannot stay
    eng.scheduler.output_estimate = 1
    eng.speculator.proposer = Oracle({tuple(p): w for p, w in zip(prompts, want)}, wrong=0.1)
    reqs = run(eng, prompts, sp, check=assert_tables_cover_computed)
    assert eng.scheduler.preemptions > 0 and sum(r.n_accepted for r in reqs) > 0
    assert [r.output_ids for r in reqs] == want


def test_sliding_window_trimming_with_drafts(tiny_model):
    from edgellm.engine.swa import slots_needed

    llm = LLM(tiny_model("gemma3"), ctx_size=512, progress=False)
    rng = np.random.default_rng(3)
    prompts = [repetitive(rng, seg=5, reps=3) for _ in range(3)]
    sp = SamplingParams(max_tokens=30, **GREEDY)
    want = plain(llm, prompts, sp, swa_slots=0)
    eng = make_engine(llm, 512, max_batch=2, token_budget=32, block_size=4, swa_slots=slots_needed(2, 8, 4, 32),
                      speculative={"k": 6})
    eng.speculator.proposer = Oracle({tuple(p): w for p, w in zip(prompts, want)}, wrong=0.2)
    reqs = run(eng, prompts, sp)
    assert eng.kv.windows is not None and eng.stats()["swa_slots_reused"] > 0
    assert [r.output_ids for r in reqs] == want and sum(r.n_accepted for r in reqs) > 20


def test_back_off_engages_when_drafts_miss(tiny_llm):
    """A proposer that is always wrong: a few probes per back-off period, the same output."""
    rng = np.random.default_rng(4)
    prompt = [1] + rng.integers(3, 500, 20).tolist()
    sp = SamplingParams(max_tokens=120, **GREEDY)
    want = plain(tiny_llm, [prompt], sp)[0]
    eng = make_engine(tiny_llm, speculative="ngram")
    eng.speculator.proposer = Oracle({tuple(prompt): want}, wrong=1.0)
    (r,) = run(eng, [prompt], sp)
    assert r.output_ids == want and r.n_accepted == 0
    verifications = r.n_drafted  # probes after the first are 1 token long
    assert verifications <= 4 + MISS_LIMIT * 4, verifications


def test_logprobs_with_drafts(tiny_llm):
    rng = np.random.default_rng(5)
    prompt = repetitive(rng, seg=6, reps=4)
    sp = SamplingParams(max_tokens=20, logprobs=2, **GREEDY)
    (a,) = run(make_engine(tiny_llm, speculative="ngram"), [prompt], sp)
    (b,) = run(make_engine(tiny_llm), [prompt], sp)
    assert a.output_ids == b.output_ids and a.logprobs == b.logprobs


# -- the draft model ---------------------------------------------------------------------------------------------------
def test_draft_model_same_vocab_greedy_equals_plain(tiny_llm, tiny_model):
    rng = np.random.default_rng(6)
    prompts = [[1] + rng.integers(3, 500, 25).tolist(), repetitive(rng, seg=5)]
    sp = SamplingParams(max_tokens=24, **GREEDY)
    want = plain(tiny_llm, prompts, sp)
    other = tiny_model("llama", seed=1, d_model=128, d_ff=256, n_head=2, n_kv_head=1)  # another one, same vocab
    eng = make_engine(tiny_llm, speculative={"draft_model": other, "k": 3})
    reqs = run(eng, prompts, sp)
    assert [r.output_ids for r in reqs] == want and sum(r.n_drafted for r in reqs) > 0
    assert eng.speculator.proposer.manager.pool.n_free == eng.speculator.proposer.manager.pool.n_blocks
    # the target as its own draft: every draft token is accepted
    eng = make_engine(tiny_llm, speculative={"draft_model": tiny_llm.loaded.path, "k": 4})
    reqs = run(eng, prompts, sp)
    assert [r.output_ids for r in reqs] == want
    assert all(r.n_accepted == r.n_drafted > 0 for r in reqs)


def test_draft_model_with_another_vocabulary_is_refused(tiny_llm, tiny_model):
    with pytest.raises(DraftModelError, match="vocabulary"):
        make_engine(tiny_llm, speculative={"draft_model": tiny_model("llama", n_vocab=300)})


# -- the default model -------------------------------------------------------------------------------------------------
@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1000), k=st.integers(1, 8))
def test_default_model_greedy_equals_plain(gemma_llm, seed, k):
    rng = np.random.default_rng(seed)
    words = "the cat sat on a mat and then it ran to the door where the dog was".split()
    text = " ".join(rng.choice(words, 8))
    prompts = [f"Repeat: {text}\n{text}\n", " ".join(rng.choice(words, 6))]
    ids = [gemma_llm.prompt_ids(p) for p in prompts]
    sp = SamplingParams(max_tokens=10, **GREEDY)
    eng = Engine(gemma_llm.loaded, gemma_llm.model, gemma_llm.tokenizer, ctx_size=1024, kv_cache_tokens=1024,
                 speculative={"k": k})
    reqs = run(eng, ids, sp)
    ref = Engine(gemma_llm.loaded, gemma_llm.model, gemma_llm.tokenizer, ctx_size=1024, kv_cache_tokens=1024)
    assert [r.output_ids for r in reqs] == [r.output_ids for r in run(ref, ids, sp)]


# -- API, CLI, server ---------------------------------------------------------------------------------------------------
def test_llm_option_cli_and_server_stats(tiny_llm, tiny_model):
    import httpx
    from click.testing import CliRunner
    from server_thread import ServerThread

    from edgellm.cli import main
    from edgellm.server.app import create_app

    assert tiny_llm.engine.speculator is not None  # LLM's default: prompt lookup
    with pytest.raises(InvalidRequestError):
        LLM(tiny_model("llama"), speculative="eagle", progress=False)
    path = tiny_model("llama")
    outs = [CliRunner().invoke(main, ["generate", "-m", path, "-p", "a b a b a b", "-n", "12", "--temp", "0",
                                      "--speculative", mode]) for mode in ("off", "ngram")]
    assert outs[0].exit_code == 0 and outs[0].output == outs[1].output
    srv = ServerThread(create_app(tiny_llm))
    try:
        prompt = repetitive(np.random.default_rng(11), seg=6, reps=4)
        body = {"prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True}
        usage = httpx.post(srv.url + "/v1/completions", json=body, timeout=scaled(60)).json()["usage"]
        details = usage.get("completion_tokens_details") or {}
        text = httpx.get(srv.url + "/metrics").text
        assert "edgellm_spec_draft_tokens_total" in text and "edgellm_spec_accepted_tokens_total" in text
        assert details.get("accepted_prediction_tokens", 0) + details.get("rejected_prediction_tokens", 0) > 0
    finally:
        srv.stop()
