"""numpy's elementwise functions that the routing objective uses, over plain Python numbers.

The objective (router/scheduling/cost.py, router/scheduling/plugins/scorers/latency_cost.py) is written once,
against a namespace ``xp`` of elementwise functions: ``numpy`` itself prices every candidate of a large fleet
in a few array operations; ``SCALAR_OPS`` prices one candidate at a time on its floats. Below a dozen
candidates that is several times faster: a numpy call costs about a microsecond whatever the size of its
arrays, and the objective is some hundred of them, while the same operation on two floats costs tens of
nanoseconds. IEEE arithmetic on doubles is the same in both, so both give the same scores to the last bit
(tests/test_vector_decisions.py holds them to it).

Only what the objective needs is here, with numpy's meaning where Python's differs: ``ceil`` and ``trunc``
return floats, ``maximum`` and ``minimum`` propagate NaN, and ``where`` takes both branches already computed,
as numpy's does (the shared code never divides by a value it masks afterwards).
"""

from __future__ import annotations

import math
import sys


def maximum(a: float, b: float) -> float:
    if a != a or b != b:  # NaN: numpy's maximum propagates it, Python's max would not
        return math.nan
    return a if a >= b else b


def minimum(a: float, b: float) -> float:
    if a != a or b != b:
        return math.nan
    return a if a <= b else b


def where(cond: bool, a: float, b: float) -> float:
    return a if cond else b


def clip(x: float, lo: float, hi: float) -> float:
    return minimum(maximum(x, lo), hi)


def ceil(x: float) -> float:
    return float(math.ceil(x)) if math.isfinite(x) else x


def trunc(x: float) -> float:
    return float(math.trunc(x)) if math.isfinite(x) else x


def asarray(x: float, dtype: type = float) -> float:
    return dtype(x)


def logical_and(a: bool, b: bool) -> bool:
    return bool(a) and bool(b)


def logical_not(a: bool) -> bool:
    return not a


def ones_like(x: float) -> float:
    return 1.0


def floor_divide(a: float, b: float) -> float:
    return a // b


isnan = math.isnan

# the namespace the shared code calls them through, as it calls numpy's: this module itself (a module's
# attributes are the quickest Python lookups there are)
SCALAR_OPS = sys.modules[__name__]
