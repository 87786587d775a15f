"""Embeddings: the final-normed hidden states of a text, pooled as the GGUF file says and L2-normalised.

Pooling is `{arch}.pooling_type` (llama.cpp's enum: 1 mean, 2 cls = first token, 3 last token); a plain decoder's
file has no key (or 0, none), and its embedding is the mean over the tokens. A reranker's (4, rank) is refused.

Many inputs go through the model together: they are packed into forwards of at most the engine's token budget and
batch size (one multi-sequence ForwardBatch each, with KV blocks held through the KV cache manager like LLM.scratch,
so sliding-window slots are set as for an engine step), each run on the engine thread between its steps
(LLM.call). An input longer than the token budget runs alone, in chunks. Nothing is sampled and nothing is cached.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from edgellm.errors import ContextOverflowError, InvalidRequestError, UnsupportedModelError
from edgellm.models.common import ForwardBatch

POOLING: dict[int | None, str] = {None: "mean", 0: "mean", 1: "mean", 2: "cls", 3: "last"}


def pooling_type(metadata: dict) -> str:
    """The pooling of a model ("mean", "cls" or "last") from its GGUF metadata."""
    key = f"{metadata.get('general.architecture')}.pooling_type"
    value = metadata.get(key)
    value = None if value is None else int(value)
    if value not in POOLING:
        raise UnsupportedModelError(f"{key} = {value} (a reranker?) has no embedding pooling edgellm supports")
    return POOLING[value]


def pool(h: np.ndarray, kind: str) -> np.ndarray:
    """(D,) pooled vector of one sequence's hidden states h (n, D)."""
    if kind == "cls":
        return h[0]
    if kind == "last":
        return h[-1]
    return h.mean(axis=0, dtype=np.float64).astype(np.float32)


def normalize(v: np.ndarray) -> np.ndarray:
    """L2-normalised rows of v (N, D) (a zero row stays zero)."""
    n = np.linalg.norm(v, axis=-1, keepdims=True)
    return (v / np.where(n > 0, n, 1)).astype(np.float32)


def _groups(lengths: list[int], budget: int, max_seqs: int) -> list[list[int]]:
    """Indices of the inputs packed into forwards of at most `budget` rows and `max_seqs` sequences (an input
    longer than the budget alone)."""
    out, cur, rows = [], [], 0
    for i, n in enumerate(lengths):
        if cur and (rows + n > budget or len(cur) == max_seqs):
            out.append(cur)
            cur, rows = [], 0
        cur.append(i)
        rows += n
    if cur:
        out.append(cur)
    return out


class _Holder:
    """A holder of KV blocks for one sequence of an embedding batch (the KV cache manager reads n_computed)."""

    n_computed = 0


def _hidden_group(llm, seqs: list[list[int]]) -> list[np.ndarray]:
    """Final hidden states (n_i, D) of each sequence, in one forward (engine thread)."""
    eng = llm.engine
    holders = [_Holder() for _ in seqs]
    try:
        for h, ids in zip(holders, seqs):
            if eng.kv_manager.allocate(h, len(ids)) is None:
                raise ContextOverflowError("the free KV cache cannot hold this embedding batch right now; retry")
        tables = [eng.kv_manager.block_table(h) for h in holders]
        bt = np.full((len(seqs), max(map(len, tables))), -1, dtype=np.int64)  # (S, MB)
        for s, t in enumerate(tables):
            bt[s, :len(t)] = t
        toks = np.concatenate([np.asarray(ids, dtype=np.int64) for ids in seqs])  # (T,)
        pos = np.concatenate([np.arange(len(ids), dtype=np.int64) for ids in seqs])  # (T,)
        row_seq = np.concatenate([np.full(len(ids), s, dtype=np.int64) for s, ids in enumerate(seqs)])  # (T,)
        batch = ForwardBatch(toks, pos, row_seq, bt, np.arange(len(toks), dtype=np.int64))
        eng.kv_manager.prepare(batch)
        h = llm.model.hidden(batch, eng.kv)  # (T, D)
        bounds = np.cumsum([0] + [len(ids) for ids in seqs])
        return [h[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    finally:
        for h in holders:
            eng.kv_manager.free(h, cache=False)


def _hidden_long(llm, ids: list[int], budget: int) -> np.ndarray:
    """Final hidden states (n, D) of one sequence longer than the token budget, in chunks (engine thread)."""
    out = []
    with llm.scratch(len(ids)) as sc:
        for start in range(0, len(ids), budget):
            chunk = ids[start:start + budget]
            out.append(sc.hidden(chunk, start, range(len(chunk))))
    return np.concatenate(out)


def embed_ids(llm, seqs: Sequence[Sequence[int]], *, pooling: str | None = None) -> np.ndarray:
    """(N, D) float32 L2-normalised embeddings of token sequences (each non-empty, within the context)."""
    seqs = [list(s) for s in seqs]
    for i, s in enumerate(seqs):
        if not s:
            raise InvalidRequestError(f"input {i} is empty")
        if len(s) > llm.capacity.max_len:
            raise ContextOverflowError(f"input {i} has {len(s)} tokens; this model embeds at most "
                                       f"{llm.capacity.max_len} (raise --ctx-size)")
    kind = pooling or pooling_type(llm.loaded.metadata)
    cap = llm.capacity
    vecs: list[np.ndarray | None] = [None] * len(seqs)
    for group in _groups([len(s) for s in seqs], cap.token_budget, cap.max_batch):
        if len(group) == 1 and len(seqs[group[0]]) > cap.token_budget:
            hs = [llm.call(lambda g=group: _hidden_long(llm, seqs[g[0]], cap.token_budget))]
        else:
            hs = llm.call(lambda g=group: _hidden_group(llm, [seqs[i] for i in g]))
        for i, h in zip(group, hs):
            vecs[i] = pool(h, kind)
    d = llm.config.d_model
    return normalize(np.stack(vecs)) if vecs else np.empty((0, d), np.float32)
