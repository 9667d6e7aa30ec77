"""Routing decisions: fleet state, per-decision snapshots, plugins and profiles, the request lifecycle, and
the core that composes them."""

from router.scheduling.core import RoutingConfig, RoutingCore
from router.scheduling.cost import CostModel, CostParams, Estimate
from router.scheduling.lifecycle import Dispatch
from router.scheduling.profiles import BUILTIN_PROFILES, Profile, SchedulingConfig
from router.scheduling.types import CandidateReport, Decision, Endpoint, RouteRequest, hit_tokens

__all__ = [
    "BUILTIN_PROFILES", "CandidateReport", "CostModel", "CostParams", "Decision", "Dispatch", "Endpoint", "Estimate",
    "Profile", "RouteRequest", "RoutingConfig", "RoutingCore", "SchedulingConfig", "hit_tokens",
]
