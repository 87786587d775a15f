"""IR bodies of the non-linear 4-bit formats (IQ4_NL, MXFP4 per 32; IQ4_XS per 256 with 8 sub-block scales).

Their 4-bit codes index a 16-entry int8 table (kvalues_iq4nl, kvalues_mxfp4 of ggml-common.h), so the kernels do
what ggml-cpu's ggml_vec_dot_iq4_nl_q8_0 / _mxfp4_q8_0 / _iq4_xs_q8_K do: look the codes up as int8 weights
(vpshufb on x86, tbl on NEON, a select tree in the portable form) and take exact int8 dot products with int8
activations quantized per 32 (q8_0) or per 256 (q8_K); then one float32 fma per block and row.

Repacked layout of one (row group, block) — see repack.py, plane "nibq". Elements come in runs of 32 (IQ4_XS: 8
runs); a run is 8 *quad vectors* of 64 bytes (byte 4r+e = row r, element 4l+e of quad l), stored as 4 nibble
vectors: vector j holds quad j in the low nibbles and quad j+4 in the high ones. A looked-up quad vector is
then, as it is, the weight operand of a 4-product dot instruction (vpdpbusd, sdot) against the broadcast
activation quad of each row: no shuffle.
  sc: IQ4_NL: f16 d of the 16 rows; MXFP4: the E8M0 exponent byte of the 16 rows; IQ4_XS: the 8 signed
      sub-block scales (ls - 32) of the 16 rows (sub-block-major), then f16 d at 128.

Dot forms (per target, see FORMS):
  vnni:  the table + 128 as unsigned bytes, vpdpbusd(u8 weights, s8 activations), minus 128 * the run's
         activation sum (exact, from bs);
  sign:  AVX2 / AVX-512 without VNNI: |w| x sign(x, w) with vpmaddubsw (pairs <= 2*127*127, no saturation), then
         vpmaddwd by ones (ggml's mul_add_epi8);
  sdot:  NEON sdot (signed x signed) with dotprod, else its widening twin; also the portable form.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from quant.iquants import KV_IQ4NL, KV_MXFP4
from quant.types import QuantType as Q

from .ir_emit import F32, I8, I16, I32, Emit, V
from .matmul_ir import register
from .matmul_neon import sdot

RUN_BYTES = 256  # nibble bytes of one run of 32 elements for the 16 rows


def _s8(v: int) -> int:
    return (v + 128) % 256 - 128


def _bytes(e: Emit, n: int, val: int):
    return ir.Constant(V(I8, n), [_s8(val)] * n)


def lookup(e: Emit, idx, table) -> ir.Value:
    """table[idx] lane by lane: idx <n x i8> of codes 0..15, table 16 ints (as bytes) -> <n x i8>."""
    b = e.b
    n = idx.type.count
    tab = [_s8(int(v)) for v in table]
    feats = e.feats
    if "avx512bw" in feats and n == 64:  # vpshufb looks up within each 16-byte lane: the table in every lane
        return e.call("llvm.x86.avx512.pshuf.b.512", V(I8, 64), [ir.Constant(V(I8, 64), tab * 4), idx])
    if "avx2" in feats and n == 32:
        return e.call("llvm.x86.avx2.pshuf.b", V(I8, 32), [ir.Constant(V(I8, 32), tab * 2), idx])
    if e.neon and n % 16 == 0:
        t16 = ir.Constant(V(I8, 16), tab)
        return e.join([e.call("llvm.aarch64.neon.tbl1.v16i8", V(I8, 16), [t16, c]) for c in e.chunks(idx, 16)])
    # portable: a binary select tree on the code's 4 bits (15 selects)
    vals = [ir.Constant(V(I8, n), [v] * n) for v in tab]
    for bit in range(4):
        hit = b.icmp_unsigned("!=", b.and_(idx, _bytes(e, n, 1 << bit)), _bytes(e, n, 0))
        vals = [b.select(hit, vals[2 * j + 1], vals[2 * j]) for j in range(len(vals) // 2)]
    return vals[0]


def _dot_u8(e: Emit, acc, wq, xq):
    return e.dpbusd(acc, wq, xq)  # unsigned weights (first byte operand) x signed activations


def _dot_sign(e: Emit, acc, wq, xq):
    """acc + per-dword sums of 4 signed products, as |w| x sign(x, w) with vpmaddubsw + vpmaddwd by ones."""
    b = e.b
    n = 4 * e.w
    w8, x8 = b.bitcast(wq, V(I8, n)), b.bitcast(xq, V(I8, n))
    neg = b.icmp_signed("<", w8, _bytes(e, n, 0))
    aw = b.select(neg, b.sub(_bytes(e, n, 0), w8), w8)  # vpabsb
    if "avx2" in e.feats and n == 32:
        sx = e.call("llvm.x86.avx2.psign.b", V(I8, 32), [x8, w8])
    else:  # no 512-bit vpsignb: negate where w < 0 (where w = 0 the product is 0 either way)
        sx = b.select(neg, b.sub(_bytes(e, n, 0), x8), x8)
    m16 = e.maddubs(aw, sx)  # <2W x i16>: each row's two pair sums, |.| <= 2*127*127
    return e.add(acc, e.pmadd(m16, ir.Constant(V(I16, 2 * e.w), [1] * (2 * e.w))))


@dataclass(frozen=True)
class Form:
    """How a target multiplies looked-up weight quads with int8 activation quads: the offset added to the table
    (128: unsigned bytes), and dot(e, acc, wq, xq) -> acc + per-dword sums of 4 products (<W x i32> each)."""

    offset: int
    dot: Callable


FORMS = {"vnni": Form(128, _dot_u8), "sign": Form(0, _dot_sign), "sdot": Form(0, sdot)}


def form(e: Emit) -> Form:
    """The dot form of this slice's target (see the module docstring)."""
    if e.has_vnni("vpdpbusd"):
        return FORMS["vnni"]
    if not e.neon and ("avx2" in e.feats or "avx512bw" in e.feats):
        return FORMS["sign"]
    return FORMS["sdot"]


