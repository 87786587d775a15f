"""IR bodies of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the float formats.

Repacked layout of one (row group, block) — see repack.py:
  qs: pair vectors of 32 bytes (lane 2r+e = row r, element 2p+e), 4-bit codes two pairs per vector
      (low nibble = pair v, high nibble = pair v+8), Q5 high bits as one u32 per pair (bit = lane);
  sc: f16 d for the 16 rows, then (Q4_1 / Q5_1) f16 m for the 16 rows.
On x86 (repack.QUAD_32) the nibble formats' qs is instead one run of 32 as matmul_kquad stores the k-quants': 4
nibble vectors of quads ("nibq"), then Q5's fifth bits as one bit-plane vector ("bitq"); Q8_0's too where vpdpbusd
exists: its 8 quads with the codes + 128 ("q8q"). The quads take int8 activations.
Activations: int16 (quantized per 32 like Q8_0; int8 for the quads and on NEON), dx per 32; for the formats with a min (Q4_1, Q5_1) bs holds
the Q8_1 block sum s = f16(d*sum(xq)) (float32, even columns), as llama.cpp's block_q8_1.
y[r] += d[r]*dx * sum(w*xq)  (+ m[r] * s for the formats with a min): the block's integer sum is exact, then
one float32 fma per block and row.
"""
from __future__ import annotations

from quant.types import QuantType as Q

from .ir_emit import F16, F32, I16, I32, Emit, R, V
from .matmul_ir import register
from .matmul_kquad import FORMS, nib_quads, q5_k_quads, q8_quads, quad_sums
from .matmul_neon import s8_sums
from .repack import LAYOUTS, QUAD_32


def _finish32(e: Emit, mb: int, sums: list, with_min: bool) -> None:
    """acc += f16(x.d) * f16(y.d) * float(sum)  [+ f16(x.m) * y.s] for each row's exact block sum."""
    d = e.f16x16(0)
    m = e.f16x16(32) if with_min else None
    for i in range(mb):
        e.acc[i] = e.fma(e.fmul(d, e.dxs(i)), e.cvt32(sums[i]), e.acc[i])
        if with_min:  # bs holds y.s as float32 at the block's even column
            ys = e.splat(e.load(e.bs, e.elem_off(e.bsoff, e.bsstride, i, 0, 4), F32), e.w)
            e.acc[i] = e.fma(m, ys, e.acc[i])


def _minus_offset(e: Emit, mb: int, sums: list, offset: int) -> list:
    """Block sums of codes stored `offset` above their values: minus offset * (each row's activation sum)."""
    if not offset:
        return sums
    return [e.b.sub(sums[i], e.mul(e.splat(e.add(e.bsum(i, 0), e.bsum(i, 1)), e.w), e.c32(offset)))
            for i in range(mb)]


def _signed_sums(e: Emit, mb: int, pairs8) -> list:
    """Exact block sums sum(w * xq) per row (<W x i32>) from the 16 pair vectors as signed bytes (<2W x i8>;
    pair p holds elements (2p, 2p+1)) and int16 activations: 16 packed multiply-adds (vpmaddwd / vpdpwssd),
    pair-outer so that one widened weight vector is live at a time."""
    nc = e.chains(mb)
    sums = [e.zeros_i32()] * (mb * nc)
    for p in range(16):
        w16 = e.s16(pairs8[p])
        for i in range(mb):
            c = i * nc + p % nc
            sums[c] = e.madd(sums[c], w16, i, 2 * p)
    return [e.sum_chains(sums[i * nc:(i + 1) * nc]) for i in range(mb)]


def _nibble_pairs(e: Emit, offset: int, high_bits: bool):
    """16 pair vectors (<2W x i8>, codes minus offset) from 8 nibble vectors [+ 16 u32 bit planes at 256]."""
    pairs = [None] * 16
    for v in range(8):
        raw = e.wvec(32 * v)
        lo, hi = e.lo4(raw), e.hi4(raw)
        if high_bits:
            lo = e.b.or_(lo, e.shl(e.wbits(256 + 4 * v), 4))
            hi = e.b.or_(hi, e.shl(e.wbits(256 + 4 * (v + 8)), 4))
        if offset:
            lo, hi = e.sub8(lo, offset), e.sub8(hi, offset)
        pairs[v], pairs[v + 8] = lo, hi
    return pairs


