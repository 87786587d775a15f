"""Paged attention (prefill and decode in one kernel): GQA/MQA, causal, sliding window, soft-cap.

K/V live in blocks: kcache[block, slot_in_block, kv_head, :]. Each query row knows its sequence (block
table) and its position; it attends to positions [lo, pos] of its own sequence. Each (row, head) is
computed independently in a fixed order (llama.cpp's, see paged_attention), so a row's result does not depend
on other sequences' rows in the batch.
"""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic, overload

from kernels_cpu._jit import jit, parallel_jit
from kernels_cpu.ops import bits_to_f32, f16_bits_to_f32, fma32, ggml_expf
from kernels_cpu.parallel import parallel_for


def kv_value(x):
    """A cached K/V element as float32: float32 as is; f16 (int16 bits) and bf16 (uint16 bits) widened."""
    raise NotImplementedError  # only used inside jitted code


@overload(kv_value)
def _kv_value(x):
    if x == types.int16:  # f16 bits
        return lambda x: f16_bits_to_f32(x)
    if x == types.uint16:  # bf16 bits
        return lambda x: bits_to_f32(np.uint32(x) << np.uint32(16))
    return lambda x: x


# --- llama.cpp's SIMD sums as LLVM IR (F32 cache): vectors in registers, operations in ggml's order -------------

_F32, _I64 = ir.FloatType(), ir.IntType(64)


def _vec(n):
    return ir.VectorType(_F32, n)


def _as_i64(context, builder, ty, val):
    return context.cast(builder, val, ty, types.int64)


def _vload(builder, ptr, off, n=16):
    """<n x float> at float pointer ptr + off (i64 elements)."""
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), _vec(n).as_pointer()), align=4)


def _fma(builder, a, b, c):
    """a * b + c with one rounding (llvm.fma), scalars or vectors."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    mod = builder.module
    fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ty, [ty] * 3), name)
    return builder.call(fn, [a, b, c])


def _lanes(builder, v, idx):
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), idx))


def _reduce16(builder, v):
    """GCC's _mm512_reduce_add_ps of a <16 x float>: hi + lo halves 16 -> 8 -> 4, then [0]+[2], [1]+[3], then
    the two."""
    v = builder.fadd(_lanes(builder, v, list(range(8, 16))), _lanes(builder, v, list(range(8))))
    v = builder.fadd(_lanes(builder, v, [4, 5, 6, 7]), _lanes(builder, v, [0, 1, 2, 3]))
    v = builder.fadd(v, _lanes(builder, v, [2, 3, 0, 1]))
    i32 = ir.IntType(32)
    return builder.fadd(builder.extract_element(v, ir.Constant(i32, 0)), builder.extract_element(v, ir.Constant(i32, 1)))


def _reduce16_list(builder, xs):
    """The same reduction tree across 16 values (lane l = xs[l]), element-wise for vectors."""
    t = [builder.fadd(xs[i + 8], xs[i]) for i in range(8)]
    t = [builder.fadd(t[i + 4], t[i]) for i in range(4)]
    t = [builder.fadd(t[i], t[i + 2]) for i in range(2)]
    return builder.fadd(t[0], t[1])


@intrinsic
def _vdot_f32(typingctx, a, aoff, b, boff, n):
    """ggml_vec_dot_f32 (AVX512) of a[aoff:aoff+n] and b[boff:boff+n] (flat float32 arrays, n % 64 == 0):
    4 accumulators of 16 lanes (element i: lane i % 64, fma over i // 64), (s0 + s2) + (s1 + s3), reduce_add."""
    def codegen(context, builder, sig, args):
        from numba.core import cgutils

        pa = builder.gep(context.make_array(sig.args[0])(context, builder, args[0]).data,
                         [_as_i64(context, builder, sig.args[1], args[1])])
        pb = builder.gep(context.make_array(sig.args[2])(context, builder, args[2]).data,
                         [_as_i64(context, builder, sig.args[3], args[3])])
        nn = _as_i64(context, builder, sig.args[4], args[4])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(16), [0.0] * 16)) for _ in range(4)]
        with cgutils.for_range(builder, builder.udiv(nn, ir.Constant(_I64, 64))) as lp:
            base = builder.mul(lp.index, ir.Constant(_I64, 64))
            for j, acc in enumerate(accs):
                off = builder.add(base, ir.Constant(_I64, 16 * j))
                builder.store(_fma(builder, _vload(builder, pa, off), _vload(builder, pb, off), builder.load(acc)), acc)
        s0, s1, s2, s3 = (builder.load(a) for a in accs)
        return _reduce16(builder, builder.fadd(builder.fadd(s0, s2), builder.fadd(s1, s3)))
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and a == b):
        return None
    return types.float32(a, aoff, b, boff, n), codegen


