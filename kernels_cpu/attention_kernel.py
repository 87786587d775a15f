"""The paged attention kernel (kernels_cpu/attention.py calls it) and the LLVM IR of llama.cpp's SIMD sums that it
inlines: vectors in registers, operations in ggml's order. One file, because Numba's cache of a kernel is only
invalidated by edits to the kernel's own file, not to the intrinsics it inlines.

A K/V cache comes in one of these forms (its Numba type), read as <n x float> vectors by the form's loader:

    float32 array               F32 cache
    int16 array                 f16 bits, widened exactly (fpext)
    uint16 array                bf16 bits, widened exactly
    (int8 array, int16 array)   q8_0 (kernels_cpu/attention_q8.py): per 32 values along head_dim one f16 scale d
                                and 32 int8 q; an element is d * q, exact in float32 (11 + 8 significant bits)

Every sum runs over the widened values, so each form gives what an F32 cache holding the same values gives, bit
for bit (tests/test_kv_q8.py checks it).
"""
from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from kernels_cpu import ops
from kernels_cpu._jit import jit, parallel_jit
from kernels_cpu.ops import bits_to_f32, f16_bits_to_f32, fma32, ggml_expf

_F32, _I64, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
_PV_WIDTH = 16  # output elements per vector in the P @ V kernels
PV_HEADS = 4  # query heads of a KV head summed together by pv_sgemm (each V slice loaded once for them)
_EXP_LANES = 8  # softmax exponentials a vector (expf_sub)


def _vec(n, ty=_F32):
    return ir.VectorType(ty, n)


def _as_i64(context, builder, ty, val):
    return context.cast(builder, val, ty, types.int64)


def _vload(builder, ptr, off, n=16):
    """<n x elem> at element pointer ptr + off (i64 elements), aligned as one element."""
    elem = ptr.type.pointee
    align = 4 if isinstance(elem, ir.FloatType) else elem.width // 8
    return builder.load(builder.bitcast(builder.gep(ptr, [off]), ir.VectorType(elem, n).as_pointer()), align=align)


def _splat(builder, x, n):
    one = builder.insert_element(ir.Constant(ir.VectorType(x.type, 1), ir.Undefined), x, ir.Constant(_I32, 0))
    return _lanes(builder, one, [0] * n)


def _fma(builder, a, b, c):
    """a * b + c with one rounding (llvm.fma), scalars or vectors."""
    ty = a.type
    name = f"llvm.fma.v{ty.count}f32" if isinstance(ty, ir.VectorType) else "llvm.fma.f32"
    mod = builder.module
    fn = mod.globals.get(name) or ir.Function(mod, ir.FunctionType(ty, [ty] * 3), name)
    return builder.call(fn, [a, b, c])


def _lanes(builder, v, idx):
    return builder.shuffle_vector(v, ir.Constant(v.type, ir.Undefined), ir.Constant(ir.VectorType(_I32, len(idx)), idx))


def _reduce16(builder, v):
    """GCC's _mm512_reduce_add_ps of a <16 x float>: hi + lo halves 16 -> 8 -> 4, then [0]+[2], [1]+[3], then
    the two."""
    v = builder.fadd(_lanes(builder, v, list(range(8, 16))), _lanes(builder, v, list(range(8))))
    v = builder.fadd(_lanes(builder, v, [4, 5, 6, 7]), _lanes(builder, v, [0, 1, 2, 3]))
    v = builder.fadd(v, _lanes(builder, v, [2, 3, 0, 1]))
    lane = [builder.extract_element(v, ir.Constant(_I32, i)) for i in (0, 1)]
    return builder.fadd(*lane)


def _reduce16_list(builder, xs):
    """The same reduction tree across 16 values (lane l = xs[l]), element-wise for vectors."""
    return _reduce16_lazy(builder, xs.__getitem__)


def _reduce16_lazy(builder, lane):
    """_reduce16_list of lane(0..15), emitting each lane's code only when the tree needs it, so that a few partial
    sums are live at a time instead of 16 vectors (which spilled accumulators to the stack)."""
    def t(i):
        return builder.fadd(lane(i + 8), lane(i))

    def u(i):
        return builder.fadd(t(i + 4), t(i))

    return builder.fadd(builder.fadd(u(0), u(2)), builder.fadd(u(1), u(3)))


