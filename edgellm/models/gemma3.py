"""Gemma 2 and 3: scaled embeddings, GeGLU, pre- and post-norms around attention and FFN, tied output head,
sliding-window/global layers; Gemma 3 adds QK-norm and a local rope base (5:1 layers), Gemma 2 soft-caps the
attention and final logits (1:1 layers)."""
from __future__ import annotations

import math

import numpy as np

from edgellm.loader import LoadedModel
from edgellm.models.common import CausalLM, ForwardBatch, Weights, attend, linear, linears
from kernels_cpu.ops import geglu, qk_norm_rope, residual_norm, rmsnorm, rope_tables


class Layer:
    def __init__(self, w: Weights, i: int, cfg):
        b = f"blk.{i}."
        self.attn_norm, self.ffn_norm = w.vector(b + "attn_norm.weight"), w.vector(b + "ffn_norm.weight")
        self.post_attn_norm = w.vector(b + "post_attention_norm.weight")
        self.post_ffn_norm = w.vector(b + "post_ffw_norm.weight")
        self.q_norm = w.vector(b + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = w.vector(b + "attn_k_norm.weight") if cfg.qk_norm else None
        self.wq, self.wk, self.wv = (w.matrix(b + f"attn_{x}.weight") for x in "qkv")
        self.wo = w.matrix(b + "attn_output.weight")
        self.gate, self.up, self.down = (w.matrix(b + f"ffn_{x}.weight") for x in ("gate", "up", "down"))


class Model(CausalLM):
    """Gemma 3 forward over a ForwardBatch; weights stay quantized (prepared views of the GGUF memmap)."""

    Layer = Layer

    def __init__(self, loaded: LoadedModel, *, progress: bool = False, ctx_size: int | None = None):
        super().__init__(loaded, progress=progress, ctx_size=ctx_size)
        self.embed_scale = np.float32(math.sqrt(self.cfg.d_model))

    def hidden(self, batch: ForwardBatch, kv) -> np.ndarray:
        """Final-normed hidden states (R, D) of batch.logit_rows; writes this step's K/V into kv."""
        c = self.cfg
        T = len(batch.tokens)
        x = self.embed(batch.tokens) * self.embed_scale  # (T, D)
        ropes = {base: rope_tables(batch.positions, c.head_dim, base, c.rope_scale if base == c.rope_base else 1.0)
                 for base in {c.rope_base, c.rope_base_local}}
        h = rmsnorm(x, self.layers[0].attn_norm, c.rms_eps)
        for i, L in enumerate(self.layers):
            local = c.swa_layers[i]
            cos, sin = ropes[c.rope_base_local if local else c.rope_base]
            q, k, v = linears(h, (L.wq, L.wk, L.wv))
            q = q.reshape(T, c.n_heads, c.head_dim)
            k = k.reshape(T, c.n_kv_heads, c.head_dim)
            v = v.reshape(T, c.n_kv_heads, c.v_head_dim)
            qk_norm_rope(q, k, L.q_norm, L.k_norm, c.rms_eps, (cos, sin), neox=True)  # in place, one call
            a = attend(kv, i, q, k, v, batch, window=c.sliding_window if local else 0,
                       scale=c.attn_scale, softcap=c.attn_softcap)
            # x += post_attn_norm(attention out); h = ffn_norm(x); x += post_ffn_norm(FFN out); h = the next
            # layer's attn_norm(x): one call each (x is this forward's own array, updated in place)
            h = residual_norm(x, linear(a, L.wo), L.post_attn_norm, L.ffn_norm, c.rms_eps)
            f = linear(geglu(*linears(h, (L.gate, L.up))), L.down)
            nxt = self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else None
            h = residual_norm(x, f, L.post_ffn_norm, nxt, c.rms_eps)
        return rmsnorm(x[batch.logit_rows], self.output_norm, c.rms_eps)  # only rows that are sampled