_PV_WIDTH = 16  # output elements per vector in the P @ V kernels


class _PV:
    """Codegen shared by the two P @ V intrinsics (same arguments: o, ooff, w, wstride, v, cbase, n_chunks,
    stride, first, last, vd, heads): pointers, the masked fma of one cell, the chunk loop, the output store."""

    def __init__(self, context, builder, sig, args):
        ty, b = sig.args, builder
        self.b = b
        (self.ooff, self.wstride, self.n_chunks, self.stride, self.first, self.last, self.nvd, self.heads) = (
            _as_i64(context, b, ty[i], args[i]) for i in (1, 3, 6, 7, 8, 9, 10, 11))
        self.po0 = b.gep(context.make_array(ty[0])(context, b, args[0]).data, [self.ooff])
        self.pw0 = context.make_array(ty[2])(context, b, args[2]).data
        self.pv = context.make_array(ty[4])(context, b, args[4]).data
        self.pbase = context.make_array(ty[5])(context, b, args[5]).data
        self.zero = ir.Constant(_vec(_PV_WIDTH), [0.0] * _PV_WIDTH)

    def k(self, x):
        return ir.Constant(_I64, x)

    def fma_cell(self, acc, pw, cell, vrow, masked):
        """acc += w[cell] * V[vrow : vrow + W] (one rounding); a masked cell outside first..last leaves acc."""
        b, W = self.b, _PV_WIDTH
        wj = b.load(b.gep(pw, [cell]))
        splat = _lanes(b, b.insert_element(ir.Constant(_vec(1), ir.Undefined), wj, ir.Constant(ir.IntType(32), 0)),
                       [0] * W)
        a = b.load(acc)
        f = _fma(b, splat, _vload(b, self.pv, vrow, W), a)
        if masked:
            ok = b.and_(b.icmp_signed(">=", cell, self.first), b.icmp_signed("<=", cell, self.last))
            f = b.select(ok, f, a)
        b.store(f, acc)

    def over_chunks(self, body):
        """body(c, masked) for c < n_chunks; only the first and last chunks can hold masked cells."""
        from numba.core import cgutils

        b = self.b
        last_chunk = b.sub(self.n_chunks, self.k(1))
        with cgutils.for_range(b, self.n_chunks) as lc:
            c = lc.index
            edge = b.or_(b.icmp_signed("==", c, self.k(0)), b.icmp_signed("==", c, last_chunk))
            with b.if_else(edge) as (then, otherwise):
                with then:
                    body(c, True)
                with otherwise:
                    body(c, False)

    def over_outputs(self, head_sum):
        """For each slice d0 of W output elements and each head g: o[g*vd + d0 :][:W] = head_sum(d0, w of g)."""
        from numba.core import cgutils

        b, W = self.b, _PV_WIDTH
        with cgutils.for_range(b, b.udiv(self.nvd, self.k(W))) as ld:
            d0 = b.mul(ld.index, self.k(W))
            with cgutils.for_range(b, self.heads) as lg:
                r = head_sum(d0, b.gep(self.pw0, [b.mul(lg.index, self.wstride)]))
                po = b.gep(self.po0, [b.add(b.mul(lg.index, self.nvd), d0)])
                b.store(r, b.bitcast(po, _vec(W).as_pointer()), align=4)


