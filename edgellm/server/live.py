"""Rolling engine statistics for the dashboard (/api/dashboard): TTFT and inter-token latencies of the last minute,
token counters, and the engine's state at the moment of the call. The page polls once a second and keeps its own
history for the plots, so nothing here runs on a timer."""
from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

WINDOW_S = 60.0  # latency percentiles cover this many seconds
PERCENTILES = (50, 90, 99)


class LiveStats:
    """Thread-safe: the engine thread and the event loop record, the dashboard route reads."""

    def __init__(self, window_s: float = WINDOW_S):
        self.window = window_s
        self._lock = threading.Lock()
        self._ttft: deque[tuple[float, float]] = deque()  # (time, seconds)
        self._itl: deque[tuple[float, float]] = deque()
        self.prompt_tokens = 0  # cumulative, over finished requests
        self.decode_tokens = 0  # cumulative, as tokens stream out
        self.finished = 0

    def request_done(self, ttft_s: float | None, prompt_tokens: int) -> None:
        with self._lock:
            if ttft_s is not None:
                self._ttft.append((time.monotonic(), ttft_s))
            self.prompt_tokens += prompt_tokens
            self.finished += 1

    def tokens_out(self, gap_s: float | None, n: int) -> None:
        """n tokens streamed; gap_s: seconds per token since the previous piece (None for the first)."""
        with self._lock:
            self.decode_tokens += n
            if gap_s is not None:
                now = time.monotonic()
                self._itl.extend((now, gap_s) for _ in range(n))

    def snapshot(self) -> dict:
        """Percentiles of the last window (milliseconds) and the cumulative counters."""
        cut = time.monotonic() - self.window
        with self._lock:
            for q in (self._ttft, self._itl):
                while q and q[0][0] < cut:
                    q.popleft()
            ttft = [v for _, v in self._ttft]
            itl = [v for _, v in self._itl]
            counts = {"prompt_tokens": self.prompt_tokens, "decode_tokens": self.decode_tokens,
                      "finished": self.finished}
        return {**counts, "ttft_ms": _percentiles(ttft), "itl_ms": _percentiles(itl), "window_s": self.window}


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {f"p{p}": None for p in PERCENTILES} | {"n": 0}
    v = np.percentile(np.asarray(xs) * 1e3, PERCENTILES)
    return {f"p{p}": round(float(x), 2) for p, x in zip(PERCENTILES, v)} | {"n": len(xs)}
