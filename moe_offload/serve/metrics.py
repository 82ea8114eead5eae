"""Prometheus metrics of the server (one registry per server, so several can live in one process).

Request counters and latency histograms are observed by the HTTP layer; queue depth, running
sequences and the expert cache's counters are read at scrape time from the scheduler (the cache
stats are the snapshot the loop thread takes after each step, never read across threads mid-step).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.s = scheduler

    def collect(self):
        s = self.s
        g = GaugeMetricFamily("moe_offload_queue_depth", "requests waiting for a batch slot")
        g.add_metric([], s.num_waiting)
        yield g
        g = GaugeMetricFamily("moe_offload_running_sequences", "sequences prefilling or decoding")
        g.add_metric([], s.num_running)
        yield g
        c = CounterMetricFamily("moe_offload_scheduler_steps", "scheduler loop steps")
        c.add_metric([], s.steps)
        yield c
        c = CounterMetricFamily("moe_offload_decode_steps", "decode forwards of the running batch by path: graph "
                                "(a CUDA graph replay over the static KV cache) or eager", labels=["path"])
        for path, n in s.decode_steps.items():
            c.add_metric([path], n)
        yield c
        c = CounterMetricFamily("moe_offload_prefill_batches", "prefill forwards that took several waiting prompts "
                                "together (serve.prefill_batch_tokens)")
        c.add_metric([], s.prefill_batches)
        yield c
        steps = CounterMetricFamily("moe_offload_decode_rows_steps", "decode forwards by rows in the batch",
                                    labels=["rows"])
        secs = CounterMetricFamily("moe_offload_decode_rows_seconds", "seconds in decode forwards (forward + "
                                   "sampling, the ids read on the host) by rows in the batch", labels=["rows"])
        for rows, (n, t) in sorted(dict(s.decode_timing).items()):
            steps.add_metric([str(rows)], n)
            secs.add_metric([str(rows)], t)
        yield steps
        yield secs
        yield from cache_metrics(s.cache_stats)


def cache_metrics(stats: dict):
    """Prometheus families from ``engine.cache.stats()`` (keys absent in a stats version are skipped)."""
    total = stats.get("total", {})
    for key, help_ in (("hits", "decode expert lookups that were resident"), ("misses", "decode expert lookups copied in"),
                       ("evictions", "slots evicted"), ("prefill_hits", "prefill experts copied from slots"),
                       ("prefill_misses", "prefill experts copied from the host")):
        if key in total:
            c = CounterMetricFamily(f"moe_offload_cache_{key}", help_)
            c.add_metric([], total[key])
            yield c
    if "bytes" in total:
        c = CounterMetricFamily("moe_offload_cache_bytes", "bytes copied per copy path", labels=["path"])
        for path, n in total["bytes"].items():
            c.add_metric([path], n)
        yield c
    for key, name, label in (("hit_d2d_fallbacks", "moe_offload_cache_fallbacks", "reason"),
                             ("declined", "moe_offload_cache_declined", "path_reason")):
        c = CounterMetricFamily(name, f"cache stats {key}", labels=[label])
        for reason, n in (stats.get(key) or {}).items():
            c.add_metric([str(reason)], n)
        yield c
    if "decode_boundary_s" in stats:
        c = CounterMetricFamily("moe_offload_decode_boundary_seconds", "host seconds between decode steps committing "
                                "and scheduling expert admissions (the GPU waits for them)")
        c.add_metric([], stats["decode_boundary_s"])
        yield c
    for key in ("slots", "resident_experts"):
        if key in stats:
            g = GaugeMetricFamily(f"moe_offload_cache_{key}", f"cache {key}")
            g.add_metric([], stats[key])
            yield g


class Metrics:
    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("moe_offload_requests", "HTTP generation requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=self.registry)
        self.prompt_tokens = Counter("moe_offload_prompt_tokens", "prompt tokens of admitted requests", registry=self.registry)
        self.generated_tokens = Counter("moe_offload_generated_tokens", "tokens generated", registry=self.registry)
        self.ttft = Histogram("moe_offload_ttft_seconds", "submit to first token", buckets=_LATENCY_BUCKETS,
                              registry=self.registry)
        self.queue = Histogram("moe_offload_queue_seconds", "submit to the first prefill chunk",
                               buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.prefill = Histogram("moe_offload_prefill_seconds", "first prefill chunk to the first token sampled",
                                 buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("moe_offload_time_per_output_token_seconds", "mean time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.registry.register(_SchedulerCollector(scheduler))

    def observe_finished(self, req) -> None:
        """Latencies and token counts of a request that produced tokens."""
        n = len(req.output_ids)
        self.generated_tokens.inc(n)
        if req.t_first is not None:
            self.ttft.observe(req.t_first - req.t_submit)
            if req.t_prefill is not None:
                self.queue.observe(req.t_prefill - req.t_submit)
                self.prefill.observe(req.t_first - req.t_prefill)
            if n > 1 and req.t_done is not None:
                self.tpot.observe((req.t_done - req.t_first) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
