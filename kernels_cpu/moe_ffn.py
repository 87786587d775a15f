"""The routed experts' FFN of one MoE layer in one compiled call: routing, grouping by expert, the activations'
quantization, the gate and up projections (one parallel loop for both), bias + gated activation + the down
projection's quantization (a parallel loop over the routed rows), the down projection, and each token's weighted
sum of its experts. A decode step of a 16-layer MoE model made ~390 Python calls and five thread hand-offs per
layer for this before; now one call and three (two without a down bias).

Each piece is the compiled kernel the step-by-step path uses (kernels_cpu.moe's gating / grouping / combine,
moe_matmul's job kernels, matmul_driver.quantize_act, ops.GLU_KERNELS), so the result is the same, bit for bit, as
route -> group_by_expert -> expert_inputs -> expert_matmul x 3 -> combine, and a row's result never depends on
the other rows or on the split of the work over the threads.

One copy of the function per (gate, up, down format, activation, gating), with those kernels bound as its globals;
its prange twin where Numba's team is a persistent pool (parallel.fast_prange), else the serial copy.
"""
from __future__ import annotations

import hashlib
import types
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np

from . import matmul_driver, moe, moe_matmul, ops, parallel
from ._jit import jit
from .matmul import activation_form
from .matmul_driver import SOURCE_TAG, quantize_act
from .moe import GATINGS, WEIGHT_SUM_MIN, combine_kernel, group_kernel
from .moe_matmul import ExpertStack, expert_inputs, expert_matmul, job_kernels


def _source_tag() -> str:
    """The matmul IR's tag and the sources of the kernels the fused function calls: Numba's cache index only
    tracks this file, so the tag (a closure cell) keys the cache on them."""
    h = hashlib.sha256(SOURCE_TAG.encode())
    for mod in (moe, moe_matmul, ops, matmul_driver):
        h.update(Path(mod.__file__).read_bytes())
    return h.hexdigest()[:16]


TAG = _source_tag()


@jit
def _rows_in(xT, dT, bT, sT, kT, xR, dR, kR, h, tok, qb):
    # the activations of rows h (T, K) in a driver's form, quantized once per token (xT, dT, bT, sT: quantize_act's
    # outputs, kT the sums the driver takes: bT or sT), then gathered per routed row r = token tok[r] into xR, dR,
    # kR; float activations (qb 0): h copied, zero-padded to xR's columns
    T, K = h.shape
    R = len(tok)
    if qb == 0:
        for r in range(R):
            t = tok[r]
            for c in range(K):
                xR[r, c] = h[t, c]
            for c in range(K, xR.shape[1]):
                xR[r, c] = 0
        return
    quantize_act(xT, dT, bT, sT, h, qb)
    for r in range(R):
        t = tok[r]
        xR[r] = xT[t]
        dR[r] = dT[t]
        kR[r] = kT[t]


@jit
def _row_act(a, xr, dr, br, sr, qb):
    # one activation row a (1, F) into the down projection's form (rows xr, dr, br, sr of one routed row)
    if qb == 0:
        F = a.shape[1]
        for c in range(F):
            xr[0, c] = a[0, c]
        for c in range(F, xr.shape[1]):
            xr[0, c] = 0
        return
    quantize_act(xr, dr, br, sr, a, qb)


@jit
def _bounds(starts, G, nt):
    # nt + 1 bounds over the (job, row group) units, J jobs x G groups, of about equal work (unit cost: its
    # job's rows starts[j+1] - starts[j])
    J = len(starts) - 1
    U = J * G
    b = np.empty(nt + 1, np.int64)
    b[0] = 0
    total = G * starts[J]
    acc = 0
    c = 1
    u = 0
    for j in range(J):
        n = starts[j + 1] - starts[j]
        for _ in range(G):
            while c < nt and acc * nt >= total * c:
                b[c] = u
                c += 1
            acc += n
            u += 1
    while c < nt:
        b[c] = U
        c += 1
    b[nt] = U
    return b


