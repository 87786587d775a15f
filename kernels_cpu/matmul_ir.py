"""SIMD building blocks for the fused matmul kernels, written as LLVM IR through a Numba intrinsic.

Plain Numba loops do not reliably give packed integer multiply-adds (LLVM widens to int64, or leaves
16/32-trip block loops scalar), so the inner block of each format is spelled out here as vector IR:

* a weight *row group* is R = 16 output rows; one "pair vector" holds 32 bytes = elements (2p, 2p+1) of
  each of the 16 rows (lane 2r+e), so a packed multiply-add (vpmaddwd) against the broadcast activation pair
  (x[2p], x[2p+1]) yields 16 int32 partial dot products, one per row, with no horizontal reductions;
* float arithmetic is explicit (f32 scale products as llama.cpp, then llvm.fma into double accumulators in a
  fixed order), so a row's result never depends on
  how many activation rows are processed together (batch invariance).

`qdot(FMT, MB, facc, xq, xoff, xstride, dx, dxoff, dxstride, bs, bsoff, bsstride, qs, qoff, sc, soff, nb, ...)`
runs the K blocks of one row group for MB activation rows (a loop in IR, accumulators in registers) and
stores the MB x 16 outputs to facc (float64). FMT (the QuantType id) and MB are compile-time literals; the
per-format body (one K block) is looked up in BODIES, which matmul_q and matmul_k fill.
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._jit import host_features

R = 16  # output rows per group (lanes of one 512-bit float vector)

I1, I8, I16, I32, I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
F16, F32, F64 = ir.HalfType(), ir.FloatType(), ir.DoubleType()


def V(t: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(t, n)


class Emit:
    """IR helpers bound to one intrinsic call site: pointers into the flat arrays and vector ops."""

    def __init__(self, context, builder, sig, args):
        self.b = builder
        (_, _, facc, xq, xoff, xstride, dx, dxoff, dxstride, bs, bsoff, bsstride, qs, qoff, sc, soff) = args[:16]
        aty = sig.args

        def data(i, v):
            return builder.bitcast(context.make_array(aty[i])(context, builder, v).data, I8.as_pointer())

        self.facc = data(2, facc)
        self.xq, self.xoff, self.xstride = data(3, xq), xoff, xstride
        # uint8 activations (codes + 128): the 32-block formats' u8 x s8 form (see xquad / dpbusd)
        self.x_u8 = aty[3].dtype == types.uint8
        self.dx, self.dxoff, self.dxstride = data(6, dx), dxoff, dxstride
        self.bs, self.bsoff, self.bsstride = data(9, bs), bsoff, bsstride
        self.qs = builder.gep(data(12, qs), [qoff])
        self.sc = builder.gep(data(14, sc), [soff])
        # <16 x double> output accumulators of the mb rows (SSA values carried across the K blocks): bodies
        # add their block's products with e.acc[i] = e.fma(..., e.acc[i]). Double: the outputs are the exactly
        # rounded sums of the per-block products (quantized activations amplify tiny differences, so this
        # keeps results as close to llama.cpp's as any summation order can).
        self.acc: list = []

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

    def loop(self, n, fn: Callable, state: list) -> list:
        """Run state = fn(t, state) for t in 0..n-1 as an IR loop (keeps code small); n: int or i64 value;
        state: list of vectors (kept in registers by LLVM's mem2reg)."""
        from numba.core import cgutils

        b = self.b
        ptrs = [cgutils.alloca_once_value(b, v) for v in state]
        with cgutils.for_range(b, ir.Constant(I64, n) if isinstance(n, int) else n) as lp:
            new = fn(lp.index, [b.load(p) for p in ptrs])
            for p, v in zip(ptrs, new):
                b.store(v, p)
        return [b.load(p) for p in ptrs]

    # -- activations ----------------------------------------------------------------------------------
    def xpair(self, i: int, k: int):
        """Activation row i, elements (k, k+1) of the current block as a broadcast <32 x i16>."""
        v = self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 2), I32)
        return self.b.bitcast(self.splat(v, 16), V(I16, 32))

    def xquad(self, i: int, k: int):
        """uint8 activation row i, elements k..k+3 of the current block as a broadcast <16 x i32>."""
        return self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 1), I32), 16)

    def xval(self, i: int, k: int):
        """Float activation row i, element k of the current block, broadcast to <16 x float>."""
        return self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 4), F32), R)

    def dxs(self, i: int):
        """Activation scale of row i for the current block, broadcast <16 x float>."""
        return self.splat(self.load(self.dx, self.elem_off(self.dxoff, self.dxstride, i, 0, 4), F32), R)

    def bsum(self, i: int, j: int):
        """Sum of quantized activations of row i over its j-th 16-element run of the current block (i32)."""
        return self.load(self.bs, self.elem_off(self.bsoff, self.bsstride, i, j, 4), I32)

    # -- vector ops -----------------------------------------------------------------------------------
    def splat(self, v, n: int):
        b = self.b
        vec = b.insert_element(ir.Constant(V(v.type, n), ir.Undefined), v, ir.Constant(I32, 0))
        return b.shuffle_vector(vec, ir.Constant(V(v.type, n), ir.Undefined), ir.Constant(V(I32, n), [0] * n))

    def const(self, ty, n, val):
        return ir.Constant(V(ty, n), [val] * n)

    def zeros_i32(self):
        return ir.Constant(V(I32, R), [0] * R)

    def wvec(self, off):
        """32 weight bytes of the current (group, block) at byte offset off: <32 x i8>."""
        return self.load(self.qs, off, V(I8, 32))

    def wbits(self, off):
        """32 one-bit flags (u32 at byte offset off) as <32 x i8> of 0/1."""
        bits = self.b.bitcast(self.load(self.qs, off, I32), V(I1, 32))
        return self.b.zext(bits, V(I8, 32))

    def f16x16(self, off):
        """16 f16 values at byte offset off of the scale block, as <16 x float>."""
        return self.b.fpext(self.load(self.sc, off, V(F16, R)), V(F32, R))

    def u8x16(self, off, signed=False):
        """16 bytes at byte offset off of the scale block, widened to <16 x i32>."""
        v = self.load(self.sc, off, V(I8, R))
        return self.b.sext(v, V(I32, R)) if signed else self.b.zext(v, V(I32, R))

    def lo4(self, v):
        return self.b.and_(v, self.const(I8, 32, 0x0F))

    def hi4(self, v):
        return self.b.lshr(v, self.const(I8, 32, 4))

    def bits2(self, v, shift: int):
        return self.b.and_(self.b.lshr(v, self.const(I8, 32, shift)), self.const(I8, 32, 3))

    def shl(self, v, n: int):
        return self.b.shl(v, self.const(I8, 32, n))

    def sub8(self, v, n: int):
        return self.b.sub(v, self.const(I8, 32, n))

    def s16(self, v):
        """<32 x i8> signed -> <32 x i16>."""
        return self.b.sext(v, V(I16, 32))

    def pmadd(self, w16, x16):
        """Pairwise multiply-add <32 x i16> x <32 x i16> -> <16 x i32> (vpmaddwd)."""
        b = self.b
        feats = host_features()
        mod = b.module
        if "avx512bw" in feats:
            name = "llvm.x86.avx512.pmaddw.d.512"
            fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(V(I32, 16), [V(I16, 32)] * 2), name)
            return b.call(fn, [w16, x16])
        if "avx2" in feats:  # two 256-bit halves
            name = "llvm.x86.avx2.pmadd.wd"
            fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(V(I32, 8), [V(I16, 16)] * 2), name)
            und = ir.Constant(V(I16, 32), ir.Undefined)
            halves = []
            for h in range(2):
                idx = ir.Constant(V(I32, 16), list(range(16 * h, 16 * h + 16)))
                halves.append(b.call(fn, [b.shuffle_vector(w16, und, idx), b.shuffle_vector(x16, und, idx)]))
            return b.shuffle_vector(halves[0], halves[1], ir.Constant(V(I32, 16), list(range(16))))
        # portable form; LLVM lowers it to the target's widening multiply-add where one exists
        m = b.mul(b.sext(w16, V(I32, 32)), b.sext(x16, V(I32, 32)))
        und = ir.Constant(V(I32, 32), ir.Undefined)
        ev = b.shuffle_vector(m, und, ir.Constant(V(I32, 16), list(range(0, 32, 2))))
        od = b.shuffle_vector(m, und, ir.Constant(V(I32, 16), list(range(1, 32, 2))))
        return b.add(ev, od)

    def madd(self, acc, w16, i: int, k):
        """acc + pmadd(w16, activation pair (k, k+1) of row i): one vpdpwssd with a broadcast memory operand
        where AVX512-VNNI exists."""
        if "avx512vnni" not in host_features():
            return self.add(acc, self.pmadd(w16, self.xpair(i, k)))
        b = self.b
        x = self.splat(self.load(self.xq, self.elem_off(self.xoff, self.xstride, i, k, 2), I32), 16)
        name = "llvm.x86.avx512.vpdpwssd.512"
        fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(V(I32, 16), [V(I32, 16)] * 3), name)
        return b.call(fn, [acc, b.bitcast(w16, V(I32, 16)), x])

    def quad(self, a, c):
        """Two pair vectors (<32 x i8>: lane 2r+e = row r, element e of pair a / c) as one quad vector
        <16 x i32> whose dword r holds row r's 4 bytes (a0, a1, c0, c1)."""
        b = self.b
        a16, c16 = b.bitcast(a, V(I16, R)), b.bitcast(c, V(I16, R))
        idx = [j for r in range(R) for j in (r, R + r)]
        return b.bitcast(b.shuffle_vector(a16, c16, ir.Constant(V(I32, 2 * R), idx)), V(I32, R))

    def dpbusd(self, acc, xu8, w8):
        """acc + per-dword sum of 4 products u8 (xu8) x s8 (w8), as <16 x i32>: vpdpbusd with AVX512-VNNI,
        else the widening form (same integers)."""
        b = self.b
        if "avx512vnni" in host_features():
            name = "llvm.x86.avx512.vpdpbusd.512"
            fn = b.module.globals.get(name) or ir.Function(b.module, ir.FunctionType(V(I32, 16), [V(I32, 16)] * 3),
                                                          name)
            return b.call(fn, [acc, xu8, w8])
        x32 = b.zext(b.bitcast(xu8, V(I8, 64)), V(I32, 64))
        w32 = b.sext(b.bitcast(w8, V(I8, 64)), V(I32, 64))
        m = b.mul(x32, w32)
        und = ir.Constant(V(I32, 64), ir.Undefined)
        for j in range(4):
            acc = b.add(acc, b.shuffle_vector(m, und, ir.Constant(V(I32, 16), list(range(j, 64, 4)))))
        return acc

    def add(self, a, c):
        return self.b.add(a, c)

    def mul(self, a, c):
        return self.b.mul(a, c)

    def fmul(self, a, c):
        return self.b.fmul(a, c)

    def fneg(self, a):
        return self.b.fneg(a)

    def cvt(self, v):
        """<16 x i32> -> <16 x double> (exact)."""
        return self.b.sitofp(v, V(F64, R))

    def cvt32(self, v):
        """<16 x i32> -> <16 x float> (rounded to nearest even, as cvtdq2ps)."""
        return self.b.sitofp(v, V(F32, R))

    def wide(self, v):
        """<16 x float> -> <16 x double> (exact)."""
        return self.b.fpext(v, V(F64, R))

    def fma(self, a, c, acc):
        """a*c + acc, always fused (same rounding whatever the surrounding code); float or double vectors."""
        ty = a.type
        name = "llvm.fma.v16f64" if ty.element == F64 else "llvm.fma.v16f32"
        mod = self.b.module
        fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ty, [ty] * 3), name)
        return self.b.call(fn, [a, c, acc])

