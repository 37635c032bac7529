"""Prometheus metrics. Each app gets its own registry, so tests can build many apps in one process.

Label values come from the server's own vocabulary (endpoints, statuses, finish reasons), except the LoRA
adapters' names, which clients choose: those series are read from the adapters loaded at each scrape
(`AdapterSeries`), so an unloaded adapter's series leaves /metrics with it and the set stays within MAX_LORAS + 1.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, disable_created_metrics
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from app.gateway_metrics import add_gateway_metrics

# `*_created` timestamps double the output and no dashboard uses them.
disable_created_metrics()

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
PREFIX = "simple_serve"


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes and friends: the soak watches RSS through it
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests to the API, by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter(f"{PREFIX}_completion_tokens", "tokens generated", registry=r)
        self.time_to_first_token = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                                             "from admission request to first token", buckets=LATENCY_BUCKETS,
                                             registry=r)
        self.inter_token_latency = Histogram(f"{PREFIX}_inter_token_latency_seconds", "gap between tokens of a stream",
                                             buckets=LATENCY_BUCKETS, registry=r)
        self.request_duration = Histogram(f"{PREFIX}_generation_duration_seconds", "submit to last token",
                                          buckets=LATENCY_BUCKETS, registry=r)
        # batch progress (app/batch/), without ids or names: what a dashboard needs, nothing a tenant could read
        self.batch_lines = Counter(f"{PREFIX}_batch_lines", "batch lines finished, by result (ok: a 200)",
                                   ["result"], registry=r)
        self.batches_in_progress = Gauge(f"{PREFIX}_batches_in_progress", "batches not yet finished", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for a decode slot", registry=r)
        self.active_sequences = Gauge(f"{PREFIX}_active_sequences", "sequences being decoded", registry=r)
        self.cancellations = Counter(f"{PREFIX}_cancellations", "generations stopped because the client left",
                                     registry=r)
        self.prefix_cache_queried = Counter(f"{PREFIX}_prefix_cache_queried_tokens",
                                            "prompt tokens looked up in the prefix cache", registry=r)
        self.prefix_cache_hits = Counter(f"{PREFIX}_prefix_cache_hit_tokens",
                                         "prompt tokens whose keys and values came from the prefix cache", registry=r)
        self.prefix_cache_bytes = Gauge(f"{PREFIX}_prefix_cache_bytes", "bytes of KV held by the prefix cache (part of the reserved bytes)",
                                        registry=r)
        self.draft_tokens = Counter(f"{PREFIX}_spec_draft_tokens", "n-gram draft tokens verified", registry=r)
        self.accepted_tokens = Counter(f"{PREFIX}_spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.finished = Counter(f"{PREFIX}_generations_finished", "generations by finish reason (stop, length; "
                                "timeout: its deadline passed; error: the model failed; abort: the server gave up "
                                "on it)", ["reason"], registry=r)
        self.deadlines_exceeded = Counter(f"{PREFIX}_deadlines_exceeded", "requests ended by a deadline, by stage: "
                                          "queue (never started, 503), run (ended mid-generation, finish reason "
                                          "timeout)", ["stage"], registry=r)
        self.weight_bytes = Gauge(f"{PREFIX}_weight_bytes", "bytes of the model's weights in memory, by format: "
                                  "the linears' fp32, bf16, fp16, int8, int4; the input embeddings; copies (a bf16 "
                                  "copy of int4 weights, PREPACK's fp32 copies); other (norms, biases)", ["format"],
                                  registry=r)
        self.kv_cache_budget = Gauge(f"{PREFIX}_kv_cache_budget_bytes", "KV cache bytes the engine may hold "
                                     "(KV_CACHE_BYTES)", registry=r)
        self.kv_cache_reserved = Gauge(f"{PREFIX}_kv_cache_reserved_bytes", "KV cache bytes reserved by admitted "
                                       "requests (each its prompt + max_tokens worst case) and the prefix cache; "
                                       "admission keeps this within the budget", registry=r)
        self.kv_cache_in_use = Gauge(f"{PREFIX}_kv_cache_used_bytes", "KV cache bytes the running requests hold now",
                                     registry=r)
        self.decode_steps = Counter(f"{PREFIX}_decode_steps", "passes in which every row decoded one token, by "
                                    "path: eager (the packed pass), pooled (DECODE_STEP=compiled), graph (that step "
                                    "replayed as a CUDA graph)", ["path"], registry=r)
        self.embedding_requests = Counter(f"{PREFIX}_embedding_requests", "requests served by an embedding model, "
                                          "by endpoint (embeddings, rerank, score)", ["endpoint"], registry=r)
        self.embedding_tokens = Counter(f"{PREFIX}_embedding_tokens", "tokens run through an embedding model",
                                        registry=r)
        self.embedding_inputs = Counter(f"{PREFIX}_embedding_inputs", "texts (or token lists) embedded", registry=r)
        self.adapter_series = AdapterSeries()
        r.register(self.adapter_series)
        add_gateway_metrics(self, r)  # KV usage 0..1, cache info, and vLLM-named aliases for endpoint pickers


class AdapterSeries(Collector):
    """`lora_requests` and `lora_generated_tokens` by adapter, "" the base model. An adapter's counts live on it
    (app/models/lora.py `LoraAdapter`), so its series exist while it is loaded: 20 load / use / unload cycles under
    fresh names leave none behind. A request still running with an unloaded adapter counts on its own copy."""

    def __init__(self) -> None:
        self.adapters = None  # app.models.lora.LoraAdapters, once the server has one
        # each written by one thread only: submits on the event loop, tokens on the engine's thread
        self.base_requests = self.base_tokens = 0

    def count_request(self, adapter) -> None:
        if adapter is None:
            self.base_requests += 1
        else:
            adapter.requests += 1

    def count_token(self, adapter) -> None:
        if adapter is None:
            self.base_tokens += 1
        else:
            adapter.generated_tokens += 1

    def collect(self):
        requests = CounterMetricFamily(f"{PREFIX}_lora_requests", "requests submitted, by LoRA adapter (\"\": the "
                                       "base model; an adapter's series leave with it when it is unloaded)",
                                       labels=["adapter"])
        tokens = CounterMetricFamily(f"{PREFIX}_lora_generated_tokens", "tokens generated, by LoRA adapter (\"\": "
                                     "the base model)", labels=["adapter"])
        requests.add_metric([""], self.base_requests)
        tokens.add_metric([""], self.base_tokens)
        by_name: dict[str, list[int]] = {}  # two keys may each load an adapter of one name: one series, summed
        for adapter in self.adapters.loaded() if self.adapters is not None else []:
            counts = by_name.setdefault(adapter.name, [0, 0])
            counts[0] += adapter.requests
            counts[1] += adapter.generated_tokens
        for name, (n_requests, n_tokens) in by_name.items():
            requests.add_metric([name], n_requests)
            tokens.add_metric([name], n_tokens)
        yield requests
        yield tokens


UNSCRAPED = Metrics()  # where the server's own generations count (warm-up, /health/generate): no /metrics shows it


def parse_samples(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {"name" or "name{labels}": value}, as a soak or a test reads /metrics back."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out
