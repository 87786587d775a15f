"""Fused dequantizing matmul: the public entry points and the prepared-weight object.

    pw = prepare_weight(raw, qtype, (N, K))   # repack once at load time
    y = matmul(x, pw)                          # x (M, K) float32 -> y (M, N) = x @ W.T
    rows = get_rows(pw, ids)                   # dequantized rows (embedding lookup)

Quantized weights are never expanded to float32: the kernels read the packed codes and multiply them with
activations quantized to 8 bits per block (per 32 for the simple formats, per 256 for the k-quants, as
llama.cpp does), in integer SIMD, scaling per block in float32. Float weights (F32/F16/BF16) use float
activations. One code path serves every M, so a row's output does not depend on the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from quant.types import FORMATS, QuantType, row_bytes

from ._jit import host_features
from .handoff import handoff_seconds
from .matmul_driver import driver, quantize_act, quantize_act_split, split_driver
from . import parallel
from .repack import LAYOUTS, QUAD_32, QUAD_K, repack

# Work (multiply-adds) below which one thread is used: splitting costs more than it saves. With a prange
# pool (FAST_PRANGE: a ~2 µs hand-off) from PARALLEL_MIN_MACS; with the Python-level hand-off from
# HANDOFF_MIN_MACS, raised on hosts where that hand-off is slow: a split must save twice handoff_seconds()
# at ~MACS_PER_SECOND per thread (the kernels' rough single-thread rate; 27e9 at 1 row and 56e9 at 8 rows on
# the AVX-512 test host).
PARALLEL_MIN_MACS = 1 << 18
HANDOFF_MIN_MACS = 1 << 20
MACS_PER_SECOND = 40e9


def split_min_macs() -> int:
    """Multiply-adds from which a matmul is split over the threads on this host."""
    if parallel.fast_prange():
        return PARALLEL_MIN_MACS
    return max(HANDOFF_MIN_MACS, int(2 * handoff_seconds() * MACS_PER_SECOND))


@dataclass(eq=False)
class PreparedWeight:
    """A weight matrix W (N, K) in the kernels' layout.

    qtype: storage type; shape: (N, K) (N outputs, K inputs); qs (G, NB, QB) uint8 packed codes and
    sc (G, NB, SB) uint8 scales in groups of 16 rows (see repack.py); raw: the original (N, row_bytes) bytes
    (a zero-copy view when loaded from a file), used by get_rows.
    """

    qtype: QuantType
    shape: tuple[int, int]
    qs: np.ndarray = field(repr=False)
    sc: np.ndarray = field(repr=False)
    raw: np.ndarray = field(repr=False)
    _act_block: int = field(init=False, repr=False)  # activation quantization block (0: float activations)
    _kp: int = field(init=False, repr=False)  # K padded to whole kernel blocks
    _run: object = field(init=False, repr=False)  # the compiled driver (lazily compiled on first call)
    _split: object = field(init=False, repr=False)  # its prange twin over row-group chunks (FAST_PRANGE)

    def __post_init__(self):
        lay = LAYOUTS[self.qtype]
        self._act_block = lay.act_block
        self._kp = self.qs.shape[1] * lay.block
        self._run = driver(int(self.qtype))
        self._split = split_driver(int(self.qtype))

    @property
    def nbytes(self) -> int:
        """Bytes of the repacked weight (what a matmul reads)."""
        return self.qs.nbytes + self.sc.nbytes


SUPPORTED = frozenset(LAYOUTS)


def prepare_weight(raw: np.ndarray, qtype: QuantType | int, shape: tuple[int, int]) -> PreparedWeight:
    """Validate and repack a weight for `matmul`.

    raw: uint8 (N, row_bytes) — GGUF tensor bytes (a flat (N*row_bytes,) array is accepted too);
    qtype: a QuantType; shape: (N, K) with K the input dimension (GGUF's ne = [K, N]).
    Raises ValueError if the type is unsupported or raw does not match shape and qtype.
    """
    try:
        qtype = QuantType(int(qtype))
    except ValueError:
        raise ValueError(f"unknown quantization type id {qtype!r}") from None
    if qtype not in SUPPORTED:
        raise ValueError(f"matmul does not support {qtype.name}; supported: "
                         f"{', '.join(sorted(t.name for t in SUPPORTED))}")
    if len(tuple(shape)) != 2:
        raise ValueError(f"{qtype.name}: shape must be (N, K), got {shape!r}")
    n, k = (int(s) for s in shape)
    if n <= 0 or k <= 0:
        raise ValueError(f"{qtype.name}: shape must be positive, got {shape!r}")
    rb = row_bytes(qtype, k)  # raises ValueError when K is not a whole number of blocks
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8:
        raise ValueError(f"{qtype.name}: raw must be a numpy uint8 array, got "
                         f"{type(raw).__name__} {getattr(raw, 'dtype', '')}")
    if raw.ndim == 1 and raw.size == n * rb:
        raw = raw.reshape(n, rb)
    if raw.shape != (n, rb):
        raise ValueError(f"{qtype.name}: raw has shape {raw.shape}, expected ({n}, {rb}) for shape (N={n}, K={k})")
    if not raw.flags.c_contiguous:
        raw = np.ascontiguousarray(raw)
    qs, sc = repack(raw, qtype, n, k)
    return PreparedWeight(qtype, (n, k), qs, sc, raw)


# On AVX2 hosts without AVX-512 every quantized format but Q8_0 takes int8 activations: its unsigned codes
# multiply them with vpmaddubsw (32 products per instruction, twice vpmaddwd's; see Emit.u8w_sums). Q8_0's
# weights are signed, so it keeps int16 activations unless the host has vpdpbusd (AVX-VNNI, AVX512-VNNI: its codes
# + 128 as quads, repack.QUAD_32). Same integer sums, hence the same outputs.
# On NEON (AArch64) every quantized format takes int8 activations, Q8_0 too (signed x signed: sdot, or smull +
# sadalp without dotprod; see matmul_neon).
ACT_S8 = ("avx2" in host_features() and "avx512bw" not in host_features()) or "neon" in host_features()
S8_Q8_0 = "neon" in host_features()

_NO_DX = np.zeros((1, 1), np.float32)
_NO_BS = np.zeros((1, 1), np.int32)
_NO_S1 = np.zeros((1, 0), np.float32)
# Weights whose llama.cpp dot product takes block_q8_1 activations: the min term uses the block's f16 sum s.
_Q8_1_WEIGHTS = frozenset({QuantType.Q4_1, QuantType.Q5_1})
# int8 activations on every target: the table-lookup formats (matmul_iq: looked-up int8 weights x int8 codes) and
# the formats stored as quad vectors (the k-quants on x86, the 32-block nibble formats on AVX2: unsigned codes x
# int8 codes, vpdpbusd / vpmaddubsw; their layout has no int16 form)
_S8_WEIGHTS = frozenset({QuantType.IQ4_NL, QuantType.IQ4_XS, QuantType.MXFP4}) | QUAD_K | QUAD_32


def _prepare_x(x: np.ndarray, pw: PreparedWeight):
    """Activations in the kernel's form (xq, dx, bs): int16 codes (M, K) (int8 codes for the formats of
    _S8_WEIGHTS and when ACT_S8), scales (M, K/qb) and sums of 16 codes (M, K/16) — for Q4_1 / Q5_1, bs is instead
    float32 (M, K/16) with the f16-rounded Q8_1 block sums at even columns (see quantize_act); or, for float weights, float32 x zero-padded to whole blocks (dx, bs
    unused)."""
    M, K = x.shape
    qb = pw._act_block
    if qb == 0:
        if pw._kp != K:
            xp = np.zeros((M, pw._kp), np.float32)
            xp[:, :K] = x
            x = xp
        return x, _NO_DX, _NO_BS
    xq = np.empty((M, K), _act_dtype(pw))
    dx = np.empty((M, K // qb), np.float32)
    bs = np.empty((M, K // 16), np.int32)
    if pw.qtype in _Q8_1_WEIGHTS:
        s1 = np.empty((M, K // 16), np.float32)
        _quantize_rows(xq, dx, bs, s1, x, qb)
        return xq, dx, s1
    _quantize_rows(xq, dx, bs, None, x, qb)
    return xq, dx, bs


def prepare_activations(x: np.ndarray, pw: PreparedWeight) -> tuple:
    """x (M, K) float32 C-contiguous in the form the drivers of weight pw take: (xq, dx, bs) as _prepare_x
    describes (for kernels that run the drivers themselves, e.g. kernels_cpu.moe_matmul)."""
    return _prepare_x(x, pw)


@dataclass(frozen=True)
class ActivationForm:
    """How m activation rows are prepared for a weight's drivers (see _prepare_x): codes of `dtype` quantized per
    `block` elements (0: float32 activations, zero-padded to k_padded columns), and whether the drivers take the
    Q8_1 block sums (s1) in place of the sums of 16 codes."""

    dtype: type
    block: int
    q8_1: bool
    k_padded: int


def activation_form(pw: PreparedWeight) -> ActivationForm:
    """The activation form pw's drivers take, for any number of rows (for kernels that quantize activations
    themselves, e.g. kernels_cpu.moe_ffn)."""
    if pw._act_block == 0:
        return ActivationForm(np.float32, 0, False, pw._kp)
    dt = _act_dtype(pw)
    return ActivationForm(dt, pw._act_block, pw.qtype in _Q8_1_WEIGHTS, pw.shape[1])


def _act_dtype(pw: PreparedWeight):
    """Activation code type of weight pw's drivers, whatever the row count: int8 (the table-lookup formats,
    _S8_WEIGHTS; every quad-vector format where ACT_S8) or int16 (Q8_0's pair vectors, where the host has no
    vpdpbusd / sdot form for it: S8_Q8_0 false)."""
    if pw.qtype in _S8_WEIGHTS or (ACT_S8 and (pw.qtype != QuantType.Q8_0 or S8_Q8_0)):
        return np.int8
    return np.int16


def _quantize_chunk(xq, dx, bs, s1, x, qb, lo, hi, _scratch):
    quantize_act(xq[lo:hi], dx[lo:hi], bs[lo:hi], _NO_S1 if s1 is None else s1[lo:hi], x[lo:hi], qb)


def _quantize_split(xq, dx, bs, s1, x, qb, bounds):
    quantize_act_split(xq, dx, bs, _NO_S1 if s1 is None else s1, x, qb, bounds)


def _quantize_rows(xq, dx, bs, s1, x, qb) -> None:
    """quantize_act over row chunks on the worker threads (rows are independent: prefill of 512 rows
    spent ~10% of its time here on one core)."""
    if x.shape[0] < 64:  # decode: no thread hand-off on the per-token path
        quantize_act(xq, dx, bs, _NO_S1 if s1 is None else s1, x, qb)
        return
    parallel.parallel_for(_quantize_chunk, x.shape[0], 32, None, xq, dx, bs, s1, x, qb, split=_quantize_split)


def _as_input(x: np.ndarray, pw: PreparedWeight) -> np.ndarray:
    """x as a C-contiguous float32 (M, K) array for weight pw, or ValueError."""
    k = pw.shape[1]
    if x.dtype != np.float32 or not x.flags.c_contiguous:
        x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"matmul: x has shape {x.shape}, expected (M, {k}) for weight {pw.qtype.name} {pw.shape}")
    return x


def _act_key(pw: PreparedWeight) -> tuple:
    """Weights with equal keys take the same activation arrays from _prepare_x."""
    return (pw._act_block, pw.qtype in _Q8_1_WEIGHTS, pw._kp if pw._act_block == 0 else 0,
            _act_dtype(pw) if pw._act_block else None)


def matmul(x: np.ndarray, pw: PreparedWeight, out: np.ndarray | None = None) -> np.ndarray:
    """y = x @ W.T for a prepared weight W (N, K).

    x: float32 (M, K) (converted to C-contiguous float32 if needed); out: optional float32 (M, N)
    C-contiguous array to write into. Returns y (M, N) float32. Row i of y depends only on row i of x
    (bit-identical whatever M and the thread count).
    """
    x = _as_input(x, pw)
    m, n = x.shape[0], pw.shape[0]
    if out is None:
        out = np.empty((m, n), np.float32)
    elif out.shape != (m, n) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"matmul: out must be C-contiguous float32 {(m, n)}, got {out.dtype} {out.shape}")
    if m == 0:
        return out
    _run(out, _prepare_x(x, pw), pw)
    return out


def matmul_many(x: np.ndarray, weights: list[PreparedWeight]) -> list[np.ndarray]:
    """[matmul(x, w) for w in weights] (e.g. the Q, K and V projections of one input), quantizing x once
    per activation format the weights share instead of once per weight. Same results as separate calls."""
    if not weights:
        return []
    x = _as_input(x, weights[0])
    acts: dict[tuple, tuple] = {}
    outs = []
    for pw in weights:
        xw = _as_input(x, pw)
        out = np.empty((x.shape[0], pw.shape[0]), np.float32)
        if x.shape[0]:
            key = _act_key(pw)
            if key not in acts:
                acts[key] = _prepare_x(xw, pw)
            _run(out, acts[key], pw)
        outs.append(out)
    return outs


def _run(out: np.ndarray, act: tuple, pw: PreparedWeight) -> None:
    """out = x @ W.T from x's prepared activations act = (xq, dx, bs), on one or more threads."""
    xq, dx, bs = act
    m, n = out.shape
    groups = pw.qs.shape[0]
    threads = min(parallel.get_threads(), groups)
    if threads == 1 or m * n * pw.shape[1] < split_min_macs():
        pw._run(out, xq, dx, bs, pw.qs, pw.sc, 0, groups)
    elif (bounds := parallel.prange_bounds(groups, threads)) is not None:
        pw._split(out, xq, dx, bs, pw.qs, pw.sc, bounds)
    else:
        parallel.run_chunks(pw._run, parallel.chunk_bounds(groups, threads), out, xq, dx, bs, pw.qs, pw.sc)


