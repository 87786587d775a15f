"""Engine: owns the model, the paged KV cache, the block pool and the scheduler; step() moves every
running request forward by one forward pass."""
from __future__ import annotations

from edgellm.engine.block_pool import BlockPool
from edgellm.engine.kv_cache import PagedKVCache
from edgellm.engine.prefix_tree import PrefixTree
from edgellm.engine.request import Request, history_array
from edgellm.engine.runner import ModelRunner
from edgellm.engine.scheduler import Scheduler
from edgellm.engine.swa import slots_needed
from edgellm.errors import ContextOverflowError
from edgellm.sampling import SamplingParams, token_logprobs
from edgellm.structured import MaskWorker

BLOCK_SIZE = 16


class Engine:
    """Continuous-batching engine over one loaded model. Not thread-safe by itself: one thread steps it."""

    def __init__(self, loaded, model, tokenizer, *, ctx_size: int, kv_cache_tokens: int | None = None,
                 max_batch: int = 8, token_budget: int = 512, block_size: int = BLOCK_SIZE, kv_dtype: str = "f32",
                 swa_slots: int | None = None):
        """swa_slots: blocks of K/V kept by sliding-window layers (None: enough for max_batch windows, see
        engine/swa.py; 0: keep every block, like llama.cpp's --swa-full)."""
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
        self.pool = BlockPool(n_blocks)
        self.prefix = PrefixTree(self.pool, block_size)
        if self.kv.windows is not None:  # a cached prefix is only as long as its sliding-window K/V reaches
            self.prefix.usable = self.kv.windows.usable_prefix
        self.prefix.copy = self._copy_block  # copy-on-write of partly reused blocks
        self.scheduler = Scheduler(self.pool, block_size, max_batch=max_batch, token_budget=token_budget,
                                   prefix_cache=self.prefix)
        self.runner = ModelRunner(model, self.kv)
        self.requests: dict[int, Request] = {}
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
        if params.max_tokens == 0:
            req._finish("length")
        if not defer:
            self.enqueue(req)
        return req

    def enqueue(self, req: Request) -> None:
        self.requests[req.id] = req
        self.scheduler.add(req)

    def is_released(self, req: Request) -> bool:
        """True once a finished request's blocks are back in the pool / tree."""
        return req.id not in self.requests

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Request]:
        """Run one forward for the scheduled batch; returns requests that produced output or finished."""
        items = self.scheduler.schedule()
        if not items:
            return self._reap()
        # grammar masks for this step are computed on a worker thread while the forward runs (both drop the GIL)
        masks = self.masks.start([it.request.matcher for it in items if it.request.matcher is not None
                                  and it.request.n_computed + it.n_new == it.request.n_tokens])
        if self.kv.windows is not None:
            self.kv.windows.pin_running(self.scheduler.running)
        logits = self.runner.run(items)
        self.masks.wait(masks)
        touched = []
        for it in items:
            r = it.request
            if r.id in logits and not r.finished:
                try:
                    m = r.matcher
                    tok = r.sampler(logits[r.id] if m is None else m.apply(logits[r.id]), history_array(r))
                    k = r.params.logprobs
                    r.append_token(tok, None if k is None else token_logprobs(logits[r.id], tok, k))
                    if m is not None:
                        m.after_token(r, tok)
                except Exception as e:  # one request's sampling/grammar failure ends that request only
                    r.fail(e)
                touched.append(r)
        return touched + self._reap()

    def _reap(self) -> list[Request]:
        done = [r for r in self.scheduler.running if r.finished]
        done += [r for r in self.scheduler.waiting if r.finished]
        done += [r for r in self.requests.values() if r.finished and r not in done]
        for r in done:
            if r in self.scheduler.running:
                self.scheduler.running.remove(r)
            if r in self.scheduler.waiting:
                self.scheduler.waiting.remove(r)
            self.scheduler.release(r)
            self.requests.pop(r.id, None)
        return done

    def _copy_block(self, src: int, dst: int, n: int, req: Request) -> bool:
        """The prefix tree's copy-on-write (req is being admitted and will continue at req.n_computed + n). A
        trimmed sliding-window layer gives dst a slot whose block no running request, nor req, still attends to."""
        keep = set()
        if self.kv.windows is not None:
            for r in self.scheduler.running:
                keep.update(self.kv.windows.seen(r.block_table, r.n_computed))
            keep.update(self.kv.windows.seen(req.block_table, req.n_computed + n))
        return self.kv.copy_block(src, dst, n, keep)

    def cancel(self, req: Request) -> None:
        req.cancel()

    def stats(self) -> dict:
        return {
            "blocks_total": self.pool.n_blocks,
            "blocks_used": self.pool.n_used,
            "blocks_free": self.pool.n_free,
            "blocks_cached": len(self.pool.cached),
            "evictions": self.pool.evictions,
            "preemptions": self.scheduler.preemptions,
            "prefix_hit_tokens": self.prefix.hit_tokens,
            "prefix_tree_blocks": len(self.prefix),
            "prefix_cow_copies": self.prefix.cow_copies,
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            **(self.kv.windows.stats() if self.kv.windows is not None else {}),
        }
