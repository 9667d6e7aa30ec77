"""llm-d's learned latency predictor as the ``llmd_predicted`` peer's own (router/scheduling/plugins/scorers/
peer_llmd_latency_predictor.py): gradient-boosted trees trained online on what the lifecycle observes, a bounded
window, the router's own predictions until trained, and its predictions what the simulator's figures judge."""

from __future__ import annotations

import random

import numpy as np
import pytest

from router.load.metrics import EngineMetrics
from router.scheduling import RoutingConfig, RoutingCore
from router.scheduling.plugins.registry import REGISTRY
from router.scheduling.plugins.scorers.peer_llmd_latency_predictor import (
    FEATURES,
    TTFT_FEATURES,
    LlmdLatencyPredictor,
    LlmdLatencyPredictorParams,
    OnlineRegressor,
    report_row,
    router_step,
    router_ttft,
)
from router.scheduling.profiles import SchedulingConfig, build_profile
from sim.runner import SimConfig, SimResult, Simulation, summarise
from sim.suite import SYNTH_ENGINE
from sim.workload import tokens_for_block, zipf_prefixes
from tests.test_routing_core import request


def synthetic_ttft(row: np.ndarray) -> float:
    """A queue and a prefill: 5 ms, 4 ms per waiting request, 1 ms per running one, 20 us per uncached token."""
    return 0.005 + 0.004 * row[1] + 0.001 * row[2] + 2e-5 * row[5]


def synthetic_tpot(row: np.ndarray) -> float:
    return 0.01 + 0.002 * row[2] + 0.02 * row[0]


