"""Routed-expert matmuls in one compiled call: every (expert, rows) job of a MoE layer's gate, up or down
projection runs in a single prange loop over (job, row group) units, instead of one matmul call (and one
thread hand-off) per expert. A decode step of an 8-of-48-expert model made ~29 kernel calls per layer this
way before; now 3.

The experts of one 3-D GGUF tensor are an `ExpertStack`: codes qs (E, G, NB, QB) and scales sc (E, G, NB, SB)
in one array each (the weight cache stores them so), each expert a `PreparedWeight` view of it. Each output
element is computed by the same per-format driver as `matmul` (same instruction sequence whatever the rows
of a job), so results are bit-identical to per-expert `matmul` calls and do not depend on the batch.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import numba
import numpy as np

from quant.types import QuantType

from . import parallel
from ._jit import jit
from .matmul import PreparedWeight, prepare_activations, split_min_macs
from .matmul_driver import SOURCE_TAG, driver


@dataclass(eq=False)
class ExpertStack:
    """The E experts (N, K) of one 3-D weight tensor in the kernels' layout: qs (E, G, NB, QB) uint8 and
    sc (E, G, NB, SB) (see repack.py), raw (E, N, row_bytes) the GGUF bytes (zero-copy when from a file)."""

    qtype: QuantType
    shape: tuple[int, int]
    qs: np.ndarray = field(repr=False)
    sc: np.ndarray = field(repr=False)
    raw: np.ndarray = field(repr=False)
    experts: list = field(init=False, repr=False)  # [PreparedWeight view of expert e]

    def __post_init__(self):
        if not (self.qs.flags.c_contiguous and self.sc.flags.c_contiguous):
            raise ValueError("ExpertStack: qs and sc must be C-contiguous")
        self.experts = [PreparedWeight(self.qtype, self.shape, self.qs[e], self.sc[e], self.raw[e])
                        for e in range(self.qs.shape[0])]

    @classmethod
    def from_weights(cls, weights: list[PreparedWeight]) -> "ExpertStack":
        """Stack separately prepared experts (copies their codes once: for the uncached load path)."""
        w0 = weights[0]
        return cls(w0.qtype, w0.shape, np.stack([w.qs for w in weights]), np.stack([w.sc for w in weights]),
                   np.stack([w.raw for w in weights]))

    @property
    def n_experts(self) -> int:
        return self.qs.shape[0]


def _template(tag):
    def run_jobs(y, xq, dx, bs, qs, sc, eid, starts, lo, hi, _scratch):
        """Units lo..hi-1 of the (job, row group) space: job j = rows starts[j]:starts[j+1] of y / xq / dx /
        bs times expert eid[j] of qs / sc, row group g of the expert's output rows."""
        if tag is None:  # never: the source tag keys the cache (see matmul_driver.make_driver)
            return
        G = qs.shape[1]
        t = lo
        while t < hi:
            j = t // G
            g0 = t - j * G
            g1 = min(G, g0 + hi - t)
            s, e = starts[j], starts[j + 1]
            serial(y[s:e], xq[s:e], dx[s:e], bs[s:e], qs[eid[j]], sc[eid[j]], g0, g1)  # noqa: F821 - bound below
            t += g1 - g0

    def run_split(y, xq, dx, bs, qs, sc, eid, starts, bounds):
        for c in numba.prange(len(bounds) - 1):
            run(y, xq, dx, bs, qs, sc, eid, starts, bounds[c], bounds[c + 1], None)  # noqa: F821 - bound below

    return run_jobs, run_split


_KERNELS: dict[int, tuple] = {}


def job_kernels(fmt: int) -> tuple:
    """(serial, prange twin) job kernels of one format, compiled lazily and cached on disk; the format's
    driver is bound as a global of a per-format copy (see matmul_driver.make_split_driver). serial(y, xq, dx, bs,
    qs, sc, eid, starts, lo, hi, None) runs units lo..hi-1 of the (job, row group) space (see _template); compiled
    callers take it too (moe_ffn)."""
    k = _KERNELS.get(fmt)
    if k is None:
        jobs_t, split_t = _template(SOURCE_TAG)
        serial = _bind(jobs_t, f"run_jobs_{fmt}", dict(serial=driver(fmt)))
        run = jit(serial)
        split = numba.njit(cache=True, nogil=True, parallel=True)(
            _bind(split_t, f"run_jobs_split_{fmt}", dict(run=run)))
        k = _KERNELS[fmt] = (run, split)
    return k


