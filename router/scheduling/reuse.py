"""How likely the fleet is to be asked again for a block it evicts: the price of evicting, learned.

A ghost list of the keys the workers' GPU caches evicted lately (ARC's idea): a request asking for one counts a
reuse; one that ages out of the list unasked counts none. The probability is the reused fraction, both counts
decaying so that it follows the workload, pulled towards a prior while there are few. The list holds about as
many keys as the fleet's caches hold blocks: a block asked for again only after that many evictions would have
been evicted again by then anyway.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class ReuseTracker:
    def __init__(self, window_blocks: int = 1 << 16, prior: float = 0.5, prior_samples: float = 64.0) -> None:
        self.window_blocks = max(1, window_blocks)
        self.prior = prior
        self.prior_samples = prior_samples
        self._ghosts: OrderedDict[int, None] = OrderedDict()
        self.reused = 0.0  # decayed counts of resolved ghosts
        self.expired = 0.0
        self._decay = 1.0 - 1.0 / self.window_blocks

    def set_window(self, blocks: int) -> None:
        self.window_blocks = max(1, blocks)
        self._decay = 1.0 - 1.0 / self.window_blocks

    def evicted(self, keys: Iterable[int]) -> None:
        ghosts = self._ghosts
        for k in keys:
            if k in ghosts:
                ghosts.move_to_end(k)
                continue
            ghosts[k] = None
            if len(ghosts) > self.window_blocks:
                ghosts.popitem(last=False)
                self.expired = self.expired * self._decay + 1.0
                self.reused *= self._decay

    def requested(self, keys: Iterable[int]) -> None:
        ghosts = self._ghosts
        if not ghosts:
            return
        for k in keys:
            if k in ghosts:
                del ghosts[k]
                self.reused = self.reused * self._decay + 1.0
                self.expired *= self._decay

    def forget(self, keys: Iterable[int]) -> None:
        for k in keys:
            self._ghosts.pop(k, None)

    @property
    def probability(self) -> float:
        """P(an evicted block is asked for again)."""
        n0 = self.prior_samples
        return (self.reused + self.prior * n0) / (self.reused + self.expired + n0)

    def __len__(self) -> int:
        return len(self._ghosts)
