"""Prometheus metrics for the server, in a registry of its own (several servers can share a process,
as the tests do). Gauges read the engine's state when scraped; latencies are observed per request."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from seekforge.serve.engine import LLMEngine, RequestOutput

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    def __init__(self, engine: LLMEngine):
        self.registry = r = CollectorRegistry()
        sched, blocks = engine.scheduler, engine.block_manager
        Gauge("seekforge_num_requests_running", "Sequences in the running batch", registry=r) \
            .set_function(lambda: len(sched.running))
        Gauge("seekforge_num_requests_waiting", "Sequences waiting for admission", registry=r) \
            .set_function(lambda: len(sched.waiting))
        Gauge("seekforge_kv_cache_usage_ratio", "Fraction of KV blocks in use", registry=r) \
            .set_function(lambda: blocks.usage)
        Gauge("seekforge_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / looked up",
              registry=r).set_function(lambda: blocks.prefix_hit_rate)
        Gauge("seekforge_num_preemptions", "Sequences preempted (recomputed) so far", registry=r) \
            .set_function(lambda: sched.num_preemptions)
        spec = engine.spec
        if spec is not None:  # vLLM reports the same pair (spec_decode acceptance rate / mean length)
            Gauge("seekforge_spec_decode_num_draft_tokens_total", "Draft tokens proposed by the MTP modules",
                  registry=r).set_function(lambda: spec.num_draft_tokens)
            Gauge("seekforge_spec_decode_num_accepted_tokens_total", "Draft tokens accepted by the target model",
                  registry=r).set_function(lambda: spec.num_accepted_tokens)
            Gauge("seekforge_spec_decode_acceptance_rate", "Accepted / proposed draft tokens", registry=r) \
                .set_function(lambda: spec.acceptance_rate)
            Gauge("seekforge_spec_decode_mean_accepted_length",
                  "Tokens a sequence gains per verify pass (accepted drafts + 1)", registry=r) \
                .set_function(lambda: spec.mean_accepted_length)
        self.ttft = Histogram("seekforge_time_to_first_token_seconds", "Time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("seekforge_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("seekforge_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("seekforge_generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter("seekforge_requests", "Finished requests", ["finish_reason"], registry=r)

    def observe(self, out: RequestOutput) -> None:
        """Record a finished request."""
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        if out.tpot is not None:
            self.tpot.observe(out.tpot)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        for c in out.outputs:
            self.requests.labels(finish_reason=c.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
