"""Request: one generation's state as it moves through the scheduler, and what it returns. Only the scheduler writes
a Request (append_token, finish, fail, n_computed, state; the block table is the KV cache manager's); other
threads ask for an end with `cancel()`, applied at the next step."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from enum import Enum

from edgellm.sampling import Sampler, SamplingParams
from edgellm.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


class RequestState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestOutput:
    """What a finished (or streaming) request gives back."""

    request_id: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length" | "cancelled" | "error" | None while running
    prompt_token_ids: list[int]
    metrics: dict = field(default_factory=dict)


class StopMatcher:
    """Holds back text that could be the start of a stop string, so stops split across tokens are found."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, stopped)."""
        text = self.pending + piece
        if not self.stops:
            self.pending = ""
            return text, False
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            idx = min(h[0] for h in hits)
            self.pending = ""
            return text[:idx], True
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self.pending = text[len(text) - hold:] if hold else ""
        return text[:len(text) - hold], False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Request:
    """A prompt plus its sampling state, KV blocks and output so far."""

    def __init__(self, prompt_ids: list[int], params: SamplingParams, tokenizer, *, max_len: int, priority: int = 0):
        self.id = next(_ids)
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.priority = priority
        self.max_len = max_len  # prompt + output may not exceed this (the context size)
        self.sampler = Sampler(params)
        self.matcher = None  # a structured.GrammarMatcher when params constrain the output
        self.detok = IncrementalDetokenizer(tokenizer, skip_special=params.skip_special_tokens)
        self.stop = StopMatcher(params.stop)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.stop_ids))
        self.output_ids: list[int] = []
        self.logprobs: list[tuple[float, list[tuple[int, float]]]] = []  # per output token, if params.logprobs
        self.text = ""
        self.n_computed = 0  # tokens whose K/V are in the cache
        self.n_cached = 0  # prompt tokens reused from the prefix tree
        self.n_drafted = self.n_accepted = 0  # speculative draft tokens verified / accepted (engine/speculative.py)
        self.state = RequestState.WAITING
        self.finish_reason: str | None = None
        self.cancel_requested = False  # set by cancel() (any thread), applied by the scheduler
        self.error: BaseException | None = None
        self.t_arrival = time.perf_counter()
        self.t_first: float | None = None
        self.t_end: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def n_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def append_token(self, tok: int, logprob: tuple[float, list[tuple[int, float]]] | None = None) -> None:
        """Record a sampled token (and its logprob entry, if asked for); update text, stop strings and the
        finish reason."""
        if self.t_first is None:
            self.t_first = time.perf_counter()
        p = self.params
        if tok in self.stop_ids:
            self.finish("stop")
            return
        self.output_ids.append(tok)
        if logprob is not None:
            self.logprobs.append(logprob)
        piece, stopped = self.stop.feed(self.detok.add(tok))
        self.text += piece
        if stopped:
            self.finish("stop", flush=False)
        elif len(self.output_ids) >= p.max_tokens or self.n_tokens >= self.max_len:
            self.finish("length")

    def finish(self, reason: str, *, flush: bool = True) -> None:
        """End with `reason`, flushing text held back by the detokenizer and the stop matcher (scheduler only)."""
        if flush:
            piece, _ = self.stop.feed(self.detok.flush())
            piece += self.stop.flush()
            self.text += piece
        self.finish_reason = reason
        self.state = RequestState.FINISHED
        self.t_end = time.perf_counter()

    def fail(self, error: BaseException) -> None:
        """End the request because of an error in its own processing (reported to its caller)."""
        self.error = error
        if not self.finished:
            self.finish("error")

    def cancel(self) -> None:
        """Ask for the request to end ("cancelled"); the scheduler ends it and frees its blocks at the next step."""
        self.cancel_requested = True

    def output(self) -> RequestOutput:
        return RequestOutput(self.id, self.text, list(self.output_ids), self.finish_reason,
                             list(self.prompt_ids), self.metrics())

    def metrics(self) -> dict:
        now = self.t_end or time.perf_counter()
        ttft = (self.t_first - self.t_arrival) if self.t_first else None
        n_dec = max(len(self.output_ids) - 1, 0)
        dec_time = (now - self.t_first) if self.t_first else 0.0
        return {
            "ttft_s": ttft,
            "decode_tps": n_dec / dec_time if dec_time > 0 else 0.0,
            "total_s": now - self.t_arrival,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.n_cached,
            "draft_tokens": self.n_drafted,
            "accepted_draft_tokens": self.n_accepted,
        }
