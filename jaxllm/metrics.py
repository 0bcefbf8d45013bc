"""Prometheus metrics of a serving engine (prometheus-client, one registry per engine).

The series vLLM exports carry vLLM's names (`vllm:` prefix), labels (`model_name` and
`engine`, the data-parallel replica, on every one; `finished_reason` on
`request_success_total`) and histograms, so that vLLM's Grafana dashboards, routers and
autoscalers read a jaxllm server as they read vLLM. What jaxllm adds keeps a
`jaxllm:` prefix. docs/operations.md lists both.

Gauges and the cache/preemption counters follow each engine core's scheduler stats
(running totals; the counters advance by the difference); token counters and latency
histograms follow the frontend's IterationStats (jaxllm.outputs).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from jaxllm.messages import FinishReason, SchedulerStats, SpecDecodingStats
from jaxllm.outputs import FinishedRequestStats, IterationStats

# vLLM's buckets
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                          20.0, 40.0, 80.0)
_REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                            240.0, 480.0, 960.0, 1920.0, 7680.0)
_N_BUCKETS = (1, 2, 5, 10, 20)
_STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LABELS = ["model_name", "engine"]


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class _Family:
    """One metric family's children, one per engine, made on first use."""

    def __init__(self, metric, model_name: str, extra: tuple[str, ...]) -> None:
        self.metric, self.model_name, self.extra = metric, model_name, extra

    def __call__(self, engine: int, **labels):
        return self.metric.labels(model_name=self.model_name, engine=str(engine), **labels)


