"""The one engine model shared by the simulated worker and the simulator."""

from workers.engine.block_pool import BlockPool, CachedBlock, engine_block_hash
from workers.engine.engine import EngineConfig, EngineModel, EngineRequest, StepResult, TokenOutput
from workers.engine.timing import TimingModel

__all__ = [
    "BlockPool", "CachedBlock", "EngineConfig", "EngineModel", "EngineRequest", "StepResult",
    "TimingModel", "TokenOutput", "engine_block_hash",
]
