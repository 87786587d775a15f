"""Mixture-of-experts FFN (qwen3moe): a router picks each token's top-k experts by softmax probability, and only
those experts' weights are read. Rows are grouped by expert (one matmul per expert over the rows routed to it), and
each row sums its experts in ascending expert order, so a row's result never depends on the other rows (batch
invariance)."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import linear, linears
from kernels_cpu.moe import route
from kernels_cpu.ops import swiglu


class MoEFFN:
    """The routed experts' SwiGLU FFNs of one layer: router (E, D), per expert gate/up (F, D) and down (D, F)."""

    def __init__(self, w, prefix: str, cfg):
        self.router = w.matrix(prefix + "ffn_gate_inp.weight")
        n = cfg.n_experts
        self.gate = w.experts(prefix + "ffn_gate_exps.weight", n)
        self.up = w.experts(prefix + "ffn_up_exps.weight", n)
        self.down = w.experts(prefix + "ffn_down_exps.weight", n)
        self.k, self.norm = cfg.n_experts_used, cfg.moe_norm_topk

    def expert(self, e: int, x: np.ndarray) -> np.ndarray:
        """Expert e's SwiGLU FFN of rows x (R, D) -> (R, D)."""
        return linear(swiglu(*linears(x, (self.gate[e], self.up[e]))), self.down[e])

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """(T, D) -> (T, D)."""
        sel, wts = route(linear(h, self.router), self.k, norm=self.norm)  # (T, k) each
        if len(h) == 1:  # decode: one row, its experts in ascending id order as in the batched path below
            order = np.argsort(sel[0])
            es = [int(sel[0, j]) for j in order]
            # every expert's gate and up from one quantization of the row (matmul_many shares it)
            gu = linears(h, [m for e in es for m in (self.gate[e], self.up[e])])
            out = np.zeros_like(h)
            for n, (e, j) in enumerate(zip(es, order)):
                out += linear(swiglu(gu[2 * n], gu[2 * n + 1]), self.down[e]) * wts[0, j]
            return out
        out = np.zeros_like(h)
        for e in np.unique(sel):  # ascending expert id: every row adds its experts in the same order
            rows, slot = np.nonzero(sel == e)
            y = self.expert(int(e), np.ascontiguousarray(h[rows]))  # (R, D)
            out[rows] += y * wts[rows, slot][:, None]
        return out
