"""Every plugin type the scheduler knows, by ``type_name``: one line per plugin. Files outside ``router/``
add theirs with ``register`` (config ``scheduling.imports`` loads them)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

from router.scheduling.plugins.base import Plugin
from router.scheduling.plugins.filters.admission import Admission
from router.scheduling.plugins.filters.healthy import Healthy
from router.scheduling.plugins.filters.in_subset import InSubset
from router.scheduling.plugins.filters.not_draining import NotDraining
from router.scheduling.plugins.filters.serves_model import ServesModel
from router.scheduling.plugins.pickers.meets_objective import MeetsObjective
from router.scheduling.plugins.pickers.min_score import MinScore
from router.scheduling.plugins.pickers.peer_llmd_headroom import LlmdHeadroom
from router.scheduling.plugins.pickers.peer_softmax import Softmax
from router.scheduling.plugins.pickers.random_pick import RandomPick
from router.scheduling.plugins.pickers.round_robin import RoundRobin
from router.scheduling.plugins.pickers.session_hash import SessionHash
from router.scheduling.plugins.scorers.approx_prefix import ApproxPrefix
from router.scheduling.plugins.scorers.latency_cost import LatencyCost
from router.scheduling.plugins.scorers.load import Load
from router.scheduling.plugins.scorers.peer_aibrix_prefix import AibrixPrefixCache
from router.scheduling.plugins.scorers.peer_dynamo_cost import DynamoCost
from router.scheduling.plugins.scorers.peer_llmd_affinity import LlmdPrefixAffinity
from router.scheduling.plugins.scorers.peer_llmd_kv_util import LlmdKvUtilization
from router.scheduling.plugins.scorers.peer_llmd_latency_predictor import LlmdLatencyPredictor
from router.scheduling.plugins.scorers.peer_llmd_lora import LlmdLoraAffinity
from router.scheduling.plugins.scorers.peer_llmd_prefix import LlmdPrecisePrefix
from router.scheduling.plugins.scorers.peer_llmd_queue import LlmdQueue
from router.scheduling.plugins.scorers.peer_llmd_token_load import LlmdTokenLoad
from router.scheduling.plugins.scorers.peer_preble_e2 import PrebleE2

REGISTRY: dict[str, type[Plugin]] = {}


def register(cls: type[Plugin]) -> type[Plugin]:
    """Add a plugin type (usable as a class decorator); a type name is registered once."""
    if cls.kind not in ("filter", "scorer", "picker"):
        raise ValueError(f"plugin {cls.__name__}: kind must be filter, scorer or picker, not {cls.kind!r}")
    known = REGISTRY.get(cls.type_name)
    if known is not None and known is not cls:
        raise ValueError(f"plugin type {cls.type_name!r} is already registered ({known.__module__})")
    REGISTRY[cls.type_name] = cls
    return cls


for _cls in (Healthy, NotDraining, InSubset, ServesModel, Admission,
             LatencyCost, Load, ApproxPrefix,
             MinScore, MeetsObjective, RandomPick, RoundRobin, SessionHash,
             # the peers' algorithms (the llmd, llmd_predicted, llmd_affinity, dynamo, aibrix and preble profiles)
             LlmdPrecisePrefix, LlmdQueue, LlmdKvUtilization, LlmdTokenLoad, LlmdPrefixAffinity, LlmdLoraAffinity,
             DynamoCost, Softmax, AibrixPrefixCache, PrebleE2, LlmdHeadroom, LlmdLatencyPredictor):
    register(_cls)


def import_plugins(source: str) -> None:
    """Load a file (``path/to/scorer.py``) or module (``pkg.scorer``) whose import registers plugins."""
    if source.endswith(".py"):
        path = Path(source).resolve()
        if not path.is_file():
            raise ValueError(f"no such plugin file: {source}")
        name = f"kvrouter_plugin_{path.stem}_{abs(hash(str(path)))}"
        if name in sys.modules:
            return
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        importlib.import_module(source)
