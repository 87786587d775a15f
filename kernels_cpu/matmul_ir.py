"""The fused matmul kernels' row-group loop (qdot), written as LLVM IR through a Numba intrinsic.

Plain Numba loops do not reliably give packed integer multiply-adds (LLVM widens to int64, or leaves
16/32-trip block loops scalar), so the inner block of each format is spelled out here as vector IR:

* a weight *row group* is R = 16 output rows; one "pair vector" holds 32 bytes = elements (2p, 2p+1) of
  each of the 16 rows (lane 2r+e), so a packed multiply-add (vpmaddwd) against the broadcast activation pair
  (x[2p], x[2p+1]) yields 16 int32 partial dot products, one per row, with no horizontal reductions;
* each K block's integer dot product is exact (as ggml computes it); it is scaled in float32 and added to one
  <16 x float> accumulator per activation row with an explicit llvm.fma, in a fixed order, so a row's result
  never depends on how many activation rows are processed together (batch invariance). One accumulator per
  row (not llama.cpp's 8 SIMD lanes) keeps the hot loop inside AVX2's 16 and NEON's 32 vector registers.

`qdot(FMT, MB, facc, xq, xoff, xstride, dx, dxoff, dxstride, bs, bsoff, bsstride, qs, qoff, sc, soff, nb, ...)`
runs the K blocks of one row group for MB activation rows (a loop in IR, accumulators in registers) and
stores the MB x 16 outputs to facc (float64). FMT (the QuantType id) and MB are compile-time literals; the
per-format body (one K block) is looked up in BODIES, which matmul_q and matmul_k fill; the bodies are written in
kernels_cpu.ir_emit's vocabulary (Emit).
"""
from __future__ import annotations

from collections.abc import Callable

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._jit import host_features
from .ir_emit import F32, I8, I64, R, Emit, V, max_rows, slice_width
from .repack import LAYOUTS

# Decode (a few activation rows) streams each weight once from memory. With the loads spread among the block's
# arithmetic, the out-of-order window holds few misses at a time and the hardware prefetchers did not run far
# enough ahead on an Intel (Sapphire Rapids class) VM: DRAM-streaming rate ~ 1 / (1/compute + 1/memory). So qdot
# prefetches the lines of the block PREFETCH_BYTES ahead (rounded up to whole blocks) into L2. 2 threads, 1 row,
# ~1.1 GB of distinct 8192x2048 weights: Q4_K 16.9 -> 21.2 GB/s, Q6_K 16.0 -> 20.2, Q5_0 16.4 -> 21.4, Q8_0 22.5
# -> 22.7 (read bandwidth 24.7); 8 rows: Q4_K 11.4 -> 13.5 GB/s; 1,024-4,096 bytes did alike, a non-temporal
# prefetch halved the rate. Prefill tiles (weights cache-resident, bound by arithmetic) ran as fast as without.
# Unconditional and straight-line: a branch or a loop around the prefetches made LLVM spill in the hot loop.
# The weight lines are spread over the block's run loop (the k-quants' 8 runs of 32: a few lines a run) rather
# than issued in one burst at the block's start: 2 threads, 1 row, ~300 MB of distinct 8192x2048 weights, Zen 4,
# paired: Q6_K 1.19x (2048x8192 1.14x), Q4_K 1.0x; forced AVX2 Q6_K 1.29x, Q5_K 1.17x, Q4_K 1.01x; 8 rows Q6_K
# 1.29x, Q5_K 1.11x. Bodies without a run loop (32-blocks) get them in one burst before their arithmetic.
PREFETCH_BYTES = 2048
# Where a block costs more arithmetic per byte (AVX2's two 8-row slices; 4 or more activation rows) the stream ran
# faster prefetching further ahead: 2 threads, ~300 MB of distinct weights, Zen 4, paired, 8192 vs 2048 bytes:
# AVX-512 8 rows Q8_0 65536x640 1.31-1.37x, Q5_0 8192x640 1.10x, Q4_K 8192x2048 1.07x; 4 rows Q4_K 1.31x, Q5_0
# 1.14x; forced AVX2 1 row Q8_0 1.23-1.48x, Q5_0 1.30x, Q4_K 1.04-1.14x, 4 and 8 rows 1.05-1.32x; AVX-512 1 row
# 0.91-0.99x (so it keeps 2048). 16384 did as 8192.
PREFETCH_BYTES_FAR = 8192


