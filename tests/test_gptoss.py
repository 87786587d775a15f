"""gpt-oss (llama.cpp's OPENAI_MOE): its config, its ops (attention sinks in tests/test_kernels_attention_ops.py,
YaRN rope, swiglu_oai, routing by raw logit) against plain references, a float64 NumPy forward of the whole tiny
model, and batch invariance (the MoE layer's rows: tests/test_moe.py). Logits against llama.cpp: the tiny_gptoss
golden cases in test_golden_tiny.py."""
from __future__ import annotations

import math

import numpy as np
import pytest

from tiny_models import GPTOSS_YARN_FACTOR, GPTOSS_YARN_ORIG_CTX, tiny_spec

SPEC = tiny_spec("gpt-oss")
TOKENS = [1, 488, 259, 283, 271, 388, 281, 411, 387, 275, 265, 259, 404, 284, 259, 282, 271, 273, 277, 266, 410,
          451, 465, 259]


@pytest.fixture(scope="module")
def llm(tiny_model):
    from edgellm import LLM

    return LLM(tiny_model("gpt-oss"), ctx_size=64, progress=False)


def test_config(llm):
    c = llm.config
    assert c.arch == "gpt-oss" and c.rope_neox and c.bias and c.out_bias and c.attn_sinks and not c.qk_norm
    assert c.swa_layers == (True, False) and c.sliding_window == SPEC.sliding_window  # llama.cpp: il % 2 < 1
    assert (c.n_experts, c.n_experts_used, c.d_ff_expert) == (SPEC.n_expert, SPEC.n_expert_used, SPEC.expert_ff)
    assert (c.moe_gating, c.moe_act, c.moe_bias, c.moe_norm_topk) == ("softmax_weight", "swiglu_oai", True, False)
    assert c.ffn_norm == "post_attention_norm" and not c.tied_output
    assert c.rope_yarn == (1.0, GPTOSS_YARN_ORIG_CTX, 32.0, 1.0) and c.rope_scale == 1 / GPTOSS_YARN_FACTOR
    assert abs(c.rope_mscale - 1.0) < 1e-6  # get_mscale / (1 + 0.1 ln factor): ggml's rope multiplies it back


def test_swiglu_oai_is_the_clamped_formula():
    from kernels_cpu.ops import swiglu_oai

    rng = np.random.default_rng(0)
    g = (rng.standard_normal((5, 64)) * 6).astype(np.float32)
    u = (rng.standard_normal((5, 64)) * 6).astype(np.float32)
    g[0, :3], u[0, :3] = [9.0, -9.0, 7.0], [-8.0, 8.0, 0.5]
    x = np.minimum(g.astype(np.float64), 7.0)
    want = x / (1 + np.exp(-1.702 * x)) * (np.clip(u.astype(np.float64), -7.0, 7.0) + 1)
    got = swiglu_oai(g, u)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    big = np.tile(g, (40, 1))  # the row-split path gives the same rows
    np.testing.assert_array_equal(swiglu_oai(big, np.tile(u, (40, 1)))[:5], got)


def test_route_softmax_weight_picks_by_logit_then_softmax_over_k():
    from kernels_cpu.moe import route

    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((16, 8)) * 2).astype(np.float32)
    sel, w = route(logits, 4, norm=False, gating="softmax_weight")
    for t in range(16):
        top = list(np.argsort(-logits[t], kind="stable")[:4])
        assert list(sel[t]) == top  # best first, as argsort_top_k gives them
        e = np.exp(logits[t, top].astype(np.float64) - logits[t, top].max())
        np.testing.assert_allclose(w[t], e / e.sum(), rtol=1e-6)
    logits[0] = 0.25
    assert list(route(logits, 4, norm=False, gating="softmax_weight")[0][0]) == [0, 1, 2, 3]  # ties: lower ids