class EngineMetrics:
    def __init__(self, model_name: str, block_size: int, max_model_len: int, num_blocks: int = 0,
                 max_loras: int = 0) -> None:
        """`max_loras` > 0: LoRA is on (vLLM's lora_requests_info gauge)."""
        self.registry = CollectorRegistry()
        self._model_name = model_name
        self._max_loras = max_loras
        self._last: dict[int, SchedulerStats] = {}  # per engine: the running totals last seen
        self._make_scheduler_series(block_size, num_blocks)
        self._make_request_series(max_model_len)
        self._start_engine(0)

    def _family(self, kind, name: str, doc: str, extra: tuple[str, ...] = (), **kwargs) -> _Family:
        return _Family(kind(name, doc, _LABELS + list(extra), registry=self.registry, **kwargs), self._model_name, extra)

    def _start_engine(self, engine: int) -> None:
        """Every series of `engine` at zero, so that each is there before traffic (vLLM
        makes them at start too); finish reasons each."""
        for family in vars(self).values():
            if isinstance(family, _Family) and not family.extra:
                family(engine)
        for reason in FinishReason:
            self.request_success(engine, finished_reason=str(reason))
        self._cache_info(engine, **self._cache_labels).set(1)
        self._block_size(engine).set(self._block_size_value)

    def _make_scheduler_series(self, block_size: int, num_blocks: int) -> None:
        g, c = Gauge, Counter
        self.running = self._family(g, "vllm:num_requests_running", "Requests running in the engine.")
        self.waiting = self._family(g, "vllm:num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = self._family(g, "vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).")
        self.prefix_queries = self._family(c, "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = self._family(c, "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = self._family(c, "vllm:num_preemptions", "Requests preempted (to be recomputed).")
        self.spec_drafts = self._family(c, "vllm:spec_decode_num_drafts", "Speculative decoding: verifications of drafts.")
        self.spec_draft_tokens = self._family(c, "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens.")
        self.spec_accepted = self._family(c, "vllm:spec_decode_num_accepted_tokens",
                                          "Speculative decoding: draft tokens accepted.")
        self.spec_accepted_per_pos = self._family(c, "vllm:spec_decode_num_accepted_tokens_per_pos",
                                                  "Speculative decoding: drafts accepted at each position.", ("position",))
        self._cache_info = self._family(g, "vllm:cache_config_info", "The KV cache's configuration (the value: 1).",
                                        ("block_size", "num_gpu_blocks"))
        self._cache_labels = {"block_size": str(block_size), "num_gpu_blocks": str(num_blocks)}
        self._block_size_value = block_size
        self.kv_blocks_used = self._family(g, "jaxllm:kv_cache_blocks_used", "KV cache blocks held by requests.")
        self.kv_tokens_held = self._family(g, "jaxllm:kv_cache_tokens_held", "Tokens whose K/V the held blocks contain.")
        self._block_size = self._family(g, "jaxllm:kv_cache_block_size", "Tokens per KV cache block.")
        self.encoder_queries = self._family(c, "jaxllm:encoder_cache_queries",
                                            "Images a request needed (a vision-language model's encoder cache).")
        self.encoder_hits = self._family(c, "jaxllm:encoder_cache_hits", "Images found encoded already (no encoder step).")
        self.images_encoded = self._family(c, "jaxllm:images_encoded", "Images run through the vision tower.")
        self.seconds_since_report = self._family(
            g, "jaxllm:seconds_since_report",
            "Seconds since the engine core last reported (each step, or each second while idle): its health.")
        self._lora_info = Gauge(
            "vllm:lora_requests_info", "LoRA adapters of running and waiting requests (the value: when observed).",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=self.registry) if self._max_loras else None
        self.responses_evicted = self._family(
            c, "jaxllm:responses_store_evictions",
            "Stored responses dropped to keep the store's size (--responses-store-size); a later "
            "previous_response_id naming one is a 404.")

    def _make_request_series(self, max_model_len: int) -> None:
        c, h = Counter, Histogram
        tokens = buckets_1_2_5(max_model_len)
        self.prompt_tokens = self._family(c, "vllm:prompt_tokens", "Prompt tokens of requests that got their first token.")
        self.generation_tokens = self._family(c, "vllm:generation_tokens", "Generated tokens.")
        self.request_success = self._family(c, "vllm:request_success",
                                            "Finished sequences (a request's n, or its beam search's), by finish reason.",
                                            ("finished_reason",))
        self.iteration_tokens = self._family(h, "vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                             buckets=_STEP_TOKEN_BUCKETS)
        self.ttft = self._family(h, "vllm:time_to_first_token_seconds", "Time to first token.", buckets=_TTFT_BUCKETS)
        self.itl = self._family(h, "vllm:inter_token_latency_seconds", "Time between a sequence's successive outputs.",
                                buckets=_TOKEN_LATENCY_BUCKETS)
        self.tpot = self._family(h, "vllm:request_time_per_output_token_seconds",
                                 "A request's decode time per output token after the first.",
                                 buckets=_TOKEN_LATENCY_BUCKETS)
        latency = {"buckets": _REQUEST_LATENCY_BUCKETS}
        self.e2e = self._family(h, "vllm:e2e_request_latency_seconds", "End-to-end request latency.", **latency)
        self.queue = self._family(h, "vllm:request_queue_time_seconds", "Time waiting before the first schedule.",
                                  **latency)
        self.inference = self._family(h, "vllm:request_inference_time_seconds",
                                      "Time from the first schedule to the last token.", **latency)
        self.prefill = self._family(h, "vllm:request_prefill_time_seconds",
                                    "Time from the first schedule to the first token.", **latency)
        self.decode = self._family(h, "vllm:request_decode_time_seconds", "Time from the first token to the last.",
                                   **latency)
        self.prompt_len = self._family(h, "vllm:request_prompt_tokens", "Prompt tokens per request.", buckets=tokens)
        self.generation_len = self._family(h, "vllm:request_generation_tokens",
                                           "Generated tokens per request (all its sequences).", buckets=tokens)
        self.max_generation_len = self._family(h, "vllm:request_max_num_generation_tokens",
                                               "Generated tokens of a request's longest sequence.", buckets=tokens)
        self.params_n = self._family(h, "vllm:request_params_n", "The n of requests.", buckets=_N_BUCKETS)
        self.params_max_tokens = self._family(h, "vllm:request_params_max_tokens", "The max_tokens of requests.",
                                              buckets=tokens)

    # ------------------------------------------------------- engine core stats

    def observe_stats(self, stats: SchedulerStats, replicas: list[SchedulerStats] | None = None,
                      ages: list[float] | None = None) -> None:
        """The engine core's stats, or with data parallelism each replica's (with the
        seconds since each last reported)."""
        for engine, s in enumerate(replicas or [stats]):
            self._observe_engine(engine, s, ages[engine] if ages else 0.0)
        if self._lora_info is not None:  # one series: the current adapters
            self._lora_info.clear()
            self._lora_info.labels(self._model_name, str(self._max_loras),
                                   ",".join(sorted(set(stats.running_lora_adapters))),
                                   ",".join(sorted(set(stats.waiting_lora_adapters)))).set_to_current_time()

    def _observe_engine(self, engine: int, stats: SchedulerStats, age: float) -> None:
        if engine not in self._last:
            self._start_engine(engine)
        last = self._last.get(engine, SchedulerStats())
        self.running(engine).set(stats.num_running)
        self.waiting(engine).set(stats.num_waiting)
        self.kv_usage(engine).set(stats.kv_cache_usage)
        self.kv_blocks_used(engine).set(stats.num_blocks_used)
        self.kv_tokens_held(engine).set(stats.num_tokens_held)
        self.seconds_since_report(engine).set(age)
        self.prefix_queries(engine).inc(max(0, stats.prefix_cache_queries - last.prefix_cache_queries))
        self.prefix_hits(engine).inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.preemptions(engine).inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.encoder_queries(engine).inc(max(0, stats.encoder_cache_queries - last.encoder_cache_queries))
        self.encoder_hits(engine).inc(max(0, stats.encoder_cache_hits - last.encoder_cache_hits))
        self.images_encoded(engine).inc(max(0, stats.images_encoded - last.images_encoded))
        self._observe_spec_decoding(engine, stats.spec_decoding, last.spec_decoding)
        self._last[engine] = stats

    def _observe_spec_decoding(self, engine: int, now: SpecDecodingStats, last: SpecDecodingStats) -> None:
        self.spec_drafts(engine).inc(max(0, now.num_drafts - last.num_drafts))
        self.spec_draft_tokens(engine).inc(max(0, now.num_draft_tokens - last.num_draft_tokens))
        self.spec_accepted(engine).inc(max(0, now.num_accepted_tokens - last.num_accepted_tokens))
        for i, n in enumerate(now.accepted_per_pos):
            before = last.accepted_per_pos[i] if i < len(last.accepted_per_pos) else 0
            self.spec_accepted_per_pos(engine, position=str(i)).inc(max(0, n - before))

    def observe_step(self, engine: int, step_tokens: int) -> None:
        if step_tokens:
            self.iteration_tokens(engine).observe(step_tokens)

    # ---------------------------------------------------------- the frontend's

    def observe_iteration(self, stats: dict[int, IterationStats]) -> None:
        """What the frontend saw of each engine's requests (OutputProcessor.take_stats)."""
        for engine, it in stats.items():
            self.prompt_tokens(engine).inc(it.num_prompt_tokens)
            self.generation_tokens(engine).inc(it.num_generation_tokens)
            for t in it.time_to_first_tokens:
                self.ttft(engine).observe(t)
            for t in it.inter_token_latencies:
                self.itl(engine).observe(t)
            for finished in it.finished:
                self._observe_finished(engine, finished)

    def _observe_finished(self, engine: int, f: FinishedRequestStats) -> None:
        for reason in f.finish_reasons:
            self.request_success(engine, finished_reason=reason).inc()
        self.prompt_len(engine).observe(f.num_prompt_tokens)
        self.generation_len(engine).observe(sum(f.sample_tokens))
        self.max_generation_len(engine).observe(max(f.sample_tokens, default=0))
        self.params_n(engine).observe(f.n)
        if f.max_tokens is not None:
            self.params_max_tokens(engine).observe(f.max_tokens)
        m = f.metrics
        if m.finished_time is None:
            return
        self.e2e(engine).observe(m.finished_time - m.arrival_time)
        scheduled, first, last = m.first_scheduled_time, m.first_token_time, m.last_token_time
        if scheduled is not None:
            self.queue(engine).observe(scheduled - m.arrival_time)
            if first is not None:
                self.prefill(engine).observe(max(0.0, first - scheduled))
                self.inference(engine).observe(max(0.0, last - scheduled))
        if first is not None:
            self.decode(engine).observe(last - first)
            longest = max(f.sample_tokens, default=0)
            if longest > 1:
                self.tpot(engine).observe((last - first) / (longest - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