def prefetch_bytes(feats: frozenset[str], nrows: int) -> int:
    """How far ahead (bytes of weights) a qdot call for nrows activation rows prefetches on a target (feats); its
    passes of fewer rows (AVX2: 4 a pass) prefetch as far."""
    if "neon" in feats or (slice_width(feats) == R and nrows <= 2):
        return PREFETCH_BYTES
    return PREFETCH_BYTES_FAR

# FMT (QuantType id) -> emit(e, mb): the work of one (row group, K block) for mb activation rows, adding into
# the <16 x float> accumulators e.acc[i]
BODIES: dict[int, Callable[[Emit, int], None]] = {}
# Formats whose int8-activation x86 bodies work on slices of slice_width() rows (the table-lookup formats of
# matmul_iq), not on whole 32-byte pair vectors (Emit.u8w_sums)
SLICED: set[int] = set()
# Sliced formats whose x86 slices share one pass over K for few activation rows (see emit_qdot): the super-block
# formats, whose body keeps one slice's registers at a time in its run loop (a 32-block body holding both
# slices' constants spills on AVX2: IQ4_NL)
SHARED: set[int] = set()
# FMT -> joint(views, mb): the int16-activation AVX2 body of both 8-row slices of the group in one pass (views: one
# Emit view per slice, each with its own acc), for JOINT_ROWS activation rows a pass from JOINT_MIN_ROWS rows on:
# each activation pair is broadcast once for the 16 weight rows instead of once per slice (Q8_0's pair loop:
# matmul_q._joint_sums)
JOINT: dict[int, Callable[[list, int], None]] = {}
JOINT_ROWS = 4
JOINT_MIN_ROWS = 2


def register(*fmts: int, sliced: bool = False, shared: bool = False, joint: Callable | None = None):
    """Decorator: register an IR body for the given QuantType ids (see BODIES, SLICED, SHARED, JOINT)."""

    def deco(fn):
        for f in fmts:
            BODIES[int(f)] = fn
            if joint is not None:
                JOINT[int(f)] = joint
            if sliced:
                SLICED.add(int(f))
            if sliced and shared:
                SHARED.add(int(f))
        return fn

    return deco


def _tune(context, fn) -> None:
    """With AVX512-VNNI, tell LLVM that vpdpwssd is fast on this function: otherwise its machine combiner
    splits it into vpmaddwd + vpaddd, and the separate activation broadcasts then spill (~1.5x slower)."""
    feats = getattr(context.codegen(), "_tm_features", "")
    if "avx512vnni" not in host_features() or not feats or "+avx512vnni" not in feats:
        return
    attr = f'"target-features"="{feats},+fast-dpwssd"'
    if attr not in fn.attributes:
        set.add(fn.attributes, attr)  # string attribute: llvmlite only validates enum attributes


