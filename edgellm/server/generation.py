"""Generation: the bridge between one HTTP request and its engine requests.

Each choice of a request is one engine request. The engine thread calls a listener per text piece and once at the
end; the listener hands (choice, piece, tokens so far) to the event loop with `call_soon_threadsafe`, so routes
await output without ever blocking on a forward pass. Leaving the iteration early cancels what is left; the KV
blocks go back at the next engine step.
"""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator


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
        self._queue: asyncio.Queue = asyncio.Queue()
        self._open = len(prompts)
        state.reserve(len(prompts))
        aloop = asyncio.get_running_loop()
        submitted = 0
        try:
            for c, ids, sp in zip(self.choices, prompts, params):
                c.handle = state.llm.loop.submit(ids, sp, listener=self._listener(c, aloop))
                submitted += 1
        except BaseException:
            state.release(len(prompts) - submitted)
            self.cancel()
            raise

    def _listener(self, c: Choice, aloop):
        state = self.state

        def on_event(ev) -> None:  # engine thread
            h = c.handle
            n = len(h.request.output_ids) if h is not None else None
            if not isinstance(ev, str):  # the request is over and its blocks are back in the pool
                state.release()
                if h is not None:
                    state.metrics.finished(h.request.metrics(), h.request.finish_reason)
            aloop.call_soon_threadsafe(self._queue.put_nowait, (c, ev, n))

        return on_event

    async def events(self) -> AsyncIterator[tuple[Choice, str, int, bool]]:
        try:
            while self._open:
                c, ev, n = await self._queue.get()
                h = c.handle
                if n is None:
                    n = len(h.request.output_ids)
                finished = not isinstance(ev, str)
                if finished:
                    self._open -= 1
                    if h.error is not None:
                        raise h.error
                    c.finish_reason = h.request.finish_reason
                    n = len(h.request.output_ids)
                self._observe_itl(c, n)
                yield c, ("" if finished else ev), n, finished
        finally:
            self.cancel()

    def _observe_itl(self, c: Choice, n: int) -> None:
        now = time.perf_counter()
        new = n - c.seen
        if new > 0:
            if c.last_t is not None:
                for _ in range(new):
                    self.state.metrics.itl.observe((now - c.last_t) / new)
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
