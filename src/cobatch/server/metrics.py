"""Prometheus metrics: request counters and latency histograms kept by the HTTP side, plus engine
gauges and the batch-diagnostic counters (ds4's DS4_SERVER_BATCH_DIAG) read from the engine at scrape.

Each app has its own registry, so several servers (tests) in one process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cobatch.server.engine_thread import EngineWorker

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    """`vllm_names`: the series vLLM's dashboards read are also exported under vLLM's names (--metrics-compat
    vllm), labelled with model_name as vLLM labels them."""

    def __init__(self, worker: EngineWorker, vllm_names: bool = False, model_name: str = ""):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("cobatch_requests", "Generation requests by API and finish reason "
                                "(abort: the client went away)", ["api", "finish_reason"], registry=r)
        self.http_errors = Counter("cobatch_http_errors", "Error responses by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("cobatch_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("cobatch_generation_tokens", "Generated tokens", registry=r)
        self.prefix_cache_hit_tokens = Counter("cobatch_prefix_cache_hit_tokens",
                                               "Prompt tokens served from the prefix cache", registry=r)
        self.ttft = Histogram("cobatch_time_to_first_token_seconds", "Request arrival to first token",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("cobatch_inter_token_latency_seconds", "Gap between two tokens of a stream",
                             buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("cobatch_request_duration_seconds", "Request arrival to last token",
                                  buckets=DURATION_BUCKETS, registry=r)
        r.register(_EngineCollector(worker))
        if vllm_names:
            self._add_vllm_names(worker, model_name)

    def _add_vllm_names(self, worker: EngineWorker, model_name: str) -> None:
        r, labels = self.registry, ["model_name"]

        def also(ours, theirs):
            return _Both(ours, theirs.labels(model_name))
        self.prompt_tokens = also(self.prompt_tokens, Counter("vllm:prompt_tokens", "Prefill tokens processed",
                                                              labels, registry=r))
        self.generation_tokens = also(self.generation_tokens, Counter(
            "vllm:generation_tokens", "Generation tokens processed", labels, registry=r))
        self.ttft = also(self.ttft, Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                                              labels, buckets=TTFT_BUCKETS, registry=r))
        itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency", labels, buckets=ITL_BUCKETS,
                        registry=r)
        older = Histogram("vllm:time_per_output_token_seconds", "Time per output token (vLLM's older name of "
                          "the inter-token latency)", labels, buckets=ITL_BUCKETS, registry=r)
        self.itl = _Both(self.itl, itl.labels(model_name), older.labels(model_name))
        self.duration = also(self.duration, Histogram("vllm:e2e_request_latency_seconds", "End-to-end request "
                                                      "latency", labels, buckets=DURATION_BUCKETS, registry=r))
        r.register(_VllmEngineCollector(worker, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Both:
    """One metric update, applied to our series and to their vLLM-named twins."""

    def __init__(self, *metrics):
        self.metrics = metrics

    def inc(self, amount: float = 1) -> None:
        for m in self.metrics:
            m.inc(amount)

    def observe(self, value: float) -> None:
        for m in self.metrics:
            m.observe(value)


class _VllmEngineCollector:
    """The engine gauges under vLLM's names (kv_cache_usage_perc is the current name of gpu_cache_usage_perc;
    both are exported, for dashboards of either vLLM version)."""

    def __init__(self, worker: EngineWorker, model_name: str):
        self.worker, self.model_name = worker, model_name

    def collect(self):
        worker, blocks = self.worker, self.worker.engine.blocks
        total = len(blocks.blocks)
        usage = blocks.num_used / total if total else 0.0
        for name, doc, value in (("vllm:num_requests_running", "Requests in the model's batch", worker.num_active),
                                 ("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                                  worker.queue_depth),
                                 ("vllm:gpu_cache_usage_perc", "KV cache usage (1 = full)", usage),
                                 ("vllm:kv_cache_usage_perc", "KV cache usage (1 = full)", usage)):
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        lora = getattr(worker.engine.runner.model, "lora", None)
        if lora is not None:
            yield lora_requests_info("vllm:lora_requests_info", worker, lora.capacity)


def lora_requests_info(name: str, worker: EngineWorker, slots: int) -> GaugeMetricFamily:
    """vLLM's lora_requests_info: the LoRA adapters of running and of waiting requests, and the slots, as labels
    (value 1)."""
    running, waiting = worker.adapters_in_use()
    info = GaugeMetricFamily(name, "LoRA adapters of running and waiting requests (value 1)",
                             labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
    info.add_metric([",".join(running), ",".join(waiting), str(slots)], 1)
    return info


class _EngineCollector:
    """Reads the engine's counters at scrape time (plain int reads: safe without the engine thread)."""

    def __init__(self, worker: EngineWorker):
        self.worker = worker

    def collect(self):
        worker, engine = self.worker, self.worker.engine
        stats, blocks = engine.stats, engine.blocks
        total_blocks = len(blocks.blocks)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("cobatch_slots", "Slots (--parallel): requests decoded together", worker.num_slots)
        yield gauge("cobatch_running_requests", "Requests holding a slot", worker.num_active)
        yield gauge("cobatch_queue_depth", "Requests waiting for a slot", worker.queue_depth)
        yield gauge("cobatch_kv_blocks_total", "KV cache blocks in the pool", total_blocks)
        yield gauge("cobatch_kv_blocks_used", "KV cache blocks held by requests", blocks.num_used)
        yield gauge("cobatch_kv_usage_ratio", "Fraction of KV blocks held by requests",
                    blocks.num_used / total_blocks if total_blocks else 0.0)
        # as vLLM's cache_config_info: the configuration in labels, value 1
        info = GaugeMetricFamily("cobatch_kv_cache_info", "KV cache configuration (value 1): dtype (--kv-cache-dtype), "
                                 "tokens per block, tokens it holds", labels=["dtype", "block_size", "tokens"])
        info.add_metric([str(engine.pool.dtype).removeprefix("torch."), str(engine.pool.block_size),
                         str(engine.pool.num_blocks * engine.pool.block_size)], 1)
        yield info
        yield counter("cobatch_engine_steps", "Engine steps (forward passes)", worker.steps)
        yield counter("cobatch_decode_steps", "Steps that decoded at least one sequence", stats.decode_steps)
        yield counter("cobatch_batched_decode_steps", "Decode steps that decoded two or more sequences",
                      stats.batched_steps)
        yield gauge("cobatch_batched_decode_fraction", "Batched decode steps / decode steps",
                    stats.batched_steps / stats.decode_steps if stats.decode_steps else 0.0)
        lone = CounterMetricFamily("cobatch_lone_decode_steps", "Decode steps with a single decoder, by cause "
                                   "(peer_prefill: a peer was still prefilling; peer_finish: a peer just "
                                   "finished; no_peer: nobody else to batch with)", labels=["cause"])
        lone.add_metric(["peer_prefill"], stats.lone_peer_prefill)
        lone.add_metric(["peer_finish"], stats.lone_peer_finish)
        lone.add_metric(["no_peer"], stats.lone_no_peer)
        yield lone
        lora = getattr(engine.runner.model, "lora", None)
        if lora is not None:
            yield lora_requests_info("cobatch_lora_requests_info", worker, lora.capacity)
        yield counter("cobatch_preemptions", "Sequences pushed back for lack of KV blocks", stats.preemptions)
        yield counter("cobatch_spec_draft_tokens", "Speculative (prompt-lookup) tokens proposed", stats.draft_tokens)
        yield counter("cobatch_spec_accepted_tokens", "Speculative tokens kept", stats.accepted_tokens)
