"""Mixture of experts (edgellm/models/moe.py): routing as llama.cpp's build_moe_ffn computes it, only the routed
experts' weights read, and a row's result independent of the rows beside it. Logits against llama.cpp: the
tiny_qwen3moe golden case in test_golden_tiny.py."""
from __future__ import annotations

import numpy as np
import pytest

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
    from edgellm.models.common import linear
    from kernels_cpu.moe import route

    ffn = llm.model.layers[0].moe
    h = np.random.default_rng(1).standard_normal((3, llm.config.d_model)).astype(np.float32)
    want = ffn(h)
    sel, _ = route(linear(h, ffn.router), ffn.k, norm=ffn.norm)
    unused = sorted(set(range(MOE_EXPERTS)) - set(sel.ravel().tolist()))
    assert unused, "3 tokens x top-2 should leave some of 8 experts unrouted"
    saved = [(m, list(getattr(ffn, m))) for m in ("gate", "up", "down")]
    try:
        for m, mats in saved:
            getattr(ffn, m)[:] = [None if e in unused else x for e, x in enumerate(mats)]  # unreadable
        np.testing.assert_array_equal(ffn(h), want)
    finally:
        for m, mats in saved:
            getattr(ffn, m)[:] = mats


def test_rows_do_not_depend_on_their_batch(llm):
    ffn = llm.model.layers[1].moe
    h = np.random.default_rng(2).standard_normal((9, llm.config.d_model)).astype(np.float32)
    together = ffn(h)
    for t in range(9):
        np.testing.assert_array_equal(ffn(h[t:t + 1])[0], together[t])
