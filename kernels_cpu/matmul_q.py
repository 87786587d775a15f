"""IR bodies of the 32-element block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the float formats.

Repacked layout of one (row group, block) — see repack.py:
  qs: pair vectors of 32 bytes (lane 2r+e = row r, element 2p+e), 4-bit codes two pairs per vector
      (low nibble = pair v, high nibble = pair v+8), Q5 high bits as one u32 per pair (bit = lane);
  sc: f16 d for the 16 rows, then (Q4_1 / Q5_1) f16 m for the 16 rows.
Activations: int16 (quantized per 32 like Q8_0), dx per 32; for the formats with a min (Q4_1, Q5_1) bs holds
the Q8_1 block sum s = f16(d*sum(xq)) (float32, even columns), as llama.cpp's block_q8_1.
y[r] += d[r]*dx * sum(w*xq)  (+ m[r] * s for the formats with a min), accumulated in double.
"""
from __future__ import annotations

from llvmlite import ir

from quant.types import QuantType as Q

from .matmul_ir import F16, F32, I16, I32, Emit, R, V, hsum8, hsum8_plus, register


def _lanes(e: Emit, mb: int, pairs8, with_min: bool = False) -> None:
    """llama.cpp's dot product (vec_dot_*_q8_0 / tinyBLAS_Q0_AVX, vec_dot_q4_1_q8_1 / q5_1_q8_1), lane for lane:
    per row 8 float accumulators; lane l gets fma(d*dx, float(sum of elements 4l..4l+3), lane l) per block
    (mul_sum_i8_pairs_float / mul_sum_us8_pairs_float then _mm256_fmadd_ps), summed at the end by hsum_float_8.
    with_min (block_q8_1 activations): a 9th accumulator is llama.cpp's scalar summs = fma(f16(x.m), y.s, summs),
    added after the hsum. Integer sums are exact, so only this float order matters; reproducing it gives
    llama.cpp's outputs bit for bit.

    pairs8: the block's 16 pair vectors as signed bytes (<32 x i8>). With int16 activations each lane is two
    vpdpwssd (pairs 2l, 2l+1); with uint8 activations (codes + 128, e.x_u8) the two pairs form one quad vector
    and a lane is one vpdpbusd, started from -128 * (the row's sum of the 4 weights), shared by the mb rows."""
    d = e.f16x16(0)
    m = e.f16x16(32) if with_min else None
    if e.x_u8:
        quads = [e.quad(pairs8[2 * ln], pairs8[2 * ln + 1]) for ln in range(8)]
        bias = e.splat(ir.Constant(I32, 0x80808080), R)
        starts = [e.b.sub(e.zeros_i32(), e.dpbusd(e.zeros_i32(), bias, q)) for q in quads]
    else:
        pairs = [e.s16(v) for v in pairs8]
    for i in range(mb):
        t = e.fmul(d, e.dxs(i))  # f16(x.d) * f16(y.d) in f32
        acc = e.acc[i]
        for ln in range(8):
            if e.x_u8:
                s = e.dpbusd(starts[ln], e.xquad(i, 4 * ln), quads[ln])
            else:
                s = e.madd(e.madd(e.zeros_i32(), pairs[2 * ln], i, 4 * ln), pairs[2 * ln + 1], i, 4 * ln + 2)
            acc[ln] = e.fma(t, e.cvt32(s), acc[ln])
        if with_min:  # bs holds y.s as float32 at the block's even column
            ys = e.splat(e.load(e.bs, e.elem_off(e.bsoff, e.bsstride, i, 0, 4), F32), R)
            acc[8] = e.fma(m, ys, acc[8])


def _nibble_pairs(e: Emit, offset: int, high_bits: bool):
    """16 pair vectors (<32 x i8>, codes minus offset) from 8 nibble vectors [+ 16 u32 bit planes at 256]."""
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


@register(Q.Q8_0, lanes=8, reduce=hsum8)
def _q8_0(e: Emit, mb: int) -> None:
    _lanes(e, mb, [e.wvec(32 * p) for p in range(16)])


@register(Q.Q4_0, lanes=8, reduce=hsum8)
def _q4_0(e: Emit, mb: int) -> None:
    _lanes(e, mb, _nibble_pairs(e, 8, False))


@register(Q.Q4_1, lanes=9, reduce=hsum8_plus)
def _q4_1(e: Emit, mb: int) -> None:
    _lanes(e, mb, _nibble_pairs(e, 0, False), with_min=True)


@register(Q.Q5_0, lanes=8, reduce=hsum8)
def _q5_0(e: Emit, mb: int) -> None:
    _lanes(e, mb, _nibble_pairs(e, 16, True))


@register(Q.Q5_1, lanes=9, reduce=hsum8_plus)
def _q5_1(e: Emit, mb: int) -> None:
    _lanes(e, mb, _nibble_pairs(e, 0, True), with_min=True)


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
            s = e.wide(b.fadd(accs[i][0], accs[i][1]))
            e.acc[i] = b.fadd(e.acc[i], s)
    return body


def _row_f32(e: Emit, k: int):
    return e.load(e.qs, 64 * k, V(F32, R))


def _row_f16(e: Emit, k: int):
    return e.b.fpext(e.load(e.qs, 32 * k, V(F16, R)), V(F32, R))


def _row_bf16(e: Emit, k: int):
    b = e.b
    v = b.zext(e.load(e.qs, 32 * k, V(I16, R)), V(I32, R))
    return b.bitcast(b.shl(v, ir_const16(16)), V(F32, R))


def ir_const16(n: int):
    from llvmlite import ir

    return ir.Constant(V(I32, R), [n] * R)


register(Q.F32)(_float_body(_row_f32))
register(Q.F16)(_float_body(_row_f16))
register(Q.BF16)(_float_body(_row_bf16))
