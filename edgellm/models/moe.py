"""Mixture-of-experts FFN (qwen3moe): a router picks each token's top-k experts by softmax probability, and only
those experts' weights are read. Rows are grouped by expert (one matmul per expert over the rows routed to it), and
each row sums its experts in ascending expert order, so a row's result never depends on the other rows (batch
invariance)."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import linear, linears
from kernels_cpu.ops import swiglu

WEIGHT_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the routed weights' sum (smallest f16 normal)


def route(logits: np.ndarray, k: int, *, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """Router logits (T, E) -> (experts (T, k) int64, weights (T, k) float32): softmax, top-k by probability
    (ties to the lower expert id), optionally renormalised to sum 1 as llama.cpp's build_moe_ffn does."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z, dtype=np.float32)
    p /= p.sum(axis=1, keepdims=True, dtype=np.float32)
    sel = np.argsort(-p, axis=1, kind="stable")[:, :k]  # (T, k)
    w = np.take_along_axis(p, sel, axis=1)  # (T, k)
    if norm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True, dtype=np.float32), WEIGHT_SUM_MIN)
    return sel, w.astype(np.float32)


class MoEFFN:
    """The routed experts' SwiGLU FFNs of one layer: router (E, D), per expert gate/up (F, D) and down (D, F)."""

    def __init__(self, w, prefix: str, cfg):
        self.router = w.matrix(prefix + "ffn_gate_inp.weight")
        n = cfg.n_experts
        self.gate = w.experts(prefix + "ffn_gate_exps.weight", n)
        self.up = w.experts(prefix + "ffn_up_exps.weight", n)
        self.down = w.experts(prefix + "ffn_down_exps.weight", n)
        self.k, self.norm = cfg.n_experts_used, cfg.moe_norm_topk

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """(T, D) -> (T, D)."""
        sel, wts = route(linear(h, self.router), self.k, norm=self.norm)  # (T, k) each
        out = np.zeros_like(h)
        for e in np.unique(sel):  # ascending expert id: every row adds its experts in the same order
            rows, slot = np.nonzero(sel == e)
            x = np.ascontiguousarray(h[rows])
            y = linear(swiglu(*linears(x, (self.gate[e], self.up[e]))), self.down[e])  # (R, D)
            out[rows] += y * wts[rows, slot][:, None]
        return out
