"""A small draft model for speculative decoding (`{"draft_model": PATH, "k": 4}`, `--draft-model PATH`): a second
model with the target's vocabulary, run greedily for k steps per request on its own paged KV cache.

Each request has a DraftSeq: the tokens whose K/V the draft cache holds. A proposal first computes the tokens the
draft has not seen (the prompt, then the target's accepted tokens since the last proposal) in one forward, from the
last position where its tokens still agree with the request's, then decodes k - 1 more tokens one at a time. The
draft's rejected rows are rolled back at the next proposal (KVCacheManager.trim). The draft is deterministic
(argmax), so verification uses the same rule as prompt lookup's one-hot proposals (Sampler.verify).
"""
from __future__ import annotations

import numpy as np

from edgellm.engine.kv_cache import PagedKVCache
from edgellm.engine.kv_cache_manager import KVCacheManager
from edgellm.errors import DraftModelError
from edgellm.models.common import ForwardBatch

TOKENS_KEY = "tokenizer.ggml.tokens"


class DraftSeq:
    """One request's tokens in the draft cache (the KV cache manager's holder: n_computed positions valid)."""

    def __init__(self):
        self.ids: list[int] = []
        self.n_computed = 0


def check_same_vocab(target, draft, path: str) -> None:
    """Raise DraftModelError unless the two loaded models have the same vocabulary (size and token texts)."""
    nt, nd = target.config.n_vocab, draft.config.n_vocab
    if nt != nd:
        raise DraftModelError(f"draft model {path} has {nd} tokens, the target {nt}: a draft needs the same vocabulary")
    tt, td = target.metadata.get(TOKENS_KEY), draft.metadata.get(TOKENS_KEY)
    if tt is not None and td is not None and list(tt) != list(td):
        i = next(i for i, (a, b) in enumerate(zip(tt, td)) if a != b)
        raise DraftModelError(f"draft model {path}: token {i} is {td[i]!r}, the target's is {tt[i]!r}: "
                              f"a draft needs the same vocabulary")


class DraftModelProposer:
    """Greedy drafts from a second model (see the module docstring); its KV cache holds as many tokens as the
    target's, in f32, every block kept (no sliding-window trimming: the draft is small)."""

    def __init__(self, config, engine):
        from edgellm.loader import load_gguf
        from edgellm.model_path import resolve_model

        path = resolve_model(config.draft_model, progress=False)
        loaded = load_gguf(path)
        check_same_vocab(engine.loaded, loaded, path)
        self.model = loaded.model_module().Model(loaded, ctx_size=engine.ctx_size)
        n_blocks, bs = engine.pool.n_blocks, engine.block_size
        self.kv = PagedKVCache(loaded.config, n_blocks, bs)
        self.manager = KVCacheManager(n_blocks, bs, self.kv)
        self._seqs: dict[int, DraftSeq] = {}

    def propose(self, req, k: int) -> list[int]:
        """Up to k greedy draft tokens after req's tokens ([] when the draft cache is full)."""
        seq = self._seqs.setdefault(req.id, DraftSeq())
        ids = req.all_ids
        n = 0
        lim = min(seq.n_computed, len(ids) - 1)  # the last token is always run: its logits give the first draft
        while n < lim and seq.ids[n] == ids[n]:
            n += 1
        seq.n_computed = n
        self.manager.trim(seq, n)
        if self.manager.allocate(seq, len(ids) - n + k - 1) is None:
            return []
        out: list[int] = []
        new, pos = ids[n:], n
        for _ in range(k):
            batch = ForwardBatch.single(new, pos, self.manager.block_table(seq))
            self.manager.prepare(batch)
            logits = self.model.forward(batch, self.kv)  # (1, V)
            pos += len(new)
            seq.n_computed = pos
            new = [int(np.argmax(logits[-1]))]
            out.append(new[0])
        seq.ids = ids + out[:-1]  # the last draft token's K/V is not computed
        return out

    def release(self, req) -> None:
        seq = self._seqs.pop(req.id, None)
        if seq is not None:
            self.manager.free(seq, cache=False)

    def close(self) -> None:
        for rid in list(self._seqs):
            self.manager.free(self._seqs.pop(rid), cache=False)