def run_sums(e: Emit, mb: int, run, table, fm: Form) -> list:
    """Exact per-row sums (<W x i32>) of table[code] * x over run `run` (int or i64) of 32 elements."""
    b = e.b
    n = 4 * e.w
    tab = [int(v) + fm.offset for v in table]
    nc = e.chains(mb)
    sums = [e.zeros_i32()] * (mb * nc)
    for j in range(4):
        raw = e.load(e.qs, e.shift(e.lin(run, RUN_BYTES, 64 * j), 4), V(I8, n))
        codes = (b.and_(raw, _bytes(e, n, 15)), b.lshr(raw, _bytes(e, n, 4)))
        for half, idx in enumerate(codes):
            quad = 4 * half + j
            wq = b.bitcast(lookup(e, idx, tab), V(I32, e.w))
            for i in range(mb):
                c = i * nc + quad % nc
                sums[c] = fm.dot(e, sums[c], wq, e.xquad(i, e.lin(run, 32, 4 * quad)))
    out = [e.sum_chains(sums[i * nc:(i + 1) * nc]) for i in range(mb)]
    if fm.offset:  # (w + offset) * x summed: subtract offset * the run's activation sum (two sums of 16)
        for i in range(mb):
            xs = e.add(e.bsum(i, e.lin(run, 2)), e.bsum(i, e.lin(run, 2, 1)))
            out[i] = b.sub(out[i], e.splat(b.mul(xs, ir.Constant(I32, fm.offset)), e.w))
    return out


def _f16_d(e: Emit):
    return e.f16x16(0)


def _e8m0_half(e: Emit):
    """ggml_e8m0_to_fp32_half of the rows' exponent bytes: 2^(e-128) as float bits ((e-1) << 23; below e = 2
    the denormals 0x00200000 << e)."""
    b = e.b
    v = e.u8x16(0)
    small = b.icmp_unsigned("<", v, e.c32(2))
    den = b.shl(e.c32(0x00200000), b.and_(v, e.c32(1)))
    norm = b.shl(b.sub(v, e.c32(1)), e.c32(23))
    return b.bitcast(b.select(small, den, norm), V(F32, e.w))


def _block32(table, scale: Callable):
    """IQ4_NL / MXFP4: acc += (x.d * y.d) * sumi per block, as ggml."""

    def body(e: Emit, mb: int) -> None:
        sums = run_sums(e, mb, 0, table, form(e))
        d = scale(e)
        for i in range(mb):
            e.acc[i] = e.fma(e.fmul(d, e.dxs(i)), e.cvt32(sums[i]), e.acc[i])
    return body


def _iq4_xs(e: Emit, mb: int) -> None:
    """acc += (x.d * y.d) * sum_j (ls_j - 32) * sumi_j over the 8 sub-blocks of 32 (exact in int32)."""
    fm = form(e)

    def step(t, state):
        sums = run_sums(e, mb, t, KV_IQ4NL, fm)
        ls = e.u8x16(e.lin(t, 16), signed=True)  # <W x i32> the rows' sub-block scale
        return [e.add(state[i], e.mul(sums[i], ls)) for i in range(mb)]

    tot = e.loop(8, step, [e.zeros_i32()] * mb)
    d = e.f16x16(128)
    for i in range(mb):
        e.acc[i] = e.fma(e.fmul(e.dxs(i), d), e.cvt32(tot[i]), e.acc[i])


register(Q.IQ4_NL, sliced=True)(_block32(KV_IQ4NL, _f16_d))
register(Q.MXFP4, sliced=True)(_block32(KV_MXFP4, _e8m0_half))
register(Q.IQ4_XS, sliced=True, shared=True)(_iq4_xs)
