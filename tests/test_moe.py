"""Mixture of experts (edgellm/models/moe.py): routing as llama.cpp's build_moe_ffn computes it, only the routed
experts' weights read, and a row's result independent of the rows beside it. Logits against llama.cpp: the
tiny_qwen3moe golden case in test_golden_tiny.py."""
from __future__ import annotations

import numpy as np
import pytest

from kernels_cpu.ops import swiglu
from tiny_models import tiny_spec, write_tiny_model

SPEC = tiny_spec("qwen3moe")
MOE_EXPERTS, MOE_USED = SPEC.n_expert, SPEC.n_expert_used


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from edgellm import LLM

    path = write_tiny_model(tmp_path_factory.mktemp("moe") / "moe.gguf", "qwen3moe")
    return LLM(str(path), ctx_size=64, progress=False)


def test_config_reads_the_experts(llm):
    c = llm.config
    assert (c.n_experts, c.n_experts_used, c.d_ff_expert, c.moe_norm_topk) == (MOE_EXPERTS, MOE_USED, 128, True)


def test_route_matches_a_plain_reference():
    from kernels_cpu.moe import route

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((32, 8)).astype(np.float32) * 2
    sel, w = route(logits, 2, norm=True)
    for t in range(32):
        p = np.exp(logits[t].astype(np.float64) - logits[t].max())
        p /= p.sum()
        top = sorted(range(8), key=lambda e: -p[e])[:2]
        assert list(sel[t]) == top
        np.testing.assert_allclose(w[t], p[top] / p[top].sum(), rtol=1e-6)
    logits[0, :] = 0.5  # a tie everywhere: the lowest ids win
    assert list(route(logits, 3, norm=True)[0][0]) == [0, 1, 2]
    _, raw = route(logits, 2, norm=False)
    assert not np.allclose(raw.sum(1), 1.0)  # without renormalising the top-2 keep their softmax mass


def test_only_routed_experts_are_read(llm):
    from kernels_cpu.moe_matmul import ExpertStack

    ffn = llm.model.layers[0].moe
    h = np.random.default_rng(1).standard_normal((3, llm.config.d_model)).astype(np.float32)
    want = ffn(h)
    sel, _ = ffn.routes(h)
    unused = sorted(set(range(MOE_EXPERTS)) - set(sel.ravel().tolist()))
    assert unused, "3 tokens x top-2 should leave some of 8 experts unrouted"
    saved = {m: getattr(ffn.experts, m) for m in ("gate", "up", "down")}
    try:
        rng = np.random.default_rng(7)
        for m, st in saved.items():  # the unrouted experts' codes and scales replaced by noise
            qs, sc = st.qs.copy(), st.sc.copy()
            qs[unused] = rng.integers(0, 256, qs[unused].shape, dtype=np.uint8)
            sc[unused] = rng.integers(0, 256, sc[unused].shape).astype(sc.dtype)
            setattr(ffn.experts, m, ExpertStack(st.qtype, st.shape, qs, sc, st.raw))
        np.testing.assert_array_equal(ffn(h), want)
        used = sorted(set(sel.ravel().tolist()))
        st = ffn.experts.gate  # and noise in a routed expert does change the output (the check above can fail)
        qs = st.qs.copy()
        qs[used[0]] = rng.integers(0, 256, qs[used[0]].shape, dtype=np.uint8)
        ffn.experts.gate = ExpertStack(st.qtype, st.shape, qs, st.sc, st.raw)
        assert not np.array_equal(ffn(h), want)
    finally:
        for m, st in saved.items():
            setattr(ffn.experts, m, st)


