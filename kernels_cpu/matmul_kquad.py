"""x86 block sums of the quad-vector formats (k-quants; Q4_0 .. Q5_1 on AVX2): unsigned codes x int8 activations.

Repacked layout of one (row group, super-block) on x86 (repack.QUAD_K; planes "nibq", "bitq", "crumbq"): 8 runs t
of 32 elements, each 8 *quad vectors* of 64 bytes (byte 4r+e = row r, element 4l+e of quad l of the run), stored
run by run (run t at t * RUN bytes, RUN = 256, 320 (Q5_K), 384 (Q6_K)):
  nibq (at 0 of the run, 256 bytes): vector j (0..3) holds the codes' bits 0-3 of quad j (low nibbles) and of
      quad j+4 (high nibbles), as matmul_iq's table-lookup formats;
  bitq (Q5_K, at 256, 64 bytes): bit l of each byte = bit 4 of quad l;
  crumbq (Q6_K, at 256, 128 bytes): vector u (0, 1) holds bits 4-5 of quads u, u+2, u+4, u+6 in its
      bits 0-1, 2-3, 4-5, 6-7.
Q2_K and Q3_K have no nibble plane: their run (128 / 192 bytes) starts with crumbq0 (as crumbq, of bits 0-1), then
for Q3_K bitq2 (as bitq, of bit 2).
Scales as matmul_k describes them. A quad vector of codes (0..63) is then, as it is, the unsigned operand of a
4-product dot against the broadcast int8 activation quad of each row: no shuffle, one instruction per 64
products, where the pair vectors of matmul_k take two (ggml's Q8_K activations are int8 too).

Dot forms (FORMS, chosen per target by form()):
  vnni: vpdpbusd per quad and row into the int32 sum of each sub-block, times its scale (vpmulld);
  madd: vpmaddubsw per quad and row (pairs <= 2*63*127, no saturation), `chunk` quads summed in int16, widened
        by the sub-block scale with vpmaddwd (the scale in both halves of each row's dword), as ggml on AVX2.
Both give the same exact integer sums; code offsets and mins are corrected by the caller (matmul_k).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir

from quant.types import QuantType as Q

from .ir_emit import I8, I16, I32, Emit, V
from .repack import LAYOUTS

NIB_RUN = 256  # nibq bytes of one run of 32 elements for the 16 rows (the bitq / crumbq bytes follow them)


def _run(qt: Q) -> int:
    """Bytes of one run of 32 elements (16 rows) in qt's repacked block: an eighth of the block."""
    return LAYOUTS[qt].qbytes // 8


def _bytes(e: Emit, val: int):
    return ir.Constant(V(I8, 4 * e.w), [val] * (4 * e.w))


def _load(e: Emit, off):
    """The slice's bytes of the 64-byte quad vector at byte offset off (int or i64) of the (group, block)."""
    return e.load(e.qs, e.shift(off, 4), V(I8, 4 * e.w))


def _shift(e: Emit, v, n: int):
    """v << n (n > 0) or v >> -n (logical), bytewise."""
    b = e.b
    return b.shl(v, _bytes(e, n)) if n > 0 else (b.lshr(v, _bytes(e, -n)) if n < 0 else v)


def nib_quads(e: Emit, t, run: int = NIB_RUN) -> list:
    """The 8 quad vectors (<4W x i8>, quad l at index l) of the codes' bits 0-3 in run t (int or i64) of `run`
    bytes."""
    lo, hi = [None] * 4, [None] * 4
    for j in range(4):
        raw = _load(e, e.lin(t, run, 64 * j))
        lo[j], hi[j] = e.b.and_(raw, _bytes(e, 15)), e.b.lshr(raw, _bytes(e, 4))
    return lo + hi


def q8_quads(e: Emit, t) -> list:
    """The 8 quad vectors of a Q8_0 block stored as quads (repack plane "q8q": codes + 128, 0..255), run t = 0."""
    return [_load(e, e.lin(t, 512, 64 * j)) for j in range(8)]


def q4_k_quads(e: Emit, t) -> list:
    return nib_quads(e, t)


def q5_k_quads(e: Emit, t, run: int | None = None) -> list:
    """Codes 0..31: bit 4 of quad l is bit l of the bitq vector (after the run's nibq bytes; runs of `run` bytes,
    Q5_K's by default)."""
    run = _run(Q.Q5_K) if run is None else run
    hb = _load(e, e.lin(t, run, NIB_RUN))
    return [e.b.or_(q, e.b.and_(_shift(e, hb, 4 - l), _bytes(e, 16))) for l, q in enumerate(nib_quads(e, t, run))]