@dataclass(frozen=True)
class Body:
    """How one format's kernel block is emitted.

    emit(e, mb): the work of one (row group, K block); lanes: accumulators per activation row. lanes == 0: one
    <16 x double> accumulator per row (e.acc[i]); lanes > 0: e.acc[i] is a list of `lanes` <16 x float>
    accumulators that reproduce llama.cpp's SIMD lanes, and reduce(e, accs) -> <16 x float> sums them in
    llama.cpp's order at the end of the row."""

    emit: Callable[[Emit, int], None]
    lanes: int = 0
    reduce: Callable | None = None


# FMT (QuantType id) -> Body
BODIES: dict[int, Body] = {}


def register(*fmts: int, lanes: int = 0, reduce: Callable | None = None):
    """Decorator: register an IR body for the given QuantType ids (see Body)."""

    def deco(fn):
        for f in fmts:
            BODIES[int(f)] = Body(fn, lanes, reduce)
        return fn

    return deco


def hsum8(e: Emit, a: list):
    """llama.cpp's hsum_float_8 of 8 lanes: ((a0+a4)+(a2+a6)) + ((a1+a5)+(a3+a7))."""
    b = e.b
    s = [b.fadd(a[i], a[i + 4]) for i in range(4)]
    return b.fadd(b.fadd(s[0], s[2]), b.fadd(s[1], s[3]))


