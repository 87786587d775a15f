"""Matmul kernel throughput on the default model's shapes (Gemma 3 270M Q4_K_M).

    python benchmarks/bench_matmul.py [--threads N] [--types Q8_0,Q4_K] [--m 1,512] [--no-head] [--all]
                                      [--shapes 2048x8192,...]

Prints, per (type, N x K, M): best time per call, GFLOP/s (2*M*N*K / t) and GB/s of weight bytes read
(file-size bytes / t: what bounds decode). Weights are random bytes with small finite f16 scales.
Shapes whose K is not a multiple of the type's block size are skipped (e.g. k-quants with K = 640).
"""
from __future__ import annotations

import argparse
import functools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kernels_cpu import matmul, prepare_weight, set_threads  # noqa: E402
from kernels_cpu.matmul import weight_bytes  # noqa: E402
from quant.types import FORMATS, QuantType  # noqa: E402

# Byte offsets of the f16 scale fields in one block, per format (kept finite and small).
SCALE_FIELDS = {
    QuantType.Q4_0: (0,), QuantType.Q4_1: (0, 2), QuantType.Q5_0: (0,), QuantType.Q5_1: (0, 2),
    QuantType.Q8_0: (0,), QuantType.Q2_K: (80, 82), QuantType.Q3_K: (108,), QuantType.Q4_K: (0, 2),
    QuantType.Q5_K: (0, 2), QuantType.Q6_K: (208,), QuantType.IQ4_NL: (0,), QuantType.IQ4_XS: (0,),
    QuantType.MXFP4: (),
}
E8M0_FIELDS = {QuantType.MXFP4: 0}  # the block's exponent byte, set to 2^-7
LAYER_SHAPES = [(1024, 640), (640, 1024), (2048, 640), (640, 2048), (256, 640)]  # (N, K)
HEAD_SHAPE = (262144, 640)
DEFAULT_TYPES = "Q8_0,Q5_0,Q4_K,Q6_K"
ALL_TYPES = "F32,F16,BF16,Q4_0,Q4_1,Q5_0,Q5_1,Q8_0,Q2_K,Q3_K,Q4_K,Q5_K,Q6_K,IQ4_NL,IQ4_XS,MXFP4"


def random_weight(qtype: QuantType, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Random (n, row_bytes) uint8 weight bytes of a valid-looking `qtype` tensor."""
    fmt = FORMATS[qtype]
    nb = k // fmt.block_size
    if qtype in (QuantType.F32, QuantType.F16, QuantType.BF16):
        w = rng.standard_normal((n, k), dtype=np.float32) * 0.05
        if qtype == QuantType.F16:
            w = w.astype(np.float16)
        elif qtype == QuantType.BF16:
            w = (w.view(np.uint32) >> 16).astype(np.uint16)
        return w.view(np.uint8).reshape(n, -1)
    raw = rng.integers(0, 256, (n, nb, fmt.type_size), dtype=np.uint8)
    scale = np.array([0.01], np.float16).view(np.uint8)
    for off in SCALE_FIELDS[qtype]:
        raw[:, :, off:off + 2] = scale
    if qtype in E8M0_FIELDS:
        raw[:, :, E8M0_FIELDS[qtype]] = 121
    return raw.reshape(n, -1)


def bench(fn, min_time: float = 0.3, max_reps: int = 200) -> float:
    """Best (minimum) seconds per call after one warm-up call: robust to other load on the machine."""
    fn()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < 3 or (time.perf_counter() < t_end and len(times) < max_reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.min(times))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--all", action="store_true", help="every supported type")
    ap.add_argument("--m", default="1,512")
    ap.add_argument("--no-head", action="store_true", help="skip the 262144 x 640 output head")
    ap.add_argument("--shapes", default="", help="N x K shapes instead of the model's, e.g. 2048x8192")
    args = ap.parse_args(argv)
    threads = set_threads(args.threads)
    types = [QuantType[t] for t in (ALL_TYPES if args.all else args.types).split(",")]
    ms = [int(m) for m in args.m.split(",")]
    rng = np.random.default_rng(0)
    print(f"threads={threads}")
    print(f"{'type':6} {'N x K':>13} {'M':>4} {'ms':>9} {'GFLOP/s':>8} {'GB/s':>7}")
    for qt in types:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",") if sh] or list(LAYER_SHAPES)
        if not args.no_head and not args.shapes and qt == QuantType.Q8_0:
            shapes.append(HEAD_SHAPE)
        for n, k in shapes:
            if k % FORMATS[qt].block_size:
                continue
            pw = prepare_weight(random_weight(qt, n, k, rng), qt, (n, k))
            wb = weight_bytes(pw)
            for m in ms:
                x = rng.standard_normal((m, k), dtype=np.float32)
                out = np.empty((m, n), np.float32)
                big = n * k * m >= 1e10
                t = bench(functools.partial(matmul, x, pw, out), min_time=1.0 if big else 0.3,
                          max_reps=5 if big else 200)
                print(f"{qt.name:6} {f'{n}x{k}':>13} {m:4d} {t * 1e3:9.3f} {2 * m * n * k / t / 1e9:8.1f} "
                      f"{wb / t / 1e9:7.2f}", flush=True)


if __name__ == "__main__":
    main()