@intrinsic
def _pv_sgemm_f32(typingctx, o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads):
    """P @ V in tinyBLAS<16, __m512>'s order, for `heads` query heads sharing one KV head and cells in chunks of 16
    (cell j of the run: lane j % 16, fma over j // 16, then reduce_add of the 16 lanes): o[ooff + g*vd + d] for
    d < vd (vd % _PV_WIDTH == 0). Head g's weights of chunk c are w[g*wstride + 16c :][:16]; the chunk's 16 V
    rows start at cbase[c] and follow each other at `stride` (a chunk lies in one KV block). Only cells
    first..last of the run are visible: the others leave the lanes unchanged (as their weight 0 does in
    llama.cpp; their V rows may be garbage). Vectorised over d, 16 lane accumulators in registers; the heads
    run one after the other over the same slice of V (then in L1)."""
    def codegen(context, builder, sig, args):
        from numba.core import cgutils

        e, b = _PV(context, builder, sig, args), builder
        accs = [cgutils.alloca_once(b, _vec(_PV_WIDTH)) for _ in range(16)]

        def head_sum(d0, pw):
            for acc in accs:
                b.store(e.zero, acc)

            def chunk(c, masked):
                row = b.add(b.load(b.gep(e.pbase, [c])), d0)
                for lane, acc in enumerate(accs):
                    cell = b.add(b.mul(c, e.k(16)), e.k(lane))
                    e.fma_cell(acc, pw, cell, b.add(row, b.mul(e.stride, e.k(lane))), masked)
            e.over_chunks(chunk)
            return _reduce16_list(b, [b.load(acc) for acc in accs])

        e.over_outputs(head_sum)
        return context.get_dummy_value()
    if not (isinstance(v, types.Array) and v.dtype == types.float32):
        return None
    return types.void(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads), codegen


@intrinsic
def _pv_vecdot_f32(typingctx, o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads):
    """P @ V in ggml_vec_dot_f32's order (a one-token batch in llama.cpp), as _pv_sgemm_f32 but for chunks of 64
    cells: cell j of the run in accumulator j % 64 (fma over j // 64); accumulators l, l+16, l+32, l+48 combined
    as (l + (l+32)) + ((l+16) + (l+48)), then reduce_add over l. cbase[i]: V offset of cell 16 i of the run."""
    def codegen(context, builder, sig, args):
        from numba.core import cgutils

        e, b = _PV(context, builder, sig, args), builder
        accs = [cgutils.alloca_once(b, _vec(_PV_WIDTH)) for _ in range(4)]

        def head_sum(d0, pw):
            us = []
            for lane in range(16):
                for acc in accs:
                    b.store(e.zero, acc)

                def chunk(c, masked):
                    for i, acc in enumerate(accs):  # cells lane + 16 i of the chunk
                        cell = b.add(b.mul(c, e.k(64)), e.k(lane + 16 * i))
                        row = b.load(b.gep(e.pbase, [b.add(b.mul(c, e.k(4)), e.k(i))]))
                        e.fma_cell(acc, pw, cell, b.add(b.add(row, b.mul(e.stride, e.k(lane))), d0), masked)
                e.over_chunks(chunk)
                a0, a1, a2, a3 = (b.load(acc) for acc in accs)  # lanes l, l+16, l+32, l+48
                us.append(b.fadd(b.fadd(a0, a2), b.fadd(a1, a3)))
            return _reduce16_list(b, us)

        e.over_outputs(head_sum)
        return context.get_dummy_value()
    if not (isinstance(v, types.Array) and v.dtype == types.float32):
        return None
    return types.void(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads), codegen


# --- the same sums in plain Numba (any K/V dtype, any head size) ------------------------------------------------

