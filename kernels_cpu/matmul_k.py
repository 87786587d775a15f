"""IR bodies of the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): one 256-element super-block per call.

Repacked layout of one (row group, super-block) — see repack.py. Elements come in 8 runs t of 32
(16 pairs pp each); pair vectors as in matmul_q:
  nibble plane (Q4_K, Q5_K, Q6_K): 64 vectors, vector t*8+v holds pair v (low) and pair v+8 (high) of run t;
  2-bit plane (Q6_K high bits at +2048, Q2_K / Q3_K low bits at 0): 32 vectors, vector t*4+u holds pairs
      u, u+4, u+8, u+12 of run t in bits 0-1, 2-3, 4-5, 6-7;
  bit plane (Q5_K bit 4 at +2048, Q3_K bit 2 at +1024): one u32 per pair (t*16+pp), bit = lane.
  sc: per-sub-block scales for the 16 rows (u8 or i8, sub-block-major), then f16 d [, f16 dmin].
Activations: int16 quantized per 256 (like Q8_K) with one dx, bs = sums per 16.
Integer sums are scaled by the integer sub-block scales and accumulated exactly in int32, then
y[r] += d[r]*dx * sum_j sc_j*isum_j  (- dmin[r]*dx * sum_j m_j*bsum_j for the formats with mins).
"""
from __future__ import annotations

from quant.types import QuantType as Q

from .matmul_ir import F32, I16, I32, Emit, R, V, hsum8, register


def _accumulate(e: Emit, mb: int, acc, isums, scale) -> list:
    return [e.add(acc[i], e.mul(isums[i], scale)) for i in range(mb)]


def _finish(e: Emit, mb: int, acc, macc, doff: int) -> None:
    """facc += cvt(acc)*(d*dx) [- cvt(macc)*(dmin*dx)], in this order."""
    d = e.f16x16(doff)
    dmin = e.f16x16(doff + 32) if macc is not None else None
    for i in range(mb):
        dxi = e.splat(e.load(e.dx, e.elem_off(e.dxoff, e.dxstride, i, 0, 4), F32), R)
        t = e.wide(e.fmul(d, dxi))  # d*dx in f32, like llama.cpp
        a = e.cvt(acc[i])
        if macc is None:
            e.acc[i] = e.fma(a, t, e.acc[i])
        else:
            tm = e.wide(e.fneg(e.fmul(dmin, dxi)))
            am = e.cvt(macc[i])
            e.acc[i] = e.fma(am, tm, e.fma(a, t, e.acc[i]))


