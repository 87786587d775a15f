"""Generation: the bridge between one HTTP request and its engine requests.

Each choice of a request is one engine request. Their events reach the event loop through the API's one asyncio
bridge (`edgellm.api.AsyncEvents`), tagged with their choice and the number of output tokens at that moment, so
routes await output without ever blocking on a forward pass. Leaving the iteration early cancels what is left; the KV
blocks go back at the next engine step.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator

from edgellm.api import AsyncEvents


class Choice:
    """One engine request of an HTTP request, and how much of it has been sent."""

    def __init__(self, index: int):
        self.index = index
        self.handle = None
        self.sent = 0  # output tokens already reported (logprobs alignment)
        self.seen = 0  # output tokens seen by the consumer (inter-token latency)
        self.last_t: float | None = None
        self.finish_reason: str | None = None

    @property
    def request(self):
        return self.handle.request


class Generation:
    """Submits every choice of a request to the engine (counted against the server's queue: 429 when full) and
    yields (choice, text piece, output tokens so far, finished) as the engine thread produces them.
    `state` is the server's ServerState (llm, reserve/release, metrics)."""

    def __init__(self, state, prompts: list[list[int]], params: list):
        self.state = state
        self.choices = [Choice(i) for i in range(len(prompts))]
        self._bridge = AsyncEvents()
        self._open = len(prompts)
        state.reserve(len(prompts))
        submitted = 0
        try:
            for c, ids, sp in zip(self.choices, prompts, params):
                c.handle = state.llm.submit(ids, sp, listener=self._bridge.listener(c, self._on_event))
                submitted += 1
        except BaseException:
            state.release(len(prompts) - submitted)
            self.cancel()
            raise

    def _on_event(self, h, piece: str | None) -> int:  # engine thread: the output tokens at this piece
        if piece is None:  # the request is over and its blocks are back in the pool
            self.state.release()
            self.state.metrics.finished(h.request.metrics(), h.request.finish_reason)
        return len(h.request.output_ids)

    async def events(self) -> AsyncIterator[tuple[Choice, str, int, bool]]:
        try:
            while self._open:
                c, h, piece, n = await self._bridge.get()
                finished = piece is None
                if finished:
                    self._open -= 1
                    if h.error is not None:
                        raise h.error
                    c.finish_reason = h.request.finish_reason
                self._observe_itl(c, n)
                yield c, ("" if finished else piece), n, finished
        finally:
            self.cancel()

    def _observe_itl(self, c: Choice, n: int) -> None:
        now = time.perf_counter()
        new = n - c.seen
        if new > 0:
            self.state.metrics.tokens_out(None if c.last_t is None else (now - c.last_t) / new, new)
            c.last_t, c.seen = now, n

    def cancel(self) -> None:
        for c in self.choices:
            if c.handle is not None and not c.handle.done.is_set():
                c.handle.cancel()

    async def collect(self, http_request) -> None:
        """Run to the end (non-streaming); a client that disconnects meanwhile cancels the generation."""

        async def drain():
            async for _ in self.events():
                pass

        task = asyncio.ensure_future(drain())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await http_request.is_disconnected():
                    self.cancel()  # nobody will read the answer
                    task.cancel()
                    await asyncio.wait({task})
                    return
            task.result()
        finally:
            if not task.done():
                task.cancel()
            self.cancel()
