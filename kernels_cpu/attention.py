"""Paged attention (prefill and decode in one kernel): GQA/MQA, causal, sliding window, soft-cap, attention sinks.

K/V live in blocks: kcache[block, slot_in_block, kv_head, :]. Each query row knows its sequence (block
table) and its position; it attends to positions [lo, pos] of its own sequence. Each (row, head) is
computed in a fixed order (see paged_attention), so a row's result does not depend on the other rows in the
batch. The kernel and the IR it inlines: kernels_cpu/attention_kernel.py.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kernels_cpu._jit import jit
from kernels_cpu.attention_kernel import AHEAD, NQ_MAX, _paged_attention, _paged_attention_split, attention_jobs
from kernels_cpu.attention_q8 import Q8Cache
from kernels_cpu.parallel import get_threads, parallel_for, prange_bounds, prange_team

_NO_SINKS = np.zeros(0, np.float32)
_ROW_ERRORS = {1: "negative position or row_seq out of range", 2: "position beyond the block table",
               3: "sequence {seq}: block id out of range"}


@jit
def _check_rows(positions, row_seq, block_tables, NB, BS):
    # (0, 0) when every row's position and sequence are in range and every block a row can touch (0 .. its
    # position's block) is a block id < NB; else (a key of _ROW_ERRORS, the first bad sequence for key 3)
    S, MB = block_tables.shape
    last = np.full(S, -1, np.int64)  # per sequence: its rows' last block index
    for t in range(len(positions)):
        p, q = positions[t], row_seq[t]
        if p < 0 or q < 0 or q >= S:
            return 1, 0
        if p // BS >= MB:
            return 2, 0
        last[q] = max(last[q], p // BS)
    for q in range(S):
        for b in range(last[q] + 1):
            if block_tables[q, b] < 0 or block_tables[q, b] >= NB:
                return 3, q
    return 0, 0


def _flat(cache):
    """A cache as the kernel takes it: a flat array, or q8_0's flat (qs, d)."""
    return cache.flat() if isinstance(cache, Q8Cache) else np.ascontiguousarray(cache).reshape(-1)


@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """What a call's rows decide, the same in every layer of one forward: the validated int64 positions / row_seq /
    block_tables, the jobs and their split over threads (bounds: prange chunk bounds, None for one thread or when
    splits run on the Python-level hand-off) with one scratch row per chunk. Built by attention_plan; a model
    builds one per forward and block table (ForwardBatch.attention_plan), not one per layer (~25 µs a call)."""

    key: tuple  # (T, NB, BS, KVH, H, hd + vd) the rows were validated and split for
    positions: np.ndarray  # (T,) int64
    row_seq: np.ndarray  # (T,) int64
    block_tables: np.ndarray  # (S, MB) int64
    jobs: np.ndarray  # (n, 6) int64, see attention_jobs
    threads: int
    bounds: np.ndarray | None  # (threads + 1,) int64
    scratch: np.ndarray  # (threads, NQ_MAX * (max_ctx + AHEAD)) float32


