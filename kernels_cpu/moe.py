"""Mixture-of-experts routing kernels, one per gating function of llama.cpp's build_moe_ffn (GATINGS):
"softmax" (qwen3moe): softmax over each row's router logits, the top-k experts by probability; "softmax_weight"
(gpt-oss): the top-k experts by raw logit, then a softmax over those k. Ties go to the lower expert id; the
weights are optionally renormalised to sum 1. group_by_expert orders the picks for the expert matmuls, combine sums
each token's expert outputs in its router's order. One compiled call replaces a dozen small NumPy operations per
layer in decode."""
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
def _group(tok, eid, starts, wr, pos, sel, w, E):
    # counting sort of the (token, expert) pairs of sel (T, k) by expert, stable in token order:
    # tok (R,) / wr (R,) per pair, eid (J,) the routed experts ascending, starts (J+1,), pos (T, k) the row of
    # each pick in that order; returns J
    T, k = sel.shape
    count = np.zeros(E + 1, dtype=np.int64)
    for t in range(T):
        for j in range(k):
            count[sel[t, j] + 1] += 1
    J = 0
    for e in range(E):
        if count[e + 1]:
            eid[J] = e
            starts[J] = count[e]
            J += 1
        count[e + 1] += count[e]  # now count[e + 1]: pairs of experts <= e
    starts[J] = T * k
    for t in range(T):
        for j in range(k):
            e = sel[t, j]
            r = count[e]
            count[e] = r + 1
            tok[r] = t
            wr[r] = w[t, j]
            pos[t, j] = r
    return J


group_kernel = _group  # compiled (tok, eid, starts, wr, pos, sel, w, E) -> J, for compiled callers (moe_ffn)


def group_by_expert(sel: np.ndarray, w: np.ndarray, n_experts: int):
    """The routed pairs of sel / w (T, k) grouped by ascending expert, each group in token order:
    (tok (R,) each pair's token, eid (J,) the experts used, starts (J+1,): expert eid[j] has pairs
    starts[j]:starts[j+1], w (R,) each pair's weight, pos (T, k) the row of each token's pick), R = T * k."""
    sel = np.ascontiguousarray(sel, dtype=np.int64)
    if sel.ndim != 2 or w.shape != sel.shape or (sel.size and (sel.min() < 0 or sel.max() >= n_experts)):
        raise ValueError(f"group_by_expert: selection {sel.shape} of experts outside 0..{n_experts - 1}")
    R = sel.size
    tok, wr = np.empty(R, np.int64), np.empty(R, np.float32)
    eid, starts = np.empty(n_experts, np.int64), np.empty(n_experts + 1, np.int64)
    pos = np.empty(sel.shape, np.int64)
    J = _group(tok, eid, starts, wr, pos, sel, np.ascontiguousarray(w, dtype=np.float32), n_experts)
    return tok, eid[:J], starts[:J + 1], wr, pos


@jit
def _combine(out, y, w, pos):
    # out (T, D) float32 += y[pos[t, j]] * w[t, j] for each token t, its picks j in order
    T, k = pos.shape
    D = out.shape[1]
    for t in range(T):
        for j in range(k):
            r = pos[t, j]
            wr = w[t, j]
            for d in range(D):
                out[t, d] += y[r, d] * wr


combine_kernel = _combine  # compiled (out, y, w, pos), for compiled callers (moe_ffn)


def combine(out: np.ndarray, y: np.ndarray, w: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """out (T, D) += the expert outputs y (R, D) weighted by w (T, k): token t adds row pos[t, j] of y times
    w[t, j] for j = 0, 1, ... in turn, its router's order (llama.cpp sums the picks so), so a token's sum never
    depends on the batch."""
    R, D = y.shape
    pos = np.ascontiguousarray(pos, dtype=np.int64)
    if out.shape[1] != D or np.shape(w) != pos.shape or pos.shape[0] != len(out) or \
            (pos.size and (pos.min() < 0 or pos.max() >= R)):
        raise ValueError(f"combine: out {out.shape}, y {y.shape}, w {np.shape(w)}, pos {pos.shape}")
    _combine(out, np.ascontiguousarray(y, dtype=np.float32), np.ascontiguousarray(w, dtype=np.float32), pos)
    return out