# --- loaders: one per cache form ---------------------------------------------------------------------------

def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


class _LoadF32:
    sgemm_lanes = 16  # lanes of pv_sgemm accumulated in one pass over the chunks (see _LoadQ8)

    def __init__(self, context, builder, ty, val):
        self.b, self.p = builder, _data(context, builder, ty, val)

    def load(self, off, n):
        return _vload(self.b, self.p, off, n)

    def load32(self, off):
        """Elements off .. off + 31 as two <16 x float> (off % 32 == 0)."""
        return self.load(off, 16), self.load(self.b.add(off, ir.Constant(_I64, 16)), 16)


class _LoadF16(_LoadF32):
    def load(self, off, n):
        return self.b.fpext(self.b.bitcast(_vload(self.b, self.p, off, n), _vec(n, ir.HalfType())), _vec(n))


class _LoadBF16(_LoadF32):
    def load(self, off, n):
        b = self.b
        wide = b.shl(b.zext(_vload(b, self.p, off, n), _vec(n, _I32)), ir.Constant(_vec(n, _I32), [16] * n))
        return b.bitcast(wide, _vec(n))


class _LoadQ8:
    """q8_0: elements off .. off + n - 1 must lie in one 32-value block (off % 32 + n <= 32)."""

    # 16 lanes in one pass: LLVM hoists the cells' loads and widening above the fmas and spills them with the
    # accumulators to the stack (2x slower); two passes of 8 lanes over the chunks keep them in registers
    sgemm_lanes = 8

    def __init__(self, context, builder, ty, val):
        qs, d = cgutils.unpack_tuple(builder, val, 2)
        self.b = builder
        self.pq, self.pd = _data(context, builder, ty[0], qs), _data(context, builder, ty[1], d)

    def _scale(self, off, n):
        b = self.b
        d = _splat(b, b.load(b.gep(self.pd, [b.ashr(off, ir.Constant(_I64, 5))])), n)  # broadcast, then widen
        return b.fpext(b.bitcast(d, _vec(n, ir.HalfType())), _vec(n))

    def _q(self, off, n):
        b = self.b
        return b.sitofp(b.sext(_vload(b, self.pq, off, n), _vec(n, _I32)), _vec(n))

    def load(self, off, n):
        return self.b.fmul(self._scale(off, n), self._q(off, n))  # exact: 11 x 8 significant bits

    def load32(self, off):
        d = self._scale(off, 16)  # one block: one scale
        return self.b.fmul(d, self._q(off, 16)), self.b.fmul(d, self._q(self.b.add(off, ir.Constant(_I64, 16)), 16))


def kv_form(ty) -> str | None:
    """The cache form (module doc) of a Numba type, or None."""
    if isinstance(ty, types.Array):
        return {types.float32: "f32", types.int16: "f16", types.uint16: "bf16"}.get(ty.dtype)
    if (isinstance(ty, types.BaseTuple) and len(ty) == 2 and all(isinstance(t, types.Array) for t in ty)
            and (ty[0].dtype, ty[1].dtype) == (types.int8, types.int16)):
        return "q8_0"
    return None


LOADERS = {"f32": _LoadF32, "f16": _LoadF16, "bf16": _LoadBF16, "q8_0": _LoadQ8}


def _loader(context, builder, ty, val):
    return LOADERS[kv_form(ty)](context, builder, ty, val)


# --- the sums -------------------------------------------------------------------------------------------------