@jit
def _tree16(a, o):
    """_mm512_reduce_add_ps (GCC) of the 16 floats a[o:o+16]: halves added lane-wise 16 -> 8 -> 4 -> 2 -> 1."""
    t0 = a[o + 0] + a[o + 8]
    t1 = a[o + 1] + a[o + 9]
    t2 = a[o + 2] + a[o + 10]
    t3 = a[o + 3] + a[o + 11]
    t4 = a[o + 4] + a[o + 12]
    t5 = a[o + 5] + a[o + 13]
    t6 = a[o + 6] + a[o + 14]
    t7 = a[o + 7] + a[o + 15]
    u0, u1, u2, u3 = t0 + t4, t1 + t5, t2 + t6, t3 + t7
    return (u0 + u2) + (u1 + u3)


def _kq_dot(q, qoff, k, koff, n, acc):
    """ggml_vec_dot_f32's SIMD part over n (% 64 == 0) elements; acc: (64,) float32 scratch."""
    raise NotImplementedError  # only used inside jitted code


@overload(_kq_dot)
def _kq_dot_impl(q, qoff, k, koff, n, acc):
    if k.dtype == types.float32:
        return lambda q, qoff, k, koff, n, acc: _vdot_f32(q, qoff, k, koff, n)

    def generic(q, qoff, k, koff, n, acc):
        acc[:] = 0.0
        for i0 in range(0, n, 64):
            for j in range(64):
                acc[j] = fma32(q[qoff + i0 + j], kv_value(k[koff + i0 + j]), acc[j])
        for j in range(16):
            acc[j] = (acc[j] + acc[j + 32]) + (acc[j + 16] + acc[j + 48])
        return _tree16(acc, 0)
    return generic


def _fast_ok(v, bs, vd):
    """Whether the IR P @ V kernels apply: F32 cache, 16-cell chunks inside one block, whole vectors."""
    raise NotImplementedError  # only used inside jitted code


@overload(_fast_ok)
def _fast_ok_impl(v, bs, vd):
    if v.dtype == types.float32:
        return lambda v, bs, vd: bs % 16 == 0 and vd % _PV_WIDTH == 0
    return lambda v, bs, vd: False


def _pv_fast(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads, nl):
    raise NotImplementedError  # only used inside jitted code


@overload(_pv_fast)
def _pv_fast_impl(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads, nl):
    if v.dtype != types.float32:
        return lambda o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads, nl: None

    def f32(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads, nl):
        if nl == 16:
            _pv_sgemm_f32(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads)
        else:
            _pv_vecdot_f32(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads)
    return f32


