"""Mixture-of-experts routing kernels, one per gating function of llama.cpp's build_moe_ffn (GATINGS):
"softmax" (qwen3moe): softmax over each row's router logits, the top-k experts by probability; "softmax_weight"
(gpt-oss): the top-k experts by raw logit, then a softmax over those k. Ties go to the lower expert id; the
weights are optionally renormalised to sum 1. One compiled call replaces a dozen small NumPy operations per layer
in decode."""
from __future__ import annotations

import math

import numpy as np

from kernels_cpu._jit import jit

WEIGHT_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the routed weights' sum (smallest f16 normal)


@jit
def _route(sel, w, logits, norm, floor):
    # sel (T, k) int64, w (T, k) float32 out; logits (T, E) float32
    T, E = logits.shape
    k = sel.shape[1]
    p = np.empty(E, dtype=np.float32)
    for t in range(T):
        mx = logits[t, 0]
        for e in range(1, E):
            mx = max(mx, logits[t, e])
        s = np.float32(0.0)
        for e in range(E):
            p[e] = math.exp(logits[t, e] - mx)
            s += p[e]
        for e in range(E):
            p[e] = p[e] / s
        tot = np.float32(0.0)
        for j in range(k):  # selection: k passes, each the largest probability not taken (lowest id on ties)
            best = -1
            for e in range(E):
                if p[e] >= 0 and (best < 0 or p[e] > p[best]):
                    best = e
            sel[t, j] = best
            w[t, j] = p[best]
            tot += p[best]
            p[best] = -1.0
        if norm:
            tot = max(tot, floor)
            for j in range(k):
                w[t, j] = w[t, j] / tot


@jit
def _route_softmax_weight(sel, w, logits, norm, floor):
    # sel (T, k) int64, w (T, k) float32 out; logits (T, E) float32. argsort_top_k of the logits (descending),
    # then ggml_soft_max of the k picked values: max, e = expf(x - max) summed in double, e * (float)(1 / sum)
    # (libm expf: ggml's vector expf only runs on 16 values or more, so this is its result for k < 16)
    T, E = logits.shape
    k = sel.shape[1]
    taken = np.zeros(E, dtype=np.bool_)
    for t in range(T):
        taken[:] = False
        for j in range(k):
            best = -1
            for e in range(E):
                if not taken[e] and (best < 0 or logits[t, e] > logits[t, best]):
                    best = e
            sel[t, j] = best
            w[t, j] = logits[t, best]
            taken[best] = True
        mx = w[t, 0]
        for j in range(1, k):
            mx = max(mx, w[t, j])
        s = 0.0
        for j in range(k):
            w[t, j] = np.float32(math.exp(w[t, j] - mx))
            s += np.float64(w[t, j])
        inv = np.float32(1.0 / s)
        tot = np.float32(0.0)
        for j in range(k):
            w[t, j] = w[t, j] * inv
            tot += w[t, j]
        if norm:
            tot = max(tot, floor)
            for j in range(k):
                w[t, j] = w[t, j] / tot


GATINGS = {"softmax": _route, "softmax_weight": _route_softmax_weight}  # llama.cpp's expert gating functions


def route(logits: np.ndarray, k: int, *, norm: bool, gating: str = "softmax") -> tuple[np.ndarray, np.ndarray]:
    """Router logits (T, E) -> (experts (T, k) int64, weights (T, k) float32), each row's experts in the order
    llama.cpp picks them (best first). gating: a key of GATINGS."""
    logits = np.ascontiguousarray(logits, dtype=np.float32)
    if not 0 < k <= logits.shape[1]:
        raise ValueError(f"top-{k} of {logits.shape[1]} experts")
    sel = np.empty((logits.shape[0], k), dtype=np.int64)
    w = np.empty((logits.shape[0], k), dtype=np.float32)
    GATINGS[gating](sel, w, logits, norm, WEIGHT_SUM_MIN)
    return sel, w


@jit
def _combine(out, y, w, tok, rows):
    # out (T, D) float32 += y[rows[r]] * w[r] into row tok[r], for r in order
    D = out.shape[1]
    for r in range(len(tok)):
        t = tok[r]
        yr = rows[r]
        wr = w[r]
        for d in range(D):
            out[t, d] += y[yr, d] * wr


def combine(out: np.ndarray, y: np.ndarray, w: np.ndarray, tok: np.ndarray, rows: np.ndarray | None = None
            ) -> np.ndarray:
    """out (T, D) += the expert outputs y (R, D) weighted by w (R,): for r in order, row rows[r] of y (default: r)
    into token tok[r] (callers fix each token's order of its experts, so its sum never depends on the batch)."""
    R, D = y.shape
    tok = np.ascontiguousarray(tok, dtype=np.int64)
    rows = np.arange(R, dtype=np.int64) if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    if out.shape[1] != D or len(w) != R or len(tok) != R or (R and (tok.min() < 0 or tok.max() >= len(out))) \
            or len(rows) != R or (R and (rows.min() < 0 or rows.max() >= R)):
        raise ValueError(f"combine: out {out.shape}, y {y.shape}, w {np.shape(w)}, tok {tok.shape}, rows {rows.shape}")
    _combine(out, np.ascontiguousarray(y, dtype=np.float32), np.ascontiguousarray(w, dtype=np.float32), tok, rows)
    return out
