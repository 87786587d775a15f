"""LLM: the Python API — a thin facade over the engine (generate / stream / tokenize / detokenize)."""
from __future__ import annotations

import os
import sys
import threading
from typing import Iterator, Sequence

from edgellm.engine.engine import Engine
from edgellm.engine.request import Request, RequestOutput
from edgellm.errors import InvalidRequestError
from edgellm.loader import LoadedModel, load_gguf
from edgellm.model_path import resolve_model
from edgellm.sampling import SamplingParams
from edgellm.tokenizer import Tokenizer

DEFAULT_CTX = 4096


def physical_cores() -> int:
    """Physical core count (hyper-threads would oversubscribe the kernels)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
        if n:
            return n
    except ImportError:
        pass
    return os.cpu_count() or 1


def load_model(model: str | None = None, *, progress: bool = True) -> LoadedModel:
    """Resolve (default model if None) and open a GGUF model, validated."""
    return load_gguf(resolve_model(model, progress=progress))


class LLM:
    """A loaded model ready to generate. Prompts are strings (tokenized with BOS as the file says)
    or lists of token ids."""

    def __init__(self, model: str | None = None, *, threads: int | None = None, ctx_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_batch: int = 8, progress: bool | None = None):
        if progress is None:
            progress = sys.stderr.isatty()
        from kernels_cpu import set_threads

        self.threads = threads or physical_cores()
        set_threads(self.threads)
        self.loaded = load_model(model, progress=progress)
        cfg = self.loaded.config
        self.config = cfg
        self.tokenizer = Tokenizer.from_metadata(self.loaded.metadata)
        self.ctx_size = min(ctx_size or DEFAULT_CTX, cfg.n_ctx_train)
        if self.ctx_size < 2:
            raise InvalidRequestError("ctx_size must be >= 2")
        from edgellm.warmup import warm_up

        self.model = self.loaded.model_module().Model(self.loaded)
        self.engine = Engine(self.loaded, self.model, self.tokenizer, ctx_size=self.ctx_size,
                             kv_cache_tokens=kv_cache_tokens, max_batch=max_batch)
        warm_up(self, progress=progress)
        self._lock = threading.Lock()

    # -- tokens ---------------------------------------------------------------------------------
    def tokenize(self, text: str, *, special: bool = True, add_bos: bool = False) -> list[int]:
        """Token ids of text (no BOS unless add_bos). special=True parses control tokens in text."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens rendered as their text)."""
        return self.tokenizer.decode(list(ids))

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=None, special=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.n_vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} out of range [0, {self.config.n_vocab})")
            return list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    # -- generation -----------------------------------------------------------------------------
    def _submit(self, prompts: list, params: list[SamplingParams]) -> list[Request]:
        ids = [self._prompt_ids(p) for p in prompts]  # validate all before queueing any
        return [self.engine.add_request(i, p) for i, p in zip(ids, params)]

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Generate for one prompt (returns one RequestOutput) or a list (one continuous batch, outputs in order)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        if len(params) != len(plist):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one for all")
        with self._lock:
            reqs = self._submit(plist, list(params))
            try:
                while not all(r.finished for r in reqs):
                    self.engine.step()
                self.engine.step()  # reap: return blocks of the just-finished requests
            except BaseException:
                for r in reqs:
                    r.cancel()
                self.engine.step()
                raise
        outs = [r.output() for r in reqs]
        return outs[0] if single else outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are produced (stop strings never leak)."""
        with self._lock:
            (req,) = self._submit([prompt], [params or SamplingParams()])
            self.last_request = req
            try:
                while not req.finished:
                    self.engine.step()
                    if req.new_text:
                        piece, req.new_text = req.new_text, ""
                        yield piece
                if req.new_text:
                    piece, req.new_text = req.new_text, ""
                    yield piece
                self.engine.step()
            finally:
                if not req.finished:
                    req.cancel()
                    self.engine.step()

    def stats(self) -> dict:
        """Engine metrics: KV blocks total/used/free/cached, evictions, preemptions, queue sizes."""
        return self.engine.stats()
