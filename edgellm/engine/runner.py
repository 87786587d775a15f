"""ModelRunner: turns scheduled items into one ForwardBatch, runs the model, returns logits per item. It writes
no request state: the scheduler advances the requests from what the step returns."""
from __future__ import annotations

import numpy as np

from edgellm.engine.scheduler import ScheduledItem
from edgellm.models.common import ForwardBatch


class ModelRunner:
    """fail_steps: test hook for fault injection — the forward of each step whose number (0, 1, ... counting
    the forwards this runner ran) is in the set raises RuntimeError after it wrote the step's K/V."""

    def __init__(self, model, kv, kv_manager):
        self.model, self.kv, self.kv_manager = model, kv, kv_manager
        self.steps = 0
        self.fail_steps: set[int] = set()

    def run(self, items: list[ScheduledItem]) -> dict[int, np.ndarray]:
        """One forward over all items; returns {request id: logits (V,)} for requests that sample now."""
        toks, pos, seq, rows, sampled, decode = [], [], [], [], [], []
        block_tables = [self.kv_manager.block_table(it.request) for it in items]
        tables = np.full((len(items), max(map(len, block_tables))), -1, dtype=np.int64)  # (S, MB)
        n = 0
        for s, it in enumerate(items):
            r = it.request
            start = r.n_computed
            toks += r.all_ids[start:start + it.n_new]
            pos += range(start, start + it.n_new)
            seq += [s] * it.n_new
            # llama.cpp sums a lone token's attention in another order than a prompt's rows: decide by what the
            # row is, not by how this step's chunk happened to be cut (batch invariance)
            decode += [start >= r.prompt_rows] * it.n_new
            tables[s, :len(block_tables[s])] = block_tables[s]
            n += it.n_new
            if start + it.n_new == r.n_tokens:  # caught up with known tokens: sample the next one
                rows.append(n - 1)
                sampled.append(r.id)
        batch = ForwardBatch(np.asarray(toks, dtype=np.int64), np.asarray(pos, dtype=np.int64),
                             np.asarray(seq, dtype=np.int64), tables, np.asarray(rows, dtype=np.int64),
                             decode_rows=np.asarray(decode, dtype=bool))
        step, self.steps = self.steps, self.steps + 1
        self.kv_manager.prepare(batch)  # sliding-window slots, before the forward
        logits = self.model.forward(batch, self.kv) if len(toks) else np.empty((0, 0), np.float32)
        if step in self.fail_steps:
            raise RuntimeError(f"injected fault in the forward of step {step}")
        return {rid: logits[i] for i, rid in enumerate(sampled)}
