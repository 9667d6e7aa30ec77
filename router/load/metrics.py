"""Engine metrics as load signals: parse vLLM's and SGLang's Prometheus text. Pure.

A snapshot carries its scrape time; ``fresh()`` returns None past ``max_age_s`` so stale metrics count as
unknown, never as zero (a dead scrape must not make a busy worker look idle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

# engine metric name -> our field; vLLM first, SGLang's names beside them
_NAMES = {
    "vllm:num_requests_waiting": "waiting",
    "vllm:num_requests_running": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM < 0.10
    "sglang:num_queue_reqs": "waiting",
    "sglang:num_running_reqs": "running",
    "sglang:token_usage": "kv_usage",
}
# counters of the engine's work since it started: one going backwards means a new process (a restart the probes
# may never have seen fail)
_WORK_COUNTERS = {"vllm:prompt_tokens", "vllm:generation_tokens", "sglang:prompt_tokens", "sglang:generation_tokens"}


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    waiting: float | None
    running: float | None
    kv_usage: float | None
    scraped_at: float
    cache_tokens: int | None = None  # KV-cache capacity: vLLM's cache_config_info num_gpu_blocks x block_size
    work_tokens: float | None = None  # prompt + generation tokens processed since the engine started

    def fresh(self, now: float, max_age_s: float) -> EngineMetrics | None:
        return self if now - self.scraped_at <= max_age_s else None


_WANTED = frozenset({*_NAMES, *_WORK_COUNTERS, "vllm:cache_config_info"})


def _wanted_lines(text: str) -> str:
    """The exposition reduced to the families read here (with their HELP and TYPE lines): a vLLM scrape is
    hundreds of histogram lines, and the router scrapes every worker every second; Prometheus's own parser then
    reads what is left, so the values are what it would read from the whole text."""
    def wanted(name: str) -> bool:  # a counter's samples (and, as written today, its HELP/TYPE) end in _total
        return name in _WANTED or name.removesuffix("_total") in _WANTED or name.removesuffix("_created") in _WANTED

    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(" ", 3)
            if len(parts) >= 3 and wanted(parts[2]):
                keep.append(line)
            continue
        cut = len(line)
        for sep in ("{", " "):
            i = line.find(sep)
            if 0 <= i < cut:
                cut = i
        if wanted(line[:cut]):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_engine_metrics(text: str, scraped_at: float) -> EngineMetrics:
    """Sum across label sets (one engine per DP rank may report under one endpoint)."""
    found: dict[str, float] = {}
    cache_tokens: int | None = None
    work: float | None = None
    for fam in text_string_to_metric_families(_wanted_lines(text)):
        if fam.name == "vllm:cache_config_info":
            cache_tokens = _cache_tokens(fam.samples) or cache_tokens
            continue
        if fam.name in _WORK_COUNTERS:
            work = (work or 0.0) + sum(s.value for s in fam.samples if s.name.endswith("_total"))
            continue
        field = _NAMES.get(fam.name)
        if field is None:
            continue
        for s in fam.samples:
            if s.name == fam.name:
                found[field] = found.get(field, 0.0) + s.value
    return EngineMetrics(found.get("waiting"), found.get("running"), found.get("kv_usage"), scraped_at, cache_tokens,
                         work)


def _cache_tokens(samples: list[Any]) -> int | None:
    """Tokens the engine's GPU KV cache holds, summed over ranks; None when the labels do not say."""
    total = 0
    for s in samples:
        try:
            total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
        except (KeyError, ValueError):
            return None
    return total or None
