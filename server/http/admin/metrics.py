"""Prometheus metrics (GET /metrics): what a dashboard needs to see batching and speculation.

Speculative-decoding and prefix-cache counters carry vLLM's names under our prefix, so the
same dashboards work. The engine calls the `SchedulerObserver` hooks on its MLX thread;
prometheus-client's metrics are thread-safe.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from server.engine import GenerationStats, SchedulerObserver

PREFIX = "mlx_spec"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics(SchedulerObserver):
    """One registry per app, so several apps (tests) can live in one process."""

    def __init__(self, queue_depth, batch_size=lambda: 0, switcher=None,
                 batch_pending=lambda: 0, suffix_info=lambda: {"bytes": 0, "tokens": 0},
                 memory=lambda: None):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}_completions", "Finished completions.",
                                ["endpoint", "finish_reason"], registry=r)
        self.generated = Counter(f"{PREFIX}_generated_tokens", "Tokens generated.", registry=r)
        self.prompt = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens processed.", registry=r)
        self.tps = Histogram(f"{PREFIX}_generation_tokens_per_second", "Decode speed.",
                             buckets=(1, 2, 5, 10, 20, 50, 100, 200, 500, 1000), registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "Time to first token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram(f"{PREFIX}_time_per_output_token_seconds",
                              "Decode time per output token, per request.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds",
                                    "Time from arrival to a batch slot.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.batch = Histogram(f"{PREFIX}_batch_size", "Decoding requests per round.",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=r)
        # vLLM's speculative-decoding counters.
        self.drafts = Counter(f"{PREFIX}_spec_decode_num_drafts", "Rounds that verified a draft.",
                              registry=r)
        self.draft_tokens = Counter(f"{PREFIX}_spec_decode_num_draft_tokens",
                                    "Draft tokens proposed.", registry=r)
        self.accepted = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens",
                                "Draft tokens accepted.", registry=r)
        self.accepted_per_pos = Counter(f"{PREFIX}_spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted, by position in the draft.",
                                        ["position"], registry=r)
        # Ours: which drafter pays (model, prompt_lookup, suffix, prediction, forced).
        self.drafter_tokens = Counter(f"{PREFIX}_drafter_draft_tokens",
                                      "Draft tokens proposed, by drafter.", ["drafter"],
                                      registry=r)
        self.drafter_accepted = Counter(f"{PREFIX}_drafter_accepted_tokens",
                                        "Draft tokens accepted, by drafter.", ["drafter"],
                                        registry=r)
        # vLLM's prefix-cache counters (tokens).
        self.cache_queries = Counter(f"{PREFIX}_prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.", registry=r)
        self.cache_hits = Counter(f"{PREFIX}_prefix_cache_hits",
                                  "Prompt tokens found in the prefix cache.", registry=r)
        depth = Gauge(f"{PREFIX}_queue_depth", "Requests waiting for a batch slot.", registry=r)
        depth.set_function(queue_depth)
        running = Gauge(f"{PREFIX}_running_requests", "Requests prefilling or decoding.",
                        registry=r)
        running.set_function(batch_size)
        pending = Gauge(f"{PREFIX}_batch_requests_pending", "Requests of running batches (the"
                        " Batch APIs) not answered yet.", registry=r)
        pending.set_function(batch_pending)
        suffix_bytes = Gauge(f"{PREFIX}_suffix_index_bytes", "Bytes suffix drafting's index of"
                             " served answers holds (engine.suffix_max_mb bounds it).", registry=r)
        suffix_bytes.set_function(lambda: suffix_info()["bytes"])
        suffix_tokens = Gauge(f"{PREFIX}_suffix_index_tokens", "Tokens of served answers"
                              " suffix drafting keeps.", registry=r)
        suffix_tokens.set_function(lambda: suffix_info()["tokens"])
        # The memory budget (vLLM's preemption counter and KV usage, under our prefix).
        self.preemptions = Counter(f"{PREFIX}_num_preemptions", "Requests paused because the"
                                   " running rows outgrew the memory budget (they resume with"
                                   " the same text).", registry=r)
        self._memory_gauges(memory)
        if switcher is not None:  # models.more_targets
            switches = Gauge(f"{PREFIX}_target_switches", "Switches between the configured"
                             " targets since the start.", registry=r)
            switches.set_function(lambda: switcher.switches)
            waiting = Gauge(f"{PREFIX}_switch_queue_depth", "Requests waiting for the target"
                            " they name to be switched to.", registry=r)
            waiting.set_function(lambda: switcher.waiting)

    def _memory_gauges(self, memory) -> None:
        """Gauges read from `memory()` (the engine's `memory_info`: None without a budget)."""
        def reading(key: str, scale=lambda value, info: value):
            def read() -> float:
                info = memory()
                return float("nan") if info is None or info[key] is None else \
                    scale(info[key], info)
            return read

        r = self.registry
        for name, key, text in (
                ("memory_budget_bytes", "budget_bytes", "What the KV caches (running requests'"
                 " and the prefix cache's) may hold together."),
                ("memory_limit_bytes", "limit_bytes", "The memory limit the budget comes from"
                 " (cgroup, physical, Metal working set, CUDA device)."),
                ("kv_cache_bytes", "kv_bytes", "What the running requests' KV caches hold."),
                ("paused_requests", "paused", "Requests paused for memory, waiting to resume.")):
            Gauge(f"{PREFIX}_{name}", text, registry=r).set_function(reading(key))
        usage = Gauge(f"{PREFIX}_kv_cache_usage_perc", "The running requests' KV caches over"
                      " the memory budget (0 to 1).", registry=r)
        usage.set_function(reading("kv_bytes",
                                   lambda value, info: value / max(info["budget_bytes"], 1)))

    # -- per request (event loop) -------------------------------------------------------------
    def observe(self, endpoint: str, finish_reason: str, stats: GenerationStats) -> None:
        self.requests.labels(endpoint, finish_reason).inc()
        self.generated.inc(stats.generation_tokens)
        self.prompt.inc(stats.prompt_tokens)
        if stats.generation_tokens > 1:
            self.tps.observe(stats.generation_tps)
            self.tpot.observe(1.0 / max(stats.generation_tps, 1e-9))
        self.ttft.observe(stats.ttft_s)

    # -- SchedulerObserver (MLX thread) -------------------------------------------------------
    def on_admitted(self, queue_wait_s: float) -> None:
        self.queue_wait.observe(queue_wait_s)

    def on_round(self, batch_size, results) -> None:
        self.batch.observe(batch_size)
        for result in results.values():
            if not result.proposed:
                continue
            self.drafts.inc()
            self.draft_tokens.inc(result.proposed)
            self.accepted.inc(result.accepted)
            self.drafter_tokens.labels(result.drafter).inc(result.proposed)
            self.drafter_accepted.labels(result.drafter).inc(result.accepted)
            for position in range(result.accepted):
                self.accepted_per_pos.labels(str(position)).inc()

    def on_prefix_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.cache_queries.inc(queried_tokens)
        self.cache_hits.inc(hit_tokens)

    def on_preempted(self) -> None:
        self.preemptions.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
