"""RequestHandle: the caller's side of one request (LLM.submit, EngineLoop.submit): a stream of text pieces, then
the final output or error. It is the caller's object, not engine state: the engine thread only feeds it (`offer`,
`end`); any thread reads it (`pieces`, `result`, `done`), or gets a listener call for each event."""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Iterator

log = logging.getLogger("edgellm.engine")
_DONE = object()  # the last event of a handle's queue

# Called on the engine thread with (handle, text piece), then once with (handle, None) when the request has
# ended (handle.done is set, output or error filled in). It must be quick and must not block.
Listener = Callable[["RequestHandle", "str | None"], None]


class RequestHandle:
    """A stream of text pieces, then the final output (a RequestOutput) or error. `request` is the engine's
    Request (read it, never write it); `loop` is whoever can cancel it (an EngineLoop)."""

    def __init__(self, loop, listener: Listener | None = None):
        self._loop = loop
        self._listener = listener
        self.request = None
        self.events: queue.Queue = queue.Queue()  # str pieces, then _DONE
        self.output = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._sent = 0  # characters of the request's text already emitted

    # -- the caller's side ------------------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request; its KV blocks go back at the next step."""
        self._loop.cancel(self)

    def pieces(self) -> Iterator[str]:
        """Blocking iterator over text pieces until the request ends (re-raises engine errors)."""
        while True:
            ev = self.events.get()
            if ev is _DONE:
                self.events.put(_DONE)  # a second iteration ends too
                if self.error:
                    raise self.error
                return
            yield ev

    def result(self, timeout: float | None = None):
        """The final RequestOutput; raises the request's error, or TimeoutError if it is still running after
        timeout seconds (the request goes on: cancel() it if it is no longer wanted)."""
        if not self.done.wait(timeout):
            raise TimeoutError(f"request still running after {timeout} s")
        if self.error:
            raise self.error
        return self.output

    # -- the engine thread's side -----------------------------------------------------------------------
    def offer(self, text: str) -> None:
        """The request's whole text so far: the part not sent yet becomes the next piece."""
        if len(text) > self._sent:
            piece, self._sent = text[self._sent:], len(text)
            self._emit(piece)

    def end(self, output, error: BaseException | None = None) -> None:
        """The request ended with `output` (and `error`, if it failed): wakes every reader."""
        self.output, self.error = output, error
        self.done.set()
        self._emit(_DONE)

    def _emit(self, ev) -> None:
        self.events.put(ev)
        if self._listener is not None:
            try:
                self._listener(self, None if ev is _DONE else ev)
            except Exception:  # a listener's bug must not stop the engine thread (an asyncio loop that closed)
                log.exception("request listener failed")
