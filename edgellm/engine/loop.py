"""EngineLoop: one background thread drives Engine.step(); any thread (or asyncio task) submits requests
and receives their output through a per-request handle. Kernels release the GIL while they compute."""
from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, Iterator

from edgellm.engine.request import Request, RequestOutput

_DONE = object()


class RequestHandle:
    """The caller's side of one request: a stream of text pieces, then the final output."""

    def __init__(self, loop: "EngineLoop"):
        self._loop = loop
        self.request: Request | None = None
        self.events: queue.Queue = queue.Queue()  # str pieces, then _DONE
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.listeners: list[Callable[[object], None]] = []  # e.g. asyncio bridges

    def _emit(self, ev) -> None:
        self.events.put(ev)
        for fn in self.listeners:
            fn(ev)

    def cancel(self) -> None:
        """Stop the request; its KV blocks go back at the next step."""
        self._loop.cancel(self)

    def pieces(self) -> Iterator[str]:
        """Blocking iterator over text pieces until the request ends (re-raises engine errors)."""
        while True:
            ev = self.events.get()
            if ev is _DONE:
                if self.error:
                    raise self.error
                return
            yield ev

    def result(self, timeout: float | None = None) -> RequestOutput:
        self.done.wait(timeout)
        if self.error:
            raise self.error
        return self.output


class EngineLoop:
    """Owns the engine thread. submit() is thread-safe; the thread sleeps when there is no work."""

    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[RequestHandle, list[int], object, int]] = []
        self._cancel: list[RequestHandle] = []
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._handles: dict[int, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self.step_lock = threading.Lock()  # held around each engine step; hold it to use the model directly
        self.on_step: Callable[[], None] | None = None  # metrics hook (server)

    def submit(self, prompt_ids: list[int], params, *, priority: int = 0, listener=None) -> RequestHandle:
        """Queue a request (validated at once: raises ContextOverflowError etc. in the caller's thread)."""
        h = RequestHandle(self)
        if listener is not None:
            h.listeners.append(listener)
        # validation and per-request set-up (a grammar matcher can take a while) run outside the loop's lock
        h.request = self.engine.add_request(prompt_ids, params, priority=priority, defer=True)
        with self._cv:
            self._inbox.append(h)
            self._ensure_thread()
            self._cv.notify()
        return h

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn() on the engine thread between steps (holding step_lock) and return its result, re-raising
        its exception: direct model use (logits, perplexity) then neither races the engine nor launches
        kernels from a second thread (each thread that launches prange loops keeps its own OpenMP team,
        and two live teams make every launch slow; see edgellm.warmup)."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        with self._cv:
            self._calls.append((fn, fut))
            self._ensure_thread()
            self._cv.notify()
        return fut.result()

    def cancel(self, h: RequestHandle) -> None:
        with self._cv:
            self._cancel.append(h)
            self._cv.notify()

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="edgellm-engine", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not (self._inbox or self._cancel or self._calls or eng.has_work() or self._stop):
                    self._cv.wait()
                calls, self._calls = self._calls, []
                stop = self._stop
                if not stop:
                    for h in self._inbox:
                        self._handles[h.request.id] = h
                        eng.enqueue(h.request)
                    self._inbox.clear()
                    for h in self._cancel:
                        if h.request is not None:
                            h.request.cancel()
                    self._cancel.clear()
            for fn, fut in calls:  # queued before a shutdown too: their callers are waiting
                if fut.set_running_or_notify_cancel():
                    try:
                        with self.step_lock:
                            fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        fut.set_exception(e)
            if stop:
                return
            if not eng.has_work():
                continue
            try:
                with self.step_lock:
                    touched = eng.step()
            except BaseException as e:  # a kernel or model bug: fail the running requests, keep serving
                for rid, h in list(self._handles.items()):
                    h.request.cancel()
                    self._finish(h, error=e)
                eng.step()
                continue
            for req in touched:
                h = self._handles.get(req.id)
                if h is None:
                    continue
                if req.new_text:
                    piece, req.new_text = req.new_text, ""
                    h._emit(piece)
                if req.finished and eng.is_released(req):
                    self._finish(h, error=req.error)
            if self.on_step:
                self.on_step()

    def _finish(self, h: RequestHandle, error: BaseException | None = None) -> None:
        self._handles.pop(h.request.id, None)
        h.output = h.request.output()
        h.error = error
        h.done.set()
        h._emit(_DONE)

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