@intrinsic
def vdot(typingctx, a, aoff, b, boff, n):
    """ggml_vec_dot_f32 (AVX512) of a[aoff:aoff+n] (flat float32) and the cached b[boff:boff+n] (any form, widened;
    n % 64 == 0): 4 accumulators of 16 lanes (element i: lane i % 64, fma over i // 64), (s0 + s2) + (s1 + s3),
    reduce_add."""
    def codegen(context, builder, sig, args):
        aoff_ = _as_i64(context, builder, sig.args[1], args[1])
        pa = builder.gep(_data(context, builder, sig.args[0], args[0]), [aoff_])
        kb = _loader(context, builder, sig.args[2], args[2])
        boff_ = _as_i64(context, builder, sig.args[3], args[3])
        nn = _as_i64(context, builder, sig.args[4], args[4])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(_vec(16), [0.0] * 16)) for _ in range(4)]
        with cgutils.for_range(builder, builder.udiv(nn, ir.Constant(_I64, 64))) as lp:
            base = builder.mul(lp.index, ir.Constant(_I64, 64))
            kv = [v for j in (0, 32) for v in kb.load32(builder.add(boff_, builder.add(base, ir.Constant(_I64, j))))]
            for j, acc in enumerate(accs):
                off = builder.add(base, ir.Constant(_I64, 16 * j))
                builder.store(_fma(builder, _vload(builder, pa, off), kv[j], builder.load(acc)), acc)
        s0, s1, s2, s3 = (builder.load(a) for a in accs)
        return _reduce16(builder, builder.fadd(builder.fadd(s0, s2), builder.fadd(s1, s3)))
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and kv_form(b)):
        return None
    return types.float32(a, aoff, b, boff, n), codegen


def _reduce16x4(builder, vs):
    """_reduce16 of four <16 x float> at once, the same additions per vector (lane i + lane i+8, then i + i+4, then
    i + i^2, then lanes 0 + 1), with the four vectors' partial sums packed side by side: -> 4 float32."""
    b = builder

    def halves(x, y, hi, lo):  # lanes hi of x, then of y  +  lanes lo of x, then of y
        return b.fadd(b.shuffle_vector(x, y, ir.Constant(_vec(16, _I32), hi)),
                      b.shuffle_vector(x, y, ir.Constant(_vec(16, _I32), lo)))
    # step 1: (a hi8 + a lo8 | b hi8 + b lo8), the same for c, d
    hi8, lo8 = list(range(8, 16)) + list(range(24, 32)), list(range(8)) + list(range(16, 24))
    ab, cd = halves(vs[0], vs[1], hi8, lo8), halves(vs[2], vs[3], hi8, lo8)
    # step 2: per vector (8 lanes at 8j): hi4 + lo4 -> lanes 4j..4j+3 for a, b, c, d
    hi4 = [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31]
    lo4 = [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27]
    u = halves(ab, cd, hi4, lo4)
    # step 3: u[i] + u[i ^ 2] in each group of 4; step 4: lane 0 + lane 1 of each group
    t = b.fadd(u, _lanes(b, u, [j ^ 2 for j in range(16)]))
    r = b.fadd(t, _lanes(b, t, [j ^ 1 for j in range(16)]))
    return [b.extract_element(r, ir.Constant(_I32, 4 * j)) for j in range(4)]


@intrinsic
def vdot4(typingctx, a, aoff, astride, b, boff, n):
    """(vdot(a, aoff + j*astride, b, boff, n) for j < 4): four query heads against one cached K row, the row loaded
    once; each dot in vdot's order (n % 64 == 0), the four reductions done side by side (_reduce16x4)."""
    def codegen(context, builder, sig, args):
        aoff_ = _as_i64(context, builder, sig.args[1], args[1])
        ast = _as_i64(context, builder, sig.args[2], args[2])
        pa = builder.gep(_data(context, builder, sig.args[0], args[0]), [aoff_])
        pas = [builder.gep(pa, [builder.mul(ast, ir.Constant(_I64, j))]) for j in range(4)]
        kb = _loader(context, builder, sig.args[3], args[3])
        boff_ = _as_i64(context, builder, sig.args[4], args[4])
        nn = _as_i64(context, builder, sig.args[5], args[5])
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(_vec(16), [0.0] * 16)) for _ in range(4)]
                for _ in range(4)]
        with cgutils.for_range(builder, builder.udiv(nn, ir.Constant(_I64, 64))) as lp:
            base = builder.mul(lp.index, ir.Constant(_I64, 64))
            kv = [v for j in (0, 32) for v in kb.load32(builder.add(boff_, builder.add(base, ir.Constant(_I64, j))))]
            for h in range(4):
                for j, acc in enumerate(accs[h]):
                    off = builder.add(base, ir.Constant(_I64, 16 * j))
                    builder.store(_fma(builder, _vload(builder, pas[h], off), kv[j], builder.load(acc)), acc)
        vs = []
        for h in range(4):
            s0, s1, s2, s3 = (builder.load(x) for x in accs[h])
            vs.append(builder.fadd(builder.fadd(s0, s2), builder.fadd(s1, s3)))
        return context.make_tuple(builder, sig.return_type, _reduce16x4(builder, vs))
    if not (isinstance(a, types.Array) and a.dtype == types.float32 and kv_form(b)):
        return None
    return types.UniTuple(types.float32, 4)(a, aoff, astride, b, boff, n), codegen


