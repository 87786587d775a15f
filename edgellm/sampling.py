"""SamplingParams and the sampler: logits processors as a data pipeline, in llama.cpp's default order
(penalties -> top-k -> top-p -> min-p -> temperature -> draw)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from edgellm.errors import InvalidRequestError


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop. `temperature=0` is greedy."""

    max_tokens: int = 256
    temperature: float = 0.8
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repeat_penalty: float = 1.0  # 1.0 = off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None = off; k >= 0: record each token's logprob and the top k alternatives
    skip_special_tokens: bool = True  # False: control tokens show in the text (tool-call openers such as [TOOL_CALLS])
    # constrained decoding (at most one; see edgellm/structured.py): a JSON schema (dict / JSON string; True = any
    # JSON object), a regex the whole output matches, a list of allowed outputs, or a Lark / GBNF grammar
    json_schema: dict | str | bool | None = None
    regex: str | None = None
    choices: list[str] | None = None
    grammar: str | None = None
    compiled_grammar: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.max_tokens >= 0, "max_tokens must be >= 0"),
            (self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0, "repeat_penalty must be > 0"),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop strings must be non-empty strings"),
            (self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"logprobs must be in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequestError(msg)
        if any(v is not None for v in (self.json_schema, self.regex, self.choices, self.grammar)):
            from edgellm.structured import compile_grammar  # llguidance only when asked for

            self.compiled_grammar = compile_grammar(json_schema=self.json_schema, regex=self.regex,
                                                    choices=self.choices, grammar=self.grammar)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def _no_penalties(p: SamplingParams) -> bool:
    return p.repeat_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


def _penalties(logits: np.ndarray, p: SamplingParams, history: np.ndarray) -> np.ndarray:
    # llama.cpp llama_sampler_penalties: over the last repeat_last_n tokens (prompt included)
    if _no_penalties(p):
        return logits
    window = history if p.repeat_last_n == -1 else history[len(history) - p.repeat_last_n:] if p.repeat_last_n else history[:0]
    if not len(window):
        return logits
    ids, counts = np.unique(window, return_counts=True)
    ids_ok = ids < len(logits)
    ids, counts = ids[ids_ok], counts[ids_ok]
    v = logits[ids]
    v = np.where(v <= 0, v * p.repeat_penalty, v / p.repeat_penalty)
    v -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    logits[ids] = v
    return logits


def _top_k(logits: np.ndarray, p: SamplingParams, _h) -> np.ndarray:
    if 0 < p.top_k < len(logits):
        kth = np.partition(logits, len(logits) - p.top_k)[len(logits) - p.top_k]
        logits[logits < kth] = -np.inf
    return logits


def _softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max())
    return e / e.sum()


def _top_p(logits: np.ndarray, p: SamplingParams, _h) -> np.ndarray:
    if p.top_p < 1.0:
        probs = _softmax(logits)
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        keep = int(np.searchsorted(cum, p.top_p)) + 1  # smallest set with mass >= top_p
        logits[order[keep:]] = -np.inf
    return logits


def _min_p(logits: np.ndarray, p: SamplingParams, _h) -> np.ndarray:
    if p.min_p > 0.0:
        # relative to the top token: p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p)
        logits[logits < logits.max() + np.log(p.min_p)] = -np.inf
    return logits


Processor = Callable[[np.ndarray, SamplingParams, np.ndarray], np.ndarray]
PIPELINE: list[Processor] = [_penalties, _top_k, _top_p, _min_p]


class Sampler:
    """Per-request sampler: owns the request's random generator so seeded requests are reproducible."""

    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: np.ndarray) -> int:
        """Pick the next token from logits (V,) float32 given the sequence so far (prompt + output)."""
        p = self.params
        if p.greedy and not p.logit_bias and _no_penalties(p):
            return int(np.argmax(logits))  # float32 -> float64 is exact and monotone: the same argmax, no copy
        x = self._processed(logits, history)
        if p.greedy:
            return int(np.argmax(x))
        probs = _softmax(x / p.temperature)
        return int(self.rng.choice(len(probs), p=probs))

    def probs(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        """The distribution (V,) float64 the next token is drawn from (one-hot at the argmax when greedy)."""
        x = self._processed(logits, history)
        if self.params.greedy:
            out = np.zeros(len(x))
            out[int(np.argmax(x))] = 1.0
            return out
        return _softmax(x / self.params.temperature)

    def verify(self, logits: np.ndarray, history: np.ndarray, draft: list[int]) -> list[int]:
        """Speculative verification: logits (1 + d, V) of the last known token's row and of the d draft rows
        (row i scored after draft[:i]); returns the accepted draft prefix plus one more token (the correction,
        or the bonus after a fully accepted draft). Greedy: a draft token is accepted iff it is the argmax, so the
        tokens equal non-speculative decoding's. Sampled: the standard rejection rule for a deterministic
        proposal: accept draft token t with probability p(t), else draw from p with t removed, renormalised;
        every emitted token has exactly the distribution of plain sampling (the random draws differ)."""
        out: list[int] = []
        for i, t in enumerate(draft):
            h = np.concatenate([history, np.asarray(draft[:i], dtype=np.int64)]) if i else history  # row i's past
            if self.params.greedy:
                tok = self(logits[i], h)
                out.append(tok)
                if tok != t:
                    return out
            else:
                p = self.probs(logits[i], h)
                if self.rng.random() < p[t]:
                    out.append(t)
                else:
                    p[t] = 0.0
                    out.append(int(self.rng.choice(len(p), p=p / p.sum())))
                    return out
        out.append(self(logits[len(draft)], np.concatenate([history, np.asarray(draft, dtype=np.int64)])))
        return out

    def _processed(self, logits: np.ndarray, history: np.ndarray) -> np.ndarray:
        """logits (V,) after the logit bias and penalties, and unless greedy top-k / top-p / min-p (float64)."""
        p = self.params
        x = logits.astype(np.float64, copy=True)
        for tok, bias in p.logit_bias.items():
            if 0 <= int(tok) < len(x):
                x[int(tok)] += bias
        x = _penalties(x, p, history)
        if p.greedy:
            return x
        for proc in PIPELINE[1:]:
            x = proc(x, p, history)
        return x


def logprobs(logits: np.ndarray) -> np.ndarray:
    """log-softmax of (V,) logits in float64."""
    x = logits.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def token_logprobs(logits: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The model's logprob of `token` (raw logits, before penalties and temperature, as OpenAI reports it)
    and the k most likely (token, logprob) pairs, best first."""
    lp = logprobs(logits)  # (V,)
    if k <= 0:
        return float(lp[token]), []
    top = np.argpartition(-lp, k - 1)[:k] if k < len(lp) else np.arange(len(lp))
    top = top[np.argsort(-lp[top], kind="stable")]
    return float(lp[token]), [(int(t), float(lp[t])) for t in top]
