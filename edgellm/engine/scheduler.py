"""Scheduler: admission by free KV blocks, chunked prefill at fixed positions, continuous batching of
decodes, preemption (recompute) when blocks run out: lowest priority first, then newest.

The scheduler is the only writer of request state. It asks the KV cache manager (`lookup`, `allocate`,
`free`) and decides whom to admit or preempt from the answers; the engine hands it each step's results
(`update_from_output`, or `fail_step` when the step's forward raised) and it applies them in one place.
Requests it ended are collected with `take_finished`.

Speculative decoding (engine/speculative.py): a decode item may carry draft tokens, scored as extra rows of the
step and budgeted with it; the step returns the accepted run plus one token, applied token by token (a stop,
EOS or limit inside the run ends it there), and the rejected rows' blocks are rolled back (KVCacheManager.trim)."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edgellm.engine.kv_cache_manager import KVCacheManager
from edgellm.engine.request import Request, RequestState

OUTPUT_ESTIMATE = 64  # generated tokens budgeted at admission when other requests are running


@dataclass
class ScheduledItem:
    request: Request
    n_new: int  # tokens to run this step, starting at request.n_computed
    draft: list[int] = field(default_factory=list)  # proposed tokens after the last one, verified this step


class Scheduler:
    """Decides, each step, which requests run and how many tokens each contributes."""

    def __init__(self, kv: KVCacheManager, *, max_batch: int = 8, token_budget: int = 512,
                 prefill_chunk: int = 256, speculator=None):
        """speculator: an engine/speculative.Speculator (None: no drafting)."""
        self.kv, self.speculator = kv, speculator
        # a chunk never exceeds the step budget, or a prompt could never start
        self.max_batch, self.token_budget, self.chunk = max_batch, token_budget, min(prefill_chunk, token_budget)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished: list[Request] = []  # ended since the last take_finished()
        self.preemptions = 0
        self.output_estimate = OUTPUT_ESTIMATE

    def add(self, req: Request) -> None:
        """Queue a request (one asking for no tokens ends at once)."""
        if req.params.max_tokens == 0:
            return self._end(req, "length")
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def take_finished(self) -> list[Request]:
        """Requests ended (finished, cancelled, failed) since the last call; their KV blocks are back."""
        out, self._finished = self._finished, []
        return out

    # -- scheduling -----------------------------------------------------------------------------------
    def schedule(self) -> list[ScheduledItem]:
        """Pick this step's work. Decodes first (1 token each), then prefill chunks, then admissions."""
        for req in [r for r in (*self.running, *self.waiting) if r.cancel_requested]:
            self._end(req, "cancelled")
        items: list[ScheduledItem] = []
        budget = self.token_budget
        for req in sorted(self.running, key=lambda r: (-r.priority, r.t_arrival)):
            if req not in self.running:
                continue  # preempted below
            end = self._next_end(req, budget, req.n_computed)
            if end <= req.n_computed:
                continue
            draft = self._draft(req, end)
            while self.kv.allocate(req, end - req.n_computed + len(draft)) is None:
                if draft:
                    draft = []  # drafts never preempt anyone
                elif not self._preempt_one(req):
                    break
            else:
                items.append(ScheduledItem(req, end - req.n_computed, draft))
                budget -= end - req.n_computed + len(draft)
        items = [it for it in items if it.request in self.running]
        while self.waiting and len(self.running) < self.max_batch and budget > 0:
            req = self.waiting[0]
            hit = self.kv.lookup(req)  # the longest cached prefix; nothing taken yet
            end = self._next_end(req, budget, hit.tokens)
            # admission: the whole prompt must fit now, plus room for an estimate of its output while others
            # run (fewer preemptions); alone, a request needs room for one more token only
            if end <= hit.tokens or self.kv.allocate(req, end - hit.tokens, hit=hit,
                                                     lookahead=self._admission_tokens(req) - end) is None:
                break
            self.waiting.popleft()
            req.n_computed = req.n_cached = hit.tokens
            req.state = RequestState.RUNNING
            self.running.append(req)
            items.append(ScheduledItem(req, end - req.n_computed))
            budget -= end - req.n_computed
        # decode rows first: they take the GEMV path
        items.sort(key=lambda it: it.request.n_computed < len(it.request.prompt_ids))
        return items

    # -- applying a step's results --------------------------------------------------------------------
    def update_from_output(self, items: list[ScheduledItem], sampled: dict) -> None:
        """The step ran: advance every item's computed tokens, append the sampled tokens (sampled: request id
        -> (token, logprob entry or None), or the exception its sampling raised), end requests that finished
        (grammar, stop strings, limits) or whose sampling failed."""
        for it in items:
            r = it.request
            r.n_computed += it.n_new
            if r.id not in sampled:
                continue
            try:
                if isinstance(sampled[r.id], BaseException):
                    raise sampled[r.id]
                self._append_run(r, it.draft, sampled[r.id])
            except Exception as e:  # one request's sampling/grammar failure ends that request only
                r.fail(e)
            if r.finished:
                self._end(r, r.finish_reason, error=r.error)
            elif it.draft:
                self.kv.trim(r, r.n_tokens)  # rejected draft rows: their blocks go back

    def _append_run(self, r: Request, draft: list[int], run: list) -> None:
        """Append a step's tokens [(token, logprob entry)] (the accepted draft prefix, then one more) until one
        ends the request; the accepted draft tokens that were appended count as computed (their rows ran)."""
        accepted = len(run) - 1
        n_out = len(r.output_ids)
        for tok, logprob in run:
            r.append_token(tok, logprob)
            if r.matcher is not None and not r.finished and r.matcher.accept(tok):
                r.finish("stop")  # the grammar is complete (or rejected the token)
            if r.finished:
                break
        if draft:
            r.n_computed += min(accepted, len(r.output_ids) - n_out)
            r.n_drafted += len(draft)
            r.n_accepted += accepted
            self.speculator.record(r, len(draft), accepted)

    def fail_step(self, items: list[ScheduledItem], error: BaseException) -> None:
        """The step's forward raised: its requests end with `error`, their unverified K/V not cached."""
        for it in items:
            self._end(it.request, "error", error=error, cache=False)

    # -- helpers --------------------------------------------------------------------------------------
    def _end(self, req: Request, reason: str, *, error: BaseException | None = None, cache: bool = True) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req, cache=cache)
        if self.speculator is not None:
            self.speculator.release(req)
        if error is not None:
            req.fail(error)
        elif not req.finished:
            req.finish(reason)
        self._finished.append(req)

    def _preempt_one(self, protect: Request) -> bool:
        victims = [r for r in self.running if r is not protect]
        if not victims:
            return False
        victim = min(victims, key=lambda r: (r.priority, -r.t_arrival))
        self.running.remove(victim)
        self.kv.free(victim)
        victim.n_computed = victim.n_cached = 0
        victim.state = RequestState.WAITING
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return True

    def _draft(self, req: Request, end: int) -> list[int]:
        """Draft tokens for req's item when it reaches the request's last token (none for a chunk that stops short
        of it, e.g. while recomputing generated tokens after a preemption, or for grammar-constrained requests),
        as many as its max_tokens and context leave room for. The step budget is not consulted: decode rows come
        first and max_batch * (1 + max_k) rows stay below it, so a request's drafts never depend on the batch."""
        if self.speculator is None or end != req.n_tokens or req.matcher is not None:
            return []
        room = min(req.params.max_tokens - len(req.output_ids), req.max_len - req.n_tokens) - 1
        return self.speculator.propose(req, room) if room > 0 else []

    def _admission_tokens(self, req: Request) -> int:
        if not self.running:
            return req.n_tokens + 1
        left = max(1, req.params.max_tokens - len(req.output_ids))
        return min(req.max_len, req.n_tokens + min(left, self.output_estimate))

    def _next_end(self, req: Request, budget: int, start: int) -> int:
        """End position of req's work this step, from `start` computed tokens. A request caught up with its
        tokens runs the next one; known tokens (the prompt, and after a preemption the generated ones too) run
        in fixed chunks (multiples of `chunk`), and only when the whole chunk fits the budget. A row's result
        does not depend on how its tokens were cut into steps (kernels_cpu: per-row arithmetic whatever the
        rows of a call), so a preempted request recomputes its answer in chunks and still gets the same
        tokens."""
        total = req.n_tokens
        if start >= total - 1:
            return start + 1
        end = min(total, (start // self.chunk + 1) * self.chunk)
        return start if end - start > budget else end
