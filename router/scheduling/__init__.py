"""Routing decisions: filters, cost model, policies, and the core that composes them."""

from router.scheduling.core import RoutingConfig, RoutingCore
from router.scheduling.cost import CostModel, CostParams, Estimate
from router.scheduling.policies import POLICIES, Policy
from router.scheduling.types import CandidateReport, Decision, Endpoint, RouteRequest

__all__ = [
    "POLICIES", "CandidateReport", "CostModel", "CostParams", "Decision", "Endpoint", "Estimate", "Policy",
    "RouteRequest", "RoutingConfig", "RoutingCore",
]
