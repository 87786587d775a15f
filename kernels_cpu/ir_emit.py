"""The IR vocabulary of the fused matmul kernels (kernels_cpu.matmul_ir): LLVM types, the row-group geometry (R,
slice width, activation rows a pass) and Emit, the vector operations a format's block body is written in (loads from
the repacked weights, activation broadcasts, the packed integer multiply-adds of each ISA: vpmaddwd / vpmaddubsw /
VNNI on x86, smull / sadalp / sdot on NEON, the float fma into the accumulators).
"""
from __future__ import annotations

import copy
from collections.abc import Callable

from llvmlite import ir

from ._jit import host_features

R = 16  # output rows per group (the repacked layout; a kernel pass covers W of them, see slice_width)
PREFETCH_LOCALITY = 2  # llvm.prefetch locality 2: x86 prefetcht1 (to L2), AArch64 prfm pldl2keep

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()


def V(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


def slice_width(feats: frozenset[str] | None = None) -> int:
    """Rows of a group handled per pass (W): 16 with AVX-512 (one zmm of floats), else 8 (one ymm / two NEON
    q registers). A narrower pass keeps the accumulators and weight vectors of a block in registers."""
    feats = host_features() if feats is None else feats
    return R if "avx512bw" in feats and "avx512f" in feats else 8


def max_rows(feats: frozenset[str] | None = None) -> int:
    """Activation rows per pass over K: 8 with AVX-512's 32 registers, 4 otherwise. The decode pass (1 row)
    never spills; 4 rows spill a few vectors on AVX2 but beat 2 passes of 2 (re-decoding the weights costs more;
    forced AVX2 here, 8 rows: Q5_0 2048x640 0.134 -> 0.110 ms)."""
    return 8 if slice_width(feats) == R else 4




class Emit:
    """IR helpers bound to one intrinsic call site: pointers into the flat arrays and vector ops on the current
    slice of W rows of the 16-row group (rows lane0 .. lane0+W-1)."""

    def __init__(self, builder, ptrs, offs, xdtype: str, w: int, feats: frozenset[str]):
        """ptrs: byte pointers (facc, xq, dx, bs, qs, sc); offs: i64 values (xoff, xstride, dxoff, dxstride,
        bsoff, bsstride, qoff, soff); xdtype: the activation codes' type ('int16', 'int8'); feats: the
        target's LLVM feature names (which instructions the bodies use)."""
        self.b = builder
        self.w = w
        self.lane0 = 0
        self.feats = feats
        self.neon = "neon" in feats  # AArch64 NEON bodies (smull / sadalp; sdot with dotprod)
        self.dotprod = self.neon and "dotprod" in feats
        facc, xq, dx, bs, qs, sc = ptrs
        xoff, xstride, dxoff, dxstride, bsoff, bsstride, qoff, soff = offs
        self.facc = facc
        self.xq, self.xoff, self.xstride = xq, xoff, xstride
        # int8 activations: the unsigned-weight form (codes u8 x activations s8, vpmaddubsw; see maddubs), and
        # on NEON every quantized format's form (matmul_neon.s8_sums)
        self.x_s8 = xdtype == "int8"
        self.dx, self.dxoff, self.dxstride = dx, dxoff, dxstride
        self.bs, self.bsoff, self.bsstride = bs, bsoff, bsstride
        self.qs = builder.gep(qs, [qoff])
        self.sc = builder.gep(sc, [soff])
        # <W x float> output accumulators of the mb rows (SSA values carried across the K blocks): bodies
        # add their block's scaled integer sums with e.acc[i] = e.fma(..., e.acc[i]).
        self.acc: list = []
        # weight lines to prefetch (byte pointer, count) that the body's first run loop spreads over its
        # iterations (see spread_prefetch); None once issued
        self.pending_prefetch = None

    def part(self, lane0: int, row0: int):
        """A view of rows lane0.. of the group and activation rows row0.. of the call."""
        v = copy.copy(self)
        bld = self.b
        v.lane0 = lane0
        r = ir.Constant(I64, row0)
        v.xoff = bld.add(self.xoff, bld.mul(self.xstride, r))
        v.dxoff = bld.add(self.dxoff, bld.mul(self.dxstride, r))
        v.bsoff = bld.add(self.bsoff, bld.mul(self.bsstride, r))
        return v

    def block(self, b, qbytes, sbytes, xelems):
        """A view of block b (i64) of the row group: weight, scale and activation offsets moved along K."""
        v = copy.copy(self)
        bld = self.b
        v.qs = bld.gep(self.qs, [bld.mul(b, qbytes)])
        v.sc = bld.gep(self.sc, [bld.mul(b, sbytes)])
        v.xoff = bld.add(self.xoff, bld.mul(b, xelems))
        v.dxoff = bld.add(self.dxoff, b)
        v.bsoff = bld.add(self.bsoff, bld.mul(b, bld.lshr(xelems, ir.Constant(I64, 4))))
        return v

    # -- memory ---------------------------------------------------------------------------------------
    def at(self, base, off):
        """Byte pointer base + off (off: int or i64 value)."""
        if isinstance(off, int):
            off = ir.Constant(I64, off)
        return self.b.gep(base, [off])

    def load(self, base, off, ty, align=1):
        return self.b.load(self.b.bitcast(self.at(base, off), ty.as_pointer()), align=align)

    def store(self, val, base, off):
        self.b.store(val, self.b.bitcast(self.at(base, off), val.type.as_pointer()), align=4)

    def elem_off(self, off, stride, i, extra, size):
        """Byte offset ((off + i*stride + extra) * size) of element i rows down (extra: int or i64 value)."""
        b = self.b
        e = b.add(off, b.mul(stride, ir.Constant(I64, i))) if i else off
        if not isinstance(extra, int) or extra:
            e = b.add(e, ir.Constant(I64, extra) if isinstance(extra, int) else extra)
        return b.mul(e, ir.Constant(I64, size))

    def lin(self, t, a: int, c: int = 0):
        """t*a + c, where t is a Python int or an i64 loop index."""
        if isinstance(t, int):
            return t * a + c
        v = self.b.mul(t, ir.Constant(I64, a)) if a != 1 else t
        return self.b.add(v, ir.Constant(I64, c)) if c else v

    def shift(self, off, per_row: int):
        """Byte offset off (int or i64) moved to this slice: + lane0 * per_row bytes."""
        return self.lin(off, 1, self.lane0 * per_row) if self.lane0 else off

    def loop(self, n, fn: Callable, state: list) -> list:
        """Run state = fn(t, state) for t in 0..n-1 as an IR loop (keeps code small); n: int or i64 value;
        state: list of vectors (kept in registers by LLVM's mem2reg)."""
        from numba.core import cgutils

        b = self.b
        ptrs = [cgutils.alloca_once_value(b, v) for v in state]
        # a loop of a literal count takes the pending prefetches; with a run-time count they stay for spread_prefetch
        spread, self.pending_prefetch = ((self.pending_prefetch, None) if isinstance(n, int)
                                         else (None, self.pending_prefetch))
        with cgutils.for_range(b, ir.Constant(I64, n) if isinstance(n, int) else n) as lp:
            if spread is not None:  # this iteration's share of the pending lines
                start, lines = spread
                per = -(-lines // n)
                self._prefetch_lines(b.gep(start, [b.mul(lp.index, ir.Constant(I64, 64 * per))]), per)
            new = fn(lp.index, [b.load(p) for p in ptrs])
            for p, v in zip(ptrs, new):
                b.store(v, p)
        return [b.load(p) for p in ptrs]

    def _prefetch_lines(self, start, lines: int) -> None:
        """Prefetch (to L2) `lines` cache lines from byte pointer start: straight-line code."""
        bld = self.b
        fn = bld.module.globals.get("llvm.prefetch.p0") or ir.Function(
            bld.module, ir.FunctionType(ir.VoidType(), [self.qs.type, I32, I32, I32]), "llvm.prefetch.p0")
        read_l2_data = [ir.Constant(I32, 0), ir.Constant(I32, PREFETCH_LOCALITY), ir.Constant(I32, 1)]
        for i in range(lines):
            bld.call(fn, [bld.gep(start, [ir.Constant(I64, 64 * i)])] + read_l2_data)

    def prefetch_ahead(self, b, ahead: int, qlines: int, slines: int, qbytes, sbytes, body=None):
        """Prefetch (to L2) the first qlines / slines cache lines of the weight and scale bytes of block b + ahead
        (b, qbytes, sbytes: i64 values): the blocks of a row group and then of the next group lie end to end, so
        this runs ahead across groups (a prefetch past the array's end does not fault). Straight-line code: a loop
        here made LLVM spill the hot loop's constants. With body (a view the block's body runs on), the weight
        lines are left pending on it: its first run loop spreads them over its iterations (spread_prefetch)."""
        bld = self.b
        nb = bld.add(b, ir.Constant(I64, ahead))
        self._prefetch_lines(bld.gep(self.sc, [bld.mul(nb, sbytes)]), slines)
        start = bld.gep(self.qs, [bld.mul(nb, qbytes)])
        if body is None:
            self._prefetch_lines(start, qlines)
        else:
            body.pending_prefetch = (start, qlines)

    def mark(self):
        """The builder's position (block, instruction index), for spread_prefetch."""
        return self.b.block, len(self.b.block.instructions)

    def spread_prefetch(self, mark) -> None:
        """Issue the weight prefetches still pending because the body had no run loop to spread them over: at
        mark (see mark), before the body's arithmetic, as when they are not spread."""
        if self.pending_prefetch is None:
            return
        bld = self.b
        blk, at = mark
        here = bld.block
        if here is blk and at < len(blk.instructions):  # a loop-less body stays in mark's block
            bld.position_before(blk.instructions[at])
        self._prefetch_lines(*self.pending_prefetch)
        self.pending_prefetch = None
        bld.position_at_end(here)

    # -- activations ----------------------------------------------------------------------------------
    def xpair(self, i: int, k: int):
        """Activation row i, elements (k, k+1) of the current block as a broadcast <2W x i16>."""
        v = self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 2), I32)
        return self.b.bitcast(self.splat(v, self.w), V(I16, 2 * self.w))

    def xpair8(self, i: int, k: int):
        """int8 activation row i, elements (k, k+1) of the current block as a broadcast <2W x i8>."""
        v = self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 1), I16)
        return self.b.bitcast(self.splat(v, self.w), V(I8, 2 * self.w))

    def xquad(self, i: int, k: int):
        """int8 activation row i, elements k..k+3 of the current block as a broadcast <W x i32> (a quad)."""
        return self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 1), I32), self.w)

    def xval(self, i: int, k: int):
        """Float activation row i, element k of the current block, broadcast to <W x float>."""
        return self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 4), F32), self.w)

    def dxs(self, i: int):
        """Activation scale of row i for the current block, broadcast <W x float>."""
        return self.splat(self.load(self.dx, self.elem_off(self.dxoff, self.dxstride, i, 0, 4), F32), self.w)

    def bsum(self, i: int, j: int):
        """Sum of quantized activations of row i over its j-th 16-element run of the current block (i32)."""
        return self.load(self.bs, self.elem_off(self.bsoff, self.bsstride, i, j, 4), I32)

    def bsum_pairs(self, i: int, span: int):
        """Row i's activation sums over the sub-blocks of `span` (16 or 32) elements of the current 256-element
        block, paired for vpmaddwd: 128 / span vectors, pair p a broadcast <2W x i16> of (sum of sub-block 2p, sum of
        sub-block 2p+1). Exact: a sum of <= 32 codes of |c| <= 127 fits int16."""
        b = self.b
        v = self.load(self.bs, self.elem_off(self.bsoff, self.bsstride, i, 0, 4), V(I32, 16))  # sums per 16
        if span == 32:
            und = ir.Constant(V(I32, 16), ir.Undefined)
            v = b.add(b.shuffle_vector(v, und, ir.Constant(V(I32, 8), list(range(0, 16, 2)))),
                      b.shuffle_vector(v, und, ir.Constant(V(I32, 8), list(range(1, 16, 2)))))
        n = v.type.count
        d = b.bitcast(b.trunc(v, V(I16, n)), V(I32, n // 2))  # dword p = (sum 2p, sum 2p+1)
        und = ir.Constant(V(I32, n // 2), ir.Undefined)
        return [b.bitcast(b.shuffle_vector(d, und, ir.Constant(V(I32, self.w), [p] * self.w)), V(I16, 2 * self.w))
                for p in range(n // 2)]

    def interleave16(self, a, c):
        """<W x i32> a, c (lanes that fit int16) -> <2W x i16> with (a[r], c[r]) in dword r: a pmadd operand."""
        b = self.b
        h = V(I16, self.w)
        idx = [x for r in range(self.w) for x in (r, self.w + r)]
        return b.shuffle_vector(b.trunc(a, h), b.trunc(c, h), ir.Constant(V(I32, 2 * self.w), idx))

    # -- vector ops -----------------------------------------------------------------------------------
    def splat(self, v, n: int):
        b = self.b
        vec = b.insert_element(ir.Constant(V(v.type, n), ir.Undefined), v, ir.Constant(I32, 0))
        return b.shuffle_vector(vec, ir.Constant(V(v.type, n), ir.Undefined), ir.Constant(V(I32, n), [0] * n))

    def const(self, ty, n, val):
        return ir.Constant(V(ty, n), [val] * n)

    def c8(self, val):
        """<2W x i8> constant (pair-vector lanes)."""
        return self.const(I8, 2 * self.w, val)

    def c32(self, val):
        """<W x i32> constant (one lane per row)."""
        return self.const(I32, self.w, val)

    def zeros_i32(self):
        return self.c32(0)

    def wvec(self, off):
        """The slice's weight bytes of the pair vector at byte offset off of the (group, block): <2W x i8>."""
        return self.load(self.qs, self.shift(off, 2), V(I8, 2 * self.w))

    def wbits(self, off):
        """The slice's one-bit flags of the u32 (bit = lane) at byte offset off, as <2W x i8> of 0/1."""
        b = self.b
        v = self.load(self.qs, off, I32)
        if self.lane0:
            v = b.lshr(v, ir.Constant(I32, 2 * self.lane0))
        n = 2 * self.w
        if self.neon and n % 8 == 0:  # byte j of the flag bytes tested against its bit: dup + cmtst, no i1 lanes
            nbytes = n // 8
            by = b.bitcast(b.trunc(v, ir.IntType(n)), V(I8, nbytes)) if n < 32 else b.bitcast(v, V(I8, 4))
            rep = b.shuffle_vector(by, ir.Constant(by.type, ir.Undefined), ir.Constant(V(I32, n),
                                                                                       [j // 8 for j in range(n)]))
            hit = b.and_(rep, ir.Constant(V(I8, n), [1 << (j % 8) for j in range(n)]))
            return b.zext(b.icmp_unsigned("!=", hit, ir.Constant(V(I8, n), [0] * n)), V(I8, n))
        if n < 32:
            v = b.trunc(v, ir.IntType(n))
        return b.zext(b.bitcast(v, V(I1, n)), V(I8, n))

    def f16x16(self, off):
        """The slice's f16 values of the 16 at byte offset off of the scale block, as <W x float>."""
        return self.b.fpext(self.load(self.sc, self.shift(off, 2), V(F16, self.w)), V(F32, self.w))

    def u8x16(self, off, signed=False):
        """The slice's bytes of the 16 at byte offset off of the scale block, widened to <W x i32>."""
        v = self.load(self.sc, self.shift(off, 1), V(I8, self.w))
        return self.b.sext(v, V(I32, self.w)) if signed else self.b.zext(v, V(I32, self.w))

    def lo4(self, v):
        return self.b.and_(v, self.c8(0x0F))

    def hi4(self, v):
        return self.b.lshr(v, self.c8(4))

    def bits2(self, v, shift: int):
        return self.b.and_(self.b.lshr(v, self.c8(shift)), self.c8(3))

    def shl(self, v, n: int):
        return self.b.shl(v, self.c8(n))

    def sub8(self, v, n: int):
        return self.b.sub(v, self.c8(n))

    def s16(self, v):
        """<2W x i8> signed -> <2W x i16>."""
        return self.b.sext(v, V(I16, 2 * self.w))

    def call(self, name, ret, args):
        """Call a target intrinsic (x86 or AArch64) declared on demand."""
        return self._x86(name, ret, args)

    def chunks(self, v, n: int) -> list:
        """Split a vector into pieces of n lanes."""
        return self._chunks(v, n)

    def join(self, parts: list):
        """Concatenate vectors of equal type (a power-of-two count of them)."""
        return self._join(parts)

    def has_vnni(self, op: str) -> bool:
        """True when the VNNI instruction op ('vpdpwssd' / 'vpdpbusd') exists at this slice width."""
        return self._vnni(op) is not None

    def _x86(self, name, ret, args):
        """Call a target intrinsic (x86 or AArch64) declared on demand."""
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def _chunks(self, v, n: int) -> list:
        """Split a vector into pieces of n lanes."""
        und = ir.Constant(v.type, ir.Undefined)
        m = v.type.count
        return [self.b.shuffle_vector(v, und, ir.Constant(V(I32, n), list(range(j, j + n)))) for j in range(0, m, n)]

    def _join(self, parts: list):
        b = self.b
        while len(parts) > 1:
            n = parts[0].type.count
            parts = [b.shuffle_vector(parts[j], parts[j + 1], ir.Constant(V(I32, 2 * n), list(range(2 * n))))
                     for j in range(0, len(parts), 2)]
        return parts[0]

    def pmadd(self, w16, x16):
        """Pairwise multiply-add <2W x i16> x <2W x i16> -> <W x i32> (vpmaddwd)."""
        b = self.b
        feats = self.feats
        n = w16.type.count
        if "avx512bw" in feats and n == 32:
            return self._x86("llvm.x86.avx512.pmaddw.d.512", V(I32, 16), [w16, x16])
        if "avx2" in feats and n % 16 == 0:  # 256-bit pieces
            return self._join([self._x86("llvm.x86.avx2.pmadd.wd", V(I32, 8), [wp, xp])
                               for wp, xp in zip(self._chunks(w16, 16), self._chunks(x16, 16))])
        # portable form; LLVM lowers it to the target's widening multiply-add where one exists
        m = b.mul(b.sext(w16, V(I32, n)), b.sext(x16, V(I32, n)))
        und = ir.Constant(V(I32, n), ir.Undefined)
        ev = b.shuffle_vector(m, und, ir.Constant(V(I32, n // 2), list(range(0, n, 2))))
        od = b.shuffle_vector(m, und, ir.Constant(V(I32, n // 2), list(range(1, n, 2))))
        return b.add(ev, od)

    def maddubs(self, wu8, xs8):
        """<2W x i8> unsigned weight codes x <2W x i8> signed activations -> <W x i16>, lane r = the sum of the
        two products of row r (vpmaddubsw). Callers keep the codes small enough that no sum saturates."""
        b = self.b
        feats = self.feats
        n = wu8.type.count
        if "avx2" in feats and n == 32:
            return self._x86("llvm.x86.avx2.pmadd.ub.sw", V(I16, 16), [wu8, xs8])
        if "avx512bw" in feats and n == 64:
            return self._x86("llvm.x86.avx512.pmaddubs.w.512", V(I16, 32), [wu8, xs8])
        m = b.mul(b.zext(wu8, V(I16, n)), b.sext(xs8, V(I16, n)))
        und = ir.Constant(V(I16, n), ir.Undefined)
        ev = b.shuffle_vector(m, und, ir.Constant(V(I32, n // 2), list(range(0, n, 2))))
        od = b.shuffle_vector(m, und, ir.Constant(V(I32, n // 2), list(range(1, n, 2))))
        return b.add(ev, od)

    def row_masks(self, s16=None):
        """The two multiplier vectors that widen a <W x i16> of per-row sums (lane r = row r) with pmadd:
        (even rows, odd rows), each <W x i16> with s16's lane (or 1) at the rows kept and 0 elsewhere."""
        b = self.b
        w = self.w
        src = s16 if s16 is not None else ir.Constant(V(I16, w), [1] * w)
        zero = ir.Constant(V(I16, w), [0] * w)
        ev = [r if r % 2 == 0 else w for r in range(w)]
        od = [r if r % 2 == 1 else w for r in range(w)]
        return (b.shuffle_vector(src, zero, ir.Constant(V(I32, w), ev)),
                b.shuffle_vector(src, zero, ir.Constant(V(I32, w), od)))

    def rows_join(self, ev, od):
        """<W/2 x i32> sums of the even rows and of the odd rows -> <W x i32> in row order."""
        h = self.w // 2
        idx = [j for r in range(h) for j in (r, h + r)]
        return self.b.shuffle_vector(ev, od, ir.Constant(V(I32, self.w), idx))

    def u8w_sums(self, mb: int, runs: int, pairs: int, code, scale, chunk: int) -> list:
        """Exact per-row sums (<W x i32>) of scale * code * x over `runs` runs of `pairs` pair vectors, in the
        unsigned-weight form: code(t, p) -> <2W x i8> unsigned codes of pair p of run t (elements 2p, 2p+1 of
        the run); scale(t, p) -> <W x i32> per-row multiplier of that pair (None: 1). `chunk` pairs are summed
        in int16 by vpmaddubsw + vpaddw (the caller picks it so that no sum exceeds 32767; a chunk never
        crosses a change of scale), then widened with vpmaddwd by the scale into even / odd row lanes."""
        b = self.b
        w = self.w
        zero = ir.Constant(V(I32, w // 2), [0] * (w // 2))

        def step(t, state):
            out = list(state)
            for c0 in range(0, pairs, chunk):
                sc = scale(t, c0)
                sev, sod = self.row_masks(None if sc is None else b.trunc(sc, V(I16, w)))
                acc16 = [None] * mb
                for p in range(c0, c0 + chunk):
                    wc = code(t, p)
                    for i in range(mb):
                        m = self.maddubs(wc, self.xpair8(i, self.lin(t, 2 * pairs, 2 * p)))
                        acc16[i] = m if acc16[i] is None else b.add(acc16[i], m)
                for i in range(mb):
                    out[2 * i] = b.add(out[2 * i], self.pmadd(acc16[i], sev))
                    out[2 * i + 1] = b.add(out[2 * i + 1], self.pmadd(acc16[i], sod))
            return out

        st = self.loop(runs, step, [zero] * (2 * mb)) if runs > 1 else step(0, [zero] * (2 * mb))
        return [self.rows_join(st[2 * i], st[2 * i + 1]) for i in range(mb)]

    def chains(self, mb: int) -> int:
        """Independent integer accumulators per row for mb rows: a VNNI multiply-add waits ~5 cycles for its
        accumulator, so a single row needs several chains to keep the unit busy (integer sums: any split is
        exact)."""
        return max(1, 4 // mb) if self._vnni("vpdpwssd") else 1

    def sum_chains(self, parts: list):
        out = parts[0]
        for p in parts[1:]:
            out = self.b.add(out, p)
        return out

    def _vnni(self, op: str):
        """Name of the VNNI intrinsic op ('vpdpwssd' / 'vpdpbusd') for this slice width, or None."""
        feats = self.feats
        if self.w == 16 and "avx512vnni" in feats:
            return f"llvm.x86.avx512.{op}.512"
        if self.w == 8 and ("avxvnni" in feats or {"avx512vnni", "avx512vl"} <= feats):
            return f"llvm.x86.avx512.{op}.256"
        return None

    def madd(self, acc, w16, i: int, k):
        """acc + pmadd(w16, activation pair (k, k+1) of row i): one vpdpwssd with a broadcast memory operand
        where VNNI exists."""
        name = self._vnni("vpdpwssd")
        if name is None:
            return self.add(acc, self.pmadd(w16, self.xpair(i, k)))
        x = self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 2), I32), self.w)
        return self._x86(name, V(I32, self.w), [acc, self.b.bitcast(w16, V(I32, self.w)), x])

    def quad(self, a, c):
        """Two pair vectors (<2W x i8>: lane 2r+e = row r, element e of pair a / c) as one quad vector
        <W x i32> whose dword r holds row r's 4 bytes (a0, a1, c0, c1)."""
        b = self.b
        w = self.w
        a16, c16 = b.bitcast(a, V(I16, w)), b.bitcast(c, V(I16, w))
        idx = [j for r in range(w) for j in (r, w + r)]
        return b.bitcast(b.shuffle_vector(a16, c16, ir.Constant(V(I32, 2 * w), idx)), V(I32, w))

    def dpbusd(self, acc, xu8, w8):
        """acc + per-dword sum of 4 products u8 (xu8) x s8 (w8), as <W x i32>: vpdpbusd with VNNI, else the
        widening form (same integers)."""
        b = self.b
        name = self._vnni("vpdpbusd")
        if name is not None:
            return self._x86(name, V(I32, self.w), [acc, xu8, w8])
        n = 4 * self.w
        x32 = b.zext(b.bitcast(xu8, V(I8, n)), V(I32, n))
        w32 = b.sext(b.bitcast(w8, V(I8, n)), V(I32, n))
        m = b.mul(x32, w32)
        und = ir.Constant(V(I32, n), ir.Undefined)
        for j in range(4):
            acc = b.add(acc, b.shuffle_vector(m, und, ir.Constant(V(I32, self.w), list(range(j, n, 4)))))
        return acc

    def add(self, a, c):
        return self.b.add(a, c)

    def mul(self, a, c):
        return self.b.mul(a, c)

    def mul16(self, a, c):
        """a * c for <W x i32> lanes that fit int16 (exact): on NEON one widening multiply per 4 lanes (smull
        4h -> 4s) instead of a 32-bit mul."""
        if not self.neon:
            return self.b.mul(a, c)
        b = self.b
        h = ir.VectorType(I16, 4)
        parts = [self._x86("llvm.aarch64.neon.smull.v4i32", V(I32, 4), [b.trunc(u, h), b.trunc(v, h)])
                 for u, v in zip(self._chunks(a, 4), self._chunks(c, 4))]
        return self._join(parts)

    def fmul(self, a, c):
        return self.b.fmul(a, c)

    def fneg(self, a):
        return self.b.fneg(a)

    def cvt32(self, v):
        """<W x i32> -> <W x float> (rounded to nearest even, as cvtdq2ps)."""
        return self.b.sitofp(v, V(F32, self.w))

    def wide(self, v):
        """<W x float> -> <W x double> (exact)."""
        return self.b.fpext(v, V(F64, self.w))

    def fma(self, a, c, acc):
        """a*c + acc, always fused (same rounding whatever the surrounding code)."""
        ty = a.type
        name = f"llvm.fma.v{ty.count}f32"
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ty, [ty] * 3), name)
        return self.b.call(fn, [a, c, acc])