@jit
def _pv_lanes(o, ooff, w, base, v, bt, bs, row_stride, voff, lo, pos, vd, nl, acc, lanes):
    # P @ V with nl (16 or 64) accumulator lanes per output element: cell p in lane p % nl, fma over p // nl;
    # 64 lanes are then combined as ggml_vec_dot_f32's 4 x 16, 16 lanes reduced directly. w[p - base]: weights;
    # V row of cell p at (bt[p // bs] * bs + p % bs) * row_stride + voff. acc: (64, vd) scratch
    acc[:nl] = 0.0
    for p in range(lo, pos + 1):
        a = acc[p % nl]
        wp = w[p - base]
        vo = (bt[p // bs] * bs + p % bs) * row_stride + voff
        for d in range(vd):
            a[d] = fma32(wp, kv_value(v[vo + d]), a[d])
    for d in range(vd):
        for j in range(16):
            lanes[j] = acc[j, d]
            if nl == 64:
                lanes[j] = (acc[j, d] + acc[j + 32, d]) + (acc[j + 16, d] + acc[j + 48, d])
        o[ooff + d] = _tree16(lanes, 0)


@jit  # no fastmath: every float operation below is one of llama.cpp's, in its order
def _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, single, window, scale, softcap,
                     job_lo, job_hi, s):
    # flat C-order views: out (T*H*vd,) of (T, H, vd); q (T*H*hd,) of (T, H, hd); kc, vc of the caches
    # (NB, BS, KVH, hd) / (NB, BS, KVH, vd); dims = (H, KVH, hd, vd, BS). positions, row_seq, single: (T,);
    # block_tables: (S, MB); s: (group * S,) float32 scratch of this worker, S >= max_ctx + 128. Jobs
    # [job_lo, job_hi) of the T * KVH (row, KV head) pairs; each does the `group` query heads of its KV head
    # (K and V rows are read once for all of them). KV cells go in chunks of 16 (llama.cpp's softmax and sgemm
    # lanes): s[g * S + j] holds head g's value for cell base + j, base a multiple of 16 (of 64 for a single row).
    H, KVH, hd, vd, BS = dims
    group = H // KVH
    S = len(s) // group
    hd_main = hd - hd % 64
    cbase = np.empty(S // 16 + 1, np.int64)  # per chunk: V offset of its first cell
    m = np.empty(group, np.float32)
    kacc = np.empty(64, np.float32)
    vacc = np.empty((64, vd), np.float32)
    lanes = np.empty(16, np.float32)
    inv_cap = np.float32(1.0) / softcap if softcap > 0 else np.float32(0.0)
    for job in range(job_lo, job_hi):
        t = job // KVH
        kh = job % KVH
        pos = positions[t]
        bt = block_tables[row_seq[t]]
        lo = 0
        if window > 0 and pos - window + 1 > 0:
            lo = pos - window + 1
        nl = 64 if single[t] else 16  # P @ V lanes (see below); cells are handled from a multiple of nl on
        base = lo - lo % nl
        n16 = (pos // nl - base // nl + 1) * (nl // 16)  # chunks of 16 cells from base
        # KQ = ggml_vec_dot_f32 per visible cell: 4 x 16 lanes (element i in lane i % 64, fma over i // 64),
        # (s0 + s2) + (s1 + s3), reduce_add; the hd % 64 leftovers by scalar fma. Walked block by block.
        m[:] = -np.inf
        for b in range(lo // BS, pos // BS + 1):
            row0 = bt[b] * BS - b * BS  # cache row of cell p: row0 + p
            for p in range(max(lo, b * BS), min(pos, b * BS + BS - 1) + 1):
                koff = ((row0 + p) * KVH + kh) * hd
                for g in range(group):
                    qoff = (t * H + kh * group + g) * hd
                    x = _kq_dot(q, qoff, kc, koff, hd_main, kacc)
                    for i in range(hd_main, hd):
                        x = fma32(q[qoff + i], kv_value(kc[koff + i]), x)
                    x = x * scale  # ggml_soft_max_ext's scale (Gemma 3 scales q instead: the same for a power of 2)
                    if softcap > 0:  # ggml_scale(1/cap), ggml_tanh (tanhf), ggml_scale(cap)
                        x = np.float32(math.tanh(x * inv_cap)) * softcap
                    s[g * S + p - base] = x
                    if x > m[g]:
                        m[g] = x
        # softmax (ggml_compute_forward_soft_max_f32): e = ggml_v_expf(x - max), 0 for masked cells; per chunk a
        # reduce_add, summed in double; then every e times (float)(1.0 / sum)
        for g in range(group):
            w = s[g * S:(g + 1) * S]
            total = 0.0
            for c in range(n16):
                for j in range(16):
                    p = base + 16 * c + j
                    e = np.float32(0.0)
                    if lo <= p <= pos:
                        e = ggml_expf(w[16 * c + j] - m[g])
                    w[16 * c + j] = e
                    lanes[j] = e
                total += np.float64(_tree16(lanes, 0))
            inv = np.float32(1.0 / total)
            for j in range(16 * n16):
                w[j] = w[j] * inv
        # KQV over the KV cells, by the matmul llama.cpp picks: tinyBLAS sgemm when its batch has >= 2 tokens
        # (16 lanes: cell p in lane p % 16, fma over p // 16, reduce_add), ggml_vec_dot_f32 for a single token
        # (4 x 16 lanes). Cells outside [lo, pos] have weight 0 and leave the lanes unchanged: skipped.
        ooff = (t * H + kh * group) * vd
        if _fast_ok(vc, BS, vd):
            for c in range(n16):
                p = base + 16 * c
                if p > pos or p + 15 < lo:  # no visible cell (masked lanes): any 16 rows of a block in use
                    p = pos - pos % 16
                cbase[c] = ((bt[p // BS] * BS + p % BS) * KVH + kh) * vd
            _pv_fast(out, ooff, s, S, vc, cbase, n16 // (nl // 16), KVH * vd, lo - base, pos - base, vd, group, nl)
        else:
            for g in range(group):
                _pv_lanes(out, ooff + g * vd, s[g * S:(g + 1) * S], base, vc, bt, BS, KVH * vd, kh * vd, lo, pos,
                          vd, nl, vacc, lanes)


@parallel_jit
def _paged_attention_split(out, q, kc, vc, dims, positions, row_seq, block_tables, single, window, scale, softcap,
                           bounds, scratch):
    # _paged_attention over the job chunks [bounds[c], bounds[c+1]) in parallel; scratch (chunks, S)
    for c in numba.prange(len(bounds) - 1):
        _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, single, window, scale, softcap,
                         bounds[c], bounds[c + 1], scratch[c])


def paged_attention(q: np.ndarray, kcache: np.ndarray, vcache: np.ndarray, positions: np.ndarray,
                    row_seq: np.ndarray, block_tables: np.ndarray, *, window: int = 0, scale: float,
                    softcap: float = 0.0, single: np.ndarray | None = None) -> np.ndarray:
    """Attention of query rows over their sequences' cached K/V (the rows' own K/V must already be written).

    q: (T, H, hd) float32; kcache: (NB, BS, KVH, hd); vcache: (NB, BS, KVH, vd); positions, row_seq: (T,);
    block_tables: (S, MB) int32 block ids. Returns (T, H, vd) float32. Shapes and block ids are validated
    here because the kernel does no bounds checks.

    The float operations are llama.cpp's (ggml-cpu, F32 K/V cache, no flash attention), so an F32 cache gives
    bit-identical results. Like llama.cpp, the P @ V product sums in a different order for a sequence that has
    a single row in the call (a decode step: ggml_vec_dot_f32) than for one with several (a prefill chunk:
    tinyBLAS sgemm); rows of other sequences never matter. `single` (T,) bool chooses the order per row instead
    (the engine passes "a generated token fed back", so a prompt row sums the same way however the prompt was
    split into chunks or served from the prefix cache).
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
        last = np.full(len(block_tables), -1, np.int64)  # per sequence: its rows' last block index
        np.maximum.at(last, row_seq, positions // BS)
        touched = np.arange(block_tables.shape[1]) <= last[:, None]
        bad = touched & ((block_tables < 0) | (block_tables >= NB))
        if bad.any():
            raise ValueError(f"sequence {int(np.nonzero(bad.any(axis=1))[0][0])}: block id out of range")
    out = np.empty((T, H, vcache.shape[3]), dtype=np.float32)
    if single is None:
        single = np.bincount(row_seq)[row_seq] == 1 if T else np.zeros(0, bool)
    single = np.asarray(single, dtype=np.uint8)  # (T,)
    if single.shape != (T,):
        raise ValueError(f"single must have shape ({T},), got {single.shape}")
    max_ctx = int(positions.max()) + 1 if T else 1
    group = H // KVH
    # split (row, KV head) jobs over threads when there is enough work per thread (~64k MACs)
    work = max(1, (max_ctx if not window else min(max_ctx, window)) * (hd + vcache.shape[3]) * group)
    dims = (H, KVH, hd, vcache.shape[3], BS)
    # per (row, KV head) job: the cells it reads (causal rows late in a prompt do more; split by that work)
    ctx = positions + 1 if not window else np.minimum(positions + 1, window)
    parallel_for(_paged_attention, T * KVH, max(1, 65536 // work),
                 lambda: np.empty(group * (max_ctx + 128), np.float32),
                 out.reshape(-1), np.ascontiguousarray(q, dtype=np.float32).reshape(-1),
                 np.ascontiguousarray(kcache).reshape(-1), np.ascontiguousarray(vcache).reshape(-1), dims,
                 positions, row_seq, block_tables, single, int(window), np.float32(scale), np.float32(softcap),
                 cost=np.repeat(ctx + 16, KVH), split=_paged_attention_split)
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