def _template(tag):
    def ffn(out, h, logits, k, norm, floor, nt, same_up, alpha, limit, bias,
            g_in, g_qb, u_in, u_qb, d_in, d_qb,
            gqs, gsc, uqs, usc, dqs, dsc, gb, ub, db, F):
        """out (T, D) = the layer's routed-experts FFN of h (T, D) with router logits (T, E); *_in: the
        activation buffers of the gate, up (the gate's when same_up) and down inputs, see expert_ffn."""
        if tag is None:  # never: the source tag keys the cache
            return
        T = h.shape[0]
        E = logits.shape[1]
        R = T * k
        sel = np.empty((T, k), np.int64)
        w = np.empty((T, k), np.float32)
        ROUTE(sel, w, logits, norm, floor)  # noqa: F821 - bound per copy
        tok = np.empty(R, np.int64)
        wr = np.empty(R, np.float32)
        eid = np.empty(E, np.int64)
        starts = np.empty(E + 1, np.int64)
        pos = np.empty((T, k), np.int64)
        J = GROUP(tok, eid, starts, wr, pos, sel, w, E)  # noqa: F821
        eid = eid[:J]
        starts = starts[:J + 1]
        rid = np.empty(R, np.int64)  # each routed row's expert
        for j in range(J):  # (plain loops here: an array expression would be a parallel region of its own)
            for r in range(starts[j], starts[j + 1]):
                rid[r] = eid[j]
        gxT, gdT, gbT, gsT, gkT, gxR, gdR, gkR = g_in
        _rows_in(gxT, gdT, gbT, gsT, gkT, gxR, gdR, gkR, h, tok, g_qb)
        uxT, udT, ubT, usT, ukT, uxR, udR, ukR = u_in
        if not same_up:
            _rows_in(uxT, udT, ubT, usT, ukT, uxR, udR, ukR, h, tok, u_qb)
        gbuf = np.empty((R, F), np.float32)
        ubuf = np.empty((R, F), np.float32)
        bg = _bounds(starts, gqs.shape[1], nt)
        bu = _bounds(starts, uqs.shape[1], nt)
        for c in numba.prange(nt):
            RUN_G(gbuf, gxR, gdR, gkR, gqs, gsc, eid, starts, bg[c], bg[c + 1], None)  # noqa: F821
            RUN_U(ubuf, uxR, udR, ukR, uqs, usc, eid, starts, bu[c], bu[c + 1], None)  # noqa: F821
        dxR, ddR, dbR, dsR, dkR = d_in
        abuf = np.empty((R, F), np.float32)
        for r in numba.prange(R):
            if bias:
                e = rid[r]
                for f in range(F):
                    gbuf[r, f] += gb[e, f]
                    ubuf[r, f] += ub[e, f]
            ACT(abuf[r:r + 1], gbuf[r:r + 1], ubuf[r:r + 1], alpha, limit)  # noqa: F821
            _row_act(abuf[r:r + 1], dxR[r:r + 1], ddR[r:r + 1], dbR[r:r + 1], dsR[r:r + 1], d_qb)
        D = out.shape[1]
        y = np.empty((R, D), np.float32)
        bd = _bounds(starts, dqs.shape[1], nt)
        for c in numba.prange(nt):
            RUN_D(y, dxR, ddR, dkR, dqs, dsc, eid, starts, bd[c], bd[c + 1], None)  # noqa: F821
        if bias:
            for r in range(R):
                e = rid[r]
                for d in range(D):
                    y[r, d] += db[e, d]
        combine_kernel(out, y, w, pos)

    return ffn


_COPIES: dict[tuple, tuple] = {}


