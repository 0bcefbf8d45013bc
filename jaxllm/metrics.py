"""Prometheus metrics of a serving engine (prometheus-client, one registry per engine).

Gauges and counters follow the engine core's scheduler stats; latency histograms are
observed from each finished request's timestamps.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.messages import SchedulerStats, SpecDecodingStats
from jaxllm.outputs import RequestOutput

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self, model_name: str, block_size: int, max_loras: int = 0) -> None:
        """`max_loras` > 0: LoRA is on (vLLM's lora_requests_info gauge)."""
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.running = gauge("jaxllm:num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("jaxllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("jaxllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.kv_blocks_used = gauge("jaxllm:kv_cache_blocks_used", "KV cache blocks held by requests.")
        self.kv_tokens_held = gauge("jaxllm:kv_cache_tokens_held", "Tokens whose K/V the held blocks contain.")
        gauge("jaxllm:kv_cache_block_size", "Tokens per KV cache block.").set(block_size)
        self.prefix_queries = counter("jaxllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("jaxllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("jaxllm:num_preemptions", "Requests preempted (to be recomputed).")
        self.responses_evicted = counter("jaxllm:responses_store_evictions",
                                         "Stored responses dropped to keep the store's size (--responses-store-size); "
                                         "a later previous_response_id naming one is a 404.")
        self.spec_drafts = counter("jaxllm:spec_decode_num_drafts", "Speculative decoding: verifications of drafts.")
        self.spec_draft_tokens = counter("jaxllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens.")
        self.spec_accepted = counter("jaxllm:spec_decode_num_accepted_tokens",
                                     "Speculative decoding: draft tokens accepted.")
        self._spec_accepted_per_pos = Counter(
            "jaxllm:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: drafts accepted at each position.",
            ["model_name", "position"], registry=self.registry)
        self.prompt_tokens = counter("jaxllm:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("jaxllm:generation_tokens", "Generated tokens of finished requests.")
        self.requests_finished = counter("jaxllm:request_success", "Finished requests.")
        self.ttft = histogram("jaxllm:time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.tpot = histogram("jaxllm:time_per_output_token_seconds", "Time per output token after the first.",
                              _TPOT_BUCKETS)
        self.e2e = histogram("jaxllm:e2e_request_latency_seconds", "End-to-end request latency.", _LATENCY_BUCKETS)
        self._last = SchedulerStats()
        self._replica_gauges = {
            name: Gauge(f"jaxllm:replica_{name}", doc, ["model_name", "engine"], registry=self.registry)
            for name, doc in (("num_requests_running", "Requests running, per data-parallel replica."),
                              ("num_requests_waiting", "Requests waiting, per data-parallel replica."),
                              ("kv_cache_usage_perc", "KV cache usage (0-1), per data-parallel replica."),
                              ("prefix_cache_queries", "Prompt tokens looked up, per data-parallel replica."),
                              ("seconds_since_report", "Seconds since the data-parallel replica last reported "
                                                       "(each step, or each second while idle): its health."))
        }
        self._model_name = model_name
        self._max_loras = max_loras
        self._lora_info = Gauge(
            "jaxllm:lora_requests_info", "LoRA adapters of running and waiting requests (the value: when observed).",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry) if max_loras else None

    def observe_stats(self, stats: SchedulerStats, replicas: list[SchedulerStats] | None = None,
                      ages: list[float] | None = None) -> None:
        """The engine's stats (all replicas together), and each replica's if several
        (with the seconds since each last reported)."""
        for i, r in enumerate(replicas or []):
            for name, value in (("num_requests_running", r.num_running), ("num_requests_waiting", r.num_waiting),
                                ("kv_cache_usage_perc", r.kv_cache_usage),
                                ("prefix_cache_queries", r.prefix_cache_queries),
                                ("seconds_since_report", ages[i] if ages else 0.0)):
                self._replica_gauges[name].labels(self._model_name, str(i)).set(value)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        self.kv_blocks_used.set(stats.num_blocks_used)
        self.kv_tokens_held.set(stats.num_tokens_held)
        # The core reports running totals; counters advance by the difference.
        self.prefix_queries.inc(max(0, stats.prefix_cache_queries - self._last.prefix_cache_queries))
        self.prefix_hits.inc(max(0, stats.prefix_cache_hits - self._last.prefix_cache_hits))
        self.preemptions.inc(max(0, stats.num_preemptions - self._last.num_preemptions))
        self._observe_spec_decoding(stats.spec_decoding, self._last.spec_decoding)
        if self._lora_info is not None:  # one series: the current adapters
            self._lora_info.clear()
            self._lora_info.labels(self._model_name, str(self._max_loras),
                                   ",".join(sorted(set(stats.running_lora_adapters))),
                                   ",".join(sorted(set(stats.waiting_lora_adapters)))).set_to_current_time()
        self._last = stats

    def _observe_spec_decoding(self, now: SpecDecodingStats, last: SpecDecodingStats) -> None:
        self.spec_drafts.inc(max(0, now.num_drafts - last.num_drafts))
        self.spec_draft_tokens.inc(max(0, now.num_draft_tokens - last.num_draft_tokens))
        self.spec_accepted.inc(max(0, now.num_accepted_tokens - last.num_accepted_tokens))
        for i, n in enumerate(now.accepted_per_pos):
            before = last.accepted_per_pos[i] if i < len(last.accepted_per_pos) else 0
            self._spec_accepted_per_pos.labels(self._model_name, str(i)).inc(max(0, n - before))

    def observe_finished(self, output: RequestOutput, num_generated: int) -> None:
        """A finished request that generated `num_generated` tokens over all its samples."""
        m = output.metrics
        self.requests_finished.inc()
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.generation_tokens.inc(num_generated)
        if m is None or m.finished_time is None:
            return
        self.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            per_completion = num_generated / max(len(output.outputs), 1)  # over n samples
            if per_completion > 1 and m.last_token_time is not None:
                self.tpot.observe((m.last_token_time - m.first_token_time) / (per_completion - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
