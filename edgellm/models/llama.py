"""Llama family (llama, mistral, qwen2 with q/k/v biases, qwen3 with QK-norm, qwen3moe with routed experts
(models/moe.py), smollm3 with NoPE layers, phi3 with fused attn_qkv / gate+up, partial rotary and LongRoPE
factors, gpt-oss with q/k/v/o biases, attention sinks, alternating sliding-window layers, YaRN and biased routed
experts): RoPE, GQA, SwiGLU, optional separate output head."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import CausalLM, ForwardBatch, Weights, attend, linear, linears
from edgellm.models.moe import MoEFFN
from kernels_cpu.ops import qk_norm_rope, residual_norm, rmsnorm, rope_tables, swiglu


class Layer:
    def __init__(self, w: Weights, i: int, cfg):
        b = f"blk.{i}."
        self.attn_norm, self.ffn_norm = w.vector(b + "attn_norm.weight"), w.vector(b + f"{cfg.ffn_norm}.weight")
        q, k = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        if cfg.fused_qkv:  # one matmul, split at the q / k / v boundaries
            self.qkv, self.split = (w.matrix(b + "attn_qkv.weight"),), (q, q + k)
        else:
            self.qkv, self.split = tuple(w.matrix(b + f"attn_{x}.weight") for x in "qkv"), None
        self.bias = tuple(w.vector(b + f"attn_{x}.bias") if cfg.bias else None for x in "qkv")
        self.q_norm = w.vector(b + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w.vector(b + "attn_k_norm.weight") if cfg.qk_norm else None
        self.wo = w.matrix(b + "attn_output.weight")
        self.wo_b = w.vector(b + "attn_output.bias") if cfg.out_bias else None
        self.sinks = w.vector(b + "attn_sinks.weight") if cfg.attn_sinks else None  # (H,)
        self.moe = MoEFFN(w, b, cfg) if cfg.n_experts else None
        if self.moe is None:  # fused: ffn_up holds [gate; up] (ggml_swiglu of the stacked rows)
            self.gate_up = (w.matrix(b + "ffn_up.weight"),) if cfg.fused_up else \
                (w.matrix(b + "ffn_gate.weight"), w.matrix(b + "ffn_up.weight"))
            self.down = w.matrix(b + "ffn_down.weight")

    def qkv_proj(self, h: np.ndarray) -> list[np.ndarray]:
        """(T, D) -> [q (T, H*hd), k (T, KVH*hd), v (T, KVH*vd)]."""
        if self.split is None:
            return linears(h, self.qkv, self.bias)
        return [np.ascontiguousarray(y) for y in np.split(linear(h, self.qkv[0]), self.split, axis=1)]

    def ffn(self, h: np.ndarray) -> np.ndarray:
        if self.moe is not None:
            return self.moe(h)
        gu = linears(h, self.gate_up)
        if len(gu) == 1:
            gu = [np.ascontiguousarray(y) for y in np.split(gu[0], 2, axis=1)]
        return linear(swiglu(*gu), self.down)


def uses_long_factors(cfg, ctx_size: int | None) -> bool:
    """LongRoPE: llama.cpp takes the long factors when its context, padded up to a multiple of 256 (as
    llama_context pads n_ctx), exceeds the original training context."""
    ctx = ctx_size or cfg.n_ctx_train
    return -(-ctx // 256) * 256 > cfg.rope_ctx_orig


class Model(CausalLM):
    """Llama-family forward over a ForwardBatch; weights stay quantized."""

    Layer = Layer

    def __init__(self, loaded, *, progress: bool = False, ctx_size: int | None = None):
        super().__init__(loaded, progress=progress, ctx_size=ctx_size)
        c = self.cfg
        self.rope_factors = None
        if c.rope_factors:
            self.rope_factors = self.weights.vector(c.rope_factors[int(uses_long_factors(c, ctx_size))])

    def hidden(self, batch: ForwardBatch, kv) -> np.ndarray:
        """Final-normed hidden states (R, D) of batch.logit_rows; writes this step's K/V into kv."""
        c = self.cfg
        T = len(batch.tokens)
        rot = c.n_rot or c.head_dim
        x = self.embed(batch.tokens)  # (T, D)
        cos, sin = rope_tables(batch.positions, rot, c.rope_base, c.rope_scale, factors=self.rope_factors,
                               mscale=c.rope_mscale, yarn=c.rope_yarn)
        h = rmsnorm(x, self.layers[0].attn_norm, c.rms_eps)
        for i, L in enumerate(self.layers):
            q, k, v = L.qkv_proj(h)
            q = q.reshape(T, c.n_heads, c.head_dim)
            k = k.reshape(T, c.n_kv_heads, c.head_dim)
            v = v.reshape(T, c.n_kv_heads, c.v_head_dim)
            rope = not c.rope_layers or c.rope_layers[i]
            if rope or L.q_norm is not None:  # in place, one call; partial rotary: the first `rot` dims turn
                qk_norm_rope(q, k, L.q_norm, L.k_norm, c.rms_eps, (cos, sin) if rope else None, neox=c.rope_neox)
            a = attend(kv, i, q, k, v, batch, window=c.sliding_window if c.swa_layers[i] else 0,
                       scale=c.attn_scale, softcap=c.attn_softcap, sinks=L.sinks)
            # x += attention out; h = ffn_norm(x); x += FFN out; h = the next layer's attn_norm(x): one call each
            # (x is this forward's own array, updated in place)
            h = residual_norm(x, linear(a, L.wo, L.wo_b), None, L.ffn_norm, c.rms_eps)
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
            h = residual_norm(x, L.ffn(h), None, nxt, c.rms_eps)
        return rmsnorm(x[batch.logit_rows], self.output_norm, c.rms_eps)  # only rows that are sampled
