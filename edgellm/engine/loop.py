"""EngineLoop: one background thread drives Engine.step(); any thread (or asyncio task) submits requests
and receives their output through a per-request handle. Kernels release the GIL while they compute.

Every handle ends: with the request's output, with its own error, with EngineStoppedError after shutdown(), or
with EngineDeadError when an exception escapes Engine.step() (the engine contains a failed forward itself, so
one that escapes is an engine bug: the loop stops serving rather than run on in an unknown state)."""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Callable

from edgellm.engine.request import Request
from edgellm.errors import EngineDeadError, EngineStoppedError
from edgellm.handle import Listener, RequestHandle

log = logging.getLogger("edgellm.engine")


class EngineLoop:
    """Owns the engine thread. submit() is thread-safe; the thread sleeps when there is no work."""

    def __init__(self, engine):
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[RequestHandle] = []
        self._cancel: list[RequestHandle] = []
        self._calls: list[tuple[Callable[[], object], Future]] = []
        self._handles: dict[int, RequestHandle] = {}
        self._thread: threading.Thread | None = None
        self._stop = False
        self._error: EngineStoppedError | None = None  # set once the loop no longer serves
        self.step_lock = threading.Lock()  # held around each engine step; hold it to use the model directly
        self.on_step: Callable[[], None] | None = None  # metrics hook (server)

    @property
    def error(self) -> EngineStoppedError | None:
        """None while the loop serves; else what callers get: EngineStoppedError or EngineDeadError."""
        with self._cv:
            return self._error

    def _check(self) -> None:  # with self._cv held
        if self._error is not None:
            raise self._error

    def submit(self, prompt_ids: list[int], params, *, priority: int = 0,
               listener: Listener | None = None) -> RequestHandle:
        """Queue a request (validated at once: raises ContextOverflowError etc. in the caller's thread, and
        EngineStoppedError / EngineDeadError once the loop no longer serves)."""
        with self._cv:
            self._check()
        h = RequestHandle(self, listener)
        # validation and per-request set-up (a grammar matcher can take a while) run outside the loop's lock
        h.request = self.engine.add_request(prompt_ids, params, priority=priority, defer=True)
        with self._cv:
            self._check()  # shut down meanwhile
            self._inbox.append(h)
            self._ensure_thread()
            self._cv.notify()
        return h

    def call(self, fn: Callable[[], object]) -> object:
        """Run fn() on the engine thread between steps (holding step_lock) and return its result, re-raising
        its exception: direct model use (logits, perplexity) then neither races the engine nor launches
        kernels from a second thread (each thread that launches prange loops keeps its own OpenMP team,
        and two live teams make every launch slow; see edgellm.warmup). After shutdown() it runs fn in the
        caller's thread; a dead engine raises EngineDeadError."""
        if threading.current_thread() is self._thread:
            return fn()
        fut: Future = Future()
        with self._cv:
            if isinstance(self._error, EngineDeadError):
                raise self._error
            if self._error is None:
                self._calls.append((fn, fut))
                self._ensure_thread()
                self._cv.notify()
        if self._error is not None:  # shut down: no engine thread runs kernels any more
            with self.step_lock:
                return fn()
        return fut.result()

    def cancel(self, h: RequestHandle) -> None:
        """Ask the engine thread to cancel h's request (no effect once it has ended)."""
        with self._cv:
            self._cancel.append(h)
            self._cv.notify()

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop the engine thread: every request in flight ends with EngineStoppedError, later submits raise it.
        Waits up to timeout seconds for the current step to finish."""
        with self._cv:
            if self._error is None:
                self._error = EngineStoppedError("the engine was shut down")
            self._stop = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _ensure_thread(self) -> None:  # with self._cv held
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="edgellm-engine", daemon=True)
            self._thread.start()

    # -- the engine thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # an engine bug: fail every caller instead of leaving them waiting
            self._die(e)
            if not isinstance(e, Exception):  # KeyboardInterrupt / SystemExit are not swallowed
                raise

    def _serve(self) -> None:
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
                        eng.cancel(h.request)
                    self._cancel.clear()
            self._run_calls(calls)
            if stop:
                self._end_all(self._error)
                return
            if not eng.has_work():
                continue
            with self.step_lock:
                touched = eng.step()
            self._deliver(touched)
            if self.on_step:
                try:
                    self.on_step()
                except Exception:  # metrics must not stop the engine
                    log.exception("on_step hook failed")

    def _run_calls(self, calls) -> None:
        for fn, fut in calls:  # queued before a shutdown too: their callers are waiting
            if fut.set_running_or_notify_cancel():
                try:
                    with self.step_lock:
                        fut.set_result(fn())
                except BaseException as e:  # handed to the caller, who re-raises it
                    fut.set_exception(e)

    def _deliver(self, touched: list[Request]) -> None:
        for req in touched:
            h = self._handles.get(req.id)
            if h is not None:
                h.offer(req.text)
                if req.finished:  # the scheduler ends a request and gives its blocks back together
                    self._finish(h, error=req.error)

    def _take_all(self) -> list[RequestHandle]:
        with self._cv:
            hs = list(self._handles.values()) + self._inbox
            self._handles, self._inbox = {}, []
        return hs

    def _end_all(self, error: BaseException) -> None:
        """Shutdown: cancel and end every request in flight with `error`."""
        for h in self._take_all():
            self.engine.cancel(h.request)
            self._finish(h, error=error)

    def _die(self, e: BaseException) -> None:
        err = EngineDeadError(f"the engine failed and stopped serving: {type(e).__name__}: {e}")
        err.__cause__ = e
        log.error("engine thread died", exc_info=e)
        with self._cv:
            self._error, self._stop = err, True
            calls, self._calls = self._calls, []
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        for h in self._take_all():
            self._finish(h, error=err)

    def _finish(self, h: RequestHandle, error: BaseException | None = None) -> None:
        self._handles.pop(h.request.id, None)
        h.end(h.request.output(), error)
