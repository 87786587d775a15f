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
        """One forward over all items; returns {request id: logits (1 + len(draft), V)} for requests that sample
        now: the row of their last known token, then one per draft token (scored after the draft before it)."""
        toks, pos, seq, rows, sampled = [], [], [], [], []
        block_tables = [self.kv_manager.block_table(it.request) for it in items]
        tables = np.full((len(items), max(map(len, block_tables))), -1, dtype=np.int64)  # (S, MB)
        n = 0
        for s, it in enumerate(items):
            r = it.request
            start, m = r.n_computed, it.n_new + len(it.draft)
            toks += r.all_ids[start:start + it.n_new] + it.draft
            pos += range(start, start + m)
            seq += [s] * m
            tables[s, :len(block_tables[s])] = block_tables[s]
            n += m
            if start + it.n_new == r.n_tokens:  # caught up with known tokens: sample the next one(s)
                rows += range(n - 1 - len(it.draft), n)
                sampled.append((r.id, 1 + len(it.draft)))
        batch = ForwardBatch(np.asarray(toks, dtype=np.int64), np.asarray(pos, dtype=np.int64),
                             np.asarray(seq, dtype=np.int64), tables, np.asarray(rows, dtype=np.int64))
        step, self.steps = self.steps, self.steps + 1
        self.kv_manager.prepare(batch)  # sliding-window slots, before the forward
        logits = self.model.forward(batch, self.kv) if len(toks) else np.empty((0, 0), np.float32)
        if step in self.fail_steps:
            raise RuntimeError(f"injected fault in the forward of step {step}")
        out, i = {}, 0
        for rid, k in sampled:
            out[rid] = logits[i:i + k]  # (1 + len(draft), V)
            i += k
        return out
