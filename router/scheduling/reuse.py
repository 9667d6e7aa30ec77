"""How likely the fleet is to be asked again for a block it evicts: the price of evicting, learned.

A ghost list of the keys the workers' GPU caches evicted lately (ARC's idea): a request asking for one counts a
reuse; one that ages out of the list unasked counts none. The probability is the reused fraction, both counts
decaying so that it follows the workload, pulled towards a prior while there are few. The list holds about as
many keys as the fleet's caches hold blocks: a block asked for again only after that many evictions would have
been evicted again by then anyway.

The list is ``router/scheduling/_fastghosts.c``'s ``GhostList`` where it is built (a key costs a probe in a
table of inline 64-bit keys: the feed tells it every block a GPU cache evicts), else ``PyGhostList``, the
reference: the same ghosts in the same order and the same counts to the last bit (tests/test_reuse.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class PyGhostList:
    """The keys evicted lately, oldest first, and the decayed counts of those asked for again and those that
    aged out unasked. Keys are 64-bit block keys."""

    def __init__(self, window_blocks: int) -> None:
        self._ghosts: OrderedDict[int, None] = OrderedDict()
        self.reused = 0.0
        self.expired = 0.0
        self.set_window(window_blocks)

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

    def __len__(self) -> int:
        return len(self._ghosts)

    def oldest_first(self) -> list[int]:
        """The ghosts, oldest first (for the tests)."""
        return list(self._ghosts)


try:
    from router.scheduling._fastghosts import GhostList
except ImportError:  # built without a C compiler
    GhostList = PyGhostList  # type: ignore[misc,assignment]


class ReuseTracker:
    def __init__(self, window_blocks: int = 1 << 16, prior: float = 0.5, prior_samples: float = 64.0,
                 ghosts: type = GhostList) -> None:
        self.prior = prior
        self.prior_samples = prior_samples
        self._ghosts = ghosts(window_blocks)
        # bound once: the feed calls ``evicted`` for every GPU removal, the lifecycle ``requested`` for every request
        self.evicted = self._ghosts.evicted
        self.requested = self._ghosts.requested
        self.set_window = self._ghosts.set_window

    @property
    def window_blocks(self) -> int:
        return self._ghosts.window_blocks

    @property
    def probability(self) -> float:
        """P(an evicted block is asked for again)."""
        g, n0 = self._ghosts, self.prior_samples
        return (g.reused + self.prior * n0) / (g.reused + g.expired + n0)

    def __len__(self) -> int:
        return len(self._ghosts)
