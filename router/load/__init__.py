"""Load signals: the router's in-flight accounting and scraped engine metrics."""

from router.load.accounting import InFlight, LoadTracker, WorkerLoad, tail_blocks
from router.load.metrics import BatchLimit, EngineMetrics, parse_engine_metrics

__all__ = ["BatchLimit", "EngineMetrics", "InFlight", "LoadTracker", "WorkerLoad", "parse_engine_metrics",
           "tail_blocks"]