def attention_plan(positions, row_seq, block_tables, kshape: tuple, H: int, vd: int) -> AttentionPlan:
    """Validate query rows (positions, row_seq: (T,); block_tables: (S, MB) block ids) against a cache of shape
    kshape = (NB, BS, KVH, hd) for H query heads and value size vd, and split their jobs over the threads.
    Raises ValueError for a row out of range (the kernel does no bounds checks)."""
    NB, BS, KVH, hd = kshape
    positions = np.ascontiguousarray(positions, dtype=np.int64)
    row_seq = np.ascontiguousarray(row_seq, dtype=np.int64)
    block_tables = np.ascontiguousarray(block_tables, dtype=np.int64)
    T = len(positions)
    if len(row_seq) != T:
        raise ValueError("positions/row_seq must have one entry per query row")
    bad, seq = _check_rows(positions, row_seq, block_tables, NB, BS)
    if bad:
        raise ValueError(_ROW_ERRORS[bad].format(seq=seq))
    max_ctx = (int(positions[0]) if T == 1 else int(positions.max()) if T else 0) + 1  # (T = 1: no reduction)
    # jobs: up to NQ_MAX query vectors sharing their K/V cells (rows of a sequence x heads of a KV head), split
    # over threads by their work (cells x query vectors) when there is enough of it (~64k MACs a thread)
    jobs = attention_jobs(positions, row_seq, KVH, H // KVH)
    cost = jobs[:, 5]
    work = int(cost.sum()) * (hd + vd)
    threads = 1 if work < 2 * 65536 else max(1, min(get_threads(), len(jobs)))
    bounds = None if threads == 1 else prange_bounds(len(jobs), threads, cost)
    scratch = np.empty((threads, NQ_MAX * (max_ctx + AHEAD)), np.float32)
    return AttentionPlan((T, NB, BS, KVH, H, hd + vd), positions, row_seq, block_tables, jobs, threads, bounds,
                         scratch)


def paged_attention(q: np.ndarray, kcache, vcache, positions: np.ndarray,
                    row_seq: np.ndarray, block_tables: np.ndarray, *, window: int = 0, scale: float,
                    softcap: float = 0.0, sinks: np.ndarray | None = None,
                    plan: AttentionPlan | None = None) -> np.ndarray:
    """Attention of query rows over their sequences' cached K/V (the rows' own K/V must already be written).

    q: (T, H, hd) float32; kcache: (NB, BS, KVH, hd); vcache: (NB, BS, KVH, vd), each float32, f16 bits
    (int16), bf16 bits (uint16) or a q8_0 Q8Cache (kernels_cpu/attention_q8.py: read in place, as its values
    d * q); positions, row_seq: (T,); block_tables: (S, MB) int32 block ids. Returns (T, H, vd) float32.
    Shapes and block ids are validated here because the kernel does no bounds checks. plan: these rows'
    attention_plan for these cache shapes (made here when None; a plan made for other shapes is refused).

    llama.cpp's steps (ggml-cpu, no flash attention: K Q, scale, soft-cap, mask, softmax by ggml_expf, P V) within
    float rounding of its results, each sum in one fixed order of its own (kernels_cpu/attention_kernel.py); a
    compact form gives what an F32 cache of its widened values gives, bit for bit. A row's result depends only on
    its query, position and sequence, never on the other rows of the call, on chunking or on whether it is a
    generated token (batch invariance).

    sinks: optional (H,) float32 per-head logits that join each softmax's max and denominator but carry no value
    (gpt-oss; llama.cpp's ggml_soft_max_add_sinks); None leaves every result as it was, bit for bit.
    """
    T, H, hd = q.shape
    NB, BS, KVH, khd = kcache.shape
    vd = vcache.shape[3]
    if khd != hd or H % KVH or vcache.shape[:3] != kcache.shape[:3]:
        raise ValueError(f"attention shapes disagree: q {q.shape}, k {kcache.shape}, v {vcache.shape}")
    if plan is None:
        plan = attention_plan(positions, row_seq, block_tables, kcache.shape, H, vd)
    if plan.key != (T, NB, BS, KVH, H, hd + vd):  # also: a row count that is not q's
        raise ValueError(f"attention plan made for {plan.key}, called with {(T, NB, BS, KVH, H, hd + vd)}")
    sinks = _NO_SINKS if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32)
    if sinks.shape not in ((0,), (H,)):
        raise ValueError(f"sinks must have shape ({H},), got {sinks.shape}")
    out = np.empty((T, H, vd), dtype=np.float32)
    args = (out.reshape(-1), np.ascontiguousarray(q, dtype=np.float32).reshape(-1), _flat(kcache), _flat(vcache),
            (H, KVH, hd, vd, BS), plan.positions, plan.row_seq, plan.block_tables, int(window), np.float32(scale),
            np.float32(softcap), sinks, plan.jobs)
    if plan.threads == 1:
        _paged_attention(*args, 0, len(plan.jobs), plan.scratch[0])
    elif plan.bounds is not None and prange_team() is not None:
        _paged_attention_split(*args, plan.bounds, plan.scratch)
    else:  # the Python-level hand-off (its chunks take scratch of their own)
        parallel_for(_paged_attention, len(plan.jobs), 1, lambda: np.empty(plan.scratch.shape[1], np.float32),
                     *args, cost=plan.jobs[:, 5])
    return out


def attention_reference(q, k, v, positions, *, window=0, scale, softcap=0.0, sinks=None):
    """NumPy twin for one sequence with contiguous k/v: (P, KVH, hd) covering positions 0..P-1; sinks (H,) or
    None."""
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
            m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
            w = np.exp(s - m)
            total = w.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
            out[t, h] = (w / total) @ v[lo:pos + 1, h // group]
    return out.astype(np.float32)
