"""WG-KV series in SGLang's Prometheus exporter (``--enable-metrics``, ``GET /metrics``).

The scheduler's ``SchedulerMetricsCollector`` publishes its gauges whenever SGLang reports stats
(each prefill batch, every ``--decode-log-interval`` decode steps, and when idle); the hooks below
add our series to the same publication, with the collector's labels, from the scheduler process
(SGLang's multiprocess Prometheus directory carries them to ``/metrics``):

=======================================  =======  ===============================================
series                                   type     value
=======================================  =======  ===============================================
sglang:wgkv_admitted_fraction            gauge    tokens promoted / tokens that left a ring (all)
sglang:wgkv_pages_used / _pages_free     gauge    dual-pool pages (16 tokens of one stream each)
sglang:wgkv_kv_bytes_used                gauge    K/V bytes of the pages in use (FP8: 1 per element)
sglang:wgkv_ring_tokens                  gauge    ring occupancy of the running requests
sglang:wgkv_global_tokens                gauge    global-cache tokens of the running requests
sglang:wgkv_active_requests              gauge    request slots holding dual-pool streams
sglang:wgkv_eviction_triggers_total      counter  evictor passes that cut a request's streams
sglang:wgkv_evicted_tokens_total         counter  tokens the evictor removed
=======================================  =======  ===============================================
"""

from __future__ import annotations

import math

GAUGES = {
    "admitted_fraction": "WG-KV: tokens admitted to the global cache / tokens that left a local window.",
    "pages_used": "WG-KV: dual-cache pool pages in use.",
    "pages_free": "WG-KV: dual-cache pool pages free.",
    "kv_bytes_used": "WG-KV: K/V bytes of the dual-cache pool pages in use.",
    "ring_tokens": "WG-KV: local-window (ring) tokens of the running requests, all layers and KV heads.",
    "global_tokens": "WG-KV: global-cache tokens of the running requests, all layers and KV heads.",
    "active_requests": "WG-KV: requests holding dual-cache streams.",
}
COUNTERS = {
    "eviction_triggers": "WG-KV: evictor passes that cut a request's streams (--kv-budget).",
    "evicted_tokens": "WG-KV: tokens removed by the evictor (--kv-budget).",
}


class WGKVMetrics:
    """Our Prometheus series for one scheduler (one pool: per TP rank, labelled by the collector)."""

    def __init__(self, labels: dict, pool):
        from prometheus_client import Counter, Gauge

        self.pool = pool
        self.labels = labels
        self.gauges = {
            key: Gauge(
                name=f"sglang:wgkv_{key}",
                documentation=doc,
                labelnames=labels.keys(),
                multiprocess_mode="mostrecent",
            )
            for key, doc in GAUGES.items()
        }
        self.counters = {
            key: Counter(name=f"sglang:wgkv_{key}", documentation=doc, labelnames=labels.keys())
            for key, doc in COUNTERS.items()
        }
        self._counted = dict.fromkeys(COUNTERS, 0)

    def log(self) -> None:
        stats = self.pool.stats()
        fraction = stats["admitted_fraction"]
        values = {
            "admitted_fraction": math.nan if fraction is None else fraction,
            "pages_used": stats["used_pages"],
            "pages_free": stats["free_pages"],
            "kv_bytes_used": stats["used_bytes"],
            "ring_tokens": stats["ring_tokens"],
            "global_tokens": stats["global_tokens"],
            "active_requests": stats["active_requests"],
        }
        for key, value in values.items():
            self.gauges[key].labels(**self.labels).set(value)
        for key in COUNTERS:
            total = stats[f"{key}_total"]
            if total > self._counted[key]:
                self.counters[key].labels(**self.labels).inc(total - self._counted[key])
                self._counted[key] = total


def install(result, scheduler, *args, **kwargs):
    """AFTER ``Scheduler.init_metrics_reporter``: attach our series to the scheduler's collector."""
    from sglang_wgkv.integration.pools.req_pool import WGKVReqToTokenPool

    collector = getattr(scheduler, "metrics_collector", None)
    if collector is not None and isinstance(scheduler.req_to_token_pool, WGKVReqToTokenPool):
        collector.wgkv_metrics = WGKVMetrics(collector.labels, scheduler.req_to_token_pool)
    return None


def log_stats(result, collector, *args, **kwargs):
    """AFTER ``SchedulerMetricsCollector.log_stats``: publish ours with SGLang's."""
    metrics = getattr(collector, "wgkv_metrics", None)
    if metrics is not None:
        metrics.log()
    return None
