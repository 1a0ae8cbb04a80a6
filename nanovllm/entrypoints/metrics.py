"""The server's Prometheus metrics, named as vLLM names them where vLLM has the metric.

Latency histograms are fed by the async engine's thread (time to first token, inter-token
latency, end-to-end latency); gauges and counters of the engine's own state are read from its
metrics snapshot at scrape time, so they cost nothing between scrapes.
"""

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanovllm.engine.async_engine import AsyncLLMEngine
from nanovllm.outputs import EmbeddingRequestOutput, RequestOutput

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class ServerMetrics:
    """A private registry (so several servers can live in one process) and the engine's observer."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, **label).labels(model_name)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between two consecutive outputs of one request that added tokens.",
                             buckets=ITL_BUCKETS, **label).labels(model_name)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Time from arrival to the last output.",
                             buckets=E2E_BUCKETS, **label).labels(model_name)
        self.request_success = Counter("vllm:request_success",
                                       "Finished completions (a request with n > 1 counts n), by finish reason.",
                                       labelnames=["model_name", "finished_reason"], registry=self.registry)

    def watch(self, engine: AsyncLLMEngine):
        """Export the engine's state (read from its snapshot at each scrape)."""
        self.registry.register(_EngineStateCollector(engine, self.model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # RequestObserver hooks (engine thread; prometheus_client metrics are thread-safe)

    def first_token(self, seconds: float):
        self.ttft.observe(seconds)

    def inter_token(self, seconds: float):
        self.itl.observe(seconds)

    def finished(self, output: RequestOutput | EmbeddingRequestOutput, seconds: float):
        self.e2e.observe(seconds)
        reasons = ([completion.finish_reason for completion in output.outputs] if isinstance(output, RequestOutput)
                   else [output.finish_reason])
        for reason in reasons:
            self.request_success.labels(self.model_name, reason).inc()


class _EngineStateCollector:
    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def describe(self):
        return []  # collected only at scrape time; nothing to check at registration

    def collect(self):
        m = self.engine.metrics  # one consistent snapshot
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(labels, value)
            return family

        total, free = m["num_kvcache_blocks"], m["num_free_blocks"]
        yield gauge("vllm:num_requests_running", "Sequences being generated (a request with n > 1 counts n).",
                    m["num_running"])
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled (n > 1 counts n).",
                    m["num_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV-cache blocks held by sequences (1 = full).",
                    (total - free) / total)
        yield gauge("nanovllm:kv_cache_used_blocks", "KV-cache blocks held by sequences.", total - free)
        yield gauge("nanovllm:kv_cache_total_blocks", "KV-cache blocks in the pool.", total)
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", m["prompt_tokens"])
        yield counter("vllm:generation_tokens", "Tokens generated.", m["generation_tokens"])
        yield counter("vllm:num_preemptions", "Sequences preempted (by recompute) for lack of KV blocks.",
                      m["num_preemptions"])
        yield counter("vllm:prefix_cache_hits", "Prompt tokens whose KV was found in the prefix cache.",
                      m["prefix_cache_hit_tokens"])
        yield counter("vllm:prefix_cache_queries", "Prompt tokens received, each a prefix-cache query.",
                      m["prompt_tokens"])
        if "spec_decode_num_drafts" in m:  # an engine that speculates
            yield counter("vllm:spec_decode_num_drafts", "Drafts verified (a sequence's drafted tokens in a step).",
                          m["spec_decode_num_drafts"])
            yield counter("vllm:spec_decode_num_draft_tokens", "Drafted tokens verified.",
                          m["spec_decode_num_draft_tokens"])
            yield counter("vllm:spec_decode_num_accepted_tokens", "Drafted tokens accepted.",
                          m["spec_decode_num_accepted_tokens"])
            per_position = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                               "Drafted tokens accepted, by their place in the draft.",
                                               labels=["model_name", "position"])
            for position, accepted in enumerate(m["spec_decode_num_accepted_tokens_per_pos"]):
                per_position.add_metric([self.model_name, str(position)], accepted)
            yield per_position
        # Hits count again when a preempted sequence is readmitted; the rate is capped at 1.
        yield gauge("nanovllm:prefix_cache_hit_rate", "prefix_cache_hits / prefix_cache_queries since start.",
                    min(1.0, m["prefix_cache_hit_tokens"] / max(m["prompt_tokens"], 1)))
