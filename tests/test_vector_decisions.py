"""The vector forms of the decision path answer exactly what the per-candidate forms answer, on random fleets:
the built-in filters' masks and reasons, the latency-cost scorer's arrays against the per-candidate objective
(``Columns`` rows, ``Snapshot.memory_wait_s``), the min-score picker's order; and the decision's lazily built
reports are the ones its consumers read."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.events.feed import WorkerFeed
from router.index import Medium
from router.load import EngineMetrics, tail_blocks
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore, columns, snapshot
from router.scheduling.cost import Columns
from router.scheduling.plugins.base import Filter, Scorer
from router.scheduling.plugins.filters.admission import Admission, AdmissionParams
from router.scheduling.plugins.filters.healthy import Healthy
from router.scheduling.plugins.filters.in_subset import InSubset
from router.scheduling.plugins.filters.not_draining import NotDraining
from router.scheduling.plugins.filters.serves_model import ServesModel
from router.scheduling.plugins.pickers import min_score
from router.scheduling.plugins.pickers.min_score import SORTED_UP_TO, MinScore
from router.scheduling.plugins.pickers.random_pick import RandomPick
from router.scheduling.plugins.pickers.round_robin import RoundRobin
from router.scheduling.plugins.scorers import latency_cost
from router.scheduling.plugins.scorers.latency_cost import LatencyCost
from router.scheduling.snapshot import Snapshot

BS = 16
NOW = 100.0


@pytest.fixture(autouse=True, params=["compiled objective", "compiled, waits at once", "small-fleet paths",
                                      "array paths", "scalar objective"])
def paths(request, monkeypatch):
    """Every test five times: as built (the objective compiled, router/scheduling/_fastobjective.c), with each
    memory wait its worker's own search and with one search over every schedule; then without it: with the
    scorer's and the picker's few-worker shortcuts (the objective on each candidate's floats, a scalar memory
    wait per worker, the prefix match on lists, Python's sort) as they are; with the arrays forced for any fleet;
    and with the objective priced candidate by candidate for any fleet (the release schedules' search in numpy
    in all three)."""
    if request.param.startswith("compiled"):
        assert latency_cost.compiled_price is not None, \
            "router.scheduling._fastobjective was not built: is a C compiler installed?"
        if request.param == "compiled, waits at once":
            monkeypatch.setattr(latency_cost, "SCALAR_WAITS", 0)
        return
    monkeypatch.setattr(latency_cost, "compiled_price", None)
    monkeypatch.setattr(columns, "compiled_release_waits", None)
    if request.param == "array paths":
        monkeypatch.setattr(latency_cost, "SCALAR_WAITS", 0)
        monkeypatch.setattr(latency_cost, "SCALAR_CANDIDATES", 0)
        monkeypatch.setattr(min_score, "SORTED_UP_TO", 0)
        monkeypatch.setattr(snapshot, "LIST_MATCH_UP_TO", 0)
    elif request.param == "scalar objective":
        monkeypatch.setattr(latency_cost, "SCALAR_CANDIDATES", 1 << 30)


def chain(rng: random.Random, n: int, base: list[int] | None = None) -> list[int]:
    """Block keys: a prefix of ``base`` (when given) then fresh ones (prefix-closed, as real keys are)."""
    keep = base[: rng.randrange(len(base) + 1)] if base else []
    return keep + [rng.getrandbits(62) for _ in range(n - len(keep))]


def random_fleet(seed: int, n: int | None = None, tight: bool = False) -> tuple[RoutingCore, RouteRequest]:
    """A fleet with a bit of everything: unhealthy, draining, prefill-only and model-bound workers, workers
    without events, unsynced and suspect feeds, stale ones, loads that share the request's prefix, metrics
    fresh, stale and partial, capacities near full, fitted profiles, index hits on GPU and CPU, and
    speculative prefixes. ``tight``: caches the requests in flight nearly fill, so the memory wait is priced."""
    rng = random.Random(seed)
    core = RoutingCore(RoutingConfig(block_size=BS, seed=seed, max_inflight_requests=rng.choice([None, 4, 6]),
                                     max_inflight_tokens=rng.choice([None, 20_000])))
    n = n or rng.randrange(1, 40)
    prompt_blocks = rng.randrange(40 if tight else 1, 60)
    keys = chain(rng, prompt_blocks)
    prompt_tokens = prompt_blocks * BS + rng.randrange(BS)
    for j in range(n):
        wid = f"w{j}"
        core.upsert_endpoint(Endpoint(
            wid, f"10.0.0.{j}:8000", models=rng.choice([frozenset(), frozenset({"a"}), frozenset({"b"})]),
            loras=rng.choice([frozenset(), frozenset({"l"})]), healthy=rng.random() > 0.1,
            draining=rng.random() < 0.1, events=rng.random() > 0.1,
            role=rng.choice(["both", "both", "both", "prefill", "decode"])))
        held = chain(rng, rng.randrange(0, prompt_blocks + 5), keys)
        if held:
            core.index.store(wid, range(j * 10_000, j * 10_000 + len(held)), held,
                             rng.choice([Medium.GPU, Medium.GPU, Medium.CPU]))
        for r in range(rng.randrange(2 if tight else 0, 6)):
            own = chain(rng, rng.randrange(0, prompt_blocks + 3), keys if rng.random() < 0.5 else None)
            core.load.dispatch(f"{wid}-{r}", wid, len(own) * BS + 5, rng.randrange(0, 500), rng.randrange(1, 200),
                               NOW - rng.uniform(0, 0.1 if tight else 5), predicted_ttft_s=rng.choice([None, 0.05]),
                               keys=own, block_size=BS)
            if rng.random() < 0.5:
                core.load.first_token(f"{wid}-{r}", NOW - rng.uniform(0, 1))
        if tight or rng.random() < 0.8:
            core.update_metrics(wid, EngineMetrics(
                rng.choice([None, 0.0, 2.0, 7.0]), rng.choice([None, 1.0, 3.0]), rng.choice([None, 0.3, 0.95]),
                scraped_at=NOW - rng.choice([0.1, 0.5, 5.0]),
                cache_tokens=rng.choice([60 * BS, 120 * BS] if tight else [None, 200 * BS, 800 * BS])))
        if rng.random() < 0.3:  # a fitted profile
            for _ in range(10):
                core.cost.observe_ttft(wid, 0.05, 0.05 * rng.uniform(0.5, 2.0))
                core.cost.observe_step(wid, 0.01, 0.01 * rng.uniform(0.5, 2.0))
        u = rng.random()
        if u < 0.1:
            core.feeder.feeds[wid] = WorkerFeed(wid, synced=False)
        elif u < 0.2:
            core.worker_failed(wid, NOW - 1)
        elif u < 0.3:
            core.state.awaiting_events_since[wid] = NOW - 60
        if rng.random() < 0.1:
            core.state.speculative.record(wid, keys[: rng.randrange(len(keys) + 1)], NOW - 0.5)
    subset = frozenset(f"w{j}" for j in range(n) if rng.random() < 0.7) if rng.random() < 0.3 else None
    req = RouteRequest("q", keys, prompt_tokens, BS, max_tokens=rng.randrange(1, 300),
                       model=rng.choice([None, "a", "b"]), lora=rng.choice([None, None, "l"]), subset=subset,
                       role=rng.choice(["decode", "decode", "prefill"]))
    return core, req


FILTERS: list[Filter] = [Healthy(), NotDraining(), InSubset(), ServesModel(), Admission(AdmissionParams(3, None)),
                         Admission(AdmissionParams(None, 5000)), Admission(AdmissionParams(2, 3000))]


@pytest.mark.parametrize("seed", range(40))
def test_filter_masks_equal_the_per_candidate_filters(seed):
    core, req = random_fleet(seed)
    snap = Snapshot(core.state, req, NOW)
    for f in FILTERS:
        mask = f.mask(snap)
        verdicts = [f.filter(snap, c) for c in snap.candidates]
        assert mask.tolist() == [v is None for v in verdicts], f.type_name
        for i, v in enumerate(verdicts):
            if v is not None:
                assert f.reason(snap, i) == v


def reference_latency_cost(snap: Snapshot, cands: list) -> list[float]:
    """The objective per candidate, as the scorer computed it before it was vectorised: a ``Columns`` row and a
    memory wait (``Snapshot.memory_wait_s``) per candidate. (A LoRA request's adapter terms are added after the
    objective, the same way on every path: ``LatencyCost.objective`` is what this equals; tests/test_lora.py
    holds the adapter's terms.)"""
    req, costs = snap.request, snap.costs
    matches = snap.matches()
    keys = req.keys
    tail = tail_blocks(req.prompt_tokens, len(keys), req.max_tokens, req.block_size)
    cols = Columns(req.prompt_tokens, req.block_size, req.max_tokens)
    for c in cands:
        load, capacity = c.load, c.capacity_tokens
        new = len(keys) - (load.shared_prefix_blocks(keys) if load else 0) + tail
        wait = 0.0
        if capacity and load is not None and load.requests:
            step = costs.profile(c.worker_id).decode_step_s(load.active_blocks * req.block_size / capacity)
            wait = snap.memory_wait_s(c, step)
        cols.add(costs, c.worker_id, matches.get(c.worker_id), load, c.metrics, new,
                 snap.resident_tokens(c) if capacity else 0, capacity, wait)
    est = costs.estimate_many(cols, snap.reuse)
    return est.scores().tolist(), est


@pytest.mark.parametrize("seed", range(60))
def test_latency_cost_arrays_equal_the_per_candidate_objective(seed):
    core, req = random_fleet(seed)
    snap = Snapshot(core.state, req, NOW)
    rng = random.Random(seed)
    keep = np.array([i for i in range(snap.size) if rng.random() < 0.8], dtype=np.int64)
    snap.set_eligible_slots(keep)
    got = LatencyCost().objective(snap, keep).tolist()
    want, est = reference_latency_cost(snap, snap.eligible)
    assert got == want  # to the last bit: the picker's ties depend on it
    for k, c in enumerate(snap.eligible):  # the terms the reports show
        assert (c.queue_s, c.prefill_s, c.eviction_s, c.model_ttft_s) == (
            float(est.queue_s[k]), float(est.prefill_s[k]), float(est.eviction_s[k]), float(est.model_ttft_s[k]))
        m = snap.prefix(c)
        assert c.matched_blocks == (0 if m is None else m.gpu + m.cpu + m.storage)


@pytest.mark.parametrize("seed", range(30))
def test_memory_wait_arrays_equal_the_per_candidate_wait(seed):
    """Nearly full caches: the memory wait (a vector mask, then one binary search per row of the release
    schedules) equals each worker's own ``release_wait_s``, and is priced somewhere."""
    core, req = random_fleet(seed, n=30, tight=True)
    snap = Snapshot(core.state, req, NOW)
    got = LatencyCost().objective(snap, np.arange(snap.size)).tolist()
    assert got == reference_latency_cost(snap, snap.candidates)[0]
    assert any(snap.memory_wait_s(c, 0.01) > 0 for c in snap.candidates)


@pytest.mark.parametrize("seed", range(30))
def test_latency_cost_after_the_fleet_changes_between_decisions(seed):
    """The columns follow the writes between decisions (dispatches, completions, scrapes, fits): each decision
    still equals the per-candidate objective."""
    core, req = random_fleet(seed, n=12)
    rng = random.Random(seed)
    for step in range(8):
        snap = Snapshot(core.state, req, NOW)
        everyone = np.arange(snap.size)
        got = LatencyCost().objective(snap, everyone).tolist()
        assert got == reference_latency_cost(snap, snap.candidates)[0], step
        wid = f"w{rng.randrange(12)}"
        u = rng.random()
        if u < 0.4:
            core.load.dispatch(f"x{step}", wid, 300, 100, 50, NOW, keys=chain(rng, 10, list(req.keys)),
                               block_size=BS)
        elif u < 0.6 and core.load.inflight:
            core.load.complete(rng.choice(sorted(core.load.inflight)), NOW)
        elif u < 0.8:
            core.update_metrics(wid, EngineMetrics(1.0, 2.0, 0.5, scraped_at=NOW, cache_tokens=300 * BS))
        else:
            core.cost.observe_ttft(wid, 0.05, 0.2)


@pytest.mark.parametrize("seed", range(30))
def test_min_score_rank_equals_pick(seed):
    rng = random.Random(seed)
    n = rng.randrange(1, 60)
    # ties exact, ties within rounding, near ties either side of it, infinities
    pool = [0.5, 0.5 + 1e-12, 0.5 + 4e-10, 0.5 + 6e-10, 1.0, 2.0, float("inf"), 0.123456789049, 0.12345678905]
    scores = [rng.choice(pool) if rng.random() < 0.6 else rng.uniform(0, 3) for _ in range(n)]
    core, req = random_fleet(seed, n=n)
    snap = Snapshot(core.state, req, NOW)
    slots = np.arange(n)
    a, b = MinScore(rng=random.Random(7)), MinScore(rng=random.Random(7))
    assert a.rank(snap, slots, scores) == b.pick(snap, snap.candidates, scores)
    assert a.rng.random() == b.rng.random()  # the generator moved alike
    for cls in (RandomPick, RoundRobin):
        a, b = cls(rng=random.Random(3)), cls(rng=random.Random(3))
        for _ in range(3):
            assert a.rank(snap, slots, scores) == b.pick(snap, snap.candidates, scores)


@pytest.mark.parametrize("seed", range(6))
def test_min_score_rank_equals_pick_without_ties(seed):
    """Scores that all round apart (the ranking skips its tie-break sort): still pick's order, and the generator
    still moved by one draw per candidate; past 256 candidates the draws come from one ``getrandbits``."""
    rng = random.Random(seed)
    n = rng.choice([SORTED_UP_TO + 1, 100, 300])
    scores = rng.sample(range(10 * n), n)
    scores = [x / 7 for x in scores]
    core, req = random_fleet(seed, n=n)
    snap = Snapshot(core.state, req, NOW)
    a, b = MinScore(rng=random.Random(7)), MinScore(rng=random.Random(7))
    assert a.rank(snap, np.arange(n), scores) == b.pick(snap, snap.candidates, scores)
    assert a.rng.random() == b.rng.random()


@pytest.mark.parametrize("seed", range(40))
def test_a_wide_rankings_head_is_picks_first_few(seed):
    """A wide ranking orders its first ``HEAD`` when made and the rest when read: the head, read first, is
    ``pick``'s first few, on scores tied exactly, within rounding, near it on either side, at the k-th score's
    edge, large and infinite; then the whole ranking is ``pick``'s order."""
    rng = random.Random(seed)
    n = rng.choice([min_score.HEAD_FROM + 1, 100, 300, 1000])
    low = rng.choice([0.0, 1e-3, 0.5])  # the lowest of the spread-out scores (from 1e-3), or among them
    pool = [low, low + 1e-12, low + 4e-10, low + 6e-10, low + 1e-8, low + 2e-8, 0.123456789049, 0.12345678905,
            1e7 + 0.1, float("inf")]
    share = rng.choice([0.0, 0.05, 0.3])  # of the candidates on the pool's values (the rest spread out)
    scores = [rng.choice(pool) if rng.random() < share else rng.uniform(1e-3, 3) for _ in range(n)]
    core, req = random_fleet(seed % 6, n=n)
    snap = Snapshot(core.state, req, NOW)
    a, b = MinScore(rng=random.Random(seed)), MinScore(rng=random.Random(seed))
    ranked = a.rank(snap, np.arange(n), scores)
    want = b.pick(snap, snap.candidates, scores)
    assert a.rng.getstate() == b.rng.getstate()  # every draw made at once
    if share == 0.0 and n > min_score.HEAD_FROM:  # spread-out scores: the tail is left for when it is read
        assert isinstance(ranked, min_score.Ranking) and ranked._full is None
    assert [ranked[i] for i in range(min_score.HEAD)] == want[: min_score.HEAD]
    assert ranked[: min_score.HEAD] == want[: min_score.HEAD] and ranked[:3] == want[:3]
    assert len(ranked) == n and ranked[-1] == want[-1] and ranked[2:50:3] == want[2:50:3]
    assert list(ranked) == want and ranked == want and ranked[min_score.HEAD + 1] == want[min_score.HEAD + 1]


def test_a_ranking_reads_as_the_list_it_stands_for():
    """``Ranking``: its head without ordering the rest, anything past the head from the whole order (asked for
    once), equality with the list, a decision's ``as_dict`` a plain list."""
    asked = []

    def complete():
        asked.append(1)
        return ["a", "b", "c", "d", "e"]

    r = min_score.Ranking(["a", "b"], 5, complete)
    assert (r[0], r[1], r[:2], r[0:1], len(r)) == ("a", "b", ["a", "b"], ["a"], 5) and not asked
    assert r[-1] == "e" and r[1:4] == ["b", "c", "d"] and r[::2] == ["a", "c", "e"] and r[:9] == list("abcde")
    assert r == list("abcde") and r != list("abcd") and r != tuple("abcde") and "c" in r and asked == [1]
    with pytest.raises(IndexError):
        r[5]
    from router.scheduling.types import Decision
    d = Decision("precise", ranked=r)
    assert d.chosen == "a" and d.as_dict()["ranked"] == list("abcde")


@pytest.mark.parametrize("seed", range(6))
def test_the_array_order_keeps_the_candidates_order_among_equal_draws(seed):
    """Draws that repeat (the ranking's quicksort of them would put equal ones in any order): still by score,
    then draw, then the candidates' own order, as ``sorted`` gives it."""
    rng = random.Random(seed)
    n = rng.choice([40, 300])
    scores = [rng.choice([0.5, 1.0, 2.0]) if rng.random() < 0.7 else rng.uniform(0, 3) for _ in range(n)]
    draws = np.array([rng.choice([0.25, 0.5, 0.75]) for _ in range(n)])
    want = sorted(range(n), key=lambda i: (round(scores[i], 9), draws[i]))
    assert min_score.ordered(np.array(scores), draws).tolist() == want


def test_equal_draws_on_scores_that_round_alike_keep_the_candidates_order():
    """Two scores apart but rounding alike, with the same draw: ``sorted`` keeps them in the candidates' order
    (their keys are equal), not by the raw score."""
    for scores in ([0.1000000001, 0.1], [0.3, 0.2999999999, 0.3000000004], [2.0, 1.0000000003, 1.0]):
        draws = np.full(len(scores), 0.5)
        want = sorted(range(len(scores)), key=lambda i: (round(scores[i], 9), draws[i]))
        assert min_score.ordered(np.array(scores), draws).tolist() == want


class PerCandidateOnly(Filter):
    """A third-party filter with no vector form."""

    type_name = "test-odd-workers"

    def filter(self, snap, cand):
        return "odd" if int(cand.worker_id[1:]) % 2 else None


class LoadOnly(Scorer):
    type_name = "test-load-only"

    def score(self, snap, cands):
        return [float(c.inflight) for c in cands]


@pytest.mark.parametrize("seed", range(20))
def test_decisions_with_per_candidate_plugins(seed):
    """A profile mixing vector and per-candidate plugins decides as one whose filters and picker are asked
    per candidate: same ranking, same reports, same reasons (the latency-cost scorer's per-candidate form is
    checked against the objective above)."""
    core, req = random_fleet(seed, n=20)
    other, _ = random_fleet(seed, n=20)
    for c in (core, other):
        c.profile.filters.append(PerCandidateOnly())
        c.profile.scorers.append((LoadOnly(), 0.5))
    for f in other.profile.filters:  # the same filters, without their vector forms
        f.mask = lambda snap: None  # type: ignore[method-assign]
    other.profile.picker.rank = lambda snap, slots, scores: None  # type: ignore[method-assign]
    a, b = core.decide(req, NOW), other.decide(req, NOW)
    assert (a.outcome, a.reason, a.ranked, a.uncached_tokens, a.predicted_ttft_s) == (
        b.outcome, b.reason, b.ranked, b.uncached_tokens, b.predicted_ttft_s)
    assert [c.as_dict() for c in a.candidates] == [c.as_dict() for c in b.candidates]


@pytest.mark.parametrize("seed", range(20))
def test_lazy_reports(seed):
    """``Decision.report`` builds one candidate's report, the same object the full list holds later; the full
    list has every worker once, the eligible ones first, the filtered with their reasons."""
    core, req = random_fleet(seed, n=25)
    d = core.decide(req, NOW)
    if d.outcome != "routed":
        assert all(c.filtered for c in d.candidates)
        return
    chosen = d.report(d.chosen)
    assert chosen is not None and chosen.filtered is None
    assert d.report("nobody") is None
    reports = d.candidates
    assert sorted(c.worker_id for c in reports) == sorted(core.endpoints)
    assert next(c for c in reports if c.worker_id == d.chosen) is chosen
    eligible = [c for c in reports if not c.filtered]
    assert reports[: len(eligible)] == eligible
    assert sorted(c.worker_id for c in eligible) == sorted(d.ranked)
    assert d.report(d.chosen) is chosen
    assert chosen.score == min(c.score for c in eligible)


@pytest.mark.parametrize("seed", range(20))
def test_prefix_credited_without_the_reports(seed):
    core, req = random_fleet(seed, n=15)
    d = core.decide(req, NOW)
    lazy = d.prefix_credited
    assert lazy == any(c.prefix_credit for c in d.candidates if not c.filtered) == d.prefix_credited


@pytest.mark.parametrize("seed", range(50))
def test_first_key_holders_follow_the_requests_in_flight(seed):
    """The shared-prefix search is skipped when no request in flight starts with the prompt's first key: the
    count must follow every dispatch, retry, completion and forgotten worker, or a search would be skipped wrongly."""
    from collections import Counter

    from router.load import LoadTracker

    rng = random.Random(seed)
    tracker = LoadTracker()
    prefixes = [[rng.getrandbits(64) for _ in range(4)] for _ in range(3)]
    for step in range(60):
        op = rng.random()
        if op < 0.55:
            keys = rng.choice(prefixes)[: rng.randrange(0, 5)]
            tracker.dispatch(f"r{rng.randrange(20)}", f"w{rng.randrange(4)}", 64, 64, 8, float(step), keys=keys)
        elif op < 0.9 and tracker.inflight:
            tracker.complete(rng.choice(sorted(tracker.inflight)), float(step))
        else:
            tracker.forget_worker(f"w{rng.randrange(4)}")
        expected = Counter(r.keys[0] for r in tracker.inflight.values() if r.keys)
        assert tracker.first_key_holders == dict(expected)
        for w in tracker.workers.values():  # a worker's shared prefix is non-zero only where the count says so
            for p in prefixes:
                if w.shared_prefix_blocks(p):
                    assert p[0] in tracker.first_key_holders


@pytest.mark.parametrize("layout", ["dicts", "compact"])
def test_the_index_answer_lands_on_each_workers_own_slot(layout):
    """The index answers by its own slots (``match_lengths``, ``blocks_by_slot``), which are not the fleet's:
    workers stored in another order than the endpoints', a slot freed and reused, a worker the index knows and
    the fleet does not, an endpoint the index has never heard of. Each fleet slot reads its own worker's."""
    rng = random.Random(3)
    core = RoutingCore(RoutingConfig(block_size=BS, index=layout))
    keys = [rng.getrandbits(62) for _ in range(30)]
    names = [f"w{j}" for j in range(12)]
    held = {w: rng.randrange(0, 31) for w in names}
    held["w3"] = 0  # an endpoint the index never hears of
    h = 0
    for w in ["gone", *reversed(names)]:  # the index's slots: the reverse of the fleet's order, after "gone"
        n = 25 if w == "gone" else held[w]
        if n:
            core.index.store(w, range(h, h + n), keys[:n], Medium.GPU)
            core.index.store(w, range(h + 100, h + 100 + n), [rng.getrandbits(62) for _ in range(n)], Medium.GPU)
            h += 1000
    core.index.remove_worker("w7")  # its slot is freed and taken again
    core.index.store("w7", [h], keys[:1], Medium.GPU)
    held["w7"] = 1
    for w in names:
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{names.index(w) + 1}:8000"))
    snap = Snapshot(core.state, RouteRequest("r", keys, len(keys) * BS, BS, 16), NOW)
    arrays = snap.match_arrays()
    got = {w: int(arrays["matched_gpu"][snap.slot[w]]) for w in names}
    assert got == held
    resident = snap.resident_blocks(np.arange(snap.size))
    assert {w: int(resident[snap.slot[w]]) for w in names} == {
        w: core.index.blocks_held_on(w, Medium.GPU) for w in names}
    assert core.index.blocks_held_on("w7", Medium.GPU) == 1
    assert snap.matches()["w5"] == core.index.match(keys).get("w5")


@pytest.mark.parametrize("seed", range(40))
def test_the_prefix_match_on_lists_equals_the_arrays(seed, monkeypatch):
    """A fleet of a few workers has its prefix match worked out on lists (``LIST_MATCH_UP_TO``): every slot's
    credited and raw match and its speculative prefix, eligible or not, are what the array form gives."""
    core, req = random_fleet(seed, n=random.Random(seed).randrange(1, 9))
    keep = np.array([i for i in range(len(core.endpoints)) if random.Random(seed + i).random() < 0.7], dtype=np.int64)

    def answer(few: int) -> tuple:
        monkeypatch.setattr(snapshot, "LIST_MATCH_UP_TO", few)
        snap = Snapshot(core.state, req, NOW)
        snap.set_eligible_slots(keep)
        arrays = snap.match_arrays()
        held = [0 if m is None else m.gpu + m.cpu + m.storage for m in snap.matches().values()]
        assert snap.best_held() == max(held, default=0)  # (for plugins: what the best candidate holds)
        return ({name: a.tolist() for name, a in arrays.items()}, [a.tolist() for a in snap._raw_matches],
                snap.matches())

    assert answer(1 << 30) == answer(0)


@pytest.mark.parametrize("n", [0, 1, 33, min_score._DRAWS_BY_BITS - 1, min_score._DRAWS_BY_BITS, 1000])
def test_a_rankings_draws_are_the_generators_own(n):
    """``draws_of`` reads a wide ranking's tie-break draws from one ``getrandbits``: the same values as one
    ``random()`` each, and the generator left in the same state (the next decision draws the same too)."""
    for seed in range(20):
        ours, theirs = random.Random(seed), random.Random(seed)
        assert min_score.draws_of(ours, n).tolist() == [theirs.random() for _ in range(n)]
        assert ours.getstate() == theirs.getstate()