def _copies(fg: int, fu: int, fd: int, act: str, gating: str) -> tuple:
    """(serial, prange twin) of the fused function for the formats, activation and gating (compiled lazily,
    cached on disk: a copy's name carries its key)."""
    key = (fg, fu, fd, act, gating)
    c = _COPIES.get(key)
    if c is None:
        t = _template(TAG)
        g = dict(globals(), ROUTE=GATINGS[gating], GROUP=group_kernel, ACT=ops.GLU_KERNELS[act],
                 RUN_G=job_kernels(fg)[0], RUN_U=job_kernels(fu)[0], RUN_D=job_kernels(fd)[0])
        name = f"moe_ffn_{fg}_{fu}_{fd}_{act}_{gating}"
        made = []
        for suffix, parallel_ in (("", False), ("_split", True)):
            fn = types.FunctionType(t.__code__, g, name + suffix, None, t.__closure__)
            fn.__qualname__ = name + suffix
            made.append(numba.njit(cache=True, nogil=True, parallel=parallel_)(fn))
        c = _COPIES[key] = tuple(made)
    return c


_NONE = np.zeros((1, 1), np.float32)  # the placeholder of an absent bias
# the activations as ExpertFFN.stepwise applies them: the ops' NumPy-facing functions (ops.GLU_KERNELS inside)
_GLU_OPS = {"swiglu": lambda ffn, g, u: ops.swiglu(g, u),
            "swiglu_oai": lambda ffn, g, u: ops.swiglu_oai(g, u, alpha=ffn.alpha, limit=ffn.limit)}