def _bind(t, name: str, extra: dict):
    fn = types.FunctionType(t.__code__, dict(globals(), **extra), name, None, t.__closure__)
    fn.__qualname__ = name
    return fn


def _rows_sized(a: np.ndarray, rows: int) -> np.ndarray:
    """The float-weight placeholders of prepare_activations (1 row) widened to `rows`, so jobs can slice them."""
    return a if a.shape[0] == rows else np.zeros((rows,) + a.shape[1:], a.dtype)


_JOB_ERRORS = {1: "expert_matmul: starts must rise from 0 to the row count, one job per expert id",
               2: "expert_matmul: expert id outside 0..{n}"}


@jit
def _check_jobs(eid, starts, R, E):
    # 0 when starts (J+1,) rises from 0 to R and every eid (J,) is in 0..E-1; else a key of _JOB_ERRORS
    if starts[0] != 0 or starts[len(starts) - 1] != R:
        return 1
    for j in range(len(eid)):
        if starts[j + 1] < starts[j]:
            return 1
        if eid[j] < 0 or eid[j] >= E:
            return 2
    return 0


def expert_inputs(x: np.ndarray, stack: ExpertStack, rows: np.ndarray | None = None) -> tuple:
    """Activations of x (T, K) for the stack's kernels, as rows x[rows] (R,) when given: each row is quantized
    on its own, so quantizing x once and gathering equals quantizing the gathered rows."""
    if x.shape[1] != stack.shape[1]:
        raise ValueError(f"expert_inputs: x has {x.shape[1]} columns, the experts take {stack.shape[1]}")
    act = prepare_activations(np.ascontiguousarray(x, dtype=np.float32), stack.experts[0])
    R = x.shape[0] if rows is None else len(rows)
    act = tuple(a if rows is None or a.shape[0] != x.shape[0] else a[rows] for a in act)
    return tuple(_rows_sized(a, R) for a in act)


def expert_matmul(act: tuple, stack: ExpertStack, eid: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """y (R, N): row r of the activations act (expert_inputs, R rows) times the expert of its job, where job j
    covers rows starts[j]:starts[j+1] and uses expert eid[j]. Equal to matmul(x[s:e], stack.experts[eid[j]])
    per job, bit for bit."""
    xq, dx, bs = act
    R = xq.shape[0]
    eid = np.ascontiguousarray(eid, dtype=np.int64)
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    if len(starts) != len(eid) + 1:
        raise ValueError("expert_matmul: starts must rise from 0 to the row count, one job per expert id")
    bad = _check_jobs(eid, starts, R, stack.n_experts)
    if bad:
        raise ValueError(_JOB_ERRORS[bad].format(n=stack.n_experts - 1))
    if dx.shape[0] != R or bs.shape[0] != R:
        raise ValueError("expert_matmul: activations of unequal row counts")
    y = np.empty((R, stack.shape[0]), np.float32)
    if R == 0:
        return y
    run, split = job_kernels(int(stack.qtype))
    G = stack.qs.shape[1]
    units = len(eid) * G
    threads = min(parallel.get_threads(), units)
    if threads == 1 or R * stack.shape[0] * stack.shape[1] < split_min_macs():
        run(y, xq, dx, bs, stack.qs, stack.sc, eid, starts, 0, units, None)
        return y
    # a unit's work is its job's rows: split by it, unless the jobs times the first one's rows make R (decode)
    cost = None if len(eid) * (starts[1] - starts[0]) == R else np.repeat(np.diff(starts), G).astype(np.float64)
    parallel.parallel_for(run, units, 1, None, y, xq, dx, bs, stack.qs, stack.sc, eid, starts, cost=cost,
                          split=split)
    return y