def _nibble_body(qt: Q, offset: int, high_bits: bool, with_min: bool):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1. With int8 activations on x86: unsigned codes x activations, minus offset * (the
    block's activation sum); as quad vectors (repack.QUAD_32: AVX2 / AVX-VNNI, 8-row slices) one vpmaddubsw (or
    vpdpbusd) per 4 elements of 8 rows, as matmul_kquad's run of 32; else by pair vectors (u8w_sums: 8 pairs, or
    4 with the fifth bit, summed in int16)."""
    max_code = max(offset, (32 if high_bits else 16) - 1 - offset)  # largest |code - offset|
    run = LAYOUTS[qt].qbytes  # one run of 32 elements: nibq bytes, then Q5's bitq

    def quads(e: Emit, t):
        return q5_k_quads(e, t, run) if high_bits else nib_quads(e, t)

    def body(e: Emit, mb: int) -> None:
        if qt in QUAD_32 and e.x_s8 and not e.neon:
            sums = quad_sums(e, mb, quads, lambda e_, t, pp: e_.c32(1), 8, 4 if high_bits else 8, runs=1)
            _finish32(e, mb, _minus_offset(e, mb, sums, offset), with_min)
            return
        if not e.x_s8:
            _finish32(e, mb, _signed_sums(e, mb, _nibble_pairs(e, offset, high_bits)), with_min)
            return
        if e.neon:  # signed codes (minus the offset) x int8 activations
            pairs = _nibble_pairs(e, offset, high_bits)
            sums = s8_sums(e, mb, 1, 16, lambda t, p: pairs[p], lambda t, p: None, 16, _s8_chunk(max_code))
            _finish32(e, mb, sums, with_min)
            return
        pairs = _nibble_pairs(e, 0, high_bits)
        sums = e.u8w_sums(mb, 1, 16, lambda t, p: pairs[p], lambda t, p: None, 4 if high_bits else 8)
        _finish32(e, mb, _minus_offset(e, mb, sums, offset), with_min)
    return body


def _s8_chunk(max_code: int) -> int:
    """Pairs of a 32-block summed in int16 by s8_sums without dotprod: the largest power of two <= 16 with
    chunk * max_code * 127 < 32768 (Q8_0: 2; Q4_0, Q4_1, Q5_0: 16; Q5_1: 8)."""
    c = 16
    while c * max_code * 127 > 32767:
        c //= 2
    return c


def _joint_sums(views: list, mb: int) -> None:
    """Q8_0 with int16 activations on AVX2, both 8-row slices of the group in one pass (matmul_ir.JOINT): the 16
    pairs as an IR loop whose step widens each slice's pair vector once and multiplies it by the mb rows' pair
    broadcasts, each loaded once for both slices (the slice-by-slice pass loaded it twice and spent an address
    add per row and pair). Same integer sums as _signed_sums, hence the same outputs. Unrolled (_signed_sums over
    16 pairs per slice), LLVM hoisted all 16 widenings and spilled at 4+ rows; one row keeps that form."""
    e = views[0]

    def step(p, sums):
        out = []
        for j, v in enumerate(views):
            w16 = v.s16(v.wvec(v.lin(p, 32)))
            out += [v.madd(sums[j * mb + i], w16, i, v.lin(p, 2)) for i in range(mb)]
        return out

    sums = e.loop(16, step, [e.zeros_i32()] * (mb * len(views)))
    for j, v in enumerate(views):
        _finish32(v, mb, sums[j * mb:(j + 1) * mb], False)


@register(Q.Q8_0, sliced=Q.Q8_0 in QUAD_32, joint=None if Q.Q8_0 in QUAD_32 else _joint_sums)
def _q8_0(e: Emit, mb: int) -> None:
    if Q.Q8_0 in QUAD_32 and e.x_s8 and not e.neon:
        # quads of codes + 128 x int8 activations: vpdpbusd (its widening form at a width without it; vpmaddubsw's
        # int16 pairs would saturate on codes up to 255), minus 128 * the activation sum
        sums = quad_sums(e, mb, q8_quads, lambda e_, t, pp: e_.c32(1), 8, 8, runs=1, fm=FORMS["vnni"])
        _finish32(e, mb, _minus_offset(e, mb, sums, 128), False)
        return
    pairs = [e.wvec(32 * p) for p in range(16)]
    if e.x_s8:  # int8 activations (NEON): signed weights as they are
        sums = s8_sums(e, mb, 1, 16, lambda t, p: pairs[p], lambda t, p: None, 16, _s8_chunk(128))
    else:
        sums = _signed_sums(e, mb, pairs)
    _finish32(e, mb, sums, False)


for _qt, _args in {Q.Q4_0: (8, False, False), Q.Q4_1: (0, False, True), Q.Q5_0: (16, True, False),
                   Q.Q5_1: (0, True, True)}.items():
    register(_qt, sliced=_qt in QUAD_32)(_nibble_body(_qt, *_args))


# -- float formats: qs holds 32 k-values x 16 rows (row fastest); activations are float32 ----------------------
FLOAT_BLOCK = 32


def _float_body(load_row):
    def body(e: Emit, mb: int) -> None:
        b = e.b
        # 2 FMA chains per row (even / odd k), summed in a fixed order: the same in every row-tile variant
        accs = [[None] * 2 for _ in range(mb)]
        for k in range(FLOAT_BLOCK):
            w = load_row(e, k)
            for i in range(mb):
                x = e.xval(i, k)
                prev = accs[i][k % 2]
                accs[i][k % 2] = b.fmul(w, x) if prev is None else e.fma(w, x, prev)
        for i in range(mb):
            e.acc[i] = b.fadd(e.acc[i], b.fadd(accs[i][0], accs[i][1]))
    return body


def _row_f32(e: Emit, k: int):
    return e.load(e.qs, e.shift(4 * R * k, 4), V(F32, e.w))


def _row_f16(e: Emit, k: int):
    return e.b.fpext(e.load(e.qs, e.shift(2 * R * k, 2), V(F16, e.w)), V(F32, e.w))


def _row_bf16(e: Emit, k: int):
    b = e.b
    v = b.zext(e.load(e.qs, e.shift(2 * R * k, 2), V(I16, e.w)), V(I32, e.w))
    return b.bitcast(b.shl(v, e.c32(16)), V(F32, e.w))


register(Q.F32)(_float_body(_row_f32))
register(Q.F16)(_float_body(_row_f16))
register(Q.BF16)(_float_body(_row_bf16))
