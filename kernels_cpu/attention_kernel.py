"""The paged attention kernel (kernels_cpu/attention.py calls it) and the LLVM IR of the tiles it inlines: Q K^T, the
softmax and P V of one job (up to NQ_MAX query vectors that share their K/V cells) with vectors in registers. One
file, because Numba's cache of a kernel is only invalidated by edits to the kernel's own file, not to the
intrinsics it inlines.

Each value sums in one fixed order, whatever the job's shape (the batch, the chunking, a decode row alone): a
score over PARTIALS partial sums added by halving, a softmax denominator over chunks of 16 cells, an output as one
fma chain over its visible cells. llama.cpp's orders (tinyBLAS lanes over the cells for P V, 64 partials for
K Q) are not kept: they made each score a horizontal reduction and kept the queries of a prefill from sharing
their K and V loads (1B shape, 512-row prefill, 2 threads: 30 -> 18 ms a layer; the model's perplexity as close
to llama.cpp's as before, tests/test_golden_gemma.py).

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
from kernels_cpu._jit import host_features, jit, parallel_jit
from kernels_cpu.ops import bits_to_f32, f16_bits_to_f32, fma32

_F32, _I64, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)


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


# --- loaders: one per cache form ---------------------------------------------------------------------------

def _data(context, builder, ty, val):
    return context.make_array(ty)(context, builder, val).data


class _LoadF32:
    def __init__(self, context, builder, ty, val):
        self.b, self.p = builder, _data(context, builder, ty, val)

    def load(self, off, n):
        return _vload(self.b, self.p, off, n)

    def address(self, off):
        """Element off's address (i8*), for a prefetch."""
        return self.b.bitcast(self.b.gep(self.p, [off]), ir.IntType(8).as_pointer())


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

    def address(self, off):
        return self.b.bitcast(self.b.gep(self.pq, [off]), ir.IntType(8).as_pointer())


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


# --- the tiles: Q K^T and P V of one job, vectorised over its query vectors / value elements -----------------

def _native_width() -> int:
    """float32 lanes of the host's vector registers (AVX-512: 16, AVX2: 8, NEON: 4)."""
    f = host_features()
    return 16 if "avx512f" in f else 4 if "neon" in f else 8


# A KQ score's order, the same on every host and in every path of the kernel: PARTIALS partial sums, partial j
# an fma chain over the elements d = j, j + PARTIALS, ... below hd - hd % PARTIALS, added by halving (j + j + 8,
# then j + j + 4, ...), then the leftover elements fma'd on in order. As vectors: one <16 x float> of partials per
# query (qk_cells), or PARTIALS registers of query lanes per cell (qk_lanes): the same additions.
PARTIALS = 16
# query vectors a job: qk_lanes' 16 registers of query lanes fill half of AVX-512's 32 zmm; with 16 ymm (AVX2) or
# 32 q registers of 4 lanes (NEON) they would spill, so there every job is a few queries for qk_cells
NQ_MAX = 16 if _native_width() == 16 else 4
# P V: value elements a vector, and accumulators (vectors) side by side: enough fma chains to hide the latency
PV_WIDTH = 16 if _native_width() == 16 else 8
_PV_ACCS = 16 if _native_width() == 16 else 8  # AVX2: 8 ymm; NEON: 8 x 2 q registers
AHEAD = 8  # cells: how far ahead the tiles prefetch K / V rows (koff / voff need AHEAD spare entries)


def _halve(b, xs):
    """xs[0] + ... by halving: [x_i + x_(i + n/2)] until one is left (n a power of 2)."""
    while len(xs) > 1:
        h = len(xs) // 2
        xs = [b.fadd(xs[i], xs[i + h]) for i in range(h)]
    return xs[0]