def warm(pw: PreparedWeight) -> None:
    """Compile (or load from Numba's cache) every driver a matmul with pw can run: one thread and (with more
    than one kernel thread) split over row-group chunks, for its activation form (int16 or int8)."""
    k, g = pw.shape[1], pw.qs.shape[0]
    split = parallel.fast_prange() and parallel.get_threads() > 1  # _run never splits on one thread
    xq, dx, bs = _prepare_x(np.zeros((1, k), np.float32), pw)
    out = np.empty((1, pw.shape[0]), np.float32)
    pw._run(out, xq, dx, bs, pw.qs, pw.sc, 0, g)
    if split:
        pw._split(out, xq, dx, bs, pw.qs, pw.sc, np.array([0, g // 2, g], np.int64))


def get_rows(pw: PreparedWeight, ids) -> np.ndarray:
    """Dequantized rows W[ids] as float32 (len(ids), K) — an embedding lookup (also for a tied output head).

    Bit-exact with the reference dequantizer (quant.formats.dequantize); only the selected rows are read.
    """
    from quant.formats import dequantize

    ids = np.asarray(ids)
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
        raise ValueError(f"get_rows: ids must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    n, k = pw.shape
    if ids.size and (ids.min() < -n or ids.max() >= n):
        raise ValueError(f"get_rows: ids out of range [0, {n})")
    if ids.size == 0:
        return np.empty((0, k), np.float32)
    out = dequantize(pw.raw[ids.astype(np.int64)], pw.qtype)
    return np.ascontiguousarray(out.reshape(len(ids), k), dtype=np.float32)


def weight_bytes(pw: PreparedWeight) -> int:
    """Bytes of the weight as stored in the file (N * row_bytes)."""
    n, k = pw.shape
    return n * (k // FORMATS[pw.qtype].block_size) * FORMATS[pw.qtype].type_size
