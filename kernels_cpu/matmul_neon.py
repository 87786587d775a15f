"""The int8 block sums of the quantized formats on AArch64 NEON (and their target-independent twins).

Activations are int8 codes (-127..127, as every format quantizes them); weight codes are bytes of the pair
vectors (lane 2r+e = row r, element e of the pair), signed (Q8_0, the 32-block formats minus their offset) or
small unsigned (the k-quants, below 64, corrected for their offset by the caller). Two forms:

* with dotprod (Cortex-A76, Raspberry Pi 5): two pair vectors make a quad vector (row r's 4 bytes in dword r)
  and one `sdot` adds 4 rows x 4 products into 4 int32 lanes, against the activation quad broadcast;
* without (Cortex-A72, Raspberry Pi 4): `smull` / `smlal` multiply 8 bytes into 8 int16 products and
  accumulate a chunk of pairs in int16 (the caller's bound keeps every lane below 32768), then `sadalp` adds
  each row's two lanes into its int32 sum, or, where pairs carry a sub-block scale, `addp` makes the int16 row
  sums and `smlal` (int16 x int16 -> int32) multiplies them by the scale: widening multiply-accumulates only.

All sums are exact integers, so both forms give the other formats' results bit for bit. Without the "neon"
feature the same sequences are spelled as plain vector IR (sext / mul / shuffles) that any target lowers.
"""
from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir

from .ir_emit import I8, I16, I32, Emit, V


def _idx(idx) -> ir.Constant:
    return ir.Constant(V(I32, len(idx)), list(idx))


def _widen_mul(e: Emit, a, c, wide):
    """Lane-wise a * c (both n x iK) as n x `wide`: smull where NEON has it (8 x i8 or 4 x i16 operands)."""
    n = a.type.count
    if e.neon:
        name = f"llvm.aarch64.neon.smull.v{n}i{wide.width}"
        return e._x86(name, V(wide, n), [a, c])
    b = e.b
    return b.mul(b.sext(a, V(wide, n)), b.sext(c, V(wide, n)))