def _run_sums(e: Emit, mb: int, t, pairs) -> tuple[list, list]:
    """Integer sums of the two 16-element sub-blocks (2t, 2t+1) of run t from its 16 pair vectors."""
    nc = 2 if mb == 1 else 1  # one row: two chains per sub-block (integer sums: exact either way)
    acc = [[[e.zeros_i32()] * nc for _ in range(2)] for _ in range(mb)]  # [row][sub-block][chain]
    for pp, w in enumerate(pairs):
        for i in range(mb):
            a = acc[i][pp // 8]
            a[pp % nc] = e.madd(a[pp % nc], w, i, e.lin(t, 32, 2 * pp))
    lo = [acc[i][0][0] if nc == 1 else e.add(acc[i][0][0], acc[i][0][1]) for i in range(mb)]
    hi = [acc[i][1][0] if nc == 1 else e.add(acc[i][1][0], acc[i][1][1]) for i in range(mb)]
    return lo, hi


def _min_sums(e: Emit, mb: int, macc, m, j0, nj: int) -> list:
    """macc += m * (sum of activation runs j0 .. j0+nj-1 of 16)."""
    out = []
    for i in range(mb):
        s = e.bsum(i, j0)
        for j in range(1, nj):
            s = e.add(s, e.bsum(i, e.lin(j0, 1, j)))
        out.append(e.add(macc[i], e.mul(m, e.splat(s, R))))
    return out


def _over_runs(e: Emit, mb: int, run, with_min: bool):
    """Loop run(t, acc, macc) -> (acc, macc) over the 8 runs of 32 elements; returns the final sums."""
    zero = [e.zeros_i32()] * mb

    def step(t, state):
        acc, macc = state[:mb], state[mb:]
        acc, macc = run(t, acc, macc)
        return list(acc) + list(macc)

    state = e.loop(8, step, zero + (zero if with_min else []))
    return state[:mb], (state[mb:] if with_min else None)


def _q45_k(e: Emit, mb: int, high_bits: bool) -> None:
    def run(t, acc, macc):
        pairs = [None] * 16
        for v in range(8):
            raw = e.wvec(e.lin(t, 256, 32 * v))
            lo, hi = e.lo4(raw), e.hi4(raw)
            if high_bits:
                lo = e.b.or_(lo, e.shl(e.wbits(e.lin(t, 64, 2048 + 4 * v)), 4))
                hi = e.b.or_(hi, e.shl(e.wbits(e.lin(t, 64, 2048 + 4 * (v + 8))), 4))
            pairs[v], pairs[v + 8] = e.s16(lo), e.s16(hi)
        s0, s1 = _run_sums(e, mb, t, pairs)
        isum = [e.add(s0[i], s1[i]) for i in range(mb)]
        acc = _accumulate(e, mb, acc, isum, e.u8x16(e.lin(t, 16)))
        macc = _min_sums(e, mb, macc, e.u8x16(e.lin(t, 16, 128)), e.lin(t, 2), 2)
        return acc, macc

    acc, macc = _over_runs(e, mb, run, True)
    _finish(e, mb, acc, macc, 256)


# -- llama.cpp-exact Q4_K / Q6_K (ggml_vec_dot_q4_K_q8_K / _q6_K_q8_K, AVX2 path) ------------------------
# llama.cpp keeps 8 int32 lanes per super-block: lane l sums, over the 8 runs of 32, the scaled products of
# elements 4l..4l+3 of the run (maddubs + madd with the broadcast sub-block scale); then
# acc_l = fma(d, float(lane l), acc_l) with d = y.d * f16(x.d), and hsum_float_8 at the end. Integer sums are
# exact, so we may multiply the weights by their scale first (one vpmullw per pair vector, shared by all
# activation rows) and accumulate each lane's pairs with vpdpwssd; lanes l and l+4 use the low and high nibbles
# of the same weight vectors, so they are computed together (2 live integer lanes per row).

def _scale_pairs(e: Emit, off, signed: bool):
    """The sub-block scales of the 16 rows at scale offset off, as <32 x i16> (lane 2r+e = row r)."""
    b = e.b
    v = b.trunc(e.u8x16(off, signed=signed), V(I16, R))
    return b.shuffle_vector(v, v, ir_index([r // 2 for r in range(32)]))


def ir_index(idx):
    from llvmlite import ir

    return ir.Constant(V(I32, len(idx)), idx)


def _lane_pair_sums(e: Emit, mb: int, q: int, pair_fn) -> list:
    """Integer lanes (q, q+4) of every row: sums over the 8 runs of scaled pairs (2q, 2q+1) and (2q+8, 2q+9).
    pair_fn(t, q) -> ((w_2q, w_2q+1), (w_2q+8, w_2q+9)) weight pair vectors of run t, already scaled."""

    def step(t, state):
        (lo0, lo1), (hi0, hi1) = pair_fn(t, q)
        out = []
        for i in range(mb):
            a, c = state[2 * i], state[2 * i + 1]
            a = e.madd(e.madd(a, lo0, i, e.lin(t, 32, 4 * q)), lo1, i, e.lin(t, 32, 4 * q + 2))
            c = e.madd(e.madd(c, hi0, i, e.lin(t, 32, 16 + 4 * q)), hi1, i, e.lin(t, 32, 16 + 4 * q + 2))
            out += [a, c]
        return out

    return e.loop(8, step, [e.zeros_i32()] * (2 * mb))


def _q4_k_pairs(e: Emit):
    def fn(t, q):
        sc = _scale_pairs(e, e.lin(t, 16), False)
        lo, hi = [], []
        for v in (2 * q, 2 * q + 1):
            raw = e.wvec(e.lin(t, 256, 32 * v))
            lo.append(e.mul(e.s16(e.lo4(raw)), sc))
            hi.append(e.mul(e.s16(e.hi4(raw)), sc))
        return lo, hi
    return fn


def _q6_k_pairs(e: Emit):
    def fn(t, q):
        sc_lo = _scale_pairs(e, e.lin(t, 32), True)
        sc_hi = _scale_pairs(e, e.lin(t, 32, 16), True)
        lo, hi = [], []
        for v in (2 * q, 2 * q + 1):
            raw = e.wvec(e.lin(t, 256, 32 * v))
            for pp, nib, sc, dst in ((v, e.lo4(raw), sc_lo, lo), (v + 8, e.hi4(raw), sc_hi, hi)):
                hv = e.wvec(e.lin(t, 128, 2048 + 32 * (pp % 4)))
                code = e.b.or_(nib, e.shl(e.bits2(hv, 2 * (pp // 4)), 4))  # 0..63 (llama.cpp: no -32 here)
                dst.append(e.mul(e.s16(code), sc))
        return lo, hi
    return fn


def _hsum8_plus_min(e: Emit, a: list):
    """Q4_K: hsum_float_8(acc) + the 4 min lanes summed as llama.cpp's acc_m: (m0+m2) + (m1+m3)."""
    m = a[8:]
    return e.b.fadd(hsum8(e, a[:8]), e.b.fadd(e.b.fadd(m[0], m[2]), e.b.fadd(m[1], m[3])))


@register(Q.Q4_K, lanes=12, reduce=_hsum8_plus_min)
def _q4_k(e: Emit, mb: int) -> None:
    b = e.b
    d = e.f16x16(256)
    dmin = e.f16x16(288)
    pairs = _q4_k_pairs(e)
    ts = [b.fmul(e.dxs(i), d) for i in range(mb)]  # y.d * f16(x.d)
    for q in range(4):
        lanes = _lane_pair_sums(e, mb, q, pairs)
        for i in range(mb):
            for ln, s in ((q, lanes[2 * i]), (q + 4, lanes[2 * i + 1])):
                e.acc[i][ln] = e.fma(ts[i], e.cvt32(s), e.acc[i][ln])
    # mins: lane m = min_2m * q8s_2m + min_2m+1 * q8s_2m+1 (q8s_j = activation sum of sub-block j),
    # acc_m = fma(-y.d * f16(x.dmin), float(lane), acc_m)
    mins = [e.u8x16(128 + 16 * j) for j in range(8)]
    for i in range(mb):
        tm = b.fneg(b.fmul(e.dxs(i), dmin))
        for m in range(4):
            terms = []
            for j in (2 * m, 2 * m + 1):
                q8s = e.add(e.bsum(i, 2 * j), e.bsum(i, 2 * j + 1))
                terms.append(e.mul(mins[j], e.splat(q8s, R)))
            e.acc[i][8 + m] = e.fma(tm, e.cvt32(e.add(terms[0], terms[1])), e.acc[i][8 + m])


@register(Q.Q6_K, lanes=8, reduce=hsum8)
def _q6_k(e: Emit, mb: int) -> None:
    b = e.b
    d = e.f16x16(256)
    pairs = _q6_k_pairs(e)
    ts = [b.fmul(e.dxs(i), d) for i in range(mb)]
    scs = [e.u8x16(16 * j, signed=True) for j in range(16)]
    sums = [[None] * 8 for _ in range(mb)]
    for q in range(4):
        lanes = _lane_pair_sums(e, mb, q, pairs)
        for i in range(mb):
            sums[i][q], sums[i][q + 4] = lanes[2 * i], lanes[2 * i + 1]
    for i in range(mb):
        for ln in range(8):  # - 32 * (bsum_2l * sc_2l + bsum_2l+1 * sc_2l+1): llama.cpp's q8sclsub lane l
            corr = e.add(e.mul(scs[2 * ln], e.splat(e.bsum(i, 2 * ln), R)),
                         e.mul(scs[2 * ln + 1], e.splat(e.bsum(i, 2 * ln + 1), R)))
            corr = e.mul(corr, e.const(I32, R, 32))
            e.acc[i][ln] = e.fma(ts[i], e.cvt32(b.sub(sums[i][ln], corr)), e.acc[i][ln])


@register(Q.Q5_K)
def _q5_k(e: Emit, mb: int) -> None:
    _q45_k(e, mb, True)


def _crumb_pairs(e: Emit, t, bit_plane: bool):
    """16 pair vectors of run t from the 2-bit plane [+ the Q3_K bit plane, minus 4]."""
    lv = [e.wvec(e.lin(t, 128, 32 * u)) for u in range(4)]
    pairs = []
    for pp in range(16):
        code = e.bits2(lv[pp % 4], 2 * (pp // 4))
        if bit_plane:
            code = e.sub8(e.b.or_(code, e.shl(e.wbits(e.lin(t, 64, 1024 + 4 * pp)), 2)), 4)
        pairs.append(e.s16(code))
    return pairs


@register(Q.Q2_K)
def _q2_k(e: Emit, mb: int) -> None:
    b = e.b

    def run(t, acc, macc):
        s0, s1 = _run_sums(e, mb, t, _crumb_pairs(e, t, False))
        for h, s in ((0, s0), (1, s1)):
            packed = e.u8x16(e.lin(t, 32, 16 * h))
            sc = b.and_(packed, e.const(packed.type.element, R, 15))
            m = b.lshr(packed, e.const(packed.type.element, R, 4))
            acc = _accumulate(e, mb, acc, s, sc)
            macc = _min_sums(e, mb, macc, m, e.lin(t, 2, h), 1)
        return acc, macc

    acc, macc = _over_runs(e, mb, run, True)
    _finish(e, mb, acc, macc, 256)


@register(Q.Q3_K)
def _q3_k(e: Emit, mb: int) -> None:
    def run(t, acc, macc):
        s0, s1 = _run_sums(e, mb, t, _crumb_pairs(e, t, True))
        acc = _accumulate(e, mb, acc, s0, e.u8x16(e.lin(t, 32), signed=True))
        acc = _accumulate(e, mb, acc, s1, e.u8x16(e.lin(t, 32, 16), signed=True))
        return acc, macc

    acc, _ = _over_runs(e, mb, run, False)
    _finish(e, mb, acc, None, 256)
