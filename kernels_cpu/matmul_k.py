"""IR bodies of the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): one 256-element super-block per call.

Repacked layout of one (row group, super-block) — see repack.py. Elements come in 8 runs t of 32
(16 pairs pp each); pair vectors as in matmul_q:
  nibble plane (Q4_K, Q5_K, Q6_K): 64 vectors, vector t*8+v holds pair v (low) and pair v+8 (high) of run t;
  2-bit plane (Q6_K high bits at +2048, Q2_K / Q3_K low bits at 0): 32 vectors, vector t*4+u holds pairs
      u, u+4, u+8, u+12 of run t in bits 0-1, 2-3, 4-5, 6-7;
  bit plane (Q5_K bit 4 at +2048, Q3_K bit 2 at +1024): one u32 per pair (t*16+pp), bit = lane.
  sc: per-sub-block scales for the 16 rows (u8 or i8, sub-block-major), then f16 d [, f16 dmin].
Activations: int16 quantized per 256 (like Q8_K) with one dx, bs = sums per 16.

Every body reproduces llama.cpp's ggml_vec_dot_<type>_q8_K (AVX2 path) bit for bit. llama.cpp keeps 8 int32
lanes per super-block: lane l sums, over the 8 runs of 32, the scaled products of elements 4l..4l+3 of the run
(maddubs + madd with the broadcast sub-block scale); then acc_l = fma(d, float(lane l), acc_l) with
d = y.d * f16(x.d), and hsum_float_8 at the end. The min terms differ per type (see each body). Integer sums are
exact, so we may multiply the weights by their scale first (one vpmullw per pair vector, shared by all
activation rows) and accumulate each lane's pairs with vpdpwssd; lanes l and l+4 use pairs (2l, 2l+1) and
(2l+8, 2l+9) of each run, which share weight vectors, so they are computed together (2 live integer lanes per
row). Only the float operation order matters, and it is llama.cpp's.
"""
from __future__ import annotations

from quant.types import QuantType as Q

from .matmul_ir import I16, I32, Emit, R, V, hsum8, hsum8_plus, register


def _scale_pairs(e: Emit, v):
    """Sub-block scales of the 16 rows (<16 x i32>) as <32 x i16> (lane 2r+e = row r)."""
    b = e.b
    v = b.trunc(v, V(I16, R))
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


def _nibble_pairs(e: Emit, high_bits: bool):
    """Q4_K / Q5_K: pair_fn of _lane_pair_sums; codes 0..15 (or 0..31 with the bit plane) times the run's
    sub-block scale (one scale per run of 32)."""
    def fn(t, q):
        sc = _scale_pairs(e, e.u8x16(e.lin(t, 16)))
        lo, hi = [], []
        for v in (2 * q, 2 * q + 1):
            raw = e.wvec(e.lin(t, 256, 32 * v))
            nl, nh = e.lo4(raw), e.hi4(raw)
            if high_bits:
                nl = e.b.or_(nl, e.shl(e.wbits(e.lin(t, 64, 2048 + 4 * v)), 4))
                nh = e.b.or_(nh, e.shl(e.wbits(e.lin(t, 64, 2048 + 4 * (v + 8))), 4))
            lo.append(e.mul(e.s16(nl), sc))
            hi.append(e.mul(e.s16(nh), sc))
        return lo, hi
    return fn


