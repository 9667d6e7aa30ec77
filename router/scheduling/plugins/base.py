"""The plugin kinds a scheduling profile is made of, the way llm-d's scheduler composes them:
filters drop candidates, weighted scorers price the rest, a picker orders them.

Scores are costs: lower is better (the latency scorers' unit is seconds a user waits). A plugin is one class
with a ``type_name``, a ``Params`` dataclass of typed parameters (validated from config) and a constructor
taking them; it sees only the per-decision ``Snapshot``. Hooks: ``on_dispatch`` (a request was sent to a
worker; return an undo for when the choice is abandoned: a retry elsewhere, a gateway fallback) and
``on_first_token`` (what the request's first token taught), ``on_observed`` (its TTFT and time per output
token, with the decision's report of its worker).

Each kind has an optional vector form over the snapshot's slots (``Filter.mask``, ``Scorer.score_slots``,
``Picker.rank``): the routing core uses it when a plugin has one (the built-ins do), and the per-candidate
method otherwise, so a one-file third-party plugin with just ``filter`` / ``score`` / ``pick`` still works.
A vector form must answer exactly what the per-candidate method would.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import numpy as np

from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import CandidateReport, RouteRequest

Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True)
class NoParams:
    """A plugin without parameters."""


class Plugin:
    type_name: ClassVar[str]
    kind: ClassVar[str]  # filter | scorer | picker
    Params: ClassVar[type] = NoParams

    def __init__(self, params: Any = None, *, rng: random.Random | None = None) -> None:
        self.params = params if params is not None else self.Params()
        self.rng = rng or random.Random()

    def on_dispatch(self, req: RouteRequest, worker_id: str, now: float) -> Undo | None:
        """A request was sent to ``worker_id``; return how to take back what this recorded, if anything."""
        return None

    def on_first_token(self, worker_id: str, predicted_s: float | None, observed_s: float, now: float) -> None:
        """The first token of a request sent to ``worker_id`` came ``observed_s`` after dispatch."""

    def on_observed(self, req: RouteRequest, worker_id: str, report: CandidateReport | None, ttft_s: float | None,
                    tpot_s: float | None, now: float) -> None:
        """What serving ``req`` on ``worker_id`` showed, with the decision's report of that worker (what was known
        when it was sent): its TTFT from the dispatch at its first token (``tpot_s`` None), or its time per output
        token after the first at its end (``ttft_s`` None). Where a plugin learns from traffic."""


class Filter(Plugin):
    kind = "filter"

    def filter(self, snap: Snapshot, cand: Candidate) -> str | None:
        """Why ``cand`` may not take this request, or None."""
        raise NotImplementedError

    def mask(self, snap: Snapshot) -> np.ndarray | None:
        """The vector form: a boolean per slot, True where ``filter`` would pass it; None: no vector form."""
        return None

    def reason(self, snap: Snapshot, slot: int) -> str:
        """Why ``mask`` rejected ``slot`` (what ``filter`` says of it)."""
        why = self.filter(snap, snap.candidate(slot))
        assert why is not None, f"{self.type_name}: mask and filter disagree on {snap.ids[slot]}"
        return why


class Scorer(Plugin):
    kind = "scorer"
    uses_prefix: ClassVar[bool] = False  # reads the event-fed index (the decision says so when none is synced)

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        """One cost per candidate, in order: lower is better."""
        raise NotImplementedError

    def score_slots(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray | None:
        """The vector form: ``score`` of the candidates at ``slots`` as an array; None: no vector form."""
        return None


class Unservable(Exception):
    """A picker's verdict that no candidate should take the request (a sheddable request no worker can serve
    within its objective): the decision's outcome is ``shed``, which the front ends answer 429 with Retry-After."""


class Picker(Plugin):
    kind = "picker"

    def pick(self, snap: Snapshot, cands: Sequence[Candidate], scores: Sequence[float]) -> list[str]:
        """The candidates' worker ids, best first (the rest are the fallbacks, in order)."""
        raise NotImplementedError

    def rank(self, snap: Snapshot, slots: np.ndarray, scores: Sequence[float]) -> Sequence[str] | None:
        """The vector form: ``pick`` of the candidates at ``slots`` (``scores`` in their order), as a list or a
        sequence equal to it (one that orders its tail when read); None: none."""
        return None


def params_doc(cls: type[Plugin]) -> list[dict[str, Any]]:
    """A plugin's parameters as ``kvrouter plugins`` lists them."""
    out = []
    for f in dataclasses.fields(cls.Params):
        default = f.default if f.default is not dataclasses.MISSING else None
        out.append({"name": f.name, "type": f.type if isinstance(f.type, str) else f.type.__name__,
                    "default": default})
    return out
