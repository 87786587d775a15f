"""LLM: the Python API — a thin facade over the engine (generate / stream / tokenize / detokenize)."""
from __future__ import annotations

import os
import sys
from typing import Iterator, Sequence

import numpy as np

from edgellm.engine.engine import Engine
from edgellm.engine.loop import EngineLoop, RequestHandle
from edgellm.engine.request import RequestOutput
from edgellm.errors import InvalidRequestError
from edgellm.loader import LoadedModel, load_gguf
from edgellm.models.common import ForwardBatch
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


def _trim_heap() -> None:
    """glibc keeps freed arenas; give them back to the OS (a no-op elsewhere)."""
    import gc

    gc.collect()
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass


def load_model(model: str | None = None, *, progress: bool = True) -> LoadedModel:
    """Resolve (default model if None) and open a GGUF model, validated."""
    return load_gguf(resolve_model(model, progress=progress))


class LLM:
    """A loaded model ready to generate. Prompts are strings (tokenized with BOS as the file says)
    or lists of token ids."""

    def __init__(self, model: str | None = None, *, threads: int | None = None, ctx_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_batch: int = 8, progress: bool | None = None,
                 load_tokenizer: bool = True, kv_dtype: str = "f32"):
        if progress is None:
            progress = sys.stderr.isatty()
        from kernels_cpu import set_threads

        self.threads = threads or physical_cores()
        set_threads(self.threads)
        self.loaded = load_model(model, progress=progress)
        cfg = self.loaded.config
        self.config = cfg
        self.ctx_size = min(ctx_size or DEFAULT_CTX, cfg.n_ctx_train)
        if self.ctx_size < 2:
            raise InvalidRequestError("ctx_size must be >= 2")
        from edgellm.warmup import warm_up

        self.model = self.loaded.model_module().Model(self.loaded, progress=progress)
        self._tokenizer: Tokenizer | None = None
        if load_tokenizer:  # before the weights page in, so its build buffers never add to the peak
            self._tokenizer = Tokenizer.from_metadata(self.loaded.metadata)
        self.engine = Engine(self.loaded, self.model, lambda: self.tokenizer, ctx_size=self.ctx_size,
                             kv_cache_tokens=kv_cache_tokens, max_batch=max_batch, kv_dtype=kv_dtype)
        _trim_heap()  # hand back the loader's and tokenizer builder's temporary buffers before weights page in
        warm_up(self, progress=progress)
        self.loop = EngineLoop(self.engine)

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer, built on first use (a benchmark or a token-id client never pays for it)."""
        if self._tokenizer is None:
            self._tokenizer = Tokenizer.from_metadata(self.loaded.metadata)
        return self._tokenizer

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
    def submit(self, prompt, params: SamplingParams | None = None, *, priority: int = 0) -> RequestHandle:
        """Queue one request on the engine thread; returns its handle (stream / result / cancel)."""
        return self.loop.submit(self._prompt_ids(prompt), params or SamplingParams(), priority=priority)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Generate for one prompt (returns one RequestOutput) or a list (one continuous batch, outputs in order)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        if len(params) != len(plist):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one for all")
        ids = [self._prompt_ids(p) for p in plist]  # validate all before queueing any
        handles: list[RequestHandle] = []
        try:
            for i, p in zip(ids, params):
                handles.append(self.loop.submit(i, p))
            outs = [h.result() for h in handles]
        except BaseException:
            for h in handles:
                h.cancel()
            raise
        return outs[0] if single else outs

    def stream(self, prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text pieces as they are produced (stop strings never leak). Closing the iterator cancels."""
        h = self.submit(prompt, params)
        try:
            yield from h.pieces()
        finally:
            if not h.done.is_set():
                h.cancel()

    async def agenerate(self, prompt, params: SamplingParams | None = None) -> RequestOutput:
        """Async generate: awaits the output without blocking the event loop."""
        h, q = self._asubmit(prompt, params)
        async for _ in self._adrain(h, q):
            pass
        return h.output

    async def astream(self, prompt, params: SamplingParams | None = None):
        """Async iterator over text pieces; cancelling the consumer cancels the request."""
        h, q = self._asubmit(prompt, params)
        async for piece in self._adrain(h, q):
            yield piece

    def _asubmit(self, prompt, params):
        import asyncio

        aloop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        h = self.loop.submit(self._prompt_ids(prompt), params or SamplingParams(),
                             listener=lambda ev: aloop.call_soon_threadsafe(q.put_nowait, ev))
        return h, q

    @staticmethod
    async def _adrain(h: RequestHandle, q):
        try:
            while True:
                ev = await q.get()
                if isinstance(ev, str):
                    yield ev
                elif h.done.is_set():
                    if h.error:
                        raise h.error
                    return
        finally:
            if not h.done.is_set():
                h.cancel()

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Raw logits (T, n_vocab) of every position of a token sequence evaluated from position 0 (no
        sampling, nothing cached): for scoring and for comparisons with reference implementations."""
        ids = self._prompt_ids(list(token_ids))
        return self.loop.call(lambda: self._logits(ids))  # on the engine thread, between its steps

    def _logits(self, ids: list[int]) -> np.ndarray:
        eng = self.engine
        blocks = eng.pool.allocate(-(-len(ids) // eng.block_size))
        if blocks is None or len(ids) > self.ctx_size:
            from edgellm.errors import ContextOverflowError

            if blocks is not None:
                eng.pool.free(blocks)
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the free KV cache / context")
        try:
            return self.model.forward(ForwardBatch.single(ids, 0, blocks, all_logits=True), eng.kv)
        finally:
            eng.pool.free(blocks)

    def stats(self) -> dict:
        """Engine metrics: KV blocks total/used/free/cached, evictions, preemptions, queue sizes."""
        return self.engine.stats()
