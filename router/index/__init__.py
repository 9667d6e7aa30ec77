"""Block residency across workers (pure)."""

from router.index.residency import MEDIA, EngineHash, KvIndex, Medium, PrefixMatch

__all__ = ["MEDIA", "EngineHash", "KvIndex", "Medium", "PrefixMatch"]