def random_rows(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    prompt = rng.integers(64, 4096, n).astype(float)
    hit = np.floor(prompt * rng.random(n) / 16) * 16
    return np.column_stack([rng.random(n), rng.integers(0, 20, n), rng.integers(0, 30, n), prompt, hit,
                            prompt - hit, rng.integers(16, 256, n)]).astype(float)


def median_rel_error(predicted: np.ndarray, truth: np.ndarray) -> float:
    return float(np.median(np.abs(predicted - truth) / truth))


def test_it_learns_a_known_relation_online_and_is_silent_before_min_samples():
    p = LlmdLatencyPredictorParams(min_samples=64)
    model = OnlineRegressor(TTFT_FEATURES, p)
    train, test = random_rows(1000, 0)[:, :TTFT_FEATURES], random_rows(300, 1)[:, :TTFT_FEATURES]
    truth = np.array([synthetic_ttft(r) for r in test])
    for k, row in enumerate(train[:63]):
        model.observe(row, synthetic_ttft(row), float(k))
    assert not model.trained and model.predict(test) is None  # 63 < K: nothing to say yet
    model.observe(train[63], synthetic_ttft(train[63]), 63.0)
    assert model.trained
    early = median_rel_error(model.predict(test), truth)
    for k, row in enumerate(train[64:]):
        model.observe(row, synthetic_ttft(row), 64.0 + k)
    late = median_rel_error(model.predict(test), truth)
    assert late < 0.1 and late < early  # more observations, a better model
    # a spread the relation has: the fit ranks what it was never shown in the order the relation does
    order = np.argsort(model.predict(test))
    assert np.corrcoef(np.argsort(order), np.argsort(np.argsort(truth)))[0, 1] > 0.95


def test_the_window_is_bounded_and_the_model_follows_the_recent_relation():
    """A relation that changes: a model on all it ever saw would predict between the two; the window holds the
    last ``window`` observations only, and retrains at K, at each doubling, then every ``retrain_every``."""
    p = LlmdLatencyPredictorParams(min_samples=32, window=128, retrain_every=64, retrain_interval_s=0.0)
    model = OnlineRegressor(TTFT_FEATURES, p)
    rows = random_rows(300, 2)[:, :TTFT_FEATURES]
    for k, row in enumerate(rows):
        model.observe(row, 0.1 if k < 150 else 1.0, float(k))
    assert model.x.shape == (128, TTFT_FEATURES) and model.held == 128 and model.seen == 300
    assert model.fits == 5 and model.trained_on == 288  # at 32, 96, 160, 224 and 288: bounded work
    # the last fit saw observations 160..287, all of the new relation but one in ten of them
    for k, row in enumerate(rows[:64]):
        model.observe(row, 1.0, 300.0 + k)
    assert model.fits == 6  # at 352: the window holds 224..351, the new relation alone
    assert np.allclose(model.predict(rows[:20]), 1.0, rtol=1e-6)


def test_retraining_waits_for_its_interval_as_well_as_its_count():
    """At most one fit per ``retrain_interval_s`` of the observations' clock (llm-d's training sidecar retrains
    every second), however fast they come; and at most one per ``retrain_every`` observations."""
    p = LlmdLatencyPredictorParams(min_samples=64, retrain_every=32, retrain_interval_s=1.0)
    model = OnlineRegressor(TTFT_FEATURES, p)
    rows = random_rows(1000, 4)[:, :TTFT_FEATURES]
    fitted = []
    for k, row in enumerate(rows):  # 128 a second: the interval binds
        model.observe(row, synthetic_ttft(row), k / 128)
        if model.fitted_at not in fitted:
            fitted.append(model.fitted_at)
    assert fitted[1] == 63 / 128 and list(np.diff(fitted[1:])) == [1.0] * 7  # the first at K, then each second
    assert model.fits == len(fitted) - 1 == 8
    slow = OnlineRegressor(TTFT_FEATURES, p)
    for k, row in enumerate(rows[:200]):  # one a second: the count binds
        slow.observe(row, synthetic_ttft(row), float(k))
    assert slow.fits == 1 + (200 - 64) // 32


def test_bad_observations_are_not_learned():
    model = OnlineRegressor(TTFT_FEATURES, LlmdLatencyPredictorParams())
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        model.observe(np.zeros(TTFT_FEATURES), bad, 0.0)
    assert model.seen == 0


def test_parameters_are_checked():
    with pytest.raises(ValueError):
        LlmdLatencyPredictorParams(min_samples=100, window=50)
    with pytest.raises(ValueError):
        LlmdLatencyPredictorParams(learning_rate=0.0)


def test_it_is_registered_and_llmd_predicted_is_built_with_it():
    assert REGISTRY["llmd-latency-predictor"] is LlmdLatencyPredictor
    profile = build_profile("llmd_predicted", SchedulingConfig(), random.Random(0))
    assert [type(s).type_name for s, _ in profile.scorers] == ["latency-cost", "llmd-latency-predictor"]
    assert profile.picker.type_name == "llmd-headroom"


def _fleet(n: int = 4, policy: str = "llmd_predicted",
           scheduling: dict | None = None) -> tuple[RoutingCore, RoutingCore]:
    """A core of ``policy`` and a precise one on the same fleet state (the same latency scorer's predictions)."""
    from router.scheduling.types import Endpoint

    peer = RoutingCore(RoutingConfig(policy=policy, block_size=16, seed=1, scheduling=scheduling))
    for i in range(n):
        peer.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    own = RoutingCore(RoutingConfig(policy="precise", block_size=16, seed=1))
    own.state, own.dispatches = peer.state, peer.dispatches
    return peer, own


def _serve(peer: RoutingCore, own: RoutingCore, n: int, truth) -> tuple[list[float], list[float], list]:
    """``n`` requests through ``peer`` on a synthetic fleet: each round the engines' own counts are scraped anew
    (nothing of this router's stays in flight), the chosen worker answers ``truth(row, router's TTFT, router's
    step)`` (TTFT, TPOT). Returns the relative TTFT errors of ``peer``'s and the router's own predictions over the
    last half, and the decisions' (peer, own) pairs."""
    scorer = next(s for s, _ in peer.profile.scorers if isinstance(s, LlmdLatencyPredictor))
    rng = random.Random(3)
    now, learned_err, own_err, pairs = 0.0, [], [], []
    for i in range(n):
        for w in peer.endpoints:
            peer.update_metrics(w, EngineMetrics(float(rng.randrange(20)), float(rng.randrange(30)), rng.random(), now))
        req = request(tokens_for_block(i, rng.randrange(64, 2048)).tolist(), f"r{i}", max_tokens=rng.randrange(16, 256))
        d, ref = peer.decide(req, now), own.decide(req, now)
        assert d.outcome == "routed"
        pairs.append((d, ref))
        for w in peer.endpoints:  # where the residual reads the latency scorer's predictions back
            r = ref.report(w)
            assert router_ttft(r) == pytest.approx(r.ttft_s, rel=1e-12) and r.ttft_s > 0
            assert router_step(r, req) == pytest.approx(r.step_s, rel=1e-12) and r.step_s > 0
        chosen = d.report(d.chosen)
        row = report_row(chosen, req)
        assert row.shape == (len(FEATURES),)
        # the row it will learn on is the one the decision predicted on
        slots = np.array([peer.state.columns.slot[d.chosen]])
        assert np.array_equal(scorer.rows(d._source._snap, slots)[0], row, equal_nan=True)
        base = ref.report(d.chosen)
        ttft, tpot = truth(row, base.ttft_s, base.step_s)
        if i >= n // 2:
            learned_err.append(abs(d.predicted_ttft_s - ttft) / ttft)
            own_err.append(abs(base.ttft_s - ttft) / ttft)
        h = peer.dispatch(req, d, d.chosen, now)
        h.first_token(now + ttft)
        h.complete(now + ttft + tpot * (req.max_tokens - 1), output_tokens=req.max_tokens)
        now += 1.0
    assert scorer.ttft.seen == scorer.tpot.seen == n
    return learned_err, own_err, pairs


def test_through_the_core_it_falls_back_then_predicts_what_the_engines_show():
    """A synthetic fleet whose engines answer by a known relation of what their metrics show: before K served
    requests every candidate carries the latency scorer's predictions; after, the learned ones, close to the
    relation, and what each decision reports for its choice."""
    peer, own = _fleet()
    k = LlmdLatencyPredictorParams().min_samples
    learned_err, own_err, pairs = _serve(peer, own, 2 * k + 200,
                                         lambda row, ttft, step: (synthetic_ttft(row), synthetic_tpot(row)))
    for i, (d, ref) in enumerate(pairs):
        ours, theirs = d.report(d.chosen), ref.report(d.chosen)
        if i < k:  # untrained: the router's own predictions, candidate by candidate
            assert [d.report(w).ttft_s for w in peer.endpoints] == [ref.report(w).ttft_s for w in peer.endpoints]
            assert [d.report(w).step_s for w in peer.endpoints] == [ref.report(w).step_s for w in peer.endpoints]
        elif i > k:  # trained (at the K-th first token): the learned ones, reported for the choice
            assert d.predicted_ttft_s == ours.ttft_s != theirs.ttft_s
            assert d.predicted_tpot_s == ours.step_s != theirs.step_s
    assert np.median(learned_err) < 0.15 < np.median(own_err)


def test_the_residual_learns_what_the_routers_own_model_misses():
    """``residual: true``: the router's prediction times a learned factor. Engines slower than the router's model
    by a factor of their queue keep its prediction's shape: the residual learns the factor alone, to a few
    percent, where the router's own predictions are off by a third or more."""
    sched = {"plugins": [{"type": "llmd-latency-predictor", "name": "learner",
                          "parameters": {"residual": True, "quantile": None}}],
             "profiles": [{"name": "corrected", "plugins": ["healthy", "latency-cost", "learner", "meets-objective"]}]}
    peer, own = _fleet(policy="corrected", scheduling=sched)
    learned_err, own_err, _ = _serve(peer, own, 400, lambda row, ttft, step: (ttft * (1.5 + 0.05 * row[1]),
                                                                               step * (1.2 + 0.5 * row[0])))
    assert np.median(learned_err) < 0.05 and np.median(own_err) > 0.3


def test_a_simulated_run_of_llmd_predicted_reports_the_learned_predictions_quality():
    """The simulator runs the same plugin: its summary's ``prediction`` judges the learned model, whose predictions
    the records carry once it is trained (a twin run whose predictor never learns, as without lightgbm, carries
    the latency scorer's: the same until the first fit, different after)."""
    reqs = zipf_prefixes(240, 8, 1024, 1.1, (64, 256), 64, rate=30.0)

    def run(learns: bool) -> tuple[Simulation, SimResult]:
        sim = Simulation(reqs, SimConfig(workers=4, policy="llmd_predicted", engine=SYNTH_ENGINE))
        scorer = next(s for s, _ in sim.core.profile.scorers if isinstance(s, LlmdLatencyPredictor))
        scorer.learns = learns
        return sim, sim.run()

    sim, res = run(True)
    scorer = next(s for s, _ in sim.core.profile.scorers if isinstance(s, LlmdLatencyPredictor))
    assert scorer.ttft.trained and scorer.ttft.seen == 240 and scorer.tpot.trained
    q = summarise(res)["prediction"]
    assert q is not None and q["ttft_n"] == 240 and q["tpot_n"] == 240
    assert q["ttft_median_rel_error"] is not None and q["tpot_rank_corr"] is not None
    _, twin = run(False)
    ours = [r.predicted_ttft_s for r in res.records]
    theirs = [r.predicted_ttft_s for r in twin.records]
    assert ours[:30] == theirs[:30]  # dispatched before 64 first tokens were seen: the router's predictions
    assert all(a != b for a, b in zip(ours[-50:], theirs[-50:], strict=True))


def test_without_lightgbm_it_says_so_once_and_the_routers_predictions_stand(monkeypatch, caplog):
    from router.scheduling.plugins.scorers import peer_llmd_latency_predictor as module

    monkeypatch.setattr(module, "lightgbm_available", lambda: False)
    monkeypatch.setattr(module, "_warned", False)
    with caplog.at_level("WARNING", logger=module.__name__):
        first, second = LlmdLatencyPredictor(), LlmdLatencyPredictor()
    assert [r.getMessage() for r in caplog.records if "lightgbm" in r.getMessage()] == [
        "llmd-latency-predictor: lightgbm is not installed (pip install 'kvrouter[learn]'): it learns nothing and "
        "the router's own predictions stand"]
    req = request(tokens_for_block(1, 256).tolist(), max_tokens=32)
    from router.scheduling.types import CandidateReport

    for k in range(200):
        first.on_observed(req, "w0", CandidateReport("w0"), 0.1, 0.01, float(k))
    assert first.ttft.seen == first.tpot.seen == 0 and not first.ttft.trained and not second.learns


def test_a_training_failure_never_fails_the_observation_that_fed_it(monkeypatch):
    """The learner trains inside the lifecycle's observation hooks: an error there (a native library that does not
    load, a LightGBM error) must leave the request's completion alone and the previous model standing."""
    p = LlmdLatencyPredictorParams(min_samples=4, retrain_every=1, retrain_interval_s=0.0)
    model = OnlineRegressor(TTFT_FEATURES, p)

    def broken(now: float) -> None:
        raise OSError("libgomp.so.1: cannot open shared object file")

    monkeypatch.setattr(model, "fit", broken)
    for i in range(8):
        model.observe(np.full(TTFT_FEATURES, float(i)), 0.1 + i * 0.01, float(i))  # no exception
    assert model.seen == 8 and not model.trained
