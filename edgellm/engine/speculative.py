"""Speculative decoding: draft tokens for a decoding request, verified by the target model as extra rows of the
same batch (runner.py), accepted by the request's sampler (Sampler.verify), rejected rows rolled back
(KVCacheManager.trim). The scheduler asks `Speculator.propose(req, limit)` when it schedules a decode and reports
each verification with `record(req, drafted, accepted)`.

Drafts come from a proposer (PROPOSERS): prompt lookup ("ngram": the continuation of the latest earlier occurrence
of the request's last 3, 2 or 1 tokens in its own prompt + output) or a small draft model with the same vocabulary
(engine/draft_model.py). A draft depends on the request's own tokens and its own acceptance history only, never on
the batch: a request's tokens stay batch invariant.

Adaptive per request (DraftControl): the draft length follows the accepted run length (doubling after a fully
accepted draft, up to max_k); after MISS_LIMIT verifications in a row with nothing accepted, or when the running
acceptance rate falls below MIN_RATE, drafting pauses for a back-off period (doubling while it keeps failing, up to
BACKOFF_MAX steps) and then probes again with a short draft. Free text thus pays for a few probes only.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from edgellm.errors import InvalidRequestError

DEFAULT_K = 4
MAX_K = 8
NGRAM_SIZES = (3, 2, 1)  # longest first: a longer match predicts its continuation better
MISS_LIMIT = 2  # verifications in a row with nothing accepted before a pause
MIN_RATE = 0.2  # running acceptance rate (accepted / drafted) below which drafting pauses
RATE_DECAY = 0.7  # weight of the past in the running rate
BACKOFF_MIN, BACKOFF_MAX = 8, 128  # decode steps without drafting after a failure (doubling while it repeats)


@dataclass(frozen=True)
class SpecConfig:
    """How a request drafts: method "ngram" or "draft" (draft_model: path of a GGUF with the target's
    vocabulary); k tokens at most per step at first, up to max_k after fully accepted drafts."""

    method: str = "ngram"
    k: int = DEFAULT_K
    max_k: int = MAX_K
    draft_model: str | None = None


def parse_speculative(spec) -> SpecConfig | None:
    """`LLM(speculative=...)` as a SpecConfig, or None for off: "off" / None / False, "ngram", or a dict
    {"draft_model": PATH, "k": 4} / {"method": "ngram", "k": 6}. Raises InvalidRequestError otherwise."""
    if spec is None or spec is False or spec == "off":
        return None
    if isinstance(spec, SpecConfig):
        cfg = spec
    elif spec == "ngram":
        cfg = SpecConfig()
    elif isinstance(spec, dict):
        unknown = set(spec) - {"method", "k", "max_k", "draft_model"}
        if unknown:
            raise InvalidRequestError(f"unknown speculative option(s): {', '.join(sorted(unknown))}")
        method = spec.get("method", "draft" if spec.get("draft_model") else "ngram")
        k = spec.get("k", DEFAULT_K)
        if not isinstance(k, int) or isinstance(k, bool):
            raise InvalidRequestError(f"speculative k must be an integer; got {k!r}")
        cfg = SpecConfig(method, k, spec.get("max_k", max(MAX_K, k)), spec.get("draft_model"))
    else:
        raise InvalidRequestError(f"speculative must be 'ngram', 'off' or a dict with 'draft_model'; got {spec!r}")
    if cfg.method not in PROPOSERS:
        raise InvalidRequestError(f"speculative method must be one of {', '.join(PROPOSERS)}; got {cfg.method!r}")
    if not 1 <= cfg.k <= cfg.max_k <= 64:
        raise InvalidRequestError(f"speculative k must be in [1, max_k <= 64]; got k={cfg.k}, max_k={cfg.max_k}")
    if (cfg.method == "draft") != bool(cfg.draft_model):
        raise InvalidRequestError("a draft model path goes with method 'draft' (and only with it)")
    return cfg


@dataclass
class DraftControl:
    """One request's adaptive draft length and back-off (see the module docstring)."""

    k: int
    max_k: int
    rate: float = 1.0  # running acceptance rate, optimistic at first
    misses: int = 0  # verifications in a row with nothing accepted
    pause: int = 0  # decode steps left without drafting
    backoff: int = BACKOFF_MIN

    def allowed(self) -> int:
        """Draft tokens this step may propose (0 while paused; each call is one decode step)."""
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    def record(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        self.rate = RATE_DECAY * self.rate + (1 - RATE_DECAY) * accepted / drafted
        if accepted == drafted:
            self.k = min(self.max_k, 2 * self.k)
        else:
            self.k = max(1, accepted + 1)
        self.misses = 0 if accepted else self.misses + 1
        if accepted:
            self.backoff = BACKOFF_MIN
        if self.misses >= MISS_LIMIT or self.rate < MIN_RATE:
            self.pause, self.backoff = self.backoff, min(BACKOFF_MAX, 2 * self.backoff)
            self.misses, self.k, self.rate = 0, 1, MIN_RATE + 0.1  # the probe after the pause starts short


class NgramIndex:
    """Prompt lookup over one growing token sequence: for each n-gram (n in NGRAM_SIZES) the position just after
    its latest occurrence that has a following token. Indexed incrementally: O(len(NGRAM_SIZES)) per new token."""

    def __init__(self):
        self.after: dict[tuple, int] = {}
        self.done = 0  # positions e < done are indexed (n-grams ending just before e)

    def propose(self, ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of ids' last n tokens (longest n first)."""
        L = len(ids)
        for e in range(max(self.done, 1), L):  # n-grams ending at e - 1, followed by ids[e]
            for n in NGRAM_SIZES:
                if e >= n:
                    self.after[tuple(ids[e - n:e])] = e
        self.done = max(self.done, L)
        for n in NGRAM_SIZES:
            if L >= n:
                e = self.after.get(tuple(ids[L - n:]))
                if e is not None:  # past the end the run repeats with period L - e (a loop in the text)
                    out = ids[e:e + k]
                    while len(out) < k:
                        out += out[:k - len(out)]
                    return out
        return []


class NgramProposer:
    """Drafts from the request's own prompt and output (no second model)."""

    def __init__(self, config: SpecConfig, engine=None):
        self._index: dict[int, NgramIndex] = {}

    def propose(self, req, k: int) -> list[int]:
        return self._index.setdefault(req.id, NgramIndex()).propose(req.all_ids, k)

    def release(self, req) -> None:
        self._index.pop(req.id, None)

    def close(self) -> None:
        pass


def _draft_model_proposer(config: SpecConfig, engine):
    from edgellm.engine.draft_model import DraftModelProposer  # loads a second model: only when asked for

    return DraftModelProposer(config, engine)


PROPOSERS = {"ngram": NgramProposer, "draft": _draft_model_proposer}


@dataclass
class Speculator:
    """Per-request drafting for one engine: proposals, adaptive control and counters (drafted / accepted)."""

    config: SpecConfig
    proposer: object
    control: dict[int, DraftControl] = field(default_factory=dict)
    drafted: int = 0
    accepted: int = 0

    @classmethod
    def create(cls, config: SpecConfig | None, engine) -> "Speculator | None":
        """The speculator of an engine (None: speculation off)."""
        if config is None:
            return None
        return cls(config, PROPOSERS[config.method](config, engine))

    def propose(self, req, limit: int) -> list[int]:
        """Draft tokens to verify after req's last known token: at most `limit` (the request's own room: its
        max_tokens and context), none while its drafting is paused."""
        ctl = self.control.setdefault(req.id, DraftControl(self.config.k, self.config.max_k))
        k = min(limit, ctl.allowed())
        return self.proposer.propose(req, k) if k > 0 else []

    def record(self, req, drafted: int, accepted: int) -> None:
        """A verification of req's draft: `accepted` of `drafted` tokens matched."""
        self.drafted += drafted
        self.accepted += accepted
        ctl = self.control.get(req.id)
        if ctl is not None:
            ctl.record(drafted, accepted)

    def release(self, req) -> None:
        """req ended: forget its state (a draft model's KV blocks go back)."""
        self.control.pop(req.id, None)
        self.proposer.release(req)

    def close(self) -> None:
        """The engine closes: a proposer holding resources lets them go."""
        self.proposer.close()

    def stats(self) -> dict:
        return {"spec_draft_tokens": self.drafted, "spec_accepted_tokens": self.accepted}
