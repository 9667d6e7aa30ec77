"""The engine model's state under vLLM's Prometheus metric names: what the simulated worker serves on
``/metrics``, and the same reading as the router's ``EngineMetrics`` for the simulator.

The simulator scrapes 64 engines every virtual second; formatting and parsing Prometheus text for each was a
fifth of its time. ``engine_scrape`` hands over what ``parse_engine_metrics(engine_metrics_text(engine))``
reads, without the text (tests/test_engine_model.py holds the two equal); the live router still parses the
simulated worker's text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from router.load import EngineMetrics
from workers.engine.engine import EngineModel


def engine_metric_families(engine: EngineModel, model: str, rank: int = 0) -> Iterator[Metric]:
    labels = ["model_name", "engine"]
    lv = [model, str(rank)]

    def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=labels)
        g.add_metric(lv, value)
        return g

    def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=labels)
        c.add_metric(lv, value)
        return c

    e = engine
    yield gauge("vllm:num_requests_running", "Requests in model execution batches.", e.num_running)
    yield gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", e.num_waiting)
    yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
    yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", e.stats.prefix_queries_tokens)
    yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", e.stats.prefix_hits_tokens)
    yield counter("vllm:num_preemptions", "Cumulative number of preemptions.", e.stats.preemptions)
    yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.stats.prompt_tokens)
    yield counter("vllm:generation_tokens", "Number of generation tokens.", e.stats.generation_tokens)
    c = e.config
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching"])
    info.add_metric([str(c.block_size), str(c.num_gpu_blocks), str(c.cpu_blocks), "True"], 1.0)
    yield info
    if c.max_loras:  # as vLLM with --enable-lora: the adapters in use, the value the time of the report
        running, waiting = e.loras_of
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        lora.add_metric([str(c.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting))], time.time())
        yield lora


class _EngineCollector:
    def __init__(self, engine: EngineModel, model: str, rank: int) -> None:
        self.engine, self.model, self.rank = engine, model, rank

    def collect(self) -> Iterator[Metric]:
        return engine_metric_families(self.engine, self.model, self.rank)


def engine_metrics_text(engine: EngineModel, model: str = "sim-model", rank: int = 0) -> str:
    """The exposition text a scrape of this engine's ``/metrics`` would return (its engine metrics)."""
    registry = CollectorRegistry()
    registry.register(_EngineCollector(engine, model, rank))  # type: ignore[arg-type]
    return generate_latest(registry).decode()


def engine_scrape(engine: EngineModel, scraped_at: float) -> EngineMetrics:
    """What the router's parser reads from ``engine_metrics_text(engine)``, at ``scraped_at``: the gauges, the
    cache capacity of ``vllm:cache_config_info`` and the work counters (prompt + generation tokens)."""
    c, st = engine.config, engine.stats
    running, waiting = engine.loras_of if c.max_loras else (frozenset(), frozenset())
    return EngineMetrics(float(engine.num_waiting), float(engine.num_running), engine.kv_usage, scraped_at,
                         c.num_gpu_blocks * c.block_size or None, float(st.prompt_tokens + st.generation_tokens),
                         running, waiting, c.max_loras or None)
