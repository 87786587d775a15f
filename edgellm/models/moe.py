"""Mixture-of-experts FFN (qwen3moe, gpt-oss): a router picks each token's top-k experts (kernels_cpu.moe's gating
functions), and only those experts' weights are read. The (token, expert) pairs are grouped by ascending expert,
and each of the gate, up and down projections of all the routed experts is one compiled call
(kernels_cpu.moe_matmul), plus each routed row's expert bias where the model has them (gpt-oss); each token then
sums its experts in the order its router picked them (llama.cpp's), so a row's result never depends on the other
rows (batch invariance)."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import linear
from kernels_cpu.moe import combine, group_by_expert, route
from kernels_cpu.moe_matmul import expert_inputs, expert_matmul
from kernels_cpu.ops import swiglu, swiglu_oai

ACTIVATIONS = {"swiglu": swiglu, "swiglu_oai": swiglu_oai}  # (gate (R, F), up (R, F)) -> (R, F)


class MoEFFN:
    """The routed experts' gated FFNs of one layer: router (E, D), expert stacks gate/up (E, F, D), down (E, D, F);
    with cfg.moe_bias also the router bias (E,) and the experts' biases gate/up (E, F), down (E, D)."""

    def __init__(self, w, prefix: str, cfg):
        self.router = w.matrix(prefix + "ffn_gate_inp.weight")
        self.gate = w.expert_stack(prefix + "ffn_gate_exps.weight")
        self.up = w.expert_stack(prefix + "ffn_up_exps.weight")
        self.down = w.expert_stack(prefix + "ffn_down_exps.weight")
        if not self.gate.n_experts == self.up.n_experts == self.down.n_experts == cfg.n_experts:
            raise ValueError(f"{prefix}: expert tensors disagree with the config's {cfg.n_experts} experts")
        self.k, self.norm, self.gating = cfg.n_experts_used, cfg.moe_norm_topk, cfg.moe_gating
        self.act = ACTIVATIONS[cfg.moe_act]
        names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        self.router_b, self.gate_b, self.up_b, self.down_b = (
            w.vector(prefix + n + ".bias") if cfg.moe_bias else None for n in names)

    def routes(self, h: np.ndarray):
        """(experts (T, k), weights (T, k)) of the rows h (T, D), each row's experts best first."""
        return route(linear(h, self.router, self.router_b), self.k, norm=self.norm, gating=self.gating)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """(T, D) -> (T, D)."""
        sel, wts = self.routes(h)  # (T, k) each
        # pairs by ascending expert, then token: tok (R,), the routed experts eid (J,), job j = pairs
        # starts[j]:starts[j+1] (J+1,); pos (T, k): the row of each token's pick
        tok, eid, starts, _, pos = group_by_expert(sel, wts, self.gate.n_experts)
        row_eid = np.repeat(eid, np.diff(starts)) if self.gate_b is not None else None  # (R,) each row's expert
        act = expert_inputs(h, self.gate, tok)
        gate = _biased(expert_matmul(act, self.gate, eid, starts), self.gate_b, row_eid)  # (R, F)
        if self.up.qtype != self.gate.qtype:
            act = expert_inputs(h, self.up, tok)
        up = _biased(expert_matmul(act, self.up, eid, starts), self.up_b, row_eid)  # (R, F)
        y = expert_matmul(expert_inputs(self.act(gate, up), self.down), self.down, eid, starts)  # (R, D)
        y = _biased(y, self.down_b, row_eid)
        return combine(np.zeros_like(h), y, wts, pos)


def _biased(y: np.ndarray, bias: np.ndarray | None, row_eid: np.ndarray) -> np.ndarray:
    """y (R, N) plus each row's expert bias (ggml_add_id), in place; bias (E, N) or None."""
    if bias is not None:
        y += bias[row_eid]
    return y