def _act_arrays(f, K: int, M: int) -> tuple:
    """M activation rows of width K in form f as quantize_act writes them: (x, dx, bs, s1, sums), sums being the
    array the drivers take (bs, or s1 for Q8_1 weights); float forms: x zero-padded to f.k_padded, dx / bs zeros
    the drivers do not read (as _prepare_x's)."""
    if f.block == 0:
        dx, bs = np.zeros((M, 1), np.float32), np.zeros((M, 1), np.int32)
        return np.empty((M, f.k_padded), np.float32), dx, bs, np.zeros((M, 0), np.float32), bs
    bs = np.empty((M, K // 16), np.int32)
    s1 = np.empty((M, K // 16 if f.q8_1 else 0), np.float32)
    return np.empty((M, K), f.dtype), np.empty((M, K // f.block), np.float32), bs, s1, s1 if f.q8_1 else bs


def _gathered(f, K: int, T: int, R: int) -> tuple:
    """The buffers of an input quantized per token (T rows) and gathered per routed row (R rows): (xT, dT, bT,
    sT, kT, xR, dR, kR), see _rows_in."""
    xR, dR, _, _, kR = _act_arrays(f, K, R)
    return _act_arrays(f, K, T) + (xR, dR, kR)


@dataclass(eq=False)
class ExpertFFN:
    """One layer's routed experts: stacks gate / up (E, F, D) and down (E, D, F), top-k routing by `gating`
    (a key of kernels_cpu.moe.GATINGS; weights renormalised when norm), activation `act` (a key of
    ops.GLU_KERNELS, with swiglu_oai's alpha / limit), optional biases gate_b / up_b (E, F), down_b (E, D)."""

    gate: ExpertStack
    up: ExpertStack
    down: ExpertStack
    k: int
    norm: bool
    gating: str = "softmax"
    act: str = "swiglu"
    gate_b: np.ndarray | None = None
    up_b: np.ndarray | None = None
    down_b: np.ndarray | None = None
    alpha: float = 1.702
    limit: float = 7.0
    _biases: tuple = field(init=False, repr=False)

    def __post_init__(self):
        E, F, D = self.gate.n_experts, self.gate.shape[0], self.gate.shape[1]
        if not (self.up.n_experts == self.down.n_experts == E and self.up.shape == (F, D)
                and self.down.shape == (D, F)):
            raise ValueError(f"ExpertFFN: gate {self.gate.shape}, up {self.up.shape}, down {self.down.shape} "
                             f"x {E} experts do not make one FFN")
        if not 0 < self.k <= E:
            raise ValueError(f"ExpertFFN: top-{self.k} of {E} experts")
        if self.gating not in GATINGS or self.act not in ops.GLU_KERNELS:
            raise ValueError(f"ExpertFFN: gating {self.gating!r} / activation {self.act!r} unknown")
        have = [b is not None for b in (self.gate_b, self.up_b, self.down_b)]
        if any(have) and not all(have):
            raise ValueError("ExpertFFN: biases come for all three projections or none")
        if all(have):
            bs = tuple(np.ascontiguousarray(b, dtype=np.float32) for b in (self.gate_b, self.up_b, self.down_b))
            if bs[0].shape != (E, F) or bs[1].shape != (E, F) or bs[2].shape != (E, D):
                raise ValueError("ExpertFFN: bias shapes do not match the experts")
            self._biases = bs
        else:
            self._biases = (_NONE, _NONE, _NONE)

    def __call__(self, h: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """(T, D) rows and their router logits (T, E) -> (T, D): each row's top-k experts' gated FFNs, summed
        in the router's order with its weights."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        logits = np.ascontiguousarray(logits, dtype=np.float32)
        T, D = h.shape if h.ndim == 2 else (-1, -1)
        E, F = self.gate.n_experts, self.gate.shape[0]
        if D != self.gate.shape[1] or logits.shape != (T, E):
            raise ValueError(f"ExpertFFN: rows {h.shape} and logits {logits.shape} for {E} experts of width {D}")
        out = np.zeros((T, D), np.float32)
        if T == 0:
            return out
        R = T * self.k
        gf, uf = activation_form(self.gate.experts[0]), activation_form(self.up.experts[0])
        df = activation_form(self.down.experts[0])
        g_in = _gathered(gf, D, T, R)
        same_up = uf == gf  # the same activations: quantized once
        u_in = g_in if same_up else _gathered(uf, D, T, R)
        d_in = _act_arrays(df, F, R)  # the routed rows quantized in place: no gather
        serial, split = _copies(int(self.gate.qtype), int(self.up.qtype), int(self.down.qtype), self.act,
                                self.gating)
        nt = parallel.prange_team() or 1
        run = split if nt > 1 else serial
        gb, ub, db = self._biases
        run(out, h, logits, self.k, self.norm, WEIGHT_SUM_MIN, nt, same_up,
            np.float32(self.alpha), np.float32(self.limit), self.gate_b is not None,
            g_in, gf.block, u_in, uf.block, d_in, df.block,
            self.gate.qs, self.gate.sc, self.up.qs, self.up.sc, self.down.qs, self.down.sc, gb, ub, db, F)
        return out

    def stepwise(self, h: np.ndarray, logits: np.ndarray) -> np.ndarray:
        """The same FFN op by op (route, group_by_expert, expert_inputs / expert_matmul per projection, the
        activation, combine): the fused call's reference, equal to it bit for bit."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        sel, wts = moe.route(logits, self.k, norm=self.norm, gating=self.gating)  # (T, k) each
        # pairs by ascending expert, then token: tok (R,), the routed experts eid (J,), job j = pairs
        # starts[j]:starts[j+1] (J+1,); pos (T, k): the row of each token's pick
        tok, eid, starts, _, pos = moe.group_by_expert(sel, wts, self.gate.n_experts)
        row_eid = np.repeat(eid, np.diff(starts))  # (R,) each row's expert
        gb, ub, db = self._biases if self.gate_b is not None else (None, None, None)

        def proj(x, stack, rows=None, bias=None):
            y = expert_matmul(expert_inputs(x, stack, rows), stack, eid, starts)
            return y if bias is None else y + bias[row_eid]

        gate, up = proj(h, self.gate, tok, gb), proj(h, self.up, tok, ub)  # (R, F)
        a = _GLU_OPS[self.act](self, gate, up)
        return moe.combine(np.zeros_like(h), proj(a, self.down, None, db), wts, pos)
