"""Prometheus metrics for the server: engine gauges read at scrape time, token counters and latency histograms.

Each app has its own CollectorRegistry, so several servers (or tests) in one process do not collide.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from edgellm.server.live import LiveStats

# Latency buckets in seconds: CPU decode steps are ~10 ms to ~1 s; first tokens may wait behind a queue.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0)

SPEC_COUNTERS = {  # Engine.stats() keys of speculative decoding (present when it is on)
    "spec_draft_tokens": "Speculative draft tokens verified.",
    "spec_accepted_tokens": "Speculative draft tokens accepted (each one a token decoded without its own step).",
}
DISK_COUNTERS = {  # KVCacheManager.stats() keys of the prompt cache on disk (present when it is on)
    "disk_hit_blocks": "Prompt KV blocks loaded from the prompt cache on disk.",
    "disk_miss_blocks": "Prompt KV blocks computed although the prompt cache on disk was on.",
    "disk_read_bytes": "Bytes read from the prompt cache on disk.",
    "disk_written_bytes": "Bytes written to the prompt cache on disk.",
    "disk_bad_files": "Prompt cache files ignored as corrupt, truncated or foreign.",
}


class _EngineCollector:
    """Engine state as gauges, read from Engine.stats() when Prometheus scrapes (no polling thread)."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        llm = self.server.llm
        if llm is None:
            return
        s = llm.stats()
        gauges = [
            ("edgellm_requests_running", "Requests in the running batch.", s["running"]),
            ("edgellm_requests_waiting", "Requests waiting for admission (engine queue plus not yet handed over).",
             max(s["waiting"], self.server.n_active - s["running"])),
            ("edgellm_kv_blocks_total", "KV cache blocks in the pool.", s["blocks_total"]),
            ("edgellm_kv_blocks_used", "KV cache blocks referenced by requests.", s["blocks_used"]),
            ("edgellm_kv_blocks_free", "KV cache blocks free (cached prefix blocks included).", s["blocks_free"]),
            ("edgellm_kv_blocks_cached", "Free KV blocks still holding a reusable prefix.", s["blocks_cached"]),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        counters = [
            ("edgellm_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s["prefix_hit_tokens"]),
            ("edgellm_preemptions", "Requests preempted for lack of KV blocks.", s["preemptions"]),
        ] + [(f"edgellm_prompt_cache_{key}", doc, s[key]) for key, doc in DISK_COUNTERS.items() if key in s] + [
            (f"edgellm_{key}", doc, s[key]) for key, doc in SPEC_COUNTERS.items() if key in s]
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], value)
            yield c


class ServerMetrics:
    """The metrics one server exports on /metrics."""

    def __init__(self, server):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("edgellm_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.generation_tokens = Counter("edgellm_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("edgellm_requests", "Finished engine requests by finish reason.",
                                ["finish_reason"], registry=r)
        self.rejected = Counter("edgellm_requests_rejected", "HTTP requests rejected, by status code.",
                                ["status"], registry=r)
        self.ttft = Histogram("edgellm_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("edgellm_inter_token_latency_seconds", "Time between consecutive output tokens.",
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("edgellm_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=TTFT_BUCKETS, registry=r)
        r.register(_EngineCollector(server))
        self.live = LiveStats()  # the last minute, for the dashboard

    def finished(self, metrics: dict, finish_reason: str | None) -> None:
        """Account one finished engine request (Request.metrics())."""
        self.live.request_done(metrics["ttft_s"], metrics["prompt_tokens"])
        self.prompt_tokens.inc(metrics["prompt_tokens"])
        self.generation_tokens.inc(metrics["completion_tokens"])
        self.requests.labels(finish_reason or "unknown").inc()
        if metrics["ttft_s"] is not None:
            self.ttft.observe(metrics["ttft_s"])
        self.e2e.observe(metrics["total_s"])

    def tokens_out(self, gap_s: float | None, n: int) -> None:
        """n tokens streamed out, gap_s seconds apart each since the previous piece (None: the first piece)."""
        if gap_s is not None:
            for _ in range(n):
                self.itl.observe(gap_s)
        self.live.tokens_out(gap_s, n)
