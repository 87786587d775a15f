"""IR bodies of the k-quants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): one 256-element super-block per call.

On x86 the k-quants are stored as quad vectors and summed by matmul_kquad (int8 activations, vpdpbusd /
vpmaddubsw); the pair-vector layout and forms below serve them on AArch64.

Repacked layout of one (row group, super-block) — see repack.py. Elements come in 8 runs t of 32
(16 pairs pp each); pair vectors as in matmul_q:
  nibble plane (Q4_K, Q5_K, Q6_K): 64 vectors, vector t*8+v holds pair v (low) and pair v+8 (high) of run t;
  2-bit plane (Q6_K high bits at +2048, Q2_K / Q3_K low bits at 0): 32 vectors, vector t*4+u holds pairs
      u, u+4, u+8, u+12 of run t in bits 0-1, 2-3, 4-5, 6-7;
  bit plane (Q5_K bit 4 at +2048, Q3_K bit 2 at +1024): one u32 per pair (t*16+pp), bit = lane.
  sc: per-sub-block scales for the 16 rows (u8 or i8, sub-block-major), then f16 d [, f16 dmin].
Activations: int16 quantized per 256 (like Q8_K) with one dx, bs = sums per 16.

Each super-block's integer sum is exact, as ggml computes it, in one of two forms: int16 activations — the
weights multiplied by their sub-block scale first (one vpmullw per pair vector, shared by all activation rows)
and accumulated with packed multiply-adds (vpmaddwd / vpdpwssd); or int8 activations (AVX2 hosts) — the
unsigned codes times the activations with vpmaddubsw, a few pairs summed in int16, widened by the scale with
vpmaddwd (Emit.u8w_sums). Code offsets (Q3_K's 4, Q6_K's 32) are subtracted as exact corrections from the
activation sums. Then acc += y.d * f16(x.d) * float(sum) (one fma), and the min terms (sums of
min_j * activation sums of sub-block j, also exact) with their own fma.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from quant.types import QuantType as Q

from .ir_emit import I16, I32, Emit, V
from .matmul_ir import register
from .matmul_kquad import q2_k_quads, q3_k_quads, q4_k_quads, q5_k_quads, q6_k_quads, quad_sums
from .matmul_neon import s8_sums
from .repack import QUAD_K


def _scale_pairs(e: Emit, v):
    """Sub-block scales of the slice's rows (<W x i32>) as <2W x i16> (lane 2r+e = row r)."""
    b = e.b
    v = b.trunc(v, V(I16, e.w))
    return b.shuffle_vector(v, v, ir_index([r // 2 for r in range(2 * e.w)]))


def ir_index(idx):
    from llvmlite import ir

    return ir.Constant(V(I32, len(idx)), idx)


# -- per format: unsigned codes and sub-block scales of pair pp (0..15) of run t (0..7) ------------------------
def _nibble_codes(high_bits: bool):
    """Q4_K / Q5_K: codes 0..15 (0..31 with the bit plane at 2048); nibble vector v holds pairs v, v+8."""
    def codes(e: Emit, t, pp):
        v = pp % 8
        raw = e.wvec(e.lin(t, 256, 32 * v))
        c = e.lo4(raw) if pp < 8 else e.hi4(raw)
        if high_bits:
            c = e.b.or_(c, e.shl(e.wbits(e.lin(t, 64, 2048 + 4 * pp)), 4))
        return c
    return codes


def _crumb_codes(bit_plane: bool):
    """Q2_K: 2-bit codes 0..3; Q3_K: code | bit << 2 in 0..7 (the -4 is a correction); crumb vector u holds
    pairs u, u+4, u+8, u+12."""
    def codes(e: Emit, t, pp):
        c = e.bits2(e.wvec(e.lin(t, 128, 32 * (pp % 4))), 2 * (pp // 4))
        if bit_plane:
            c = e.b.or_(c, e.shl(e.wbits(e.lin(t, 64, 1024 + 4 * pp)), 2))
        return c
    return codes


def _q6_k_codes(e: Emit, t, pp):
    """Q6_K: 0..63 = low nibble | 2 high bits << 4 (the -32 is a correction)."""
    raw = e.wvec(e.lin(t, 256, 32 * (pp % 8)))
    nib = e.lo4(raw) if pp < 8 else e.hi4(raw)
    hv = e.wvec(e.lin(t, 128, 2048 + 32 * (pp % 4)))
    return e.b.or_(nib, e.shl(e.bits2(hv, 2 * (pp // 4)), 4))


def _run_scale(e: Emit, t, pp):
    """Q4_K / Q5_K: one unsigned 6-bit scale per run of 32."""
    return e.u8x16(e.lin(t, 16))


def _half_scale(signed: bool, mask: int | None = None):
    """Q2_K / Q3_K / Q6_K: sub-blocks of 16: pairs 0..7 of run t use scale 2t, pairs 8..15 scale 2t+1."""
    def scale(e: Emit, t, pp):
        v = e.u8x16(e.lin(t, 32, 16 * (pp // 8)), signed=signed)
        return v if mask is None else e.b.and_(v, e.c32(mask))
    return scale


@dataclass(frozen=True)
class KSpec:
    """One k-quant: codes / scale (functions above), pairs sharing one scale (span), int16 pairs per
    vpmaddubsw / smlal chunk (2 * chunk * max code * 127 < 32768), the code offset subtracted as
    offset * sum_j scale_j * q8sum_j over the 16 sub-blocks of 16 (Q3_K, Q6_K), the number of min
    sub-blocks (0: none), and where the layout is quad vectors (repack.QUAD_K) their codes (matmul_kquad; the
    chunk then counts quads, of two int16 pairs per row each: the same bound)."""

    codes: Callable
    scale: Callable
    span: int
    chunk: int
    offset: int = 0
    mins: int = 0
    quads: Callable | None = None


def _quads(qt: Q, fn: Callable) -> Callable | None:
    return fn if qt in QUAD_K else None


KSPECS = {
    Q.Q4_K: KSpec(_nibble_codes(False), _run_scale, 16, 8, mins=8, quads=_quads(Q.Q4_K, q4_k_quads)),  # 30480
    Q.Q5_K: KSpec(_nibble_codes(True), _run_scale, 16, 4, mins=8, quads=_quads(Q.Q5_K, q5_k_quads)),   # 31496
    Q.Q6_K: KSpec(_q6_k_codes, _half_scale(True), 8, 2, offset=32, quads=_quads(Q.Q6_K, q6_k_quads)),  # 32004
    Q.Q3_K: KSpec(_crumb_codes(True), _half_scale(True), 8, 8, offset=4, quads=_quads(Q.Q3_K, q3_k_quads)),
    Q.Q2_K: KSpec(_crumb_codes(False), _half_scale(False, 15), 8, 8, mins=16, quads=_quads(Q.Q2_K, q2_k_quads)),
}


def _int16_sums(e: Emit, mb: int, spec: KSpec) -> list:
    """Per row, the exact sum over the 8 runs of 32 of scale * code * x (<W x i32>): weights widened to int16
    and multiplied by their scale once (shared by the rows), then packed multiply-adds (vpmaddwd / vpdpwssd)."""

    nc = e.chains(mb)

    def step(t, state):
        out = list(state)
        for pp in range(16):
            w16 = e.mul(e.s16(spec.codes(e, t, pp)), _scale_pairs(e, spec.scale(e, t, pp)))
            for i in range(mb):
                c = i * nc + pp % nc
                out[c] = e.madd(out[c], w16, i, e.lin(t, 32, 2 * pp))
        return out

    st = e.loop(8, step, [e.zeros_i32()] * (mb * nc))
    return [e.sum_chains(st[i * nc:(i + 1) * nc]) for i in range(mb)]


def _neg_dmin(e: Emit, i: int):
    """-y.d * f16(x.dmin) of row i (dmin at scale offset 288)."""
    return e.fneg(e.fmul(e.dxs(i), e.f16x16(288)))


def _min_terms(e: Emit, mb: int, mins: list, runs: int) -> None:
    """acc -= y.d * f16(x.dmin) * sum_j min_j * q8s_j over the `runs` sub-blocks of 256 / runs elements, with
    q8s_j the exact activation sum of sub-block j (from the sums per 16 in bs)."""
    per = 16 // runs  # bsum entries (16 elements each) per sub-block
    for i in range(mb):
        tot = None
        for j in range(runs):
            q8s = e.bsum(i, per * j)
            for u in range(1, per):
                q8s = e.add(q8s, e.bsum(i, per * j + u))
            term = e.mul16(mins[j], e.splat(q8s, e.w))  # 6-bit min x a sum of <= 32 codes: both fit int16
            tot = term if tot is None else e.add(tot, term)
        e.acc[i] = e.fma(_neg_dmin(e, i), e.cvt32(tot), e.acc[i])


def _offset_corr(e: Emit, i: int, spec: KSpec):
    """offset * sum_j scale_j * q8sum_j over the 16 sub-blocks of 16 (exact), for row i."""
    tot = None
    for j in range(16):
        term = e.mul16(spec.scale(e, j // 2, 8 * (j % 2)), e.splat(e.bsum(i, j), e.w))  # int8 x 16 codes
        tot = term if tot is None else e.add(tot, term)
    return e.mul(tot, e.c32(spec.offset))


# On x86 the code-offset and min corrections run as vpmaddwd (vpdpwssd with VNNI) over pairs of sub-blocks: the
# coefficients' pair vectors are built once a block for all activation rows, then each row costs one multiply-add
# per pair instead of a broadcast, a 32-bit multiply and an add per sub-block. Same integers. Paired in one
# process, 4096x2048, 1 thread, Zen 4: AVX-512 8 rows Q4_K 1.075x, Q5_K 1.11x, Q6_K 1.04x, 1 row 1.0-1.03x;
# forced AVX2 8 rows Q4_K 1.06x, Q6_K 1.07x, 1 row Q6_K 1.05x. (NEON keeps smull per sub-block: _offset_corr,
# _min_terms.)


def _pair_terms(e: Emit, mb: int, coef: list, span: int) -> list:
    """Per row i, sum_j coef_j * (activation sum of sub-block j of `span` elements) (<W x i32>, exact) with
    the coefficients (<W x i32>, |c| < 2^15) paired as vpmaddwd operands, shared by the rows."""
    pairs = [e.interleave16(coef[2 * p], coef[2 * p + 1]) for p in range(len(coef) // 2)]
    out = []
    for i in range(mb):
        tot = None
        for wp, xp in zip(pairs, e.bsum_pairs(i, span)):
            term = e.pmadd(wp, xp)
            tot = term if tot is None else e.add(tot, term)
        out.append(tot)
    return out


def _offset_corrs(e: Emit, mb: int, spec: KSpec) -> list:
    """_offset_corr of every row (in pairs of sub-blocks on x86)."""
    if e.neon:
        return [_offset_corr(e, i, spec) for i in range(mb)]
    scales = [spec.scale(e, j // 2, 8 * (j % 2)) for j in range(16)]
    return [e.mul(t, e.c32(spec.offset)) for t in _pair_terms(e, mb, scales, 16)]


def _min_sums(e: Emit, mb: int, mins: list, runs: int):
    """acc -= y.d * f16(x.dmin) * sum_j min_j * q8s_j, as _min_terms (in pairs of sub-blocks on x86)."""
    if e.neon:
        _min_terms(e, mb, mins, runs)
        return
    for i, tot in enumerate(_pair_terms(e, mb, mins, 256 // runs)):
        e.acc[i] = e.fma(_neg_dmin(e, i), e.cvt32(tot), e.acc[i])


def _body(spec: KSpec):
    def body(e: Emit, mb: int) -> None:
        if spec.quads is not None and e.x_s8 and not e.neon:
            sums = quad_sums(e, mb, spec.quads, spec.scale, spec.span // 2, spec.chunk)
        elif e.x_s8 and e.neon:
            sums = s8_sums(e, mb, 8, 16, lambda t, p: spec.codes(e, t, p), lambda t, p: spec.scale(e, t, p),
                           spec.span, spec.chunk)
        elif e.x_s8:
            sums = e.u8w_sums(mb, 8, 16, lambda t, p: spec.codes(e, t, p), lambda t, p: spec.scale(e, t, p),
                              spec.chunk)
        else:
            sums = _int16_sums(e, mb, spec)
        d = e.f16x16(256)
        corr = _offset_corrs(e, mb, spec) if spec.offset else None
        for i in range(mb):
            s = sums[i] if corr is None else e.b.sub(sums[i], corr[i])
            e.acc[i] = e.fma(e.fmul(e.dxs(i), d), e.cvt32(s), e.acc[i])
        if spec.mins == 8:  # Q4_K / Q5_K: 6-bit mins after the 8 scales
            _min_sums(e, mb, [e.u8x16(128 + 16 * j) for j in range(8)], 8)
        elif spec.mins == 16:  # Q2_K: the min is the high nibble of each scale byte
            _min_sums(e, mb, [e.b.lshr(e.u8x16(16 * j), e.c32(4)) for j in range(16)], 16)
    return body


for _qt, _spec in KSPECS.items():
    quad = _spec.quads is not None  # quad vectors: slices of slice_width() rows, sharing a pass (SHARED)
    register(_qt, sliced=quad, shared=quad)(_body(_spec))
