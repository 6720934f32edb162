"""Prometheus metrics for one frontend, in their own CollectorRegistry (vLLM's names).

Engine-side gauges and counters (running/waiting requests, KV-cache usage, prefix-cache
queries and hits, preemptions, speculative proposals and acceptances) are the engine core's
own cumulative numbers, read from SchedulerStats at scrape time through a custom collector.
Per-request histograms and token counters are observed by the HTTP layer as outputs stream
(RequestMetrics).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.registry import Collector

from services.common.engine_output import SchedulerStats
from services.common.served_model_info import ServedModelInfo

# Like vLLM: no `*_created` timestamp series next to every counter and histogram.
prometheus_client.disable_created_metrics()

logger = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
FINISH_REASONS = ("stop", "length", "abort", "error")
# Seconds (vLLM's buckets).
# fmt: off
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
                0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
_LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
                    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
# fmt: on


class EngineStatsCollector(Collector):
    """The engine cores' latest SchedulerStats, one `engine` label per engine core (data
    parallel replicas: "0", "1", ...; set before each scrape), and the router's decisions."""

    def __init__(self) -> None:
        self.stats: dict[str, SchedulerStats] = {"0": SchedulerStats()}
        self.routing: dict[tuple[str, str], int] = {}
        self.model: ServedModelInfo | None = None

    def _accepted_per_position(self) -> Metric:
        metric = CounterMetricFamily(
            "pagestream:spec_decode_num_accepted_tokens_per_pos",
            "Accepted speculative tokens, by their position among a draft's proposals.",
            labels=["engine", "position"],
        )
        for engine, stats in sorted(self.stats.items()):
            for position, count in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
                metric.add_metric([engine, str(position)], count)
        return metric

    def _lora_requests(self) -> Metric:
        """vLLM's lora_requests_info: the adapters of running and waiting requests as
        labels (comma-separated names), the value the time of the engine's stats."""
        metric = GaugeMetricFamily(
            "pagestream:lora_requests_info",
            "LoRA adapters of the running and the waiting requests (value: the time of the "
            "stats, seconds since the epoch).",
            labels=["engine", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        for engine, stats in sorted(self.stats.items()):
            if stats.max_lora:
                running = ",".join(stats.running_lora_adapters)
                waiting = ",".join(stats.waiting_lora_adapters)
                metric.add_metric([engine, str(stats.max_lora), running, waiting], time.time())
        return metric

    def collect(self) -> Iterable[Metric]:
        if self.model is not None:
            yield from _model_series(self.model)
        yield self._lora_requests()
        for name, doc, field, family in _ENGINE_SERIES:
            metric = family(f"pagestream:{name}", doc, labels=["engine"])
            for engine, stats in sorted(self.stats.items()):
                metric.add_metric([engine], getattr(stats, field))
            yield metric
        yield self._accepted_per_position()
        if self.routing:
            routed = CounterMetricFamily(
                "pagestream:router_requests",
                "Requests the data-parallel router sent to each engine, by reason.",
                labels=["engine", "reason"],
            )
            for (engine, reason), count in sorted(self.routing.items()):
                routed.add_metric([engine, reason], count)
            yield routed


def _model_series(model: ServedModelInfo) -> Iterable[Metric]:
    """The served model: an info series (value 1) naming its dtype, weight quantization and
    speculative decoding, and its resident weight bytes."""
    info = GaugeMetricFamily(
        "pagestream:model_info",
        "The served model (value 1): architecture, dtype, weight quantization and "
        "speculative decoding (none when off).",
        labels=["model_name", "architecture", "dtype", "quantization", "speculative_decoding"],
    )
    speculative = model.speculative_decoding or "none"
    info.add_metric(
        [model.model, model.architecture, model.dtype, model.quantization, speculative], 1
    )
    yield info
    weights = GaugeMetricFamily(
        "pagestream:model_weight_bytes", "Resident weight bytes of the served model."
    )
    weights.add_metric([], model.weight_bytes)
    yield weights


# (metric name, help, SchedulerStats field, family); counters get a _total suffix.
_ENGINE_SERIES = (
    (
        "num_requests_running",
        "Requests running in the engine.",
        "num_running_reqs",
        GaugeMetricFamily,
    ),
    ("num_requests_waiting", "Requests waiting to run.", "num_waiting_reqs", GaugeMetricFamily),
    (
        "kv_cache_usage_perc",
        "Fraction of KV-cache blocks in use.",
        "kv_cache_usage",
        GaugeMetricFamily,
    ),
    (
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_queries",
        CounterMetricFamily,
    ),
    (
        "prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        "prefix_cache_hits",
        CounterMetricFamily,
    ),
    ("num_preemptions", "Preempted sequences.", "num_preemptions", CounterMetricFamily),
    (
        "kv_offload_hits",
        "Prompt tokens read back from the KV offload tiers on prefix hits.",
        "kv_offload_hits",
        CounterMetricFamily,
    ),
    (
        "kv_offload_load_failures",
        "KV blocks the offload tiers could not read back (recomputed).",
        "kv_offload_load_failures",
        CounterMetricFamily,
    ),
    (
        "spec_decode_num_drafts",
        "Sequences whose speculative proposals a step verified.",
        "spec_decode_num_drafts",
        CounterMetricFamily,
    ),
    (
        "spec_decode_num_draft_tokens",
        "Speculative tokens proposed and verified.",
        "spec_decode_num_draft_tokens",
        CounterMetricFamily,
    ),
    (
        "spec_decode_num_accepted_tokens",
        "Speculative tokens accepted.",
        "spec_decode_num_accepted_tokens",
        CounterMetricFamily,
    ),
)


class FrontendMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineStatsCollector()
        self.registry.register(self.engine)
        reg = self.registry
        self.prompt_tokens = Counter(
            "pagestream:prompt_tokens", "Prompt tokens processed.", registry=reg
        )
        self.generation_tokens = Counter(
            "pagestream:generation_tokens", "Tokens generated.", registry=reg
        )
        self.request_success = Counter(
            "pagestream:request_success",
            "Finished requests by finish reason.",
            ["finished_reason"],
            registry=reg,
        )
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        self.ttft = Histogram(
            "pagestream:time_to_first_token_seconds",
            "Time to the first token.",
            buckets=_TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "pagestream:inter_token_latency_seconds",
            "Time between streamed outputs.",
            buckets=_ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "pagestream:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "pagestream:request_queue_time_seconds",
            "Time a request waited to be scheduled.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )

    async def refresh(self, frontend) -> None:
        """Take the engine cores' current stats (the last pushed ones if they cannot answer)."""
        try:
            self.engine.stats = await frontend.engine_stats()
        except Exception:
            logger.warning("engine stats unavailable; using the last reported ones")
            self.engine.stats = {"0": frontend.last_stats}
        self.engine.routing = frontend.routing_counts()
        self.engine.model = getattr(frontend, "info", None)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def start_request(self) -> RequestMetrics:
        return RequestMetrics(self)


class RequestMetrics:
    """One HTTP request's timings; it may cover several engine requests (prompts)."""

    def __init__(self, metrics: FrontendMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last_output: float | None = None
        self.done = False

    def on_prompt(self, num_prompt_tokens: int, queue_time: float | None = None) -> None:
        self.metrics.prompt_tokens.inc(num_prompt_tokens)
        if queue_time is not None:
            self.metrics.queue_time.observe(queue_time)

    def on_tokens(self, num_new_tokens: int) -> None:
        if num_new_tokens <= 0:
            return
        now = time.monotonic()
        if self.last_output is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            self.metrics.itl.observe(now - self.last_output)
        self.last_output = now
        self.metrics.generation_tokens.inc(num_new_tokens)

    def finish(self, finish_reasons: Iterable[str | None]) -> None:
        """Once per HTTP request; unfinished sequences count as aborted."""
        if self.done:
            return
        self.done = True
        self.metrics.e2e.observe(time.monotonic() - self.arrival)
        for reason in finish_reasons:
            self.metrics.request_success.labels(reason or "abort").inc()
