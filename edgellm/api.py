"""LLM: the Python API and the one facade every caller goes through (server, chat, program frontend, CLI):
generation (sync, streaming, async), tokens, the chat template, capacity, and one-off forwards of the model.
Nothing outside edgellm/engine needs the engine's parts."""
from __future__ import annotations

import functools
import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import numpy as np

from edgellm import heap
from edgellm.engine.engine import Engine
from edgellm.engine.kv_cache import check_kv_dtype
from edgellm.engine.loop import EngineLoop
from edgellm.engine.speculative import parse_speculative
from edgellm.engine.request import RequestOutput
from edgellm.errors import ContextOverflowError, EngineStoppedError, InvalidRequestError
from edgellm.handle import Listener, RequestHandle
from edgellm.loader import LoadedModel, load_gguf
from edgellm.models.common import ForwardBatch
from edgellm.model_path import resolve_model
from edgellm.sampling import SamplingParams
from edgellm.tokenizer import Tokenizer

DEFAULT_CTX = 4096


@dataclass(frozen=True)
class Capacity:
    """How much an LLM holds at once (fixed when it loads)."""

    ctx_size: int  # context size in tokens
    max_len: int  # prompt + output tokens one request may reach (the context, or the KV cache if smaller)
    max_batch: int  # requests moved forward together in one engine step
    token_budget: int  # prompt rows one engine step computes at most
    block_size: int  # tokens per KV block
    kv_blocks: int  # KV blocks in the cache, shared by every request (and the prefix cache)


class Scratch:
    """KV blocks held through the KV cache manager for direct use of the model on one sequence (see LLM.scratch):
    forward passes at chosen positions, outside the engine's requests. The manager sets each batch's
    sliding-window slots before its forward, like an engine step's."""

    def __init__(self, model, kv, kv_manager):
        self.model, self.kv, self.kv_manager = model, kv, kv_manager
        self.n_computed = 0  # end of the last forward: the manager keeps the window before it (engine steps between)

    def _batch(self, ids, start: int, *, all_logits: bool = False, logit_rows=None) -> ForwardBatch:
        """The prepared ForwardBatch of tokens `ids` at positions start.. (logits of the last row, every row, or
        the rows given, relative to start)."""
        b = ForwardBatch.single(ids, start, self.kv_manager.block_table(self), all_logits=all_logits)
        if logit_rows is not None:
            b.logit_rows = np.asarray(logit_rows, dtype=np.int64)
        self.kv_manager.prepare(b)
        self.n_computed = start + len(b.tokens)
        return b

    def forward(self, ids, start: int = 0, *, all_logits: bool = False) -> np.ndarray:
        """Logits (rows, n_vocab) of tokens `ids` at positions start.. (their K/V stay in the blocks)."""
        return self.model.forward(self._batch(ids, start, all_logits=all_logits), self.kv)

    def hidden(self, ids, start: int, logit_rows) -> np.ndarray:
        """Final hidden states (len(logit_rows), d_model) of the chosen rows; `logits` turns them into logits."""
        return self.model.hidden(self._batch(ids, start, logit_rows=logit_rows), self.kv)

    def logits(self, h: np.ndarray) -> np.ndarray:
        """Output-head logits (rows, n_vocab) of hidden states h (rows, d_model)."""
        return self.model.logits(h)


def load_model(model: str | None = None, *, progress: bool = True) -> LoadedModel:
    """Resolve and open a GGUF model, validated: a path (a split model's first shard), a stored model's name,
    a Hugging Face ``REPO[:QUANT]`` (pulled on first use, with progress), or None for the default model."""
    return load_gguf(resolve_model(model, progress=progress))


