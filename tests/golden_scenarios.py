"""A recorded decision set for the scheduling framework's golden test (issue 14).

``play(policy, seed)`` drives a routing core through a seeded stream of requests with shared prefixes over
a small fleet: KV events for what each chosen worker caches, dispatches, first tokens and completions,
engine metrics with capacity, a draining worker, an unhealthy one, subset hints, a LoRA and a second model.
It uses only the core's public surface (endpoints, feed, metrics, decide and the request lifecycle), so the
same stream replayed through a rebuilt core must rank every request the same way. The recording in
``tests/data/golden_decisions.json`` was made by the core before the plugin framework, and re-made
(``python -m tests.golden_scenarios --record``) when decisions changed on purpose: the routing objective and
engine metrics brought up to date by the router's own accounting (issue 15) changed ``precise``,
``least_loaded`` and ``approx_prefix``; and again when the engine's running count stopped counting as
another router's the requests it runs that the router still counts as waiting (their first token on its way:
``precise``, ``least_loaded``, ``approx_prefix``); and again when a LoRA request's adapter load was priced
where it is not loaded, and left out of what the worker's TTFT fit learns (issue 45: ``precise``, seed 3); and
again when requests beyond an engine's batch limit were priced as waiting for a place (issue 50: ``precise``,
seed 2, whose random scrapes show a worker full at the same running count twice in a row); and again when the
memory wait followed the engine's admission rule and a choice's prefill was priced for the requests waiting behind
it (issue 51: ``precise``, seeds 2 and 3), and when the KV a dispatch adds between scrapes was counted at what its
request holds rather than at its last token (issue 51: ``least_loaded``, seed 3, from decision 109); the other
three are the original recording.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from router.events.codec import BlockStored, EventBatch
from router.keys import request_keys
from router.load import EngineMetrics
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore

BS = 16
POLICIES = ("random", "round_robin", "least_loaded", "session_hash", "approx_prefix", "precise")
SEEDS = (1, 2, 3)
RECORDING = Path(__file__).parent / "data" / "golden_decisions.json"


def play(policy: str, seed: int, lifecycle=None) -> list[list[str]]:  # type: ignore[no-untyped-def]
    """Every decision's ranking, in order. ``lifecycle(core, req, decision, worker, now)`` dispatches (and
    returns a completion callback); the default uses the core's lifecycle calls."""
    rng = random.Random(seed)
    core = RoutingCore(RoutingConfig(policy=policy, block_size=BS, seed=seed, max_inflight_requests=3))
    n = 5
    for i in range(n):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000", frozenset({"m2"}) if i == 4 else frozenset(),
                                      frozenset({"lora-a"}) if i in (1, 2) else frozenset()))
    prefixes = [[rng.randrange(4000) for _ in range(rng.choice((64, 160, 400)))] for _ in range(6)]
    seqs = dict.fromkeys(core.endpoints, 0)
    next_hash = [1]
    inflight: list[tuple[float, float, object]] = []  # (first token at, done at, request)
    out: list[list[str]] = []
    now = 0.0
    for step in range(160):
        now += rng.expovariate(8.0)
        for item in sorted(inflight, key=lambda x: x[1]):  # progress requests in flight
            first_at, done_at, handle = item
            if first_at <= now and not getattr(handle, "_first", False):
                handle.first_token(first_at)  # type: ignore[attr-defined]
                handle._first = True  # type: ignore[attr-defined]
            if done_at <= now:
                handle.complete(done_at)  # type: ignore[attr-defined]
                inflight.remove(item)
        if step % 10 == 0:
            for i, wid in enumerate(core.endpoints):
                core.update_metrics(wid, EngineMetrics(rng.randrange(3), rng.randrange(5), rng.random(), now,
                                                       cache_tokens=2048 * BS if i != 3 else None))
        if step == 40:
            core.endpoints["w3"].draining = True
        if step == 70:
            core.endpoints["w3"].draining = False
            core.endpoints["w0"].healthy = False
        if step == 100:
            core.endpoints["w0"].healthy = True
        prefix = rng.choice(prefixes)
        tokens = prefix + [rng.randrange(4000) for _ in range(rng.randrange(1, 80))]
        lora = "lora-a" if rng.random() < 0.1 else None
        model = "m2" if rng.random() < 0.05 else None
        subset = frozenset(rng.sample(sorted(core.endpoints), 3)) if rng.random() < 0.1 else None
        session = f"s{rng.randrange(8)}" if rng.random() < 0.7 else None
        req = RouteRequest(f"r{step}", request_keys(tokens, BS, lora_name=lora), len(tokens), BS,
                           rng.randrange(1, 64), model, lora, session, subset)
        decision = core.decide(req, now)
        out.append([decision.outcome, *decision.ranked])
        if decision.outcome != "routed":
            continue
        wid = decision.ranked[0]
        handle = (lifecycle or _lifecycle)(core, req, decision, wid, now)
        inflight.append((now + rng.uniform(0.01, 0.3), now + rng.uniform(0.3, 2.0), handle))
        if rng.random() < 0.85:  # the worker publishes what it cached (not always before the next request)
            nb = len(tokens) // BS
            hashes = list(range(next_hash[0], next_hash[0] + nb))
            next_hash[0] += nb
            ev = BlockStored(hashes, None, tokens[: nb * BS], BS, None, "GPU", lora,
                             None if lora is None else [(lora,)] * nb)
            core.feeder.offer(wid, seqs[wid], EventBatch(now, [ev], 0), now)
            seqs[wid] += 1
    return out


class _Handle:
    def __init__(self, core: RoutingCore, rid: str) -> None:
        self.core, self.rid = core, rid

    def first_token(self, now: float) -> None:
        self.core.first_token(self.rid, now)

    def complete(self, now: float) -> None:
        self.core.completed(self.rid, now)


def _lifecycle(core, req, decision, wid, now):  # type: ignore[no-untyped-def]
    core.dispatch(req, decision, wid, now)
    return _Handle(core, req.request_id)


def record() -> dict[str, list[list[str]]]:
    return {f"{p}/{s}": play(p, s) for p in POLICIES for s in SEEDS}


if __name__ == "__main__":
    if "--record" in sys.argv:
        RECORDING.write_text(json.dumps(record(), separators=(",", ":")) + "\n")
        print(f"wrote {RECORDING}")
