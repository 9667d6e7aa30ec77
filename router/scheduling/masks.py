"""Boolean masks over a snapshot's slots, at the price of small arrays.

A decision over a few workers handles arrays of a few elements, where numpy's convenience functions cost more
than the work: ``mask.any()``, ``mask.all()``, ``np.ones`` and ``np.flatnonzero`` each pass through a Python
wrapper in numpy (about a microsecond apiece, measured on numpy 2), the same operation through the C function
under it a fifth of that. A decision calls them a dozen times; these are the same answers, by the short way.
"""

from __future__ import annotations

import numpy as np


def any_set(mask: np.ndarray) -> bool:
    """``bool(mask.any())``."""
    return np.count_nonzero(mask) > 0


def all_set(mask: np.ndarray) -> bool:
    """``bool(mask.all())`` (True when empty)."""
    return np.count_nonzero(mask) == mask.size


def set_slots(mask: np.ndarray) -> np.ndarray:
    """``np.flatnonzero(mask)`` of a 1-D mask: the positions where it is set, in order."""
    return mask.nonzero()[0]


def all_slots(n: int) -> np.ndarray:
    """``np.ones(n, dtype=bool)``."""
    mask = np.empty(n, dtype=bool)
    mask.fill(True)
    return mask
