"""Scheduler: admission by free KV blocks, chunked prefill at fixed positions, continuous batching of
decodes, preemption (recompute) when blocks run out: lowest priority first, then newest."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from edgellm.engine.block_pool import BlockPool
from edgellm.engine.request import Request, RequestState


OUTPUT_ESTIMATE = 64  # generated tokens budgeted at admission when other requests are running


@dataclass
class ScheduledItem:
    request: Request
    n_new: int  # tokens to run this step, starting at request.n_computed


class Scheduler:
    """Decides, each step, which requests run and how many tokens each contributes."""

    def __init__(self, pool: BlockPool, block_size: int, *, max_batch: int = 8, token_budget: int = 512,
                 prefill_chunk: int = 256, prefix_cache=None):
        self.pool, self.bs = pool, block_size
        # a chunk never exceeds the step budget, or a prompt could never start
        self.max_batch, self.token_budget, self.chunk = max_batch, token_budget, min(prefill_chunk, token_budget)
        self.prefix = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0
        self.output_estimate = OUTPUT_ESTIMATE

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, req: Request, upto: int) -> int:
        return max(0, -(-upto // self.bs) - len(req.block_table))

    def _grow(self, req: Request, upto: int) -> bool:
        """Make req's block table cover positions < upto; False if the pool is short."""
        n = self._blocks_needed(req, upto)
        if n == 0:
            return True
        got = self.pool.allocate(n)
        if got is None:
            return False
        req.block_table.extend(got)
        return True

    def release(self, req: Request) -> None:
        """Give a request's blocks back (full prompt/output blocks stay in the prefix tree if any)."""
        if self.prefix is not None and req.block_table:
            self.prefix.release(req)
        elif req.block_table:
            self.pool.free(req.block_table)
        req.block_table = []

    def _preempt_one(self, protect: Request) -> bool:
        victims = [r for r in self.running if r is not protect]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (r.priority, -r.t_arrival))
        self.running.remove(victim)
        self.release(victim)
        victim.n_computed = 0
        victim.n_cached = 0
        victim.state = RequestState.WAITING
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return True

    def _admission_tokens(self, req: Request) -> int:
        if not self.running:
            return req.n_tokens + 1
        left = max(1, req.params.max_tokens - len(req.output_ids))
        return min(req.max_len, req.n_tokens + min(left, self.output_estimate))

    def _next_end(self, req: Request, budget: int) -> int:
        """End position of req's work this step. Tokens past the prompt (generated ones, also when
        recomputed after a preemption) run one per step through the decode path, exactly as they first
        ran, so preemption does not change results; prompt tokens run in fixed chunks."""
        if req.n_computed >= len(req.prompt_ids):
            return req.n_computed + 1
        return self._chunk_end(req, budget)

    def _chunk_end(self, req: Request, budget: int) -> int:
        """End position of the next prefill chunk: fixed multiples of `chunk` (batch-invariant splits)."""
        total = len(req.prompt_ids)
        end = min(total, (req.n_computed // self.chunk + 1) * self.chunk)
        if end - req.n_computed > budget:
            return req.n_computed  # wait for a step with room: never split at a budget-dependent place
        return end

    def schedule(self) -> list[ScheduledItem]:
        """Pick this step's work. Decodes first (1 token each), then prefill chunks, then admissions."""
        self.running = [r for r in self.running if not r.finished]
        items: list[ScheduledItem] = []
        budget = self.token_budget
        for req in sorted(self.running, key=lambda r: (-r.priority, r.t_arrival)):
            if req not in self.running:
                continue  # preempted below
            end = self._next_end(req, budget)
            if end <= req.n_computed:
                continue
            while not self._grow(req, end):
                if not self._preempt_one(req):
                    break
            if self._blocks_needed(req, end):
                continue
            items.append(ScheduledItem(req, end - req.n_computed))
            budget -= end - req.n_computed
        items = [it for it in items if it.request in self.running]
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            req = self.waiting[0]
            if req.finished:
                self.waiting.popleft()
                continue
            if self.prefix is not None and not req.block_table:
                self.prefix.admit(req)  # reuse the longest cached prefix
            end = self._next_end(req, budget)
            # admission: the whole prompt must fit now, plus room for an estimate of its output while others
            # run (fewer preemptions); alone, a request needs room for one more token only
            if self._blocks_needed(req, self._admission_tokens(req)) > self.pool.n_free or end <= req.n_computed:
                self.release(req)  # do not pin cached prefix blocks while waiting
                req.n_computed = req.n_cached = 0
                break
            self._grow(req, end)
            self.waiting.popleft()
            req.state = RequestState.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, end - req.n_computed))
            budget -= end - req.n_computed
        items.sort(key=lambda it: not self.is_decode(it))  # decode rows first: they take the GEMV path
        return items

    def is_decode(self, it: ScheduledItem) -> bool:
        return it.request.n_computed >= len(it.request.prompt_ids)