def _yarn_reference(pos, n_dims, base, factor, n_ctx_orig, beta_fast=32.0, beta_slow=1.0):
    """YaRN angles and magnitude in float64 (the LlamaYaRNScaledRotaryEmbedding recipe llama.cpp follows)."""
    def corr(beta):
        return n_dims * math.log(n_ctx_orig / (beta * 2 * math.pi)) / (2 * math.log(base))
    lo, hi = max(0.0, math.floor(corr(beta_fast))), min(n_dims - 1.0, math.ceil(corr(beta_slow)))
    i = np.arange(n_dims // 2)
    extrap = np.asarray(pos, np.float64)[:, None] * base ** (-2.0 * i / n_dims)
    ramp = 1 - np.clip((i - lo) / max(0.001, hi - lo), 0, 1)
    theta = extrap / factor * (1 - ramp) + extrap * ramp
    return theta, 1 + 0.1 * math.log(factor)


def test_yarn_rope_tables():
    from kernels_cpu.ops import rope_tables

    pos = np.array([0, 1, 7, 63, 500, 4000])
    theta, m = _yarn_reference(pos, 64, 150000.0, 32.0, 4096)
    cos, sin = rope_tables(pos, 64, 150000.0, 1 / 32, mscale=1.0, yarn=(1.0, 4096, 32.0, 1.0))
    np.testing.assert_allclose(cos, np.cos(theta) * m, atol=3e-4)
    np.testing.assert_allclose(sin, np.sin(theta) * m, atol=3e-4)
    plain = rope_tables(pos, 64, 150000.0, 1 / 32)  # without yarn: linear interpolation only
    assert not np.allclose(plain[0], cos)


def _rmsnorm(x, w, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def reference_logits(path: str, tokens) -> np.ndarray:
    """The tiny gpt-oss forward in float64 NumPy from the dequantized GGUF tensors: llama.cpp's graph
    (src/models/openai-moe.cpp), written out plainly."""
    from edgellm.gguf_file import read_gguf
    from quant.formats import dequantize

    g = read_gguf(path)

    def t(name):
        ti = g.tensors[name]
        return dequantize(g.read_tensor_copy(name), ti.qtype).reshape(ti.shape).astype(np.float64)

    s, T = SPEC, len(tokens)
    H, KVH, hd, eps = s.n_head, s.n_kv_head, s.head_dim, s.rms_eps
    pos = np.arange(T)
    theta, m = _yarn_reference(pos, hd, s.rope_freq_base, GPTOSS_YARN_FACTOR, GPTOSS_YARN_ORIG_CTX)
    cos, sin = np.cos(theta)[:, None] * m, np.sin(theta)[:, None] * m  # (T, 1, hd/2)

    def rope(x):  # NeoX halves
        a, b = x[..., :hd // 2], x[..., hd // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)

    x = t("token_embd.weight")[tokens]  # (T, D)
    for i in range(s.n_layer):
        p = f"blk.{i}."
        h = _rmsnorm(x, t(p + "attn_norm.weight"), eps)
        q = rope((h @ t(p + "attn_q.weight").T + t(p + "attn_q.bias")).reshape(T, H, hd))
        k = rope((h @ t(p + "attn_k.weight").T + t(p + "attn_k.bias")).reshape(T, KVH, hd))
        v = (h @ t(p + "attn_v.weight").T + t(p + "attn_v.bias")).reshape(T, KVH, hd)
        sinks = t(p + "attn_sinks.weight")
        window = s.sliding_window if i % 2 == 0 else 0
        att = np.zeros((T, H, hd))
        for r in range(T):
            lo = max(0, r - window + 1) if window else 0
            for hh in range(H):
                sc = k[lo:r + 1, hh // (H // KVH)] @ q[r, hh] / math.sqrt(hd)
                mx = max(sc.max(), sinks[hh])
                e = np.exp(sc - mx)
                att[r, hh] = e @ v[lo:r + 1, hh // (H // KVH)] / (e.sum() + math.exp(sinks[hh] - mx))
        x = x + att.reshape(T, -1) @ t(p + "attn_output.weight").T + t(p + "attn_output.bias")
        h = _rmsnorm(x, t(p + "post_attention_norm.weight"), eps)
        logits = h @ t(p + "ffn_gate_inp.weight").T + t(p + "ffn_gate_inp.bias")
        wg, wu, wd = (t(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        bg, bu, bd = (t(p + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down"))
        out = np.zeros_like(x)
        for r in range(T):
            top = np.argsort(-logits[r], kind="stable")[:s.n_expert_used]
            w = np.exp(logits[r, top] - logits[r, top].max())
            w /= w.sum()
            for e, we in zip(top, w):
                gg = np.minimum(h[r] @ wg[e].T + bg[e], 7.0)
                uu = np.clip(h[r] @ wu[e].T + bu[e], -7.0, 7.0)
                out[r] += we * ((gg / (1 + np.exp(-1.702 * gg)) * (uu + 1)) @ wd[e].T + bd[e])
        x = x + out
    return _rmsnorm(x, t("output_norm.weight"), eps) @ t("output.weight").T  # (T, n_vocab)


def test_logits_match_a_float64_numpy_forward(llm):
    want = reference_logits(llm.loaded.path, TOKENS)
    got = llm.logits(TOKENS)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-5, err
    # the sinks, the biases and the sliding window all matter on this model: dropping any one moves the logits
    assert np.abs(want).max() > 1 and SPEC.sliding_window < len(TOKENS)


def test_mxfp4_experts_stay_close_to_the_float_forward(tiny_model):
    from edgellm import LLM

    path = tiny_model("gpt-oss", expert_qtype="MXFP4")
    llm = LLM(path, ctx_size=64, progress=False)
    assert llm.model.layers[0].moe.experts.gate.qtype.name == "MXFP4"
    want = reference_logits(path, TOKENS)  # dequantized experts, float activations
    err = np.abs(llm.logits(TOKENS) - want).max() / np.abs(want).max()
    assert err < 3e-2, err  # edgellm, like llama.cpp, quantizes the experts' activations to q8_0


def test_batch_of_4_equals_alone(llm):
    """Greedy continuations through the engine (sliding-window slots, sinks, routed experts): the same tokens
    for a prompt alone as beside three others."""
    from edgellm import SamplingParams
    from edgellm.engine.engine import Engine

    def engine():
        return Engine(llm.loaded, llm.model, llm.tokenizer, ctx_size=llm.ctx_size, kv_cache_tokens=512)

    def run(eng, prompts):
        reqs = [eng.add_request(p, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)) for p in prompts]
        while eng.has_work() or not all(r.finished for r in reqs):
            eng.step()
        eng.step()  # reap
        return [r.output().token_ids for r in reqs]

    rng = np.random.default_rng(0)
    prompts = [[1] + rng.integers(3, 500, int(rng.integers(3, 30))).tolist() for _ in range(4)]
    together = run(engine(), prompts)
    assert together == [run(engine(), [p])[0] for p in prompts]
