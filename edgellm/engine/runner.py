"""ModelRunner: turns scheduled items into one ForwardBatch, runs the model, returns logits per item."""
from __future__ import annotations

import numpy as np

from edgellm.engine.scheduler import ScheduledItem
from edgellm.models.common import ForwardBatch


class ModelRunner:
    def __init__(self, model, kv):
        self.model, self.kv = model, kv

    def run(self, items: list[ScheduledItem]) -> dict[int, np.ndarray]:
        """One forward over all items; returns {request id: logits (V,)} for requests that sample now."""
        toks, pos, seq, rows, sampled, decode = [], [], [], [], [], []
        mb = max(len(it.request.block_table) for it in items)
        tables = np.full((len(items), mb), -1, dtype=np.int64)  # (S, MB)
        n = 0
        for s, it in enumerate(items):
            r = it.request
            start = r.n_computed
            ids = r.all_ids[start:start + it.n_new]
            toks += ids
            pos += range(start, start + it.n_new)
            seq += [s] * it.n_new
            # llama.cpp sums a lone token's attention in another order than a prompt's rows: decide by what the
            # row is, not by how this step's chunk happened to be cut (batch invariance)
            decode += [start >= r.prompt_rows] * it.n_new
            tables[s, :len(r.block_table)] = r.block_table
            n += it.n_new
            if start + it.n_new == r.n_tokens:  # caught up with known tokens: sample the next one
                rows.append(n - 1)
                sampled.append(r.id)
        batch = ForwardBatch(np.asarray(toks, dtype=np.int64), np.asarray(pos, dtype=np.int64),
                             np.asarray(seq, dtype=np.int64), tables, np.asarray(rows, dtype=np.int64),
                             decode_rows=np.asarray(decode, dtype=bool))
        logits = self.model.forward(batch, self.kv) if len(toks) else np.empty((0, 0), np.float32)
        for it in items:
            it.request.n_computed += it.n_new
        return {rid: logits[i] for i, rid in enumerate(sampled)}