class _PV:
    """Codegen of the P @ V intrinsic (arguments: o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd,
    heads): pointers, the masked fma of one cell, the chunk loop, the output store."""

    def __init__(self, context, builder, sig, args):
        ty, b = sig.args, builder
        self.b = b
        (self.ooff, self.wstride, self.n_chunks, self.stride, self.first, self.last, self.nvd, self.heads) = (
            _as_i64(context, b, ty[i], args[i]) for i in (1, 3, 6, 7, 8, 9, 10, 11))
        self.po0 = b.gep(_data(context, b, ty[0], args[0]), [self.ooff])
        self.pw0 = _data(context, b, ty[2], args[2])
        self.v = _loader(context, b, ty[4], args[4])
        self.pbase = _data(context, b, ty[5], args[5])
        self.zero = ir.Constant(_vec(_PV_WIDTH), [0.0] * _PV_WIDTH)

    def k(self, x):
        return ir.Constant(_I64, x)

    def fma_cell(self, acc, pw, cell, vrow, masked, v=None):
        """acc += w[cell] * V[vrow : vrow + W] (one rounding; v: that V slice when already loaded); a masked cell
        outside first..last leaves acc."""
        b, W = self.b, _PV_WIDTH
        a = b.load(acc)
        f = _fma(b, _splat(b, b.load(b.gep(pw, [cell])), W), self.v.load(vrow, W) if v is None else v, a)
        if masked:
            ok = b.and_(b.icmp_signed(">=", cell, self.first), b.icmp_signed("<=", cell, self.last))
            f = b.select(ok, f, a)
        b.store(f, acc)

    def over_chunks(self, body):
        """body(c, masked) for c < n_chunks (>= 1); only the first and last chunks can hold masked cells. Those
        two are peeled off the loop, so the middle chunks' accumulators stay in registers (a branch inside the
        loop made LLVM shuffle them through the stack)."""
        b = self.b
        body(self.k(0), True)
        last_chunk = b.sub(self.n_chunks, self.k(1))
        with cgutils.for_range_slice(b, self.k(1), last_chunk, self.k(1)) as (c, _):
            body(c, False)
        with b.if_then(b.icmp_signed(">", last_chunk, self.k(0))):
            body(last_chunk, True)

    def over_outputs(self, head_sum, group_sum, hg: int):
        """For each slice d0 of W output elements and each head g: o[g*vd + d0 :][:W], heads hg at a time by
        group_sum(d0, [w of each]) -> their outputs, the rest one by one by head_sum(d0, w of g)."""
        b, W = self.b, _PV_WIDTH

        def put(g, d0, r):
            po = b.gep(self.po0, [b.add(b.mul(g, self.nvd), d0)])
            b.store(r, b.bitcast(po, _vec(W).as_pointer()), align=4)

        def pw(g):
            return b.gep(self.pw0, [b.mul(g, self.wstride)])

        blocks = b.udiv(self.heads, self.k(hg))
        with cgutils.for_range(b, b.udiv(self.nvd, self.k(W))) as ld:
            d0 = b.mul(ld.index, self.k(W))
            with cgutils.for_range(b, blocks) as lb:
                gs = [b.add(b.mul(lb.index, self.k(hg)), self.k(h)) for h in range(hg)]
                for g, r in zip(gs, group_sum(d0, [pw(g) for g in gs])):
                    put(g, d0, r)
            with cgutils.for_range_slice(b, b.mul(blocks, self.k(hg)), self.heads, self.k(1)) as (g, _):
                put(g, d0, head_sum(d0, pw(g)))