def _crumb_pairs(e: Emit, bit_plane: bool):
    """Q2_K / Q3_K: pair_fn of _lane_pair_sums; 2-bit codes 0..3 (Q2_K, scale = low nibble of the packed
    scale/min byte) or, with the bit plane, (code | bit << 2) - 4 in -4..3 (Q3_K, signed scales); sub-blocks
    of 16: pairs 0..7 of run t use scale 2t, pairs 8..15 scale 2t+1."""
    def fn(t, q):
        scs = []
        for h in (0, 1):
            v = e.u8x16(e.lin(t, 32, 16 * h), signed=bit_plane)
            scs.append(_scale_pairs(e, v if bit_plane else e.b.and_(v, e.const(I32, R, 15))))
        lo, hi = [], []
        for pp in (2 * q, 2 * q + 1):
            vec = e.wvec(e.lin(t, 128, 32 * (pp % 4)))
            for p2, sc, dst in ((pp, scs[0], lo), (pp + 8, scs[1], hi)):
                code = e.bits2(vec, 2 * (p2 // 4))
                if bit_plane:
                    code = e.sub8(e.b.or_(code, e.shl(e.wbits(e.lin(t, 64, 1024 + 4 * p2)), 2)), 4)
                dst.append(e.mul(e.s16(code), sc))
        return lo, hi
    return fn


def _q6_k_pairs(e: Emit):
    def fn(t, q):
        sc_lo = _scale_pairs(e, e.u8x16(e.lin(t, 32), signed=True))
        sc_hi = _scale_pairs(e, e.u8x16(e.lin(t, 32, 16), signed=True))
        lo, hi = [], []
        for v in (2 * q, 2 * q + 1):
            raw = e.wvec(e.lin(t, 256, 32 * v))
            for pp, nib, sc, dst in ((v, e.lo4(raw), sc_lo, lo), (v + 8, e.hi4(raw), sc_hi, hi)):
                hv = e.wvec(e.lin(t, 128, 2048 + 32 * (pp % 4)))
                code = e.b.or_(nib, e.shl(e.bits2(hv, 2 * (pp // 4)), 4))  # 0..63 (llama.cpp: no -32 here)
                dst.append(e.mul(e.s16(code), sc))
        return lo, hi
    return fn


def _scaled_lanes(e: Emit, mb: int, pair_fn) -> None:
    """acc_l = fma(y.d * f16(x.d), float(integer lane l), acc_l) for the 8 lanes of every row."""
    d = e.f16x16(256)
    ts = [e.fmul(e.dxs(i), d) for i in range(mb)]
    for q in range(4):
        lanes = _lane_pair_sums(e, mb, q, pair_fn)
        for i in range(mb):
            for ln, s in ((q, lanes[2 * i]), (q + 4, lanes[2 * i + 1])):
                e.acc[i][ln] = e.fma(ts[i], e.cvt32(s), e.acc[i][ln])


def _neg_dmin(e: Emit, i: int):
    """-y.d * f16(x.dmin) of row i (dmin at scale offset 288)."""
    return e.fneg(e.fmul(e.dxs(i), e.f16x16(288)))


def _hsum8_plus_min(e: Emit, a: list):
    """Q4_K: hsum_float_8(acc) + the 4 min lanes summed as llama.cpp's acc_m: (m0+m2) + (m1+m3)."""
    m = a[8:]
    return e.b.fadd(hsum8(e, a[:8]), e.b.fadd(e.b.fadd(m[0], m[2]), e.b.fadd(m[1], m[3])))


@register(Q.Q4_K, lanes=12, reduce=_hsum8_plus_min)
def _q4_k(e: Emit, mb: int) -> None:
    _scaled_lanes(e, mb, _nibble_pairs(e, False))
    # mins: lane m = min_2m * q8s_2m + min_2m+1 * q8s_2m+1 (q8s_j = activation sum of sub-block j),
    # acc_m = fma(-y.d * f16(x.dmin), float(lane), acc_m)
    mins = [e.u8x16(128 + 16 * j) for j in range(8)]
    for i in range(mb):
        tm = _neg_dmin(e, i)
        for m in range(4):
            terms = []
            for j in (2 * m, 2 * m + 1):
                q8s = e.add(e.bsum(i, 2 * j), e.bsum(i, 2 * j + 1))
                terms.append(e.mul(mins[j], e.splat(q8s, R)))
            e.acc[i][8 + m] = e.fma(tm, e.cvt32(e.add(terms[0], terms[1])), e.acc[i][8 + m])


@register(Q.Q5_K, lanes=9, reduce=hsum8_plus)
def _q5_k(e: Emit, mb: int) -> None:
    _scaled_lanes(e, mb, _nibble_pairs(e, True))
    # mins: llama.cpp's scalar summs = fma(float(sum_j min_j * q8s_j), -y.d * f16(x.dmin), summs)
    mins = [e.u8x16(128 + 16 * j) for j in range(8)]
    for i in range(mb):
        tot = None
        for j in range(8):
            term = e.mul(mins[j], e.splat(e.add(e.bsum(i, 2 * j), e.bsum(i, 2 * j + 1)), R))
            tot = term if tot is None else e.add(tot, term)
        e.acc[i][8] = e.fma(e.cvt32(tot), _neg_dmin(e, i), e.acc[i][8])


@register(Q.Q3_K, lanes=8, reduce=hsum8)
def _q3_k(e: Emit, mb: int) -> None:
    _scaled_lanes(e, mb, _crumb_pairs(e, True))


@register(Q.Q2_K, lanes=8, reduce=hsum8)
def _q2_k(e: Emit, mb: int) -> None:
    # mins first, into the same lanes: lane l += fma(-y.d * f16(x.dmin), min_2l * bsum_2l + min_2l+1 * bsum_2l+1)
    mins = [e.b.lshr(e.u8x16(16 * j), e.const(I32, R, 4)) for j in range(16)]
    for i in range(mb):
        tm = _neg_dmin(e, i)
        for ln in range(8):
            lane = e.add(e.mul(mins[2 * ln], e.splat(e.bsum(i, 2 * ln), R)),
                         e.mul(mins[2 * ln + 1], e.splat(e.bsum(i, 2 * ln + 1), R)))
            e.acc[i][ln] = e.fma(tm, e.cvt32(lane), e.acc[i][ln])
    _scaled_lanes(e, mb, _crumb_pairs(e, False))


@register(Q.Q6_K, lanes=8, reduce=hsum8)
def _q6_k(e: Emit, mb: int) -> None:
    b = e.b
    d = e.f16x16(256)
    pairs = _q6_k_pairs(e)
    ts = [e.fmul(e.dxs(i), d) for i in range(mb)]
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


