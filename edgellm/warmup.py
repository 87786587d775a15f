"""JIT warm-up: compile (or load from Numba's cache) every kernel the model uses, with progress shown
the first time (when compiling takes long enough to notice)."""
from __future__ import annotations

import numpy as np

from edgellm.models.common import ForwardBatch


def _distinct_weights(model) -> list:
    seen, out = set(), []
    for w in [model.output] + [m for L in model.layers for m in vars(L).values()]:
        key = getattr(w, "qtype", None)
        if key is not None and key not in seen:
            seen.add(key)
            out.append(w)
    return out


def warm_up(llm, *, progress: bool = True) -> None:
    """Run every distinct matmul type once, then a tiny prefill and decode forward."""
    from tqdm import tqdm

    from kernels_cpu import matmul
    from kernels_cpu.matmul import U8_MIN_ROWS

    model = llm.model
    weights = _distinct_weights(model)
    steps = len(weights) + 1
    with tqdm(total=steps, desc="compiling kernels (first run only)", disable=not progress, delay=1.0,
              leave=False, unit="kernel") as bar:
        for w in weights:
            k = w.shape[1]
            # one compiled driver per type and activation form: int16 for decode, uint8 (the VNNI form of the
            # 32-block formats) from U8_MIN_ROWS rows
            for m in sorted({1, U8_MIN_ROWS}):
                matmul(np.zeros((m, k), np.float32), w)
            bar.update(1)
        pool = llm.engine.pool
        blocks = pool.allocate(1)
        try:
            batch = ForwardBatch.single([0, 0], 0, blocks)
            model.forward(batch, llm.engine.kv)
            batch = ForwardBatch.single([0], 1, blocks)
            model.forward(batch, llm.engine.kv)
        finally:
            pool.free(blocks)
        bar.update(1)