def _pv_intrinsic(head_sums):
    """A P @ V intrinsic (arguments: those of _PV) from head_sums(e, b) -> (head_sum(d0, pw): the 16 outputs of
    one head for the slice d0 of V, group_sum(d0, pws): those of several heads, their number; see
    _PV.over_outputs)."""
    def typer(typingctx, o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads):
        def codegen(context, builder, sig, args):
            e = _PV(context, builder, sig, args)
            e.over_outputs(*head_sums(e, builder))
            return context.get_dummy_value()
        if kv_form(v) is None:
            return None
        return types.void(o, ooff, w, wstride, v, cbase, n_chunks, stride, first, last, vd, heads), codegen
    typer.__name__ = typer.__qualname__ = head_sums.__name__
    typer.__doc__ = head_sums.__doc__
    return intrinsic(typer)


@_pv_intrinsic
def pv_sgemm(e, b):
    """P @ V in tinyBLAS<16, __m512>'s order, for `heads` query heads sharing one KV head and cells in chunks of 16
    (cell j of the run: lane j % 16, fma over j // 16, then reduce_add of the 16 lanes): o[ooff + g*vd + d] for
    d < vd (vd % _PV_WIDTH == 0). Head g's weights of chunk c are w[g*wstride + 16c :][:16]; the chunk's 16 V
    rows start at cbase[c] and follow each other at `stride` (a chunk lies in one KV block). Only cells
    first..last of the run are visible: the others leave the lanes unchanged (as their weight 0 does in
    llama.cpp; their V rows may be garbage). Vectorised over d, 16 lane accumulators in registers (in passes of
    the form's sgemm_lanes lanes over the chunks: the sums do not change); the heads run one after the other
    over the same slice of V (then in L1)."""
    per_pass = e.v.sgemm_lanes
    accs = [cgutils.alloca_once(b, _vec(_PV_WIDTH)) for _ in range(per_pass)]

    def group_sum(d0, pws):
        # len(pws) heads at once: each V slice is loaded once for all of them (per_pass // heads lanes a pass);
        # every head's lanes sum the same cells in the same order as head_sum's
        hg = len(pws)
        lanes = per_pass // hg
        xs = [[] for _ in pws]  # per head: the 16 lane sums, in lane order
        for first_lane in range(0, 16, lanes):
            for acc in accs:
                b.store(e.zero, acc)

            def chunk(c, masked):
                row = b.add(b.load(b.gep(e.pbase, [c])), d0)
                for li in range(lanes):
                    lane = first_lane + li
                    cell = b.add(b.mul(c, e.k(16)), e.k(lane))
                    vrow = b.add(row, b.mul(e.stride, e.k(lane)))
                    v = e.v.load(vrow, _PV_WIDTH)
                    for h, pw in enumerate(pws):
                        e.fma_cell(accs[h * lanes + li], pw, cell, vrow, masked, v)
            e.over_chunks(chunk)
            for h in range(hg):
                xs[h] += [b.load(accs[h * lanes + li]) for li in range(lanes)]
        return [_reduce16_list(b, x) for x in xs]

    def head_sum(d0, pw):
        xs = []  # the 16 lane sums, in lane order
        for first_lane in range(0, 16, per_pass):  # a pass over the chunks per group of lanes
            for acc in accs:
                b.store(e.zero, acc)

            def chunk(c, masked):
                row = b.add(b.load(b.gep(e.pbase, [c])), d0)
                for lane, acc in enumerate(accs, first_lane):
                    cell = b.add(b.mul(c, e.k(16)), e.k(lane))
                    e.fma_cell(acc, pw, cell, b.add(row, b.mul(e.stride, e.k(lane))), masked)
            e.over_chunks(chunk)
            xs += [b.load(acc) for acc in accs]
        return _reduce16_list(b, xs)
    return head_sum, group_sum, PV_HEADS


