"""LoRA adapters: which each worker holds, and what sending a request for one there costs, in seconds.

vLLM serves several adapters in one batch, up to ``max_loras`` of them (its slots); a request for an adapter not
loaded waits while it loads (tens of milliseconds to seconds, by the adapter's size and where it comes from), and
the step that loads it stalls the requests running there; when every slot is held by an adapter some running
request uses, a request for another one is skipped until a slot frees. What the router can know of it:

- the engine's own report, ``vllm:lora_requests_info``: the adapters of its running and waiting requests and its
  slots (up to a scrape old);
- the router's own requests: those in flight there, and the adapters it sent there last (an engine keeps up to
  ``max_loras`` loaded, least recently used out, so the last ``max_loras`` distinct adapters sent are the freshest
  record of what is loaded).

``LoraResidency`` keeps the second and combines it with the first (``view``); ``adapter_cost`` prices a
request's adapter on each candidate: its own wait (the load, and while the slots are full a wait for one), the
stall the load brings to the requests running there, and the expected reload of the adapter it pushes out. How
long a load takes is learned from the engines (``AdapterLoads``), from the configured prior on. Queries have no
side effects.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from dataclasses import dataclass

import numpy as np

from router.load import EngineMetrics

RECENT_CAP = 64  # adapters remembered per worker when its slots are not known


@dataclass(frozen=True, slots=True)
class LoraView:
    resident: frozenset[str]  # loaded there, as far as the router can tell
    active: frozenset[str]  # used by a request running or waiting there
    slots: int | None  # max_loras, when the engine reports it


class LoraResidency:
    def __init__(self) -> None:
        self.inflight: dict[str, tuple[str, str]] = {}  # request id -> (worker, adapter)
        self.active: dict[str, Counter[str]] = {}  # worker -> adapter -> the router's requests in flight
        self.recent: dict[str, OrderedDict[str, None]] = {}  # worker -> adapters in the order last sent

    def dispatched(self, worker_id: str, request_id: str, adapter: str | None) -> None:
        self.ended(request_id)  # the same request moved to another worker
        if not adapter:
            return
        self.inflight[request_id] = (worker_id, adapter)
        self.active.setdefault(worker_id, Counter())[adapter] += 1
        recent = self.recent.setdefault(worker_id, OrderedDict())
        recent[adapter] = None
        recent.move_to_end(adapter)
        while len(recent) > RECENT_CAP:
            recent.popitem(last=False)

    def ended(self, request_id: str) -> None:
        held = self.inflight.pop(request_id, None)
        if held is None:
            return
        worker_id, adapter = held
        counts = self.active.get(worker_id)
        if counts is not None:
            counts[adapter] -= 1
            if counts[adapter] <= 0:
                del counts[adapter]

    def forget(self, worker_id: str) -> None:
        """The worker is gone or restarted: nothing of it is loaded any more."""
        self.recent.pop(worker_id, None)
        self.active.pop(worker_id, None)
        for rid in [r for r, (w, _) in self.inflight.items() if w == worker_id]:
            del self.inflight[rid]

    def view(self, worker_id: str, metrics: EngineMetrics | None) -> LoraView:
        ours = frozenset(self.active.get(worker_id, ()))
        reported = (metrics.loras_running | metrics.loras_waiting) if metrics is not None else frozenset()
        slots = metrics.max_loras if metrics is not None else None
        active = ours | reported
        recent = list(self.recent.get(worker_id, ()))
        if slots is not None:
            recent = recent[-slots:] if slots > 0 else []
        return LoraView(active | frozenset(recent), active, slots)


@dataclass(frozen=True, slots=True)
class AdapterCost:
    ttft_s: float  # added to its own time to first token
    stall_s: float  # added to what it costs the requests running there
    eviction_s: float  # the expected reload of the adapter its load pushes out
    load_s: float = 0.0  # of ttft_s, the load alone, where it is not also waiting for a slot (0: no load, or both)


def adapter_cost(view: LoraView, adapter: str, load_s: float, running: float, slot_wait_s: float,
                 reuse: float) -> AdapterCost:
    """What a request for ``adapter`` costs on a worker of ``view`` beyond its tokens: nothing where the adapter is
    loaded; else its load (and, if every slot is held by an adapter in use there, ``slot_wait_s`` before a slot
    frees: the caller's estimate of when one of the requests there ends), the load's stall to the ``running``
    requests, whose next step waits for it, and, where every slot is taken, the adapter it pushes out, loaded
    again by the next request for it there with probability ``reuse`` (the fleet's, as for evicted KV blocks)."""
    if adapter in view.resident:
        return AdapterCost(0.0, 0.0, 0.0)
    full = view.slots is not None and len(view.resident) >= view.slots
    blocked = view.slots is not None and len(view.active) >= view.slots
    if blocked:
        return AdapterCost(load_s + slot_wait_s, load_s * running, 0.0)
    return AdapterCost(load_s, load_s * running, reuse * load_s if full else 0.0, load_s)


class AdapterLoads:
    """How long loading each adapter takes, learned from the engines: a request that was priced with a load,
    and had nothing queued ahead of it, waited its adapter's load beyond the rest of its predicted TTFT; that
    excess is one sample of the load. An adapter's estimate is the median of its last ``window`` samples, with
    the fleet's median standing in until it has ``min_samples`` of its own, and ``prior_s`` (the configured
    ``lora_load_ms``) until the fleet has any; the prior also counts as ``prior_samples`` samples in each median,
    so a few samples move it a little and many decide it."""

    def __init__(self, prior_s: float, window: int = 64, min_samples: int = 3, prior_samples: int = 2) -> None:
        self.prior_s, self.window, self.min_samples, self.prior_samples = prior_s, window, min_samples, prior_samples
        self.samples: dict[str, deque[float]] = {}
        self.fleet: deque[float] = deque(maxlen=4 * window)
        self._estimates: dict[str, float] = {}

    def observe(self, adapter: str, sample_s: float) -> None:
        if not np.isfinite(sample_s):
            return
        sample_s = max(0.0, sample_s)
        self.samples.setdefault(adapter, deque(maxlen=self.window)).append(sample_s)
        self.fleet.append(sample_s)
        self._estimates.clear()

    def load_s(self, adapter: str) -> float:
        est = self._estimates.get(adapter)
        if est is None:
            own = self.samples.get(adapter)
            source = own if own is not None and len(own) >= self.min_samples else self.fleet
            est = float(np.median([*source, *([self.prior_s] * self.prior_samples)])) if source else self.prior_s
            self._estimates[adapter] = est
        return est
