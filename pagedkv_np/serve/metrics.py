"""The server's Prometheus metrics, in a registry of its own.

Two kinds of figures:

- events, counted where they happen: HTTP requests by route and status,
  finished requests by reason, prompt and generated tokens, time to first
  token and inter-token latency (histograms, observed by the engine thread);
- engine state (queue length, running batch, pages, prefix hits,
  preemptions), read at scrape time from the last snapshot the engine thread
  published, so that a scrape never touches the engine itself.

The project's names start with ``pagedkv_``. Beside them, the gauges that
cluster schedulers read off vLLM servers (the Gateway API Inference
Extension / llm-d inference scheduler, the SGLang router), under vLLM's
names and meanings, labelled ``model_name`` as vLLM labels them:

- ``vllm:num_requests_waiting``: requests accepted, no token yet (the queue);
- ``vllm:num_requests_running``: requests in the running batch;
- ``vllm:kv_cache_usage_perc``: pages held by requests / pages, 0 to 1
  (1 means 100 %; pages that only hold a cached prefix count as free, since
  they are evicted on demand);
- ``vllm:cache_config_info``: 1, labelled with the pool's ``block_size``
  (tokens per page), ``num_gpu_blocks`` (pages; CPU pages here) and
  ``cache_dtype``.
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
        yield from self._vllm(snapshot)

    def _vllm(self, snapshot: dict) -> Iterator[Any]:
        """vLLM's scheduler-facing gauges (see the module docstring)."""
        model = [self._owner.model_name]
        num_pages = int(snapshot.get("num_pages", 0))
        usage = float(snapshot.get("pages_used", 0)) / num_pages if num_pages else 0.0
        for name, doc, value in (
                ("vllm:num_requests_waiting", "Requests waiting to be processed",
                 float(snapshot.get("num_queued", 0))),
                ("vllm:num_requests_running", "Requests in model execution batches",
                 float(snapshot.get("num_running", 0))),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage",
                 usage)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric(model, value)
            yield gauge
        config = self._owner.cache_config
        if config:
            info = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache",
                                     labels=sorted(config))
            info.add_metric([str(config[k]) for k in sorted(config)], 1.0)
            yield info


class ServerMetrics:
    """The metrics of one server.

    Attributes
    ----------
    registry : prometheus_client.CollectorRegistry
    snapshot : dict
        The engine figures last published by :meth:`publish` (replaced
        whole, never edited, so a scrape from another thread reads one
        consistent dict).
    model_name : str
        The ``model_name`` label of the ``vllm:`` gauges.
    cache_config : dict
        The labels of ``vllm:cache_config_info`` (empty: not shown).
    """

    def __init__(self) -> None:
        self.model_name = ""
        self.cache_config: dict[str, str] = {}
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
