"""Mixture-of-experts FFN (qwen3moe): a router picks each token's top-k experts by softmax probability, and only
those experts' weights are read. The (token, expert) pairs are grouped by ascending expert, and each of the gate,
up and down projections of all the routed experts is one compiled call (kernels_cpu.moe_matmul); each token then
sums its experts in ascending expert order, so a row's result never depends on the other rows (batch
invariance)."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import linear
from kernels_cpu.moe import combine, group_by_expert, route
from kernels_cpu.moe_matmul import expert_inputs, expert_matmul
from kernels_cpu.ops import swiglu


class MoEFFN:
    """The routed experts' SwiGLU FFNs of one layer: router (E, D), expert stacks gate/up (E, F, D), down (E, D, F)."""

    def __init__(self, w, prefix: str, cfg):
        self.router = w.matrix(prefix + "ffn_gate_inp.weight")
        self.gate = w.expert_stack(prefix + "ffn_gate_exps.weight")
        self.up = w.expert_stack(prefix + "ffn_up_exps.weight")
        self.down = w.expert_stack(prefix + "ffn_down_exps.weight")
        if not self.gate.n_experts == self.up.n_experts == self.down.n_experts == cfg.n_experts:
            raise ValueError(f"{prefix}: expert tensors disagree with the config's {cfg.n_experts} experts")
        self.k, self.norm = cfg.n_experts_used, cfg.moe_norm_topk

    def routes(self, h: np.ndarray):
        """(experts (T, k), weights (T, k)) of the rows h (T, D)."""
        return route(linear(h, self.router), self.k, norm=self.norm)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """(T, D) -> (T, D)."""
        sel, wts = self.routes(h)  # (T, k) each
        # pairs by ascending expert, then token: tok (R,), the routed experts eid (J,), job j = pairs
        # starts[j]:starts[j+1] (J+1,), each pair's weight w (R,)
        tok, eid, starts, w = group_by_expert(sel, wts, self.gate.n_experts)
        act = expert_inputs(h, self.gate, tok)
        gate = expert_matmul(act, self.gate, eid, starts)  # (R, F)
        if self.up.qtype != self.gate.qtype:
            act = expert_inputs(h, self.up, tok)
        up = expert_matmul(act, self.up, eid, starts)  # (R, F)
        y = expert_matmul(expert_inputs(swiglu(gate, up), self.down), self.down, eid, starts)  # (R, D)
        return combine(np.zeros_like(h), y, w, tok)
