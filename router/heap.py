"""How the router's processes run CPython's cycle collector.

CPython collects its youngest objects every 700 allocations of container objects and, now and then, walks every
object the process holds. A routing process allocates thousands of short-lived objects per request (parsed
bodies, decisions, protocol messages) beside a long-lived heap (the modules of numpy, the tokenizer and the
protocol libraries, the index, the engines' pools in the simulator): the picker behind Envoy spent 4-7% of its CPU
in the collector, each full walk of its 72,000 objects paused it for 23-34 ms, and a 64-worker simulator run spent a
sixth of its time there (docs/benchmarks.md). ``rare_collections`` freezes what exists when it starts (never
walked again) and collects the young every ``YOUNG_THRESHOLD`` allocations: reference cycles are still
collected, only later.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

YOUNG_THRESHOLD = 50_000  # container allocations between collections of the youngest generation (CPython: 700)
OLDER_THRESHOLDS = (20, 20)  # young collections per middle one, middle ones per full walk (CPython: 10, 10)


@contextmanager
def rare_collections() -> Iterator[None]:
    """Within: everything allocated before it frozen, collections rare. After: the thresholds as they were, and
    the freeze undone unless the caller had frozen objects itself (unfreeze is all or none)."""
    threshold, frozen_by_caller = gc.get_threshold(), gc.get_freeze_count()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if not frozen_by_caller:
            gc.unfreeze()
