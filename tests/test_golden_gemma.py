"""The default model (Gemma 3 270M Q4_K_M) against llama.cpp golden files (tests/golden/make_model_golden.py):
greedy continuations and perplexity."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from edgellm.sampling import SamplingParams
from timing import scaled

GOLDEN = Path(__file__).parent / "golden"
GREEDY = json.loads((GOLDEN / "greedy_gemma3.json").read_text())
PPL = json.loads((GOLDEN / "perplexity_gemma3.json").read_text())
PPL_LONG = json.loads((GOLDEN / "perplexity_gemma3_long.json").read_text())


def test_prompt_tokens_match(gemma_llm):
    for case in GREEDY["prompts"]:
        assert gemma_llm.tokenizer.encode(case["text"], add_bos=True, special=True) == case["prompt_ids"], case["id"]


# A greedy continuation is compared with llama.cpp's up to the first step where llama.cpp's top-2 logit margin
# is below NEAR_TIE; a divergence before that is a failure. Kernels that sum in another order than llama.cpp
# flip an occasional 8-bit activation code, and the logits move by ~0.1 after a few dozen tokens. llama.cpp's
# own AVX2 build against its AVX-512 golden (tests/golden/llamacpp_cross_build.json) leaves the golden's code_fib
# continuation at step 23, at a margin of 0.386. So do our kernels since attention sums in its own order
# (kernels_cpu/attention_kernel.py; also history at step 9, margin 0.152), while their mean |dNLL| on the
# perplexity texts is 0.078 / 0.079 (llama.cpp's order: 0.085 / 0.080; llama.cpp's cross-build: 0.080).
# The threshold is llama.cpp's own cross-build spread: a divergence where llama.cpp was surer than that fails.
NEAR_TIE = 0.4
CLI_CASE = 1  # the prompt test_greedy_cli_matches_api runs through the CLI: its whole continuation is generated


def _first_near_tie(case) -> int:
    """Steps of the case's continuation that are compared: those before llama.cpp's first near-tie."""
    return next((i for i, s in enumerate(case["steps"]) if s["gap"] < NEAR_TIE), len(case["steps"]))


@pytest.fixture(scope="module")
def greedy_outputs(gemma_llm):
    """The greedy continuations as one continuous batch, each only as long as it is compared (the CLI case: all
    greedy_steps). Tokens after the first near-tie are never compared, and a greedy token does not depend on how
    many follow it nor on the batch: 17 x 48 decode rows would be 816, here 215 (4x less work under
    emulation, where the 262144-row output head of every decoded token dominates)."""
    cases = GREEDY["prompts"]
    steps = GREEDY["greedy_steps"]
    params = [SamplingParams(max_tokens=steps if i == CLI_CASE else max(1, _first_near_tie(c)), temperature=0,
                             ignore_eos=True) for i, c in enumerate(cases)]
    outs = gemma_llm.generate([c["prompt_ids"] for c in cases], params)
    return {c["id"]: o for c, o in zip(cases, outs)}


def _divergences(greedy_outputs):
    """(case id, first differing step, llama.cpp's margin there, the smallest margin before it) for every prompt
    that diverges before its first near-tie step."""
    out = []
    for case in GREEDY["prompts"]:
        got, want = greedy_outputs[case["id"]].token_ids, case["generated_ids"]
        gaps = [s["gap"] for s in case["steps"]]
        stop = _first_near_tie(case)
        assert len(got) >= stop and len(want) == len(gaps), case["id"]
        d = next((i for i, (a, b) in enumerate(zip(got[:stop], want[:stop])) if a != b), None)
        if d is not None:
            out.append((case["id"], d, gaps[d], min(gaps[:d], default=None)))
    return out


def test_greedy_matches_llamacpp_up_to_near_ties(greedy_outputs):
    assert len(GREEDY["prompts"]) >= 10
    bad = _divergences(greedy_outputs)
    assert not bad, bad
    checked = sum(_first_near_tie(c) for c in GREEDY["prompts"])
    assert checked >= 45  # the threshold leaves a comparison (47 of 816 steps; the perplexity tests score 10,000+)


def test_greedy_cli_matches_api(greedy_outputs, default_model):
    import subprocess
    import sys

    case = GREEDY["prompts"][CLI_CASE]
    r = subprocess.run([sys.executable, "-m", "edgellm.cli", "generate", "--prompt", case["text"], "--max-tokens", "48",
                        "--temperature", "0"], capture_output=True, text=True, timeout=scaled(300))
    assert r.returncode == 0, r.stderr
    out = greedy_outputs[case["id"]]
    assert r.stdout.rstrip("\n") == out.text


def _nll_vs_golden(llm, golden):
    """(our perplexity, relative difference from llama.cpp's, our NLL - llama.cpp's per scored token)."""
    from edgellm.perplexity import perplexity

    text = (GOLDEN / golden["text_file"]).read_text()
    res = perplexity(llm, text, n_ctx=golden["n_ctx"])
    assert res.n_tokens == golden["n_scored"] == len(golden["nll"])
    assert math.isclose(res.ppl, math.exp(np.mean(res.nll)), rel_tol=1e-9)
    return res.ppl, abs(res.ppl - golden["ppl"]) / golden["ppl"], np.asarray(res.nll) - np.asarray(golden["nll"])


# The contract (issue 14): perplexity within 0.3% of llama.cpp's, mean |dNLL| <= 0.09 nats. llama.cpp's own builds
# are that far apart per token (tiled vs untiled matmul on one host: 0.081 nats): 8-bit activation codes that sit on
# a rounding boundary flip with the last bit of any upstream sum. Over the 762 tokens of perplexity.txt those
# differences leave the mean NLL a standard error of ~0.004 nats, 0.4% of perplexity: llama.cpp's own AVX2 build is
# 0.37% from its AVX-512 golden there (llamacpp_cross_build.json), and two equally exact attention orders of ours
# 0.05% and 0.48%. So the 0.3% is held on the long text (11938 tokens scored, standard error ~0.0012 nats), where
# both of those orders are within 0.07% of llama.cpp; the short text keeps the per-token bound and a mean within
# three standard errors.
def test_perplexity_matches_llamacpp(gemma_llm):
    text = (GOLDEN / PPL["text_file"]).read_text()
    assert gemma_llm.tokenizer.encode(text, add_bos=True, special=False) == PPL["tokens"]
    ppl, rel, d = _nll_vs_golden(gemma_llm, PPL)
    sem = float(np.std(d) / np.sqrt(len(d)))
    print(f"ppl {ppl:.4f} vs llama.cpp {PPL['ppl']:.4f} (rel {rel:.2e}); mean |dNLL| {np.mean(np.abs(d)):.4f}, "
          f"mean dNLL {np.mean(d):+.4f} (standard error {sem:.4f})")
    assert len(d) >= 500
    assert np.mean(np.abs(d)) <= 0.09
    assert abs(np.mean(d)) <= 3 * sem


def test_long_text_perplexity_matches_llamacpp(gemma_llm):
    ppl, rel, d = _nll_vs_golden(gemma_llm, PPL_LONG)
    print(f"long text: ppl {ppl:.4f} vs llama.cpp {PPL_LONG['ppl']:.4f} (rel {rel:.2e}); mean |dNLL| "
          f"{np.mean(np.abs(d)):.4f}")
    assert len(d) >= 10000
    assert rel <= 0.003
    assert np.mean(np.abs(d)) <= 0.09


@pytest.fixture(scope="module")
def kv_ppl(gemma_llm):
    """Perplexity with f32 KV and with the compact f16 KV (half the memory)."""
    from edgellm import LLM
    from edgellm.perplexity import perplexity

    text = (GOLDEN / PPL["text_file"]).read_text()
    compact = LLM(kv_dtype="f16", progress=False)
    assert compact.engine.kv.nbytes * 2 == gemma_llm.engine.kv.nbytes * compact.ctx_size // gemma_llm.ctx_size
    p32 = perplexity(gemma_llm, text, n_ctx=PPL["n_ctx"]).ppl
    p16 = perplexity(compact, text, n_ctx=PPL["n_ctx"]).ppl
    print(f"ppl f32 KV {p32:.4f}, f16 KV {p16:.4f} ({(p16 - p32) / p32:+.3%})")
    return p32, p16


def test_f16_kv_perplexity_within_half_percent(kv_ppl):
    p32, p16 = kv_ppl
    assert abs(p16 - p32) / p32 <= 0.005