def q6_k_quads(e: Emit, t) -> list:
    """Codes 0..63: bits 4-5 of quad l = 2s + u are bits 2s, 2s+1 of crumbq vector u."""
    run = _run(Q.Q6_K)
    hv = [_load(e, e.lin(t, run, NIB_RUN + 64 * u)) for u in range(2)]
    return [e.b.or_(q, e.b.and_(_shift(e, hv[l % 2], 4 - 2 * (l // 2)), _bytes(e, 0x30)))
            for l, q in enumerate(nib_quads(e, t, run))]


def _crumbs(e: Emit, t, run: int) -> list:
    """Bits 0-1 of the 8 quads of run t: quad l = 2s + u is bits 2s, 2s+1 of crumbq0 vector u (at 0 of the run)."""
    cv = [_load(e, e.lin(t, run, 64 * u)) for u in range(2)]
    return [e.b.and_(_shift(e, cv[l % 2], -2 * (l // 2)), _bytes(e, 3)) for l in range(8)]


def q2_k_quads(e: Emit, t) -> list:
    """Codes 0..3."""
    return _crumbs(e, t, _run(Q.Q2_K))


def q3_k_quads(e: Emit, t) -> list:
    """Codes 0..7 (the -4 is a correction): bit 2 of quad l is bit l of the bitq2 vector (at 128 of the run)."""
    run = _run(Q.Q3_K)
    hb = _load(e, e.lin(t, run, 128))
    return [e.b.or_(q, e.b.and_(_shift(e, hb, 2 - l), _bytes(e, 4))) for l, q in enumerate(_crumbs(e, t, run))]


def _scale_pairs(e: Emit, v):
    """Per-row scales <W x i32> as <2W x i16> with row r's scale in both halves of dword r."""
    b = e.b
    v = b.trunc(v, V(I16, e.w))
    return b.shuffle_vector(v, v, ir.Constant(V(I32, 2 * e.w), [r // 2 for r in range(2 * e.w)]))


def _vnni_sub(e: Emit, mb: int, quads: list, xq: Callable, sc, out: list) -> list:
    """out[i] + sc * sum over the quads of dot(quad, activation quad of row i): chains of vpdpbusd."""
    nc = min(e.chains(mb), len(quads))
    sums = [e.zeros_i32()] * (mb * nc)
    for l, q in quads:
        wq = e.b.bitcast(q, V(I32, e.w))
        for i in range(mb):
            c = i * nc + l % nc
            sums[c] = e.dpbusd(sums[c], wq, xq(i, l))
    return [e.add(out[i], e.mul(e.sum_chains(sums[i * nc:(i + 1) * nc]), sc)) for i in range(mb)]


def _madd_sub(e: Emit, mb: int, quads: list, xq: Callable, sc, out: list, chunk: int) -> list:
    """out[i] + sc * sum over the quads of the 4 products per row: vpmaddubsw, `chunk` quads summed in int16,
    then one vpmaddwd by the scale pairs per chunk."""
    b = e.b
    sp = _scale_pairs(e, sc)
    out = list(out)
    for c0 in range(0, len(quads), chunk):
        acc16 = [None] * mb
        for l, q in quads[c0:c0 + chunk]:
            for i in range(mb):
                m = e.maddubs(q, b.bitcast(xq(i, l), V(I8, 4 * e.w)))
                acc16[i] = m if acc16[i] is None else b.add(acc16[i], m)
        out = [e.add(out[i], e.pmadd(acc16[i], sp)) for i in range(mb)]
    return out


@dataclass(frozen=True)
class Form:
    """How a target sums the quads of one sub-block: sub(e, mb, [(l, quad)], xq, scale, out, chunk) -> out
    plus scale times the sub-block's per-row dot products (<W x i32> each)."""

    sub: Callable


FORMS = {"vnni": Form(lambda e, mb, qs, xq, sc, out, chunk: _vnni_sub(e, mb, qs, xq, sc, out)),
         "madd": Form(_madd_sub)}


def form(e: Emit) -> Form:
    """vpdpbusd where this slice width has it (AVX-512 VNNI, AVX-VNNI), else vpmaddubsw + vpmaddwd."""
    return FORMS["vnni"] if e.has_vnni("vpdpbusd") else FORMS["madd"]


def quad_sums(e: Emit, mb: int, quads: Callable, scale: Callable, per_scale: int, chunk: int,
              runs: int = 8, fm: Form | None = None) -> list:
    """Exact per-row sums (<W x i32>) over the block's `runs` runs (8 of a super-block, 1 of a 32-block) of
    scale * code * x: quads(e, t) -> the run's 8 quad vectors of codes; scale(e, t, pp) -> <W x i32> scales of
    pair pp of run t, shared by `per_scale` consecutive quads; `chunk` quads (dividing per_scale) summed in int16
    by the madd form. fm: the form to use instead of the target's (form(e))."""
    fm = fm or form(e)

    def xq(t):
        return lambda i, l: e.xquad(i, e.lin(t, 32, 4 * l))

    def step(t, state):
        qv = quads(e, t)
        for s0 in range(0, 8, per_scale):
            state = fm.sub(e, mb, [(l, qv[l]) for l in range(s0, s0 + per_scale)], xq(t), scale(e, t, 2 * s0),
                           state, chunk)
        return state

    zero = [e.zeros_i32()] * mb
    return e.loop(runs, step, zero) if runs > 1 else step(0, zero)
