"""Block residency across workers (pure)."""

from router.index.residency import MEDIA, BlockEntry, EngineHash, KvIndex, Medium, PrefixMatch

__all__ = ["MEDIA", "BlockEntry", "EngineHash", "KvIndex", "Medium", "PrefixMatch"]
