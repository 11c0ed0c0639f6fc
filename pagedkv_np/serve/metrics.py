"""The server's Prometheus metrics, in a registry of its own.

Two kinds of figures:

- events, counted where they happen: HTTP requests by route and status,
  finished requests by reason, prompt and generated tokens, time to first
  token and inter-token latency (histograms, observed by the engine thread);
- engine state (queue length, running batch, pages, prefix hits,
  preemptions), read at scrape time from the last snapshot the engine thread
  published, so that a scrape never touches the engine itself.

Every name starts with ``pagedkv_``.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Iterator

try:
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client import CONTENT_TYPE_LATEST
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "pagedkv_np.serve needs prometheus-client: pip install 'pagedkv-np[serve]'") from exc

__all__ = ["ServerMetrics", "CONTENT_TYPE"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# a cached prompt answers in milliseconds, a long uncached one in seconds
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5,
                 5.0, 10.0, 20.0, 40.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15,
                0.25, 0.5, 1.0, 2.5)

# snapshot key -> (metric name, kind, help)
_ENGINE_FIGURES = (
    ("num_queued", "pagedkv_queue_length", "gauge",
     "Requests accepted and waiting for their first token"),
    ("num_running", "pagedkv_running_requests", "gauge", "Requests in the running batch"),
    ("pages_used", "pagedkv_pages_used", "gauge", "K/V pages held by requests"),
    ("pages_free", "pagedkv_pages_free", "gauge", "K/V pages never used or freed"),
    ("pages_evictable", "pagedkv_pages_evictable", "gauge",
     "K/V pages holding a cached prefix, reusable and evictable"),
    ("num_pages", "pagedkv_pages", "gauge", "K/V pages in the pool"),
    ("prefix_hit_rate", "pagedkv_prefix_hit_rate", "gauge",
     "Prompt tokens served from the prefix cache / prompt tokens admitted"),
    ("prefix_hit_tokens", "pagedkv_prefix_hit_tokens", "counter",
     "Prompt tokens served from the prefix cache"),
    ("prefix_query_tokens", "pagedkv_prefix_query_tokens", "counter",
     "Prompt tokens admitted (looked up in the prefix cache)"),
    ("num_preemptions", "pagedkv_preemptions", "counter",
     "Requests preempted for lack of pages (recomputed later)"),
)


class _EngineCollector:
    """Yields the engine figures from the last published snapshot."""

    def __init__(self, owner: ServerMetrics) -> None:
        self._owner = owner

    def collect(self) -> Iterator[Any]:
        snapshot = self._owner.snapshot
        for key, name, kind, doc in _ENGINE_FIGURES:
            value = float(snapshot.get(key, 0))
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(name, doc, value=value)


class ServerMetrics:
    """The metrics of one server.

    Attributes
    ----------
    registry : prometheus_client.CollectorRegistry
    snapshot : dict
        The engine figures last published by :meth:`publish` (replaced
        whole, never edited, so a scrape from another thread reads one
        consistent dict).
    """

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        reg = self.registry
        self.http_requests = Counter("pagedkv_http_requests", "HTTP requests answered",
                                     ["route", "status"], registry=reg)
        self.finished = Counter("pagedkv_requests_finished",
                                "Generation requests finished, by finish reason",
                                ["finish_reason"], registry=reg)
        self.rejected = Counter("pagedkv_requests_rejected",
                                "Generation requests refused because the queue was full",
                                registry=reg)
        self.prompt_tokens = Counter("pagedkv_prompt_tokens", "Prompt tokens of finished "
                                     "requests", registry=reg)
        self.generation_tokens = Counter("pagedkv_generation_tokens", "Tokens generated",
                                         registry=reg)
        self.ttft = Histogram("pagedkv_time_to_first_token_seconds",
                              "From a request's arrival to its first generated token",
                              buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("pagedkv_inter_token_latency_seconds",
                             "Between successive generated tokens of a request",
                             buckets=_ITL_BUCKETS, registry=reg)
        self.snapshot: dict = {}
        reg.register(_EngineCollector(self))

    def publish(self, snapshot: dict) -> None:
        """Replace the engine figures (called by the engine thread)."""
        self.snapshot = dict(snapshot)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
