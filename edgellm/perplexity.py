"""Perplexity as llama-perplexity computes it: windows of n_ctx tokens, each starting with BOS, scoring
the second half of each window (tokens after the first n_ctx/2)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from edgellm.errors import ContextOverflowError
from edgellm.sampling import logprobs

LOGIT_ROWS = 16  # output-head rows per call: bounds the (rows, n_vocab) logits buffer


@dataclass
class PerplexityResult:
    ppl: float
    n_tokens: int
    nll: list[float]


def perplexity(llm, text: str, *, n_ctx: int = 512, progress: bool = False, chunk: int = 256) -> PerplexityResult:
    """Perplexity of text under llm's model (see module doc). Needs at least one window of n_ctx tokens."""
    return llm.call(lambda: _perplexity(llm, text, n_ctx, progress, chunk))  # on the engine thread, between steps


def _perplexity(llm, text: str, n_ctx: int, progress: bool, chunk: int) -> PerplexityResult:
    from tqdm import tqdm

    toks = llm.tokenizer.encode(text, add_bos=True, special=False)
    n_windows = len(toks) // n_ctx
    if n_ctx < 4 or n_windows == 0:
        raise ContextOverflowError(f"text has {len(toks)} tokens; need at least one window of --ctx {n_ctx} tokens")
    if n_ctx > llm.config.n_ctx_train:
        raise ContextOverflowError(f"--ctx {n_ctx} exceeds the model's training context {llm.config.n_ctx_train}")
    first = n_ctx // 2
    nll: list[float] = []
    bos = llm.tokenizer.bos_id
    with llm.scratch(n_ctx) as sc:
        for w in tqdm(range(n_windows), desc="perplexity", disable=not progress, unit="window"):
            win = list(toks[w * n_ctx:(w + 1) * n_ctx])
            if bos is not None:
                win[0] = bos
            hid = []
            for s in range(0, n_ctx, chunk):
                part = win[s:s + chunk]
                rows = [j - s for j in range(s, s + len(part)) if first <= j < n_ctx - 1]
                hid.append(sc.hidden(part, s, rows))
            h = np.concatenate(hid)  # (n_ctx - 1 - first, D): rows first .. n_ctx-2
            for r0 in range(0, len(h), LOGIT_ROWS):
                lg = sc.logits(h[r0:r0 + LOGIT_ROWS])
                for i, row in enumerate(lg):
                    j = first + r0 + i
                    nll.append(-float(logprobs(row)[win[j + 1]]))
    return PerplexityResult(math.exp(sum(nll) / len(nll)), len(nll), nll)