def test_group_by_expert_matches_a_stable_sort():
    from kernels_cpu.moe import group_by_expert

    rng = np.random.default_rng(1)
    for T, k, E in ((1, 2, 8), (7, 2, 8), (33, 4, 48), (0, 2, 8)):
        sel = np.array([rng.permutation(E)[:k] for _ in range(T)], dtype=np.int64).reshape(T, k)
        w = rng.random((T, k)).astype(np.float32)
        order = np.argsort(sel.ravel(), kind="stable")
        eid, first = np.unique(sel.ravel()[order], return_index=True)
        tok, eid2, starts, wr, pos = group_by_expert(sel, w, E)
        np.testing.assert_array_equal(tok, order // k)
        np.testing.assert_array_equal(order[pos.ravel()], np.arange(T * k))  # each pick's row
        np.testing.assert_array_equal(eid2, eid)
        np.testing.assert_array_equal(starts, np.append(first, T * k))
        np.testing.assert_array_equal(wr, w.ravel()[order])
    with pytest.raises(ValueError, match="outside"):
        group_by_expert(np.array([[0, 8]]), np.ones((1, 2), np.float32), 8)


def test_expert_matmul_rejects_bad_jobs(llm):
    from kernels_cpu.moe_matmul import expert_inputs, expert_matmul

    ffn = llm.model.layers[1].moe
    act = expert_inputs(np.ones((3, llm.config.d_model), np.float32), ffn.experts.gate)
    for eid, starts, msg in (([0, 1], [0, 2, 2, 3], "starts"), ([0, 1], [0, 2, 1], "starts"),
                             ([0, 1], [0, 1, 2], "starts"), ([0, MOE_EXPERTS], [0, 1, 3], "outside")):
        with pytest.raises(ValueError, match=msg):
            expert_matmul(act, ffn.experts.gate, np.array(eid), np.array(starts))


def test_fused_expert_calls_equal_one_matmul_per_expert(llm):
    """The one-call-per-projection path equals the plain per-expert matmuls, bit for bit."""
    from edgellm.models.common import linear, linears

    ffn = llm.model.layers[1].moe
    h = np.random.default_rng(3).standard_normal((5, llm.config.d_model)).astype(np.float32)
    sel, wts = ffn.routes(h)
    want = np.zeros_like(h)
    for e in np.unique(sel):  # ascending expert id
        rows, slot = np.nonzero(sel == e)
        x = np.ascontiguousarray(h[rows])
        g, u = linears(x, (ffn.experts.gate.experts[e], ffn.experts.up.experts[e]))
        want[rows] += linear(swiglu(g, u), ffn.experts.down.experts[e]) * wts[rows, slot][:, None]
    np.testing.assert_array_equal(ffn(h), want)


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss"])
def test_rows_do_not_depend_on_their_batch(arch, tiny_model):
    from edgellm import LLM

    llm = LLM(tiny_model(arch), ctx_size=64, progress=False)
    ffn = llm.model.layers[1].moe
    h = np.random.default_rng(2).standard_normal((9, llm.config.d_model)).astype(np.float32)
    together = ffn(h)
    for t in range(9):
        np.testing.assert_array_equal(ffn(h[t:t + 1])[0], together[t])


# expert formats of the fused call (each case compiles its own copy): k-quants (int8 quads on x86); gate Q8_0
# (int16 activations, or int8 for its quads where vpdpbusd exists), up Q4_1 (Q8_1 block sums: other activations than the gate's),
# down F16 (float activations); MXFP4 with biases, swiglu_oai and gpt-oss's gating
FUSED_CASES = [(("Q4_K", "Q4_K", "Q6_K"), False), (("Q8_0", "Q4_1", "F16"), False), (("MXFP4", "MXFP4", "MXFP4"), True)]


def _stack(qt, n, k, E, rng):
    from kernels_cpu import prepare_weight
    from kernels_cpu.moe_matmul import ExpertStack
    from quant.types import QuantType
    from test_kernels_matmul import random_weight

    q = QuantType[qt]
    return ExpertStack.from_weights([prepare_weight(random_weight(q, n, k, rng), q, (n, k)) for _ in range(E)])


@pytest.mark.parametrize("formats,biased", FUSED_CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else
                         ("biased" if v else "plain"))
def test_fused_ffn_equals_stepwise(formats, biased):
    """kernels_cpu.moe_ffn's one call equals the op-by-op path bit for bit, for 1..9 rows, on 1 and 2 threads
    (serial copy / prange twin), and a row's result does not depend on the rows beside it."""
    from kernels_cpu import parallel
    from kernels_cpu.moe_ffn import ExpertFFN

    rng = np.random.default_rng(5)
    E, D, F, k = 8, 256, 256, 3
    g, u, d = _stack(formats[0], F, D, E, rng), _stack(formats[1], F, D, E, rng), _stack(formats[2], D, F, E, rng)
    bias = [rng.standard_normal(s).astype(np.float32) for s in ((E, F), (E, F), (E, D))] if biased else [None] * 3
    act, gating = ("swiglu_oai", "softmax_weight") if biased else ("swiglu", "softmax")
    ffn = ExpertFFN(g, u, d, k, not biased, gating, act, *bias)
    h = rng.standard_normal((9, D)).astype(np.float32)
    logits = rng.standard_normal((9, E)).astype(np.float32)
    before = parallel.get_threads()
    try:
        for threads in (1, 2):
            parallel.set_threads(threads)
            together = ffn(h, logits)
            np.testing.assert_array_equal(together, ffn.stepwise(h, logits))
            assert np.abs(together).max() > 0
            for T in (1, 2, 5):
                np.testing.assert_array_equal(ffn(h[:T], logits[:T]), together[:T])
            np.testing.assert_array_equal(ffn(h[4:5], logits[4:5])[0], together[4])
    finally:
        parallel.set_threads(before)


def test_fused_ffn_rejects_bad_input():
    from kernels_cpu.moe_ffn import ExpertFFN

    rng = np.random.default_rng(6)
    g, u, d = _stack("Q8_0", 64, 128, 4, rng), _stack("Q8_0", 64, 128, 4, rng), _stack("Q8_0", 128, 64, 4, rng)
    with pytest.raises(ValueError, match="one FFN"):
        ExpertFFN(g, u, g, 2, True)
    with pytest.raises(ValueError, match="top-5"):
        ExpertFFN(g, u, d, 5, True)
    ffn = ExpertFFN(g, u, d, 2, True)
    with pytest.raises(ValueError, match="logits"):
        ffn(np.ones((3, 128), np.float32), np.ones((3, 5), np.float32))
    with pytest.raises(ValueError, match="logits"):
        ffn(np.ones((3, 64), np.float32), np.ones((3, 4), np.float32))
    assert ffn(np.ones((0, 128), np.float32), np.ones((0, 4), np.float32)).shape == (0, 128)
