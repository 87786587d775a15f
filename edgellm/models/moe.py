"""Mixture-of-experts FFN (qwen3moe, gpt-oss): a router picks each token's top-k experts (kernels_cpu.moe's gating
functions), and only those experts' weights are read. The routed experts' FFN after the router's matmul is one
compiled call (kernels_cpu.moe_ffn): the (token, expert) pairs grouped by ascending expert, each of the gate, up and
down projections of all the routed experts one parallel loop, plus each routed row's expert bias where the model
has them (gpt-oss); each token then sums its experts in the order its router picked them (llama.cpp's), so a row's
result never depends on the other rows (batch invariance). `stepwise` is the same computation op by op."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import linear
from kernels_cpu.moe import route
from kernels_cpu.moe_ffn import ExpertFFN


class MoEFFN:
    """The routed experts' gated FFNs of one layer: router (E, D) and `experts` (kernels_cpu.moe_ffn.ExpertFFN:
    stacks gate/up (E, F, D), down (E, D, F)); with cfg.moe_bias also the router bias (E,) and the experts' biases
    gate/up (E, F), down (E, D)."""

    def __init__(self, w, prefix: str, cfg):
        self.router = w.matrix(prefix + "ffn_gate_inp.weight")
        gate, up, down = (w.expert_stack(prefix + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        if not gate.n_experts == up.n_experts == down.n_experts == cfg.n_experts:
            raise ValueError(f"{prefix}: expert tensors disagree with the config's {cfg.n_experts} experts")
        names = ("ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
        self.router_b, gate_b, up_b, down_b = (
            w.vector(prefix + n + ".bias") if cfg.moe_bias else None for n in names)
        self.experts = ExpertFFN(gate, up, down, cfg.n_experts_used, cfg.moe_norm_topk, cfg.moe_gating,
                                 cfg.moe_act, gate_b, up_b, down_b)

    def routes(self, h: np.ndarray):
        """(experts (T, k), weights (T, k)) of the rows h (T, D), each row's experts best first."""
        x = self.experts
        return route(linear(h, self.router, self.router_b), x.k, norm=x.norm, gating=x.gating)

    def __call__(self, h: np.ndarray) -> np.ndarray:
        """(T, D) -> (T, D): the router's matmul, then one compiled call for the experts."""
        return self.experts(h, linear(h, self.router, self.router_b))

    def stepwise(self, h: np.ndarray) -> np.ndarray:
        """The same FFN op by op (ExpertFFN.stepwise): the fused call's reference."""
        return self.experts.stepwise(h, linear(h, self.router, self.router_b))
