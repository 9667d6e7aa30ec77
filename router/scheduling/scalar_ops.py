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


def _maximum(a: float, b: float) -> float:
    if a != a or b != b:  # NaN: numpy's maximum propagates it, Python's max would not
        return math.nan
    return a if a >= b else b


def _minimum(a: float, b: float) -> float:
    if a != a or b != b:
        return math.nan
    return a if a <= b else b


def _where(cond: bool, a: float, b: float) -> float:
    return a if cond else b


def _clip(x: float, lo: float, hi: float) -> float:
    return _minimum(_maximum(x, lo), hi)


def _ceil(x: float) -> float:
    return float(math.ceil(x)) if math.isfinite(x) else x


def _trunc(x: float) -> float:
    return float(math.trunc(x)) if math.isfinite(x) else x


def _asarray(x: float, dtype: type = float) -> float:
    return dtype(x)


def _logical_and(a: bool, b: bool) -> bool:
    return bool(a) and bool(b)


def _logical_not(a: bool) -> bool:
    return not a


def _ones_like(x: float) -> float:
    return 1.0


def _floor_divide(a: float, b: float) -> float:
    return a // b


class ScalarOps:
    """The functions, by numpy's names (``xp.maximum``, ``xp.where``...)."""

    maximum = staticmethod(_maximum)
    minimum = staticmethod(_minimum)
    where = staticmethod(_where)
    clip = staticmethod(_clip)
    ceil = staticmethod(_ceil)
    trunc = staticmethod(_trunc)
    isnan = staticmethod(math.isnan)
    asarray = staticmethod(_asarray)
    logical_and = staticmethod(_logical_and)
    logical_not = staticmethod(_logical_not)
    ones_like = staticmethod(_ones_like)
    floor_divide = staticmethod(_floor_divide)


SCALAR_OPS = ScalarOps()
