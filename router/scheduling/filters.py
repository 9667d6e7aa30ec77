"""Filters run before any scoring: each returns a reason to exclude a candidate, or None.

Adding a filter: write one function here and add it to ``FILTERS``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from router.scheduling.types import Endpoint, RouteRequest

if TYPE_CHECKING:
    from router.scheduling.core import RoutingCore

SATURATED = "saturated"

Filter = Callable[[Endpoint, RouteRequest, "RoutingCore"], str | None]


def healthy(ep: Endpoint, req: RouteRequest, core: RoutingCore) -> str | None:
    return None if ep.healthy else "unhealthy"


def not_draining(ep: Endpoint, req: RouteRequest, core: RoutingCore) -> str | None:
    return "draining" if ep.draining else None


def in_subset(ep: Endpoint, req: RouteRequest, core: RoutingCore) -> str | None:
    if req.subset is None or ep.worker_id in req.subset or ep.address in req.subset:
        return None
    return "not in subset hint"


def serves_model(ep: Endpoint, req: RouteRequest, core: RoutingCore) -> str | None:
    if ep.serves(req.model, req.lora):
        return None
    return f"does not serve {'LoRA ' + req.lora if req.lora else 'model ' + str(req.model)}"


def under_admission_limit(ep: Endpoint, req: RouteRequest, core: RoutingCore) -> str | None:
    """Per-worker limits on requests and prompt tokens in flight: past them the worker is saturated."""
    load = core.load.workers.get(ep.worker_id)
    if load is None:
        return None
    cfg = core.config
    if cfg.max_inflight_requests is not None and load.requests >= cfg.max_inflight_requests:
        return SATURATED
    if cfg.max_inflight_tokens is not None and load.prompt_tokens + req.prompt_tokens > cfg.max_inflight_tokens:
        return SATURATED if load.requests else None  # one oversized request alone is still admitted
    return None


FILTERS: list[Filter] = [healthy, not_draining, in_subset, serves_model, under_admission_limit]
