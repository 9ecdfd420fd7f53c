"""Prometheus metrics (GET /metrics): what a dashboard needs to see speculation pay off."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from server.engine.events import GenerationStats

PREFIX = "mlx_spec"


class ServerMetrics:
    """One registry per app, so several apps (tests) can live in one process."""

    def __init__(self, queue_depth):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_completions", "Finished completions.",
                                ["endpoint", "finish_reason"], registry=r)
        self.generated = Counter(f"{PREFIX}_generated_tokens", "Tokens generated.", registry=r)
        self.prompt = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.proposed = Counter(f"{PREFIX}_draft_tokens_proposed", "Draft tokens proposed.",
                                registry=r)
        self.accepted = Counter(f"{PREFIX}_draft_tokens_accepted", "Draft tokens accepted.",
                                registry=r)
        self.tps = Histogram(f"{PREFIX}_generation_tokens_per_second", "Decode speed.",
                             buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        depth = Gauge(f"{PREFIX}_queue_depth", "Requests waiting or running.", registry=r)
        depth.set_function(queue_depth)

    def observe(self, endpoint: str, finish_reason: str, stats: GenerationStats) -> None:
        self.requests.labels(endpoint, finish_reason).inc()
        self.generated.inc(stats.generation_tokens)
        self.prompt.inc(stats.prompt_tokens)
        self.proposed.inc(stats.draft_tokens_proposed)
        self.accepted.inc(stats.draft_tokens_accepted)
        if stats.generation_tokens > 1:
            self.tps.observe(stats.generation_tps)
        self.ttft.observe(stats.ttft_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
