"""What an inference gateway's endpoint picker reads from /metrics, under our names and under vLLM's.

The Gateway API Inference Extension's model-server protocol (`docs/proposals/003-model-server-protocol` in
kubernetes-sigs/gateway-api-inference-extension) asks each replica for gauges of queued requests, running requests
and KV-cache utilisation from 0 to 1, and optionally a cache-info gauge whose labels carry the block size and block
count. The picker takes a flag naming each metric (`--total-queued-requests-metric` and friends), so a server may
keep its own names; its defaults are vLLM's. We export both:

    protocol field          ours (primary)                                  vLLM alias (what the defaults read)
    TotalQueuedRequests     simple_serve_queue_depth                        vllm:num_requests_waiting
    TotalRunningRequests    simple_serve_active_sequences                   vllm:num_requests_running
    KVCacheUtilization      simple_serve_kv_cache_usage_ratio               vllm:kv_cache_usage_perc
    CacheInfo               simple_serve_kv_cache_info{block_size,          vllm:cache_config_info{block_size,
                              num_gpu_blocks}                                 num_gpu_blocks}
    prefix-cache counters   simple_serve_prefix_cache_{queried,hit}_tokens  vllm:prefix_cache_{queries,hits}

Ours stay the names our dashboards and the HPA use; the aliases cost a few lines here and let a picker (or vLLM's
production-stack router) run with its defaults, including newer pickers that no longer take the flags. An alias
is read from our metric at scrape time, so the two never disagree.

The label names `block_size` and `num_gpu_blocks` are the picker's defaults, kept on a CPU too. Our KV cache is not
paged: `block_size` is the prefix cache's block (16 tokens, the unit a prefix hit is counted in) and
`num_gpu_blocks` is how many such blocks the KV budget holds.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "simple_serve"


def add_gateway_metrics(metrics, registry: CollectorRegistry) -> None:
    """Give `metrics` (app.metrics.Metrics, built up to here) the two gauges the protocol adds, and the aliases."""
    metrics.kv_cache_usage = Gauge(
        f"{PREFIX}_kv_cache_usage_ratio", "share of the KV cache budget reserved by admitted requests, 0 to 1 (the "
        "prefix cache's bytes count as free: they are evicted on demand); at 1 new requests queue", registry=registry)
    metrics.kv_cache_info = Gauge(
        f"{PREFIX}_kv_cache_info", "always 1; labels: block_size (tokens per prefix-cache block) and num_gpu_blocks "
        "(such blocks the KV budget holds), as an endpoint picker reads them", ["block_size", "num_gpu_blocks"],
        registry=registry)
    registry.register(VLLMAliases(metrics))


def _samples(metric, suffix: str = "") -> list:
    """The samples of one of our metrics (suffix "_total" for a counter's value)."""
    return [s for family in metric.collect() for s in family.samples if s.name == family.name + suffix]


class VLLMAliases(Collector):
    """The same values under vLLM's names, read from our metrics at each scrape."""

    GAUGES = (("vllm:num_requests_waiting", "queue_depth", "alias of simple_serve_queue_depth"),
              ("vllm:num_requests_running", "active_sequences", "alias of simple_serve_active_sequences"),
              ("vllm:kv_cache_usage_perc", "kv_cache_usage", "alias of simple_serve_kv_cache_usage_ratio (0 to 1)"))
    COUNTERS = (("vllm:prefix_cache_queries", "prefix_cache_queried",
                 "alias of simple_serve_prefix_cache_queried_tokens (tokens)"),
                ("vllm:prefix_cache_hits", "prefix_cache_hits",
                 "alias of simple_serve_prefix_cache_hit_tokens (tokens)"))

    def __init__(self, metrics):
        self.metrics = metrics

    def collect(self):
        for name, attr, doc in self.GAUGES:
            family = GaugeMetricFamily(name, doc)
            for sample in _samples(getattr(self.metrics, attr)):
                family.add_metric([], sample.value)
            yield family
        info = GaugeMetricFamily("vllm:cache_config_info", "alias of simple_serve_kv_cache_info",
                                 labels=["block_size", "num_gpu_blocks"])
        for sample in _samples(self.metrics.kv_cache_info):
            info.add_metric([sample.labels["block_size"], sample.labels["num_gpu_blocks"]], sample.value)
        yield info
        for name, attr, doc in self.COUNTERS:
            family = CounterMetricFamily(name, doc)
            for sample in _samples(getattr(self.metrics, attr), "_total"):
                family.add_metric([], sample.value)
            yield family
