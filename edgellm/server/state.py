"""What the server's routes share: the LLM (loading in the background), admission counts, metrics, and the map from
named errors to HTTP statuses."""
from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from edgellm import errors
from edgellm.errors import ContextOverflowError, EdgeLLMError, EngineStoppedError
from edgellm.server import protocol as P
from edgellm.server.metrics import ServerMetrics

log = logging.getLogger("edgellm.server")
ERROR_RESPONSES = {code: {"model": P.ErrorResponse} for code in (400, 401, 404, 429, 503)}

# A named error -> (HTTP status, OpenAI error type, code); the nearest class in its MRO decides.
ERROR_STATUS: dict[type, tuple[int, str, str | None]] = {
    EdgeLLMError: (400, "invalid_request_error", None),
    ContextOverflowError: (400, "invalid_request_error", "context_length_exceeded"),
    EngineStoppedError: (503, "service_unavailable", "engine_unavailable"),
}
ERROR_STATUS[errors.EngineStepError] = (500, "server_error", "engine_step_failed")  # a failed engine step


def error_status(e: BaseException) -> tuple[int, str, str | None]:
    """(status, type, code) of an error raised to a route (anything unnamed is a 500 server_error)."""
    return next((ERROR_STATUS[c] for c in type(e).__mro__ if c in ERROR_STATUS), (500, "server_error", None))


class ServerState:
    """What the routes share: the LLM (None while it loads), limits from its capacity, counters, metrics."""

    def __init__(self, llm=None, *, model: str | None = None, llm_kwargs: dict | None = None,
                 api_key: str | None = None, max_queue: int = 64, model_id: str | None = None):
        self.llm = None
        self.model_path, self.llm_kwargs = model, dict(llm_kwargs or {})
        self.api_key, self.max_queue, self.model_id = api_key, max_queue, model_id
        self.owns_llm = llm is None
        self.load_error: BaseException | None = None
        self.n_active = 0  # engine requests submitted and not yet released
        self._lock = threading.Lock()
        self.metrics = ServerMetrics(self)
        self.aliases: set[str] = set()
        if llm is not None:
            self._ready(llm)

    def load(self) -> None:
        """Load the model (run in a thread: /health answers 503 meanwhile)."""
        try:
            from edgellm.api import LLM

            self._ready(LLM(self.model_path, **self.llm_kwargs))
            log.info("model %s ready", self.model_id)
        except BaseException as e:  # reported by /health and every route
            self.load_error = e
            log.error("loading the model failed: %s", e)

    def _ready(self, llm) -> None:
        self.model_id = self.model_id or Path(llm.loaded.path).stem
        self.aliases = {self.model_id, llm.loaded.path, str(llm.loaded.metadata.get("general.name", self.model_id))}
        cap = llm.capacity
        self.max_len = cap.max_len
        self.capacity = cap.max_batch + self.max_queue
        self.created = int(time.time())
        self.llm = llm  # last: this is the readiness flag

    def unavailable(self) -> str | None:
        """Why the routes cannot serve (loading, failed to load, engine stopped or dead), or None."""
        if self.llm is None:
            return f"model failed to load: {self.load_error}" if self.load_error else "model is loading"
        err = self.llm.error
        return None if err is None else str(err)

    # -- admission --------------------------------------------------------------------------------------------
    def reserve(self, k: int) -> None:
        """Count k new engine requests in, or raise 429 if the queue is full."""
        if k > self.capacity:
            raise P.APIError(400, f"request asks for {k} sequences; this server runs at most {self.capacity} at once",
                             param="n")
        with self._lock:
            if self.n_active + k > self.capacity:
                self.metrics.rejected.labels("429").inc()
                raise P.APIError(429, f"the server is busy ({self.n_active} requests in flight, queue of "
                                      f"{self.max_queue} full); retry later", type="rate_limit_error",
                                 code="rate_limit_exceeded", headers={"Retry-After": "1"})
            self.n_active += k

    def release(self, k: int = 1) -> None:
        with self._lock:
            self.n_active -= k


