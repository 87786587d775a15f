"""Llama family (llama, mistral, qwen2 with q/k/v biases, qwen3 with QK-norm): RoPE, GQA, SwiGLU,
optional separate output head."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import CausalLM, ForwardBatch, Weights, attend, linear, linears
from kernels_cpu.ops import apply_rope, rmsnorm, rope_tables, swiglu


class Layer:
    def __init__(self, w: Weights, i: int, cfg):
        b = f"blk.{i}."
        self.attn_norm, self.ffn_norm = w.vector(b + "attn_norm.weight"), w.vector(b + "ffn_norm.weight")
        self.wq, self.wk, self.wv = (w.matrix(b + f"attn_{x}.weight") for x in "qkv")
        self.bq, self.bk, self.bv = (w.vector(b + f"attn_{x}.bias") if cfg.bias else None for x in "qkv")
        self.q_norm = w.vector(b + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w.vector(b + "attn_k_norm.weight") if cfg.qk_norm else None
        self.wo = w.matrix(b + "attn_output.weight")
        self.gate, self.up, self.down = (w.matrix(b + f"ffn_{x}.weight") for x in ("gate", "up", "down"))


class Model(CausalLM):
    """Llama-family forward over a ForwardBatch; weights stay quantized."""

    Layer = Layer

    def hidden(self, batch: ForwardBatch, kv) -> np.ndarray:
        """Final-normed hidden states (R, D) of batch.logit_rows; writes this step's K/V into kv."""
        c = self.cfg
        T = len(batch.tokens)
        x = self.embed(batch.tokens)  # (T, D)
        cos, sin = rope_tables(batch.positions, c.head_dim, c.rope_base, c.rope_scale)
        for i, L in enumerate(self.layers):
            h = rmsnorm(x, L.attn_norm, c.rms_eps)
            q, k, v = linears(h, (L.wq, L.wk, L.wv), (L.bq, L.bk, L.bv))
            q = q.reshape(T, c.n_heads, c.head_dim)
            k = k.reshape(T, c.n_kv_heads, c.head_dim)
            v = v.reshape(T, c.n_kv_heads, c.v_head_dim)
            if L.q_norm is not None:
                q, k = rmsnorm(q, L.q_norm, c.rms_eps), rmsnorm(k, L.k_norm, c.rms_eps)
            apply_rope(q, cos, sin, neox=c.rope_neox)
            apply_rope(k, cos, sin, neox=c.rope_neox)
            a = attend(kv, i, q, k, v, batch, window=c.sliding_window if c.swa_layers[i] else 0,
                       scale=c.attn_scale, softcap=c.attn_softcap)
            x = x + linear(a, L.wo)
            h = rmsnorm(x, L.ffn_norm, c.rms_eps)
            x = x + linear(swiglu(*linears(h, (L.gate, L.up))), L.down)
        return rmsnorm(x[batch.logit_rows], self.output_norm, c.rms_eps)  # only rows that are sampled