@intrinsic
def expf_sub(typingctx, w, off, n, m):
    """w[off + i] = ggml_expf(w[off + i] - m) for i < n - n % _EXP_LANES, _EXP_LANES at a time: ops.ggml_expf's
    operations on vectors, so each value is the scalar one's bit for bit (the caller does the rest by ggml_expf).
    The softmax's exponentials: a scalar loop over ggml_expf did not vectorize (1B prefill attention 13% faster)."""
    def codegen(context, builder, sig, args):
        b, W = builder, _EXP_LANES
        pw = _data(context, b, sig.args[0], args[0])
        off_, nn = (_as_i64(context, b, sig.args[i], args[i]) for i in (1, 2))
        f = lambda x: ir.Constant(_vec(W), [float(x)] * W)  # noqa: E731
        mv = _splat(b, args[3], W)
        with cgutils.for_range(b, b.udiv(nn, ir.Constant(_I64, W))) as lp:
            at = b.add(off_, b.mul(lp.index, ir.Constant(_I64, W)))
            ptr = b.bitcast(b.gep(pw, [at]), _vec(W).as_pointer())
            x = b.fsub(b.load(ptr, align=4), mv)
            n_ = b.fsub(_fma(b, x, f(ops.EXP_LOG2E), f(ops.EXP_SHIFT)), f(ops.EXP_SHIFT))
            neg = b.fsub(f(-0.0), n_)
            bb = _fma(b, neg, f(ops.EXP_LN2_LO), _fma(b, neg, f(ops.EXP_LN2_HI), x))
            u = b.fmul(bb, bb)
            j = _fma(b, _fma(b, _fma(b, f(ops.EXP_C5), bb, f(ops.EXP_C4)), u, _fma(b, f(ops.EXP_C3), bb, f(ops.EXP_C2))),
                     u, _fma(b, f(ops.EXP_C1), bb, f(1.0)))
            nc = b.select(b.fcmp_ordered(">", n_, f(-192.0)), n_, f(-192.0))
            nc = b.select(b.fcmp_ordered("<", nc, f(192.0)), nc, f(192.0))
            i64 = _vec(W, _I64)
            bits = b.shl(b.add(b.fptosi(nc, i64), ir.Constant(i64, [1023] * W)), ir.Constant(i64, [52] * W))
            r = b.fptrunc(b.fmul(b.fpext(j, _vec(W, ir.DoubleType())), b.bitcast(bits, _vec(W, ir.DoubleType()))),
                          _vec(W))
            r = b.select(b.fcmp_ordered(">", n_, f(192.0)), f(math.inf), r)
            r = b.select(b.fcmp_ordered("<", n_, f(-192.0)), f(0.0), r)
            b.store(b.select(b.fcmp_unordered("uno", n_, n_), n_, r), ptr, align=4)
        return context.get_dummy_value()
    return types.void(w, off, n, types.float32), codegen


# --- the kernel: the IR sums where they apply, the same sums in plain Numba elsewhere ----------------------------

def kv_at(c, i):
    """Element i of a flat K/V cache as float32 (any form, module doc: f32; f16 / bf16 bits widened; q8_0 (qs, d)
    as d * q)."""
    raise NotImplementedError  # only used inside jitted code


@overload(kv_at)
def _kv_at(c, i):
    return {"f32": lambda c, i: c[i],
            "f16": lambda c, i: f16_bits_to_f32(c[i]),
            "bf16": lambda c, i: bits_to_f32(np.uint32(c[i]) << np.uint32(16)),
            "q8_0": lambda c, i: f16_bits_to_f32(c[1][i >> 5]) * np.float32(c[0][i])}.get(kv_form(c))


