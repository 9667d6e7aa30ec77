"""Engine metrics as load signals: parse vLLM's and SGLang's Prometheus text. Pure.

A snapshot carries its scrape time; ``fresh()`` returns None past ``max_age_s`` so stale metrics count as
unknown, never as zero (a dead scrape must not make a busy worker look idle).
"""

from __future__ import annotations

import math
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
    # vLLM's lora_requests_info: the adapters of its running and waiting requests, and its adapter slots
    loras_running: frozenset[str] = frozenset()
    loras_waiting: frozenset[str] = frozenset()
    max_loras: int | None = None
    # the batch limit the router has learned for this engine (``BatchLimit``), set on the router's view of
    # the scrape (``FleetState.engine_view``): no engine publishes it (vLLM's ``max_num_seqs`` is in no metric)
    batch_limit: int | None = None

    def fresh(self, now: float, max_age_s: float) -> EngineMetrics | None:
        return self if now - self.scraped_at <= max_age_s else None


LORA_INFO = "vllm:lora_requests_info"
_WANTED = frozenset({*_NAMES, *_WORK_COUNTERS, "vllm:cache_config_info", LORA_INFO})


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
    lora: tuple[frozenset[str], frozenset[str], int | None] = (frozenset(), frozenset(), None)
    for fam in text_string_to_metric_families(_wanted_lines(text)):
        if fam.name == "vllm:cache_config_info":
            cache_tokens = _cache_tokens(fam.samples) or cache_tokens
            continue
        if fam.name == LORA_INFO:
            lora = _lora_info(fam.samples) or lora
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
    # an engine's figures are input too: a count or a fraction that is not a finite non-negative number says
    # nothing (and +Inf would overflow every int() downstream), so it is read as not reported
    found = {k: v for k, v in found.items() if math.isfinite(v) and v >= 0}
    return EngineMetrics(found.get("waiting"), found.get("running"), found.get("kv_usage"), scraped_at, cache_tokens,
                         work, *lora)


@dataclass(frozen=True, slots=True)
class BatchLimit:
    """An engine's batch limit as its scrapes have shown it: the number of requests it runs at once while it
    holds others waiting, which it would have started had it room (``max_num_seqs``; vLLM publishes it in no
    metric, so it is learned from the counts it does publish).

    A request waits in an engine for other reasons too, for a moment: it arrived since the engine's last step
    (at any load a scrape finds one or two so), or the step's token budget was spent on prefill. Neither holds
    the running count at one value, and neither at the most the engine has ever run: so a scrape counts as
    showing the engine full only with requests waiting at the most it has been seen running (and not where the
    router's own prefill waiting there fills a step's budget, ``budget_bound``), and the limit is taken once
    two scrapes in a row show it full at the same count. Once the engine runs more than the limit, it was no
    limit, and is unknown again. An engine whose queue the router keeps empty by holding requests at its limit
    shows no requests waiting: the limit stands (its memory running out below it, too: the memory wait prices
    that). The router then counts what waits there beyond the limit (router/scheduling/cost.py ``slot_steps``),
    counting a batch exactly at the limit as room for one more: a limit that has become too high or too low is
    found out by the next request the engine runs or holds beyond it."""

    limit: int | None = None  # as confirmed
    most_running: float = 0.0  # the most it has been seen running at once
    full_at: int | None = None  # the running count of the last scrape that showed it full, to be confirmed

    def seen(self, metrics: EngineMetrics, budget_bound: bool = False) -> BatchLimit:
        """What this scrape adds."""
        waiting, running = metrics.waiting, metrics.running
        if waiting is None or running is None:
            return self
        limit = None if self.limit is not None and running > self.limit else self.limit
        full = waiting >= 1 and running >= 1 and running >= self.most_running and not budget_bound
        if full and self.full_at == int(running):
            limit = int(running)
        return BatchLimit(limit, max(self.most_running, running), int(running) if full else None)


def _adapters(text: str) -> frozenset[str]:
    return frozenset(a.strip() for a in text.split(",") if a.strip())


def _lora_info(samples: list[Any]) -> tuple[frozenset[str], frozenset[str], int | None] | None:
    """vLLM's ``lora_requests_info`` gauge: one sample per state it has reported, its value the time of the
    report; the latest says which adapters its running and waiting requests use, and ``max_lora`` its slots."""
    latest = max((s for s in samples if s.name == LORA_INFO), key=lambda s: s.value, default=None)
    if latest is None:
        return None
    try:
        slots: int | None = int(latest.labels.get("max_lora", ""))
    except ValueError:
        slots = None
    return (_adapters(latest.labels.get("running_lora_adapters", "")),
            _adapters(latest.labels.get("waiting_lora_adapters", "")), slots)


def _cache_tokens(samples: list[Any]) -> int | None:
    """Tokens the engine's GPU KV cache holds, summed over ranks; None when the labels do not say."""
    total = 0
    for s in samples:
        try:
            total += int(s.labels["num_gpu_blocks"]) * int(s.labels["block_size"])
        except (KeyError, ValueError):
            return None
    return total or None