def _hsums(b, vs):
    """[_halve over the lanes of v for v in vs] (up to P vectors of P lanes, a power of 2 of them), the vectors'
    additions packed side by side: a pair of vectors holding g groups of w lanes becomes one vector of 2g groups of
    w/2 (group j's lanes i and i + w/2 added), then the last vector halves its groups in place. 4 queries of 16
    lanes: 8 shuffles and 5 additions instead of 16 and 16."""
    P = vs[0].type.count
    w = P
    while len(vs) > 1:
        h, g = w // 2, P // w
        lo = [j * w + i for j in range(g) for i in range(h)]
        hi = [x + h for x in lo]

        def pick(x, y, idx):
            return b.shuffle_vector(x, y, ir.Constant(ir.VectorType(_I32, P), idx + [P + i for i in idx]))
        vs = [b.fadd(pick(vs[i], vs[i + 1], lo), pick(vs[i], vs[i + 1], hi)) for i in range(0, len(vs), 2)]
        w = h
    v, width = vs[0], w  # P // width groups of width lanes; group j's sum ends in its lane j * width
    while w > 1:  # in place: lane x += lane x + w/2 of its group (a group's upper lanes become garbage)
        h = w // 2
        v = b.fadd(v, _lanes(b, v, [(x - x % w) + (x % w + h) % w for x in range(P)]))
        w = h
    return [b.extract_element(v, ir.Constant(_I32, j * width)) for j in range(P // width)]


class _Tile:
    """What the tile intrinsics' codegen shares: pointers of its array arguments, i64 constants."""

    def __init__(self, context, builder, sig, args, arrays, loader):
        self.b = builder
        self.p = {i: _data(context, builder, sig.args[i], args[i]) for i in arrays}
        self.kv = None if loader is None else _loader(context, builder, sig.args[loader], args[loader])

    @staticmethod
    def k(x):
        return ir.Constant(_I64, x)

    def at(self, i, off):
        return self.b.load(self.b.gep(self.p[i], [off]))

    def vstore(self, i, off, v):
        b = self.b
        b.store(v, b.bitcast(b.gep(self.p[i], [off]), v.type.as_pointer()), align=4)

    def scalar_kv(self, off):
        return self.b.extract_element(self.kv.load(off, 1), ir.Constant(_I32, 0))

    def prefetch(self, offs):
        """Prefetch (to L1) the cache elements at offs: the rows of cells a few ahead. Decode reads each K/V row
        once, from memory: the hardware prefetchers do not follow rows 2 KiB apart (1B: 8 KV heads of 64)."""
        b = self.b
        i8p = ir.IntType(8).as_pointer()
        fn = b.module.globals.get("llvm.prefetch.p0") or ir.Function(
            b.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0")
        for off in offs:
            b.call(fn, [self.kv.address(off), ir.Constant(_I32, 0), ir.Constant(_I32, 3), ir.Constant(_I32, 1)])


def _qk_typer(body):
    def typer(typingctx, s, qx, kc, koff, n, hd, nq):
        if not isinstance(nq, types.IntegerLiteral) or kv_form(kc) is None:
            return None

        def codegen(context, builder, sig, args):
            body(_Tile(context, builder, sig, args, (0, 1, 3), 2), nq.literal_value, args[4], args[5])
            return context.get_dummy_value()
        return types.void(s, qx, kc, koff, types.int64, types.int64, nq), codegen
    typer.__name__ = typer.__qualname__ = body.__name__
    typer.__doc__ = body.__doc__
    return intrinsic(prefer_literal=True)(typer)


def _over_cells(e, nn, nhd, body):
    """body(c, off) for each cell c < n, off its K row (koff, argument 3), after prefetching the row of the cell
    AHEAD on (4 spots along it)."""
    b, k = e.b, e.k
    with cgutils.for_range(b, nn) as lc:
        c = lc.index
        ahead = e.at(3, b.add(c, k(AHEAD)))
        e.prefetch([b.add(ahead, b.udiv(b.mul(nhd, k(i)), k(4))) for i in range(4)])
        body(c, e.at(3, c))


@_qk_typer
def qk_cells(e, NQ, nn, nhd):
    """s[c*NQ + l] = query l . K row c (PARTIALS order) for c < n, l < NQ (a literal); queries row-major in
    qr[l*hd :][:hd], K rows at koff[c] (a cache in any form). Per query one register of partials over the row:
    the form for a few queries (a decode row)."""
    b, P, k = e.b, PARTIALS, e.k
    zero = ir.Constant(_vec(P), [0.0] * P)
    main = b.sub(nhd, b.urem(nhd, k(P)))
    def cell(c, off):
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(NQ)]
        with cgutils.for_range_slice(b, k(0), main, k(P)) as (d, _):
            kv = e.kv.load(b.add(off, d), P)
            for lq, acc in enumerate(accs):
                qv = _vload(b, e.p[1], b.add(b.mul(k(lq), nhd), d), P)
                b.store(_fma(b, qv, kv, b.load(acc)), acc)
        rs = [cgutils.alloca_once_value(b, x) for x in _hsums(b, [b.load(acc) for acc in accs])]
        with cgutils.for_range_slice(b, main, nhd, k(1)) as (d, _):
            kx = e.scalar_kv(b.add(off, d))
            for lq, r in enumerate(rs):
                b.store(_fma(b, e.at(1, b.add(b.mul(k(lq), nhd), d)), kx, b.load(r)), r)
        for lq, r in enumerate(rs):
            b.store(b.load(r), b.gep(e.p[0], [b.add(b.mul(c, k(NQ)), k(lq))]))
    _over_cells(e, nn, nhd, cell)


@_qk_typer
def qk_lanes(e, NQ, nn, nhd):
    """qk_cells' scores (the same bits) with the NQ queries as the lanes: queries transposed in qt[d*NQ + l];
    per cell PARTIALS registers of NQ lanes, K elements broadcast. The form for many queries (prefill rows)."""
    b, P, k = e.b, PARTIALS, e.k
    zero = ir.Constant(_vec(NQ), [0.0] * NQ)
    main = b.sub(nhd, b.urem(nhd, k(P)))
    def fma_at(d, off, acc):  # acc += query lanes of element d * K element d
        qv = _vload(b, e.p[1], b.mul(d, k(NQ)), NQ)
        b.store(_fma(b, qv, _splat(b, e.scalar_kv(b.add(off, d)), NQ), b.load(acc)), acc)

    def cell(c, off):
        accs = [cgutils.alloca_once_value(b, zero) for _ in range(P)]
        with cgutils.for_range_slice(b, k(0), main, k(P)) as (d0, _):
            for j, acc in enumerate(accs):
                fma_at(b.add(d0, k(j)), off, acc)
        r = cgutils.alloca_once_value(b, _halve(b, [b.load(acc) for acc in accs]))
        with cgutils.for_range_slice(b, main, nhd, k(1)) as (d, _):
            fma_at(d, off, r)
        e.vstore(0, b.mul(c, k(NQ)), b.load(r))
    _over_cells(e, nn, nhd, cell)


@intrinsic(prefer_literal=True)
def pv_tile(typingctx, o, w, vc, voff, n, vd, rng, a, z, nq):
    """o[l*vd + d] = the sum over cells c < n of w[c*nq + l] * V[voff[c] + d], for lanes l < nq (a literal) and
    d < vd - vd % PV_WIDTH (the caller sums the rest in the same order): one chain of fmas per output, in cell order from 0, whatever nq. Lane l sums only
    cells rng[l] <= c <= rng[nq + l] (int64), the others leave it unchanged (their V rows may hold anything);
    cells a <= c < z are in every lane's range, so that loop has no masks. V: a cache in any form. Up to
    _PV_ACCS vectors (lanes x value slices) accumulate side by side."""
    if not isinstance(nq, types.IntegerLiteral) or kv_form(vc) is None:
        return None
    NQ = nq.literal_value
    W = PV_WIDTH
    QG = min(NQ, _PV_ACCS)  # lanes a pass
    DV = max(1, _PV_ACCS // QG)  # value slices a pass

    def codegen(context, builder, sig, args):
        e = _Tile(context, builder, sig, args, (0, 1, 3, 6), 2)
        b, k = e.b, e.k
        nn, nvd, a_, z_ = args[4], args[5], args[7], args[8]
        zero = ir.Constant(_vec(W), [0.0] * W)

        def one_pass(d0, lanes, dv):
            accs = [[cgutils.alloca_once_value(b, zero) for _ in range(dv)] for _ in lanes]
            bounds = [(e.at(6, k(lq)), e.at(6, k(NQ + lq))) for lq in lanes]

            def cells(lo, hi, masked):
                with cgutils.for_range_slice(b, lo, hi, k(1)) as (c, _):
                    row = b.add(e.at(3, c), d0)
                    if not masked:
                        ahead = b.add(e.at(3, b.add(c, k(AHEAD))), d0)
                        e.prefetch([b.add(ahead, k(W * i)) for i in range(dv)])
                    vv = [e.kv.load(b.add(row, k(W * i)), W) for i in range(dv)]
                    for lq, lane_accs, (first, last) in zip(lanes, accs, bounds):
                        wv = _splat(b, e.at(1, b.add(b.mul(c, k(NQ)), k(lq))), W)
                        ok = b.and_(b.icmp_signed(">=", c, first), b.icmp_signed("<=", c, last)) if masked else None
                        for acc, v in zip(lane_accs, vv):
                            x = b.load(acc)
                            f = _fma(b, wv, v, x)
                            b.store(b.select(ok, f, x) if masked else f, acc)
            cells(k(0), a_, True)
            cells(a_, z_, False)
            cells(z_, nn, True)
            for lq, lane_accs in zip(lanes, accs):
                for i, acc in enumerate(lane_accs):
                    e.vstore(0, b.add(b.mul(k(lq), nvd), b.add(d0, k(W * i))), b.load(acc))

        step = W * DV
        whole = b.sub(nvd, b.urem(nvd, k(W)))  # the caller does the rest
        main = b.sub(whole, b.urem(whole, k(step)))
        with cgutils.for_range_slice(b, k(0), main, k(step)) as (d0, _):
            for g0 in range(0, NQ, QG):
                one_pass(d0, range(g0, g0 + QG), DV)
        with cgutils.for_range_slice(b, main, whole, k(W)) as (d0, _):
            for g0 in range(0, NQ, QG):
                one_pass(d0, range(g0, g0 + QG), 1)
        return context.get_dummy_value()
    i64 = types.int64
    return types.void(o, w, vc, voff, i64, i64, rng, i64, i64, nq), codegen


def _expf(b, x):
    """ops.ggml_expf of each lane of the float vector x: its operations on vectors, each value the scalar one's bit
    for bit."""
    W = x.type.count

    def f(v):
        return ir.Constant(_vec(W), [float(v)] * W)
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
    r = b.fptrunc(b.fmul(b.fpext(j, _vec(W, ir.DoubleType())), b.bitcast(bits, _vec(W, ir.DoubleType()))), _vec(W))
    r = b.select(b.fcmp_ordered(">", n_, f(192.0)), f(math.inf), r)
    r = b.select(b.fcmp_ordered("<", n_, f(-192.0)), f(0.0), r)
    return b.select(b.fcmp_unordered("uno", n_, n_), n_, r)


def _rows_codegen(body, nq):
    """The codegen of an intrinsic over a job's score tile s (argument 0: n rows of nq lanes, n argument 1) from
    body(e, NQ, n, args)."""
    def codegen(context, builder, sig, args):
        arrays = [i for i, t in enumerate(sig.args) if isinstance(t, types.Array)]
        body(_Tile(context, builder, sig, args, arrays, None), nq.literal_value, args[1], args)
        return context.get_dummy_value()
    return codegen


def _row_loop(e, NQ, nn, fn):
    """fn(c, pointer to row c as <NQ x float>*) for each row c < n of the tile s (argument 0)."""
    b = e.b
    with cgutils.for_range(b, nn) as lc:
        ptr = b.bitcast(b.gep(e.p[0], [b.mul(lc.index, e.k(NQ))]), _vec(NQ).as_pointer())
        fn(lc.index, ptr)


def _lane_vec(e, i, NQ, off=0, ty=_F32):
    """Lanes off .. off + NQ - 1 of array argument i as one vector."""
    b = e.b
    return b.load(b.bitcast(b.gep(e.p[i], [e.k(off)]), _vec(NQ, ty).as_pointer()), align=ty.width // 8 if
                  isinstance(ty, ir.IntType) else 4)


@intrinsic(prefer_literal=True)
def scores_max(typingctx, s, n, rng, scale, m, nq):
    """Each score of the tile s (n rows of nq lanes, nq a literal) times scale, then -inf where lane l does not see
    row c (outside rng[l] .. rng[nq + l]); m[l] = the largest per lane (NaN never wins; -inf if none)."""
    if not isinstance(nq, types.IntegerLiteral):
        return None
    return (types.void(s, types.int64, rng, types.float32, m, nq), _rows_codegen(_scores_max, nq))


def _scores_max(e, NQ, nn, args):
    b = e.b
    sc = _splat(b, args[3], NQ)
    first, last = _lane_vec(e, 2, NQ, 0, _I64), _lane_vec(e, 2, NQ, NQ, _I64)
    ninf = ir.Constant(_vec(NQ), [-math.inf] * NQ)
    mx = cgutils.alloca_once_value(b, ninf)

    def row(c, ptr):
        x = b.fmul(b.load(ptr, align=4), sc)
        cv = _splat(b, c, NQ)
        seen = b.and_(b.icmp_signed(">=", cv, first), b.icmp_signed("<=", cv, last))
        x = b.select(seen, x, ninf)
        b.store(x, ptr, align=4)
        m = b.load(mx)
        b.store(b.select(b.fcmp_ordered(">", x, m), x, m), mx)
    _row_loop(e, NQ, nn, row)
    b.store(b.load(mx), b.bitcast(e.p[4], _vec(NQ).as_pointer()), align=4)


@intrinsic(prefer_literal=True)
def exp_sum(typingctx, s, n, m, total, nq):
    """The tile s (n rows of nq lanes) = ggml_expf(s - m[l]) per lane; total[l] (float64) = their sum in row order
    from 0."""
    if not isinstance(nq, types.IntegerLiteral):
        return None
    return types.void(s, types.int64, m, total, nq), _rows_codegen(_exp_sum, nq)


def _exp_sum(e, NQ, nn, args):
    b = e.b
    mv = _lane_vec(e, 2, NQ)
    tot = cgutils.alloca_once_value(b, ir.Constant(_vec(NQ, ir.DoubleType()), [0.0] * NQ))

    def row(c, ptr):
        x = _expf(b, b.fsub(b.load(ptr, align=4), mv))
        b.store(x, ptr, align=4)
        b.store(b.fadd(b.load(tot), b.fpext(x, _vec(NQ, ir.DoubleType()))), tot)
    _row_loop(e, NQ, nn, row)
    b.store(b.load(tot), b.bitcast(e.p[3], _vec(NQ, ir.DoubleType()).as_pointer()), align=8)


@intrinsic(prefer_literal=True)
def scale_rows(typingctx, s, n, inv, nq):
    """The tile s (n rows of nq lanes): s[c*nq + l] *= inv[l]."""
    if not isinstance(nq, types.IntegerLiteral):
        return None
    return types.void(s, types.int64, inv, nq), _rows_codegen(_scale_rows, nq)


def _scale_rows(e, NQ, nn, args):
    b = e.b
    iv = _lane_vec(e, 2, NQ)
    _row_loop(e, NQ, nn, lambda c, ptr: b.store(b.fmul(b.load(ptr, align=4), iv), ptr, align=4))


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
def attention_jobs(positions, row_seq, KVH, group):
    """The jobs of a call, (n, 6) int64: first row t0, rows nr, KV head kh, first head g0 (of the KV head's group),
    heads ng, work (cells x query vectors). A job takes up to NQ_MAX query vectors (nr rows x ng heads) that share
    their K/V cells: consecutive rows of one sequence at consecutive positions, heads of one KV head."""
    T = len(positions)
    ng = min(group, NQ_MAX)
    rows_max = max(1, NQ_MAX // ng)
    tiles = np.empty((T, 2), np.int64)
    nt = 0
    t = 0
    while t < T:
        nr = 1
        while (nr < rows_max and t + nr < T and row_seq[t + nr] == row_seq[t]
               and positions[t + nr] == positions[t + nr - 1] + 1):
            nr += 1
        tiles[nt, 0] = t
        tiles[nt, 1] = nr
        nt += 1
        t += nr
    nhg = -(-group // ng)
    jobs = np.empty((nt * KVH * nhg, 6), np.int64)
    j = 0
    for kh in range(KVH):  # a KV head's jobs follow each other: its K/V rows stay in cache between them
        for hg in range(nhg):
            g0 = hg * ng
            for i in range(nt):
                t0, nr = tiles[i, 0], tiles[i, 1]
                cells = positions[t0 + nr - 1] + 1  # an upper bound (a window shortens it)
                jobs[j, 0] = t0
                jobs[j, 1] = nr
                jobs[j, 2] = kh
                jobs[j, 3] = g0
                jobs[j, 4] = min(ng, group - g0)
                jobs[j, 5] = (cells + 16) * nr * jobs[j, 4]
                j += 1
    return jobs


@jit
def _visible_from(pos, window):
    # the first cell a row at pos sees
    return pos - window + 1 if window > 0 and pos - window + 1 > 0 else 0


@jit  # no fastmath: every float operation below is fixed, per score and per output (batch invariance)
def _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                     jobs, job_lo, job_hi, s):
    # flat C-order views: out (T*H*vd,) of (T, H, vd); q (T*H*hd,) of (T, H, hd); kc, vc of the caches
    # (NB, BS, KVH, hd) / (NB, BS, KVH, vd) in any form (module doc; q8_0: flat (qs, d) pairs); dims = (H, KVH,
    # hd, vd, BS). positions, row_seq: (T,); block_tables: (S, MB); sinks: (H,) float32 per-head sink logits or
    # (0,) for none; jobs: attention_jobs' rows, this call does [job_lo, job_hi); s: (NQ_MAX * C,) float32
    # scratch of this worker, C >= the cells of any job. A job's nq query vectors are the lanes of its (cells, nq)
    # score tile s: scores (qk_cells / qk_lanes), then scale, soft-cap, the mask, the softmax per lane, then P V (pv_tile).
    # Every value a row gets is computed by the same operations in the same order whatever shares its job, the
    # call or its sequence's chunking: a score is one fma chain over d, a softmax sum one float64 chain over the
    # cells in order (cells a row does not see add exact zeros), an output one fma chain over its cells.
    H, KVH, hd, vd, BS = dims
    group = H // KVH
    cap = len(s) // NQ_MAX  # >= cells + AHEAD
    koff = np.empty(cap, np.int64)  # per cell of the job: its K row, V row
    voff = np.empty(cap, np.int64)
    qx = np.empty(hd * NQ_MAX, np.float32)  # the job's queries: (nq, hd) rows or (hd, nq) transposed
    o = np.empty(NQ_MAX * vd, np.float32)  # (nq, vd)
    rng = np.empty(2 * NQ_MAX, np.int64)  # per lane: first, last visible cell (job-relative)
    lane_t = np.empty(NQ_MAX, np.int64)
    lane_h = np.empty(NQ_MAX, np.int64)
    m = np.empty(NQ_MAX, np.float32)
    total = np.empty(NQ_MAX, np.float64)
    inv = np.empty(NQ_MAX, np.float32)
    sink = np.empty(NQ_MAX, np.float32)
    inv_cap = np.float32(1.0) / softcap if softcap > 0 else np.float32(0.0)
    vd_main = vd - vd % PV_WIDTH
    for job in range(job_lo, job_hi):
        t0, nr, kh, g0, ng = jobs[job, 0], jobs[job, 1], jobs[job, 2], jobs[job, 3], jobs[job, 4]
        nq = nr * ng
        NQ = 4 if nq <= 4 else 8 if nq <= 8 else 16
        bt = block_tables[row_seq[t0]]
        c_lo = _visible_from(positions[t0], window)
        n = positions[t0 + nr - 1] - c_lo + 1
        c = 0
        while c < n:  # the cells' K and V rows, a block at a time
            p = c_lo + c
            run = min(BS - p % BS, n - c)
            row = (bt[p // BS] * BS + p % BS) * KVH + kh
            for i in range(run):
                koff[c + i] = (row + i * KVH) * hd
                voff[c + i] = (row + i * KVH) * vd
            c += run
        a, z = 0, n  # the cells every lane sees: [a, z)
        for lane in range(NQ):
            li = lane if lane < nq else 0  # lanes past nq repeat lane 0 (their results are dropped)
            t = t0 + li // ng
            h = kh * group + g0 + li % ng
            lane_t[lane], lane_h[lane] = t, h
            rng[lane] = _visible_from(positions[t], window) - c_lo
            rng[NQ + lane] = positions[t] - c_lo
            a = max(a, rng[lane])
            z = min(z, rng[NQ + lane] + 1)
            sink[lane] = sinks[h] if len(sinks) else -np.inf
            qo = (t * H + h) * hd
            if NQ == 4:  # rows for qk_cells, else transposed for qk_lanes
                for d in range(hd):
                    qx[lane * hd + d] = q[qo + d]
            else:
                for d in range(hd):
                    qx[d * NQ + lane] = q[qo + d]
        if a >= z:
            a, z = n, n
        # KQ (PARTIALS order), then (ggml's steps) scale, soft-cap (ggml_scale(1/cap), ggml_tanh (tanhf),
        # ggml_scale(cap)), the mask, each lane's max
        if NQ == 4:
            qk_cells(s, qx, kc, koff, n, hd, 4)
        elif NQ == 8:
            qk_lanes(s, qx, kc, koff, n, hd, 8)
        else:
            qk_lanes(s, qx, kc, koff, n, hd, 16)
        x_scale = scale
        if softcap > 0:
            for i in range(n * NQ):
                s[i] = np.float32(math.tanh(s[i] * scale * inv_cap)) * softcap
            x_scale = np.float32(1.0)  # (x * 1 is x)
        # softmax per lane: e = ggml_expf(x - max) (0 for masked cells); the sum in float64 over the cells in order,
        # then every e times (float)(1.0 / sum). A sink (gpt-oss) joins the max and adds expf(sink - max) (libm) to
        # the sum: a logit with no value
        if NQ == 4:
            scores_max(s, n, rng, x_scale, m, 4)
        elif NQ == 8:
            scores_max(s, n, rng, x_scale, m, 8)
        else:
            scores_max(s, n, rng, x_scale, m, 16)
        if len(sinks):
            for lane in range(NQ):
                m[lane] = max(m[lane], sink[lane])
        if NQ == 4:
            exp_sum(s, n, m, total, 4)
        elif NQ == 8:
            exp_sum(s, n, m, total, 8)
        else:
            exp_sum(s, n, m, total, 16)
        for lane in range(NQ):
            if len(sinks):
                total[lane] += np.float64(np.float32(math.exp(sink[lane] - m[lane])))
            inv[lane] = np.float32(1.0 / total[lane])
        if NQ == 4:
            scale_rows(s, n, inv, 4)
        elif NQ == 8:
            scale_rows(s, n, inv, 8)
        else:
            scale_rows(s, n, inv, 16)
        # P V: per output one fma chain over the lane's visible cells, in order
        if NQ == 4:
            pv_tile(o, s, vc, voff, n, vd, rng, a, z, 4)
        elif NQ == 8:
            pv_tile(o, s, vc, voff, n, vd, rng, a, z, 8)
        else:
            pv_tile(o, s, vc, voff, n, vd, rng, a, z, 16)
        for lane in range(NQ):  # value elements past the vectors (vd % PV_WIDTH): the same chains, scalar
            for d in range(vd_main, vd):
                acc = np.float32(0.0)
                for c in range(rng[lane], rng[NQ + lane] + 1):
                    acc = fma32(s[c * NQ + lane], kv_at(vc, voff[c] + d), acc)
                o[lane * vd + d] = acc
        for lane in range(nq):
            oo = (lane_t[lane] * H + lane_h[lane]) * vd
            for d in range(vd):
                out[oo + d] = o[lane * vd + d]


@parallel_jit
def _paged_attention_split(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                           jobs, bounds, scratch):
    # _paged_attention over the job chunks [bounds[c], bounds[c+1]) in parallel; scratch (chunks, S)
    for c in numba.prange(len(bounds) - 1):
        _paged_attention(out, q, kc, vc, dims, positions, row_seq, block_tables, window, scale, softcap, sinks,
                         jobs, bounds[c], bounds[c + 1], scratch[c])