@jit
def _tree16(a, o):
    """_mm512_reduce_add_ps (GCC) of the 16 floats a[o:o+16]: halves added lane-wise 16 -> 8 -> 4 -> 2 -> 1."""
    t0 = a[o + 0] + a[o + 8]
    t1 = a[o + 1] + a[o + 9]
    t2 = a[o + 2] + a[o + 10]
    t3 = a[o + 3] + a[o + 11]
    t4 = a[o + 4] + a[o + 12]
    t5 = a[o + 5] + a[o + 13]
    t6 = a[o + 6] + a[o + 14]
    t7 = a[o + 7] + a[o + 15]
    u0, u1, u2, u3 = t0 + t4, t1 + t5, t2 + t6, t3 + t7
    return (u0 + u2) + (u1 + u3)


@jit
def _pv_lanes(o, ooff, w, base, v, bt, bs, row_stride, voff, lo, pos, vd, acc, lanes):
    # P @ V (the plain-Numba twin of pv_sgemm for shapes it does not take): cell p in lane p % 16, fma over
    # p // 16, then the 16 lanes reduced; w[p - base]: weights; V row of cell p at (bt[p // bs] * bs + p % bs) *
    # row_stride + voff. acc: (16, vd) scratch
    acc[:] = 0.0
    for p in range(lo, pos + 1):
        a = acc[p % 16]
        wp = w[p - base]
        vo = (bt[p // bs] * bs + p % bs) * row_stride + voff
        for d in range(vd):
            a[d] = fma32(wp, kv_at(v, vo + d), a[d])
    for d in range(vd):
        for j in range(16):
            lanes[j] = acc[j, d]
        o[ooff + d] = _tree16(lanes, 0)


@jit(inline="always")
def _score(s, m, at, g, x, scale, softcap, inv_cap):
    # one KQ value: scaled, soft-capped, stored at s[at], folded into head g's max
    x = x * scale  # ggml_soft_max_ext's scale (Gemma 3 scales q instead: the same for a power of 2)
    if softcap > 0:  # ggml_scale(1/cap), ggml_tanh (tanhf), ggml_scale(cap)
        x = np.float32(math.tanh(x * inv_cap)) * softcap
    s[at] = x
    if x > m[g]:
        m[g] = x


@jit  # no fastmath: every float operation below is one of llama.cpp's, in its order
def _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                     job_lo, job_hi, s):
    # flat C-order views: out (T*H*vd,) of (T, H, vd); q (T*H*hd,) of (T, H, hd); kc, vc of the caches
    # (NB, BS, KVH, hd) / (NB, BS, KVH, vd) in any form (module doc; q8_0: flat (qs, d) pairs); dims = (H, KVH,
    # hd, vd, BS). positions, row_seq: (T,); block_tables: (S, MB); sinks: (H,) float32 per-head sink
    # logits or (0,) for none; s: (group * S,) float32 scratch of
    # this worker, S >= max_ctx + 128. Jobs [job_lo, job_hi) of the T * KVH (row, KV head) pairs; each does the
    # `group` query heads of its KV head (K and V rows are read once for all of them). KV cells go in chunks of
    # 16 (llama.cpp's softmax and sgemm lanes): s[g * S + j] holds head g's value for cell base + j, base a
    # multiple of 16. Every row sums in the same order, whatever else is in the call (batch invariance).
    H, KVH, hd, vd, BS = dims
    group = H // KVH
    S = len(s) // group
    hd_main = hd - hd % 64
    g_quads = group - group % 4 if hd_main == hd else 0  # heads whose KQ dots go 4 at a time (vdot4: no leftovers)
    cbase = np.empty(S // 16 + 1, np.int64)  # per chunk: V offset of its first cell
    m = np.empty(group, np.float32)
    vacc = np.empty((16, vd), np.float32)
    lanes = np.empty(16, np.float32)
    inv_cap = np.float32(1.0) / softcap if softcap > 0 else np.float32(0.0)
    for job in range(job_lo, job_hi):
        t = job // KVH
        kh = job % KVH
        pos = positions[t]
        bt = block_tables[row_seq[t]]
        lo = 0
        if window > 0 and pos - window + 1 > 0:
            lo = pos - window + 1
        base = lo - lo % 16  # cells are handled in chunks of 16 from a multiple of 16 on
        n16 = pos // 16 - base // 16 + 1  # chunks of 16 cells from base
        # KQ = ggml_vec_dot_f32 per visible cell: 4 x 16 lanes (element i in lane i % 64, fma over i // 64),
        # (s0 + s2) + (s1 + s3), reduce_add; the hd % 64 leftovers by scalar fma. Walked block by block.
        m[:] = -np.inf
        for b in range(lo // BS, pos // BS + 1):
            row0 = bt[b] * BS - b * BS  # cache row of cell p: row0 + p
            for p in range(max(lo, b * BS), min(pos, b * BS + BS - 1) + 1):
                koff = ((row0 + p) * KVH + kh) * hd
                for g4 in range(0, g_quads, 4):  # heads 4 at a time: vdot4, the same dots
                    xs = vdot4(q, (t * H + kh * group + g4) * hd, hd, kc, koff, hd_main)
                    for j in range(4):
                        _score(s, m, (g4 + j) * S + p - base, g4 + j, xs[j], scale, softcap, inv_cap)
                for g in range(g_quads, group):
                    qoff = (t * H + kh * group + g) * hd
                    x = vdot(q, qoff, kc, koff, hd_main)
                    for i in range(hd_main, hd):
                        x = fma32(q[qoff + i], kv_at(kc, koff + i), x)
                    _score(s, m, g * S + p - base, g, x, scale, softcap, inv_cap)
        # softmax (ggml_compute_forward_soft_max_f32): e = ggml_v_expf(x - max), 0 for masked cells; per chunk a
        # reduce_add, summed in double; then every e times (float)(1.0 / sum). A sink (gpt-oss) joins the max and
        # adds expf(sink - max) (libm) to the sum: a logit with no value
        for g in range(group):
            w = s[g * S:(g + 1) * S]
            if len(sinks):
                m[g] = max(m[g], sinks[kh * group + g])
            mg, s0, n = m[g], lo - base, pos - lo + 1  # the visible cells: w[s0 : s0 + n]
            expf_sub(w, s0, n, mg)  # _EXP_LANES at a time, then the rest
            for j in range(s0 + n - n % _EXP_LANES, s0 + n):
                w[j] = ggml_expf(w[j] - mg)
            w[:s0] = 0.0
            w[s0 + n:16 * n16] = 0.0
            total = 0.0
            for c in range(n16):
                total += np.float64(_tree16(w, 16 * c))
            if len(sinks):
                total += np.float64(np.float32(math.exp(sinks[kh * group + g] - m[g])))
            inv = np.float32(1.0 / total)
            for j in range(16 * n16):
                w[j] = w[j] * inv
        # KQV over the KV cells in tinyBLAS sgemm's order (16 lanes: cell p in lane p % 16, fma over p // 16,
        # reduce_add) for every row: llama.cpp sums a one-token batch in ggml_vec_dot_f32's order instead (4 x 16
        # lanes), which costs twice the time here and made a row's K/V depend on whether it was a generated
        # token. Cells outside [lo, pos] have weight 0 and leave the lanes unchanged: skipped.
        ooff = (t * H + kh * group) * vd
        if BS % 16 == 0 and vd % _PV_WIDTH == 0:  # the IR kernels: 16-cell chunks in one block
            for c in range(n16):
                p = base + 16 * c
                if p > pos or p + 15 < lo:  # no visible cell (masked lanes): any 16 rows of a block in use
                    p = pos - pos % 16
                cbase[c] = ((bt[p // BS] * BS + p % BS) * KVH + kh) * vd
            pv_sgemm(out, ooff, s, S, vc, cbase, n16, KVH * vd, lo - base, pos - base, vd, group)
        else:
            for g in range(group):
                _pv_lanes(out, ooff + g * vd, s[g * S:(g + 1) * S], base, vc, bt, BS, KVH * vd, kh * vd, lo, pos,
                          vd, vacc, lanes)


@parallel_jit
def _paged_attention_split(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                           bounds, scratch):
    # _paged_attention over the job chunks [bounds[c], bounds[c+1]) in parallel; scratch (chunks, S)
    for c in numba.prange(len(bounds) - 1):
        _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                         bounds[c], bounds[c + 1], scratch[c])