def emit_qdot(builder, fmt: int, nrows: int, ptrs, offs, xdtype: str, nblocks, qb, sb, xe,
              feats: frozenset[str]) -> None:
    """The IR of qdot (see there) at builder: ptrs / offs / xdtype as Emit takes them, nblocks, qb, sb, xe: i64
    values, feats: the target's features."""
    emit = BODIES[fmt]
    # the unsigned-weight form works on whole 32-byte vectors
    s8 = xdtype == "int8" and "neon" not in feats and fmt not in SLICED
    w = R if s8 else slice_width(feats)
    e = Emit(builder, ptrs, offs, xdtype, w, feats)
    zero = ir.Constant(V(F32, w), [0.0] * w)
    step_rows = max_rows(feats)
    int16_avx2 = xdtype == "int16" and w == 8 and "neon" not in feats
    joint = JOINT.get(fmt) if int16_avx2 and nrows >= JOINT_MIN_ROWS else None
    if joint is not None:
        step_rows = JOINT_ROWS
    lanes = list(range(0, R, w))
    lay = LAYOUTS[fmt]  # the block's bytes in qs and sc (static per format: the prefetches are straight-line code)
    ahead = -(-prefetch_bytes(feats, nrows) // lay.qbytes)  # blocks
    qlines, slines = -(-lay.qbytes // 64), -(-lay.sbytes // 64)
    # one pass over K per (slice of W rows, chunk of activation rows): its accumulators fit in registers. The x86
    # slices of a SHARED format share one pass while they fit the row budget (AVX2, 1-2 rows): each block's
    # weight lines are then read whole, once (two passes over a large matrix each took half of every line:
    # forced AVX2, 2048x8192 at 1 row: Q4_K 0.47 -> 0.27 ms, Q6_K 1.1-1.6 -> 0.68, IQ4_XS 0.64 -> 0.42)
    shared = len(lanes) > 1 and "neon" not in feats and (
        joint is not None or (fmt in SHARED and nrows * len(lanes) <= step_rows))
    for pass_lanes in ([lanes] if shared else [[lane] for lane in lanes]):
        for row0 in range(0, nrows, step_rows):
            n = min(step_rows, nrows - row0)
            parts = [e.part(lane0, row0) for lane0 in pass_lanes]

            def step(b, accs, parts=parts, n=n):
                views = [part.block(b, qb, sb, xe) for part in parts]
                e.prefetch_ahead(b, ahead, qlines, slines, qb, sb, body=views[0])
                mark = e.mark()
                for j, view in enumerate(views):
                    view.acc = list(accs[j * n:(j + 1) * n])
                if joint is not None:
                    joint(views, n)
                else:
                    for view in views:
                        emit(view, n)
                views[0].spread_prefetch(mark)
                return [a for view in views for a in view.acc]

            outs = e.loop(nblocks, step, [zero] * (n * len(parts)))
            for j, lane0 in enumerate(pass_lanes):
                for i in range(n):
                    e.store(e.wide(outs[j * n + i]), e.facc, ((row0 + i) * R + lane0) * 8)


def qdot_module(fmt: int, nrows: int, xdtype: str, triple: str, feats: frozenset[str]) -> ir.Module:
    """A stand-alone LLVM module with one function `qdot(facc, xq, dx, bs, qs, sc, xoff, xstride, dxoff,
    dxstride, bsoff, bsstride, qoff, soff, nblocks, qbytes, sbytes, xelems)` holding qdot's IR for a target
    (triple, LLVM features): to read the kernels' assembly for a CPU other than the host's (tests)."""
    mod = ir.Module(name=f"qdot_{fmt}_{nrows}")
    mod.triple = triple
    p8 = I8.as_pointer()
    fn = ir.Function(mod, ir.FunctionType(ir.VoidType(), [p8] * 6 + [I64] * 12), "qdot")
    builder = ir.IRBuilder(fn.append_basic_block("entry"))
    a = fn.args
    emit_qdot(builder, fmt, nrows, a[:6], a[6:14], xdtype, *a[14:18], feats)
    builder.ret_void()
    return mod


@intrinsic(prefer_literal=True)
def qdot(typingctx, fmt, mb, facc, xq, xoff, xstride, dx, dxoff, dxstride, bs, bsoff, bsstride, qs, qoff, sc,
         soff, nb, qbytes, sbytes, xelems):
    """One row group of a fused matmul for mb activation rows over nb K blocks (block b at qs + b*qbytes,
    sc + b*sbytes, activation element b*xelems); writes the mb x 16 outputs to facc as float64. Each block step
    prefetches the weight and scale lines prefetch_bytes(target, mb) ahead."""
    if not isinstance(fmt, types.IntegerLiteral) or not isinstance(mb, types.IntegerLiteral):
        return None
    i64 = types.int64
    sig = types.void(fmt, mb, facc, xq, i64, i64, dx, i64, i64, bs, i64, i64, qs, i64, sc, i64, i64, i64, i64, i64)

    def codegen(context, builder, signature, args):
        _tune(context, builder.function)
        aty = signature.args

        def data(i):
            return builder.bitcast(context.make_array(aty[i])(context, builder, args[i]).data, I8.as_pointer())

        ptrs = [data(i) for i in (2, 3, 6, 9, 12, 14)]
        offs = [args[i] for i in (4, 5, 7, 8, 10, 11, 13, 15)]
        emit_qdot(builder, fmt.literal_value, mb.literal_value, ptrs, offs, str(aty[3].dtype), *args[16:20],
                  host_features())
        return context.get_dummy_value()

    return sig, codegen