def _pair_sums(e: Emit, v, wide):
    """Sums of adjacent lanes (2j, 2j+1) of v, widened to `wide` (saddlp) or kept (addp of two halves)."""
    b = e.b
    n = v.type.count
    if e.neon and wide.width > v.type.element.width:
        return e._x86(f"llvm.aarch64.neon.saddlp.v{n // 2}i{wide.width}.v{n}i{v.type.element.width}",
                      V(wide, n // 2), [v])
    if wide.width > v.type.element.width:
        v = b.sext(v, V(wide, n))
    und = ir.Constant(v.type, ir.Undefined)
    return b.add(b.shuffle_vector(v, und, _idx(range(0, n, 2))), b.shuffle_vector(v, und, _idx(range(1, n, 2))))


def _addp(e: Emit, lo, hi):
    """<8 x i16> pairwise sums of lo then hi (addp): rows 0-3 from lo, 4-7 from hi, in row order."""
    if e.neon:
        return e._x86("llvm.aarch64.neon.addp.v8i16", V(I16, 8), [lo, hi])
    cat = e.b.shuffle_vector(lo, hi, _idx(range(16)))
    return _pair_sums(e, cat, I16)


def sdot(e: Emit, acc, q, x):
    """acc (<W x i32>) + per-dword sums of the 4 signed byte products of q and x (<W x i32> of bytes; x's dwords
    all equal, an activation quad broadcast). Bytes in -127..127."""
    b = e.b
    w = acc.type.count
    if e.dotprod:
        parts = []
        for a4, q4, x4 in zip(e._chunks(acc, 4), e._chunks(q, 4), e._chunks(x, 4)):
            parts.append(e._x86("llvm.aarch64.neon.sdot.v4i32.v16i8", V(I32, 4),
                                [a4, b.bitcast(q4, V(I8, 16)), b.bitcast(x4, V(I8, 16))]))
        return e._join(parts)
    if e.neon:  # per 4 rows: two smull of 8 bytes (2 rows x 4) by the quad, addp, sadalp; exact: two products of
        parts = []  # bytes in -127..127 sum to at most 32258 in int16
        for a4, q4, x4 in zip(e._chunks(acc, 4), e._chunks(q, 4), e._chunks(x, 4)):
            lo, hi = e._chunks(b.bitcast(q4, V(I8, 16)), 8)
            x8 = e._chunks(b.bitcast(x4, V(I8, 16)), 8)[0]  # the quad twice
            p16 = _addp(e, _widen_mul(e, lo, x8, I16), _widen_mul(e, hi, x8, I16))  # row r's pair sums at 2r, 2r+1
            parts.append(b.add(a4, _pair_sums(e, p16, I32)))
        return e._join(parts)
    n = 4 * w
    m = b.mul(b.sext(b.bitcast(q, V(I8, n)), V(I32, n)), b.sext(b.bitcast(x, V(I8, n)), V(I32, n)))
    und = ir.Constant(V(I32, n), ir.Undefined)
    for j in range(4):
        acc = b.add(acc, b.shuffle_vector(m, und, _idx(range(j, n, 4))))
    return acc


def s8_sums(e: Emit, mb: int, runs: int, pairs: int, code: Callable, scale: Callable, span: int,
            chunk: int) -> list:
    """Exact per-row sums (<W x i32>) of scale * code * x over `runs` runs of `pairs` pair vectors, with int8
    activations: code(t, p) -> <2W x i8> codes of pair p of run t (elements 2p, 2p+1 of the run), signed or
    below 128; scale(t, p) -> <W x i32> multiplier of the `span` pairs from p (None: 1). Without dotprod,
    `chunk` pairs (dividing span) are summed in int16: the caller picks it so that chunk * max|code| * 127
    (twice that with a scale) stays below 32768."""
    b = e.b
    w = e.w
    zero = e.zeros_i32()

    def xoff(t, p):
        return e.lin(t, 2 * pairs, 2 * p)

    def dot_step(t, state):
        out = list(state)
        for c0 in range(0, pairs, span):
            sc = scale(t, c0)
            s = list(out) if sc is None else [zero] * mb
            x16 = [None] * mb
            for p in range(c0, c0 + span, 2):  # one quad vector live at a time, shared by the rows
                q = e.quad(code(t, p), code(t, p + 1))
                lane = (p - c0) % 8 // 2
                if lane == 0:  # 16 activation bytes per row, each quad of them broadcast by sdot's lane index
                    x16 = [e.load(e.xq, e.elem_off(e.xoff, e.xstride, i, xoff(t, p), 1), V(I32, 4))
                           for i in range(mb)]
                xs = [b.shuffle_vector(x16[i], ir.Constant(V(I32, 4), ir.Undefined), _idx([lane] * w))
                      for i in range(mb)]
                s = [sdot(e, s[i], q, xs[i]) for i in range(mb)]
            out = s if sc is None else [b.add(out[i], b.mul(s[i], sc)) for i in range(mb)]
        return out

    def mull_step(t, state):
        out = list(state)
        for c0 in range(0, pairs, chunk):
            sc = scale(t, c0 - c0 % span)
            acc16 = [None] * mb  # per row: W/4 <8 x i16> pieces, lane 2r'+e of rows 4j .. 4j+3
            for p in range(c0, c0 + chunk):
                wp = e._chunks(code(t, p), 8)
                for i in range(mb):
                    x8 = e._chunks(e.xpair8(i, xoff(t, p)), 8)[0]  # the pair broadcast: every piece alike
                    prods = [_widen_mul(e, a, x8, I16) for a in wp]
                    acc16[i] = prods if acc16[i] is None else [b.add(u, v) for u, v in zip(acc16[i], prods)]
            for i in range(mb):
                if sc is None:  # sadalp: each row's two lanes into its int32 sum
                    add = e._join([_pair_sums(e, v, I32) for v in acc16[i]])
                else:  # addp to int16 row sums, then smlal by the scale (exact: |sum| * scale < 2^31)
                    rows16 = [_addp(e, acc16[i][j], acc16[i][j + 1]) for j in range(0, len(acc16[i]), 2)]
                    s16 = e._join(rows16)
                    sc16 = b.trunc(sc, V(I16, w))
                    add = e._join([_widen_mul(e, u, v, I32) for u, v in zip(e._chunks(s16, 4), e._chunks(sc16, 4))])
                out[i] = b.add(out[i], add)
        return out

    step = dot_step if e.dotprod else mull_step
    return e.loop(runs, step, [zero] * mb) if runs > 1 else step(0, [zero] * mb)
