"""``aibrix-prefix-cache``: AIBrix's ``prefix-cache`` routing, as costs that rank its choice first.

Described in vllm-project/aibrix ``pkg/plugins/gateway/algorithms/README.md`` (Prefix Cache Aware) and
``prefix_cache.go``: with R the running requests per pod (as the gateway counts them),
- if max(R) - min(R) > ``imbalance_abs_count`` (the README's default 16), the load is imbalanced: the pod with the
  fewest running requests;
- else the pods matching a prefix of the prompt, sorted by match percentage (descending), then R (ascending), and the
  first with R <= mean(R) + ``std_dev_factor`` x stddev(R) (population, over all pods; the README's default 2);
- none (no match, or every match too loaded): the pod with the fewest running requests.
(The code's current constants are 8 and 1; the README documents 16 and 2; both are parameters here.)

Running requests: ``Candidate.busy`` (the router's in-flight count, or the engine's running + waiting when higher:
AIBrix counts its gateways' requests in flight). Match percentage: ``int(100 x held blocks / prompt blocks)`` from
the event-fed index (AIBrix's KV-event-sync mode; its default mode matches its own table of routed prefixes).
Costs: the chosen pod (and any pod equal to it in match and load, drawn between at random as AIBrix shuffles before
its stable sort) costs -1, below every load; the others cost their running requests, so the fallbacks are the
least-loaded ones.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot

CHOSEN = -1.0  # below any load


@dataclass(frozen=True)
class AibrixPrefixParams:
    imbalance_abs_count: float = 16
    std_dev_factor: float = 2.0


class AibrixPrefixCache(Scorer):
    type_name = "aibrix-prefix-cache"
    Params = AibrixPrefixParams
    uses_prefix = True

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        p, total = self.params, len(snap.request.keys)
        running = [c.busy for c in cands]
        if max(running) - min(running) > p.imbalance_abs_count or not total:
            return running
        percent = []
        for c in cands:
            m = snap.prefix(c)
            percent.append(int(100 * (m.total if m else 0) / total))
        cut = statistics.fmean(running) + p.std_dev_factor * statistics.pstdev(running)
        matched = sorted((i for i in range(len(cands)) if percent[i] > 0), key=lambda i: (-percent[i], running[i]))
        chosen = next((i for i in matched if running[i] <= cut), None)
        if chosen is None:
            return running  # least-loaded fallback
        key = (percent[chosen], running[chosen])
        return [CHOSEN if (percent[i], running[i]) == key else running[i] for i in range(len(cands))]
