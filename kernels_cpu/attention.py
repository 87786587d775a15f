"""Paged attention (prefill and decode in one kernel): GQA/MQA, causal, sliding window, soft-cap.

K/V live in blocks: kcache[block, slot_in_block, kv_head, :]. Each query row knows its sequence (block
table) and its position; it attends to positions [lo, pos] of its own sequence. Each (row, head) is
computed independently in a fixed order, so a row's result does not depend on its batch neighbours.
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from kernels_cpu._jit import fast_jit
from kernels_cpu.parallel import parallel_for


@intrinsic
def _f16_bits_to_f32(typingctx, bits):
    """int16 holding IEEE half bits -> float32 (LLVM fpext; F16C vcvtph2ps on x86)."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.int16), codegen


@intrinsic
def _bitcast_f32(typingctx, bits):
    """uint32 bits -> float32 (LLVM bitcast; vectorizes)."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


def kv_value(x):
    """A cached K/V element as float32: float32 as is; f16 (int16 bits) and bf16 (uint16 bits) widened."""
    raise NotImplementedError  # only used inside jitted code


@overload(kv_value)
def _kv_value(x):
    if x == types.int16:  # f16 bits
        return lambda x: _f16_bits_to_f32(x)
    if x == types.uint16:  # bf16 bits
        return lambda x: _bitcast_f32(np.uint32(x) << np.uint32(16))
    return lambda x: x


@fast_jit  # fastmath: vectorized dot products; the order is still fixed per (row, head), so rows stay batch-invariant
def _paged_attention(out, q, kcache, vcache, positions, row_seq, block_tables, window, scale, softcap,
                     job_lo, job_hi, s):
    # out: (T, H, vd)  q: (T, H, hd)  kcache: (NB, BS, KVH, hd)  vcache: (NB, BS, KVH, vd)
    # positions, row_seq: (T,)  block_tables: (S, MB)  s: (max_ctx,) float32 scratch of this worker
    # jobs [job_lo, job_hi) of the T * H (row, head) pairs
    T, H, hd = q.shape
    BS, KVH, vd = kcache.shape[1], kcache.shape[2], vcache.shape[3]
    group = H // KVH
    for job in range(job_lo, job_hi):
        t = job // H
        h = job % H
        kh = h // group
        pos = positions[t]
        bt = block_tables[row_seq[t]]
        lo = 0
        if window > 0 and pos - window + 1 > 0:
            lo = pos - window + 1
        m = -np.inf
        for p in range(lo, pos + 1):
            blk = bt[p // BS]
            off = p % BS
            acc = np.float32(0.0)
            for d in range(hd):
                acc += q[t, h, d] * kv_value(kcache[blk, off, kh, d])
            x = acc * scale
            if softcap > 0:
                x = softcap * math.tanh(x / softcap)
            s[p - lo] = x
            if x > m:
                m = x
        total = np.float32(0.0)
        for i in range(pos + 1 - lo):
            e = np.float32(math.exp(s[i] - m))
            s[i] = e
            total += e
        o = out[t, h]
        o[:] = 0.0
        for p in range(lo, pos + 1):
            blk = bt[p // BS]
            off = p % BS
            w = s[p - lo]
            for d in range(vd):
                o[d] += w * kv_value(vcache[blk, off, kh, d])
        inv = np.float32(1.0) / total
        for d in range(vd):
            o[d] *= inv


def paged_attention(q: np.ndarray, kcache: np.ndarray, vcache: np.ndarray, positions: np.ndarray,
                    row_seq: np.ndarray, block_tables: np.ndarray, *, window: int = 0, scale: float,
                    softcap: float = 0.0) -> np.ndarray:
    """Attention of query rows over their sequences' cached K/V (the rows' own K/V must already be written).

    q: (T, H, hd) float32; kcache: (NB, BS, KVH, hd); vcache: (NB, BS, KVH, vd); positions, row_seq: (T,);
    block_tables: (S, MB) int32 block ids. Returns (T, H, vd) float32. Shapes and block ids are validated
    here because the kernel does no bounds checks.
    """
    T, H, hd = q.shape
    NB, BS, KVH, khd = kcache.shape
    if khd != hd or H % KVH or vcache.shape[:3] != kcache.shape[:3]:
        raise ValueError(f"attention shapes disagree: q {q.shape}, k {kcache.shape}, v {vcache.shape}")
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    row_seq = np.ascontiguousarray(row_seq, dtype=np.int64)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    if len(positions) != T or len(row_seq) != T:
        raise ValueError("positions/row_seq must have one entry per query row")
    if T:
        if positions.min() < 0 or row_seq.min() < 0 or row_seq.max() >= len(block_tables):
            raise ValueError("negative position or row_seq out of range")
        if positions.max() // BS >= block_tables.shape[1]:
            raise ValueError("position beyond the block table")
        # every block a row can touch must be a valid block id
        need = positions // BS
        for s in np.unique(row_seq):
            used = block_tables[s, : need[row_seq == s].max() + 1]
            if used.min() < 0 or used.max() >= NB:
                raise ValueError(f"sequence {s}: block id out of range")
    out = np.empty((T, H, vcache.shape[3]), dtype=np.float32)
    max_ctx = int(positions.max()) + 1 if T else 1
    # split (row, head) jobs over threads when there is enough work per thread (~64k MACs)
    work = max(1, (max_ctx if not window else min(max_ctx, window)) * (hd + vcache.shape[3]))
    parallel_for(_paged_attention, T * H, max(1, 65536 // work), lambda: np.empty(max_ctx, np.float32),
                 out, np.ascontiguousarray(q, dtype=np.float32), kcache, vcache, positions, row_seq,
                 block_tables, int(window), np.float32(scale), np.float32(softcap))
    return out


def attention_reference(q, k, v, positions, *, window=0, scale, softcap=0.0):
    """NumPy twin for one sequence with contiguous k/v: (P, KVH, hd) covering positions 0..P-1."""
    T, H, hd = q.shape
    group = H // k.shape[1]
    out = np.zeros((T, H, v.shape[2]), dtype=np.float64)
    for t in range(T):
        pos = int(positions[t])
        lo = max(0, pos - window + 1) if window else 0
        for h in range(H):
            s = (k[lo:pos + 1, h // group].astype(np.float64) @ q[t, h].astype(np.float64)) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[lo:pos + 1, h // group]
    return out.astype(np.float32)
