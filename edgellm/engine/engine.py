"""Engine: owns the model, the paged KV cache, the KV cache manager and the scheduler; step() moves every
running request forward by one forward pass. A step whose forward raises fails only that step's requests
(EngineStepError); step() itself does not raise for it."""
from __future__ import annotations

import numpy as np

from edgellm.engine.kv_cache import PagedKVCache
from edgellm.engine.kv_cache_manager import KVCacheManager
from edgellm.engine.prompt_cache import PROMPT_CACHE_GB, open_prompt_cache
from edgellm.engine.request import Request
from edgellm.engine.runner import ModelRunner
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.speculative import Speculator, parse_speculative
from edgellm.engine.swa import slots_needed
from edgellm.errors import ContextOverflowError, EngineStepError
from edgellm.sampling import SamplingParams, token_logprobs
from edgellm.structured import MaskWorker

BLOCK_SIZE = 16


class Engine:
    """Continuous-batching engine over one loaded model. Not thread-safe by itself: one thread steps it."""

    def __init__(self, loaded, model, tokenizer, *, ctx_size: int, kv_cache_tokens: int | None = None,
                 max_batch: int = 8, token_budget: int = 512, block_size: int = BLOCK_SIZE, kv_dtype: str = "f32",
                 swa_slots: int | None = None, prompt_cache=None, prompt_cache_gb: float | None = None,
                 speculative=None):
        """swa_slots: blocks of K/V kept by sliding-window layers (None: enough for max_batch windows, see
        engine/swa.py; 0: keep every block, like llama.cpp's --swa-full). prompt_cache: a directory where full
        prompt blocks are kept across restarts (engine/prompt_cache.py), at most prompt_cache_gb GB (None: 1).
        speculative: "ngram", a dict {"draft_model": PATH, "k": 4}, or None / "off" (the default): see
        engine/speculative.py."""
        self.loaded, self.model = loaded, model
        self._tokenizer = tokenizer  # a Tokenizer, or a zero-argument function building it on first use
        self.ctx_size = ctx_size
        kv_tokens = kv_cache_tokens or ctx_size
        n_blocks = -(-kv_tokens // block_size)
        self.block_size = block_size
        cfg = loaded.config
        if swa_slots is None and cfg.sliding_window:
            swa_slots = slots_needed(max_batch, cfg.sliding_window, block_size, token_budget)
        swa = swa_slots or None
        self.kv = PagedKVCache(cfg, n_blocks, block_size, kv_dtype=kv_dtype, swa_slots=swa)
        self.prompt_cache = None if prompt_cache is None else open_prompt_cache(
            prompt_cache, loaded, self.kv, max_bytes=int((prompt_cache_gb or PROMPT_CACHE_GB) * 1e9))
        self.kv_manager = KVCacheManager(n_blocks, block_size, self.kv, disk=self.prompt_cache)
        self.pool, self.prefix = self.kv_manager.pool, self.kv_manager.prefix  # read-only views (stats, tests)
        self.speculator = Speculator.create(parse_speculative(speculative), self)
        self.scheduler = Scheduler(self.kv_manager, max_batch=max_batch, token_budget=token_budget,
                                   speculator=self.speculator)
        self.runner = ModelRunner(model, self.kv, self.kv_manager)
        self.masks = MaskWorker()

    @property
    def tokenizer(self):
        if callable(self._tokenizer) and not hasattr(self._tokenizer, "encode"):
            self._tokenizer = self._tokenizer()
        return self._tokenizer

    def add_request(self, prompt_ids: list[int], params: SamplingParams, *, priority: int = 0,
                    defer: bool = False) -> Request:
        """Validate and queue a request (defer=True: the caller enqueues it later, from the engine thread);
        raises ContextOverflowError if it can never fit."""
        n = len(prompt_ids)
        if n == 0:
            raise ContextOverflowError("empty prompt: nothing to condition on (add BOS or text)")
        if n >= self.ctx_size:
            raise ContextOverflowError(f"prompt has {n} tokens but the context holds {self.ctx_size} "
                                       f"(including at least one generated token); use a larger --ctx-size or a shorter prompt")
        if -(-(n + 1) // self.block_size) > self.pool.n_blocks:
            raise ContextOverflowError(f"prompt of {n} tokens does not fit in the KV cache "
                                       f"({self.pool.n_blocks * self.block_size} tokens)")
        req = Request(prompt_ids, params, self.tokenizer, max_len=min(self.ctx_size, self.pool.n_blocks * self.block_size),
                      priority=priority)
        if params.compiled_grammar is not None:  # constrained decoding: one grammar matcher per request
            from edgellm.structured import make_matcher

            req.matcher = make_matcher(params.compiled_grammar, self.tokenizer)
        if not defer:
            self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        """Queue a request made by add_request(..., defer=True)."""
        self.scheduler.add(req)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one forward for the scheduled batch; returns requests that produced output or ended."""
        items = self.scheduler.schedule()
        if not items:
            return self._reap([])
        # grammar masks for this step are computed on a worker thread while the forward runs (both drop the GIL)
        masks = self.masks.start([it.request.matcher for it in items if it.request.matcher is not None
                                  and it.request.n_computed + it.n_new == it.request.n_tokens])
        try:
            logits = self.runner.run(items)
            self.masks.wait(masks)
        except Exception as e:  # a kernel or model failure: this step's requests fail, the others go on
            err = EngineStepError(f"engine step failed: {type(e).__name__}: {e}")
            err.__cause__ = e
            self.scheduler.fail_step(items, err)
            return self._reap([])
        sampled = {it.request.id: self._sample(it.request, logits[it.request.id], it.draft) for it in items
                   if it.request.id in logits}
        self.scheduler.update_from_output(items, sampled)
        return self._reap([it.request for it in items if it.request.id in sampled])

    @staticmethod
    def _sample(r: Request, logits, draft: list[int]):
        """[(token, logprob entry)] of r from its logits (1 + len(draft), V): one token, grammar mask applied, or
        the accepted draft prefix and one more (Sampler.verify); an error is returned, not raised."""
        try:
            m, k = r.matcher, r.params.logprobs
            history = np.asarray(r.all_ids, dtype=np.int64)
            if draft:
                toks = r.sampler.verify(logits, history, draft)
            else:
                toks = [r.sampler(logits[0] if m is None else m.apply(logits[0]), history)]
            return [(t, None if k is None else token_logprobs(logits[i], t, k)) for i, t in enumerate(toks)]
        except Exception as e:
            return e

    def _reap(self, touched: list[Request]) -> list[Request]:
        """touched, then the requests that ended this step without output (their blocks are back)."""
        return touched + [r for r in self.scheduler.take_finished() if r not in touched]

    def cancel(self, req: Request) -> None:
        """End req at the next step (its blocks go back then)."""
        req.cancel()

    def close(self) -> None:
        """Write the prompt cache's queued blocks to disk and stop its writer (call once no step runs)."""
        if self.prompt_cache is not None:
            self.prompt_cache.close()
        if self.speculator is not None:
            self.speculator.close()

    def stats(self) -> dict:
        return {**self.kv_manager.stats(), **(self.speculator.stats() if self.speculator else {}),
                "preemptions": self.scheduler.preemptions,
                "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting)}