def hsum8_plus(e: Emit, a: list):
    """llama.cpp's `hsum_float_8(acc) + summs`: 8 lanes, then a 9th accumulator (a scalar sum in llama.cpp)."""
    return e.b.fadd(hsum8(e, a[:8]), a[8])


def _tune(context, fn) -> None:
    """With AVX512-VNNI, tell LLVM that vpdpwssd is fast on this function: otherwise its machine combiner
    splits it into vpmaddwd + vpaddd, and the separate activation broadcasts then spill (~1.5x slower)."""
    feats = getattr(context.codegen(), "_tm_features", "")
    if "avx512vnni" not in host_features() or not feats or "+avx512vnni" not in feats:
        return
    attr = f'"target-features"="{feats},+fast-dpwssd"'
    if attr not in fn.attributes:
        set.add(fn.attributes, attr)  # string attribute: llvmlite only validates enum attributes


@intrinsic(prefer_literal=True)
def qdot(typingctx, fmt, mb, facc, xq, xoff, xstride, dx, dxoff, dxstride, bs, bsoff, bsstride, qs, qoff, sc,
         soff, nb, qbytes, sbytes, xelems):
    """One row group of a fused matmul for mb activation rows over nb K blocks (block b at qs + b*qbytes,
    sc + b*sbytes, activation element b*xelems); writes the mb x 16 outputs to facc as float64."""
    if not isinstance(fmt, types.IntegerLiteral) or not isinstance(mb, types.IntegerLiteral):
        return None
    spec = BODIES[fmt.literal_value]
    nrows = mb.literal_value
    i64 = types.int64
    sig = types.void(fmt, mb, facc, xq, i64, i64, dx, i64, i64, bs, i64, i64, qs, i64, sc, i64, i64, i64, i64, i64)
    lanes = spec.lanes

    def codegen(context, builder, signature, args):
        _tune(context, builder.function)
        e = Emit(context, builder, signature, args)
        nblocks, qb, sb, xe = args[16:20]

        def step(b, accs):
            view = e.block(b, qb, sb, xe)
            view.acc = [accs[i * lanes:(i + 1) * lanes] for i in range(nrows)] if lanes else list(accs)
            spec.emit(view, nrows)
            return [a for row in view.acc for a in row] if lanes else view.acc

        if lanes:
            zero = ir.Constant(V(F32, R), [0.0] * R)
            accs = e.loop(nblocks, step, [zero] * (nrows * lanes))
            outs = [e.wide(spec.reduce(e, accs[i * lanes:(i + 1) * lanes])) for i in range(nrows)]
        else:
            zero = ir.Constant(V(F64, R), [0.0] * R)
            outs = e.loop(nblocks, step, [zero] * nrows)  # accumulators stay in registers across the blocks
        for i, a in enumerate(outs):
            e.store(a, e.facc, i * R * 8)
        return context.get_dummy_value()

    return sig, codegen