class LLM:
    """A loaded model ready to generate. Prompts are strings (tokenized with BOS as the file says)
    or lists of token ids. ``model``: as ``load_model`` takes it.

    prompt_cache: a directory where computed prompt blocks are kept across restarts (a later process with the same
    prefix skips computing it; engine/prompt_cache.py), at most prompt_cache_gb GB (None: 1 GB), least recently used
    blocks evicted.

    speculative: "ngram" (the default: draft tokens by prompt lookup, verified in the same forward, greedy output
    unchanged), "off", or {"draft_model": PATH, "k": 4} (a small model with the same vocabulary drafts); see
    edgellm/engine/speculative.py."""

    def __init__(self, model: str | None = None, *, threads: int | None = None, ctx_size: int | None = None,
                 kv_cache_tokens: int | None = None, max_batch: int = 8, progress: bool | None = None,
                 load_tokenizer: bool = True, kv_dtype: str = "f32", prompt_cache: str | os.PathLike | None = None,
                 prompt_cache_gb: float | None = None, speculative="ngram"):
        """kv_dtype: how the KV cache stores K/V, one of edgellm.engine.kv_cache.KV_DTYPES: "f32", "f16" / "bf16"
        (half the memory), "q8_0" (ggml's 8-bit blocks, 0.53x f16's memory; head sizes must be multiples of 32)."""
        if progress is None:
            progress = sys.stderr.isatty()
        from kernels_cpu import physical_cores, set_threads

        self.threads = threads or physical_cores()
        set_threads(self.threads)
        self.loaded = load_model(model, progress=progress)
        cfg = self.loaded.config
        check_kv_dtype(kv_dtype, cfg)  # before the weights are prepared
        spec = parse_speculative(speculative)
        self.config = cfg
        self.ctx_size = min(ctx_size or DEFAULT_CTX, cfg.n_ctx_train)
        if self.ctx_size < 2:
            raise InvalidRequestError("ctx_size must be >= 2")
        from edgellm.warmup import warm_up

        self.model = self.loaded.model_module().Model(self.loaded, progress=progress, ctx_size=self.ctx_size)
        self._tokenizer: Tokenizer | None = None
        if load_tokenizer:  # before the weights page in, so its build buffers never add to the peak
            self._tokenizer = Tokenizer.from_metadata(self.loaded.metadata)
        self.engine = Engine(self.loaded, self.model, lambda: self.tokenizer, ctx_size=self.ctx_size,
                             kv_cache_tokens=kv_cache_tokens, max_batch=max_batch, kv_dtype=kv_dtype,
                             prompt_cache=prompt_cache, prompt_cache_gb=prompt_cache_gb, speculative=spec)
        heap.trim()  # hand back the loader's and tokenizer builder's temporary buffers before weights page in
        heap.keep_freed_buffers()  # forward passes reuse their buffers (edgellm/heap.py)
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

    def prompt_ids(self, prompt) -> list[int]:
        """Token ids of a prompt as submit() sees it: a string is tokenized (BOS as the file says, control-token
        text parsed), a list of token ids is checked against the vocabulary. Raises InvalidRequestError."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_bos=None, special=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.config.n_vocab]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} out of range [0, {self.config.n_vocab})")
            return list(prompt)
        raise InvalidRequestError("prompt must be a string or a list of token ids")

    # -- chat template -----------------------------------------------------------------------------
    @functools.cached_property
    def chat_template(self):
        """The model's ChatTemplate (the file's, else its family's built-in one; `notice` says which). Assign
        another ChatTemplate to chat differently (`edgellm chat` does for a base model)."""
        from edgellm.chat_template import ChatTemplate

        return ChatTemplate.for_model(self.loaded.metadata, self.tokenizer)

    def render_chat(self, messages: list[dict], *, add_generation_prompt: bool = True, **extra) -> str:
        """The prompt text of a conversation ([{"role", "content"}, ...]) in the model's chat template, ready
        for prompt_ids() / submit() (which add the BOS: the template's BOS text is stripped when the tokenizer
        adds one itself). Raises InvalidRequestError on messages the template rejects."""
        return self.chat_template.render_prompt(messages, add_generation_prompt=add_generation_prompt,
                                                tokenizer_adds_bos=self.tokenizer.add_bos, **extra)

    def chat(self, messages: list[dict], params: SamplingParams | None = None, *, tools: list[dict] | None = None,
             tool_choice=None, parallel_tool_calls: bool = True, reasoning_effort=None, **template_kwargs):
        """One assistant turn of a conversation (returns a chat_turn.TurnResult: content, reasoning_content,
        tool_calls, finish_reason, output). tools / tool_choice ("auto", "none", "required" or {"type": "function",
        "function": {"name": ...}}) as in OpenAI's API: required and named calls are constrained so they parse and
        their arguments validate. reasoning_effort ("low" / "medium" / "high" or a token count) bounds the thinking
        of a reasoning model. Raises InvalidRequestError."""
        from edgellm.chat_turn import ChatTurn

        turn = ChatTurn(self, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                        reasoning_effort=reasoning_effort, template_kwargs=template_kwargs)
        out = self.generate(turn.prompt, turn.sampling(params or SamplingParams()))
        result = turn.result(out.text, out.finish_reason)
        result.output = out
        return result

    # -- capacity and health --------------------------------------------------------------------------
    @functools.cached_property
    def capacity(self) -> Capacity:
        """Context, longest request, batch and KV cache sizes."""
        eng = self.engine
        kv_blocks = eng.pool.n_blocks
        return Capacity(ctx_size=self.ctx_size, max_len=min(self.ctx_size, kv_blocks * eng.block_size),
                        max_batch=eng.scheduler.max_batch, token_budget=eng.scheduler.token_budget,
                        block_size=eng.block_size, kv_blocks=kv_blocks)

    @property
    def error(self) -> EngineStoppedError | None:
        """None while the engine serves; else the error every request gets (EngineStoppedError after
        shutdown(), EngineDeadError if the engine thread failed)."""
        return self.loop.error

    def shutdown(self) -> None:
        """Stop the engine thread: requests in flight end with EngineStoppedError, later ones raise it; the prompt
        cache's queued blocks are written."""
        self.loop.shutdown()
        self.engine.close()

    def __enter__(self) -> "LLM":
        """``with LLM(...) as llm:`` shuts the engine down when the block ends (the engine thread otherwise keeps
        the model, its file map included, alive until shutdown() is called)."""
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- generation -----------------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams | None = None, *, priority: int = 0,
               listener: Listener | None = None) -> RequestHandle:
        """Queue one request on the engine thread; returns its handle (pieces / result / cancel).

        `listener(handle, piece)` is called on the engine thread for each text piece and once with None when
        the request has ended; it must be quick (AsyncEvents hands them to an asyncio loop). Raises
        InvalidRequestError / ContextOverflowError for a bad prompt, EngineStoppedError once the engine stopped."""
        return self.loop.submit(self.prompt_ids(prompt), params or SamplingParams(), priority=priority,
                                listener=listener)

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None):
        """Generate for one prompt (returns one RequestOutput) or a list (one continuous batch, outputs in order)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(plist)
        if len(params) != len(plist):
            raise InvalidRequestError("one SamplingParams per prompt, or a single one for all")
        ids = [self.prompt_ids(p) for p in plist]  # validate all before queueing any
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
        async for h, _ in self._aevents(prompt, params):
            pass
        return h.output

    async def astream(self, prompt, params: SamplingParams | None = None):
        """Async iterator over text pieces; cancelling the consumer cancels the request."""
        async for _, piece in self._aevents(prompt, params):
            if piece is not None:
                yield piece

    async def _aevents(self, prompt, params):
        bridge = AsyncEvents()
        h = self.submit(prompt, params, listener=bridge.listener())
        try:
            while True:
                _, h, piece, _ = await bridge.get()
                yield h, piece
                if piece is None:
                    if h.error:
                        raise h.error
                    return
        finally:
            if not h.done.is_set():
                h.cancel()

    # -- direct model use -------------------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> object:
        """Run fn() on the engine thread between its steps and return its result (re-raising its error): direct
        model use then neither races the engine nor launches kernels from a second thread."""
        return self.loop.call(fn)

    @contextmanager
    def scratch(self, n_tokens: int) -> Iterator[Scratch]:
        """KV blocks for one sequence of up to n_tokens positions, for one-off forwards (scoring, perplexity,
        benchmarks, warm-up), given back on exit. Raises ContextOverflowError if they do not fit. Use it inside
        call() once the engine may be running."""
        eng = self.engine
        sc = Scratch(self.model, eng.kv, eng.kv_manager)
        if n_tokens > self.ctx_size or eng.kv_manager.allocate(sc, n_tokens) is None:
            raise ContextOverflowError(f"{n_tokens} tokens do not fit in the context ({self.ctx_size} tokens) or "
                                       f"the free KV cache ({eng.pool.n_free * eng.block_size} tokens); raise "
                                       f"--ctx-size / kv_cache_tokens")
        try:
            yield sc
        finally:
            eng.kv_manager.free(sc, cache=False)

    def embed(self, texts, *, pooling: str | None = None) -> np.ndarray:
        """L2-normalised embeddings (N, d_model) float32 of texts (a string, a list of strings, or token-id lists),
        pooled as the GGUF file says (mean for a plain decoder; see edgellm/embeddings.py), many inputs per
        forward. Raises InvalidRequestError / ContextOverflowError."""
        from edgellm.embeddings import embed_ids

        single = isinstance(texts, str) or (isinstance(texts, list) and texts and isinstance(texts[0], int))
        items = [texts] if single else list(texts)
        return embed_ids(self, [self.prompt_ids(t) for t in items], pooling=pooling)

    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Raw logits (T, n_vocab) of every position of a token sequence evaluated from position 0 (no
        sampling, nothing cached): for scoring and for comparisons with reference implementations."""
        ids = self.prompt_ids(list(token_ids))

        def run():
            with self.scratch(len(ids)) as s:
                return s.forward(ids, 0, all_logits=True)

        return self.call(run)  # on the engine thread, between its steps

    def stats(self) -> dict:
        """Engine metrics: KV blocks total/used/free/cached, evictions, preemptions, queue sizes."""
        return self.engine.stats()


class AsyncEvents:
    """The bridge from the engine thread to an asyncio event loop, for one or more requests: pass
    `listener(tag)` to LLM.submit, then `await get()` -> (tag, handle, piece or None at the end, extra).
    `on_event(handle, piece)`, if given, runs on the engine thread first (counters, a snapshot) and its result
    is `extra`. Create it inside the running event loop."""

    def __init__(self):
        import asyncio

        self._aloop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def listener(self, tag=None, on_event: Callable[[RequestHandle, str | None], object] | None = None) -> Listener:
        """A submit() listener that hands the request's events to this loop, tagged."""

        def fn(h: RequestHandle, piece: str | None) -> None:  # engine thread
            extra = on_event(h, piece) if on_event is not None else None
            self._aloop.call_soon_threadsafe(self._queue.put_nowait, (tag, h, piece, extra))

        return fn

    async def get(self) -> tuple[object, RequestHandle, str | None, object]:
        """The next event of any request listened to."""
        return await self._queue.get()
