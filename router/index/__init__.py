"""Block residency across workers (pure): ``KvIndex`` (dicts, the fastest per event and per match in fleets
up to a few hundred workers) and ``CompactKvIndex`` (flat arrays, 6x less memory, for the thousand-worker
fleets), one API."""

from router.index.compact import CompactKvIndex
from router.index.residency import MEDIA, BlockEntry, EngineHash, KvIndex, Medium, PrefixMatch

INDEX_LAYOUTS = {"dicts": KvIndex, "compact": CompactKvIndex}

__all__ = ["INDEX_LAYOUTS", "MEDIA", "BlockEntry", "CompactKvIndex", "EngineHash", "KvIndex", "Medium",
           "PrefixMatch"]
