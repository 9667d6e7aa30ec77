"""``llmd-latency-predictor``: llm-d's learned latency predictors, as the ``llmd_predicted`` profile's own
predictions (its ``llmd-headroom`` picker reads them).

llm-d's predicted-latency routing (llm-d docs "Predicted Latency-Based Routing", guides/predicted-latency-based-
scheduling; the llm-d-inference-scheduler's ``latencypredictor`` training and prediction sidecars) predicts each
candidate pod's TTFT and TPOT with gradient-boosted trees trained online on the traffic it routes: per request, the
pod's KV-cache usage, waiting and running requests as the scheduler saw them, the prompt's length and the share of
it the pod holds (``prefix_cache_score``; the TTFT model also gets ``(1 - score) x input length``, the tokens left
to compute), against the TTFT and TPOT the stream then showed. The training sidecar keeps a bounded sample window
and retrains when enough new samples came.

Here the same, in-process: per decision one model call per target over the candidates' feature rows (read from the
snapshot: the engine view's waiting, running and KV use, NaN without fresh metrics, which the trees route as
missing; the prompt, hit and uncached tokens; the request's ``max_tokens``, where llm-d gives the TPOT model the
tokens generated so far, its TPOT being sampled along the stream and ours the request's mean). The predictions
replace the candidates' ``ttft_s`` and ``step_s`` (where the latency scorer before it wrote its own), so the picker, the
decision's ``predicted_ttft_s`` / ``predicted_tpot_s`` and the simulator's prediction figures are the learned
model's. Training happens only on the lifecycle's observations (``on_observed``: the TTFT from the dispatch at the
first token, the time per output token at the end), with the features of the decision that sent the request
(its report of the worker: what was known then); a decision itself changes nothing.

Online and bounded: each target keeps the last ``window`` observations (a ring: bounded memory) and is retrained
from scratch on them once ``retrain_every`` new ones came and ``retrain_interval_s`` passed since the last fit
(llm-d's training sidecar retrains every second, ``LATENCY_RETRAINING_INTERVAL_SEC: 1`` in its guide), so the
training work is bounded per observation and per second, and a decision costs one prediction per target. Until a
target has ``min_samples`` observations the router's own prediction stands (llm-d's sidecar answers nothing
until its first model). The library is LightGBM (one of llm-d's predictor types besides XGBoost and Bayesian
ridge), trained on one thread, deterministically: a prediction over a few candidates costs tens of microseconds,
scikit-learn's histogram GBDT about a millisecond (measured on this project's machine). LightGBM is the optional
``learn`` extra (``pip install 'kvrouter[learn]'``); without it the predictor never trains, says so once in the
log, and the router's predictions stand.

Target: the logarithm of the latency (llm-d fits the milliseconds): latencies span three orders of magnitude
between an idle and a saturated fleet, and an error in seconds would fit the saturated tail and leave the ranking
of lightly loaded candidates to noise; in logs the error is relative, the figure the simulator reports. The loss
is llm-d's default, the pinball loss of its 0.9 quantile (``quantile``; a quantile of the log is the log of the
quantile): routing on a p90 keeps the headroom rule's bin-packing from packing workers past their targets.
``quantile: null`` fits the squared error instead, a geometric mean: the figure to set beside the router's own
point predictions. ``residual: true`` (not llm-d's) learns the router's own error instead, the log of observed over
the latency scorer's prediction, with that prediction among the features, and predicts it times the learned
factor: what the router's model knows (its queue, the memory wait, an adapter's load) stays, what it misses is
learned (the scorer's prediction is read back from the report's ``queue_s + prefill_s`` and ``decode_s /
max_tokens``, the fields this does not replace). As llm-d's, the model is one for the pool (its stated
assumption: a homogeneous pool); the worker is not a feature.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from router.scheduling.plugins.base import Scorer
from router.scheduling.snapshot import Candidate, Snapshot
from router.scheduling.types import CandidateReport, RouteRequest

log = logging.getLogger(__name__)
_warned = False  # that lightgbm is missing: said once per process

# the feature columns, in order: llm-d's kv_cache_percentage, num_request_waiting, num_request_running,
# input_token_length, the prefix it holds (its prefix_cache_score x input length), the tokens left to compute
# (its effective_input_tokens), and the request's max_tokens
FEATURES = ("kv_usage", "waiting", "running", "prompt_tokens", "hit_tokens", "uncached_tokens", "max_tokens")
TTFT_FEATURES = len(FEATURES) - 1  # the TTFT model reads all but max_tokens (as llm-d's)


@dataclass(frozen=True)
class LlmdLatencyPredictorParams:
    min_samples: int = 64  # K: observations a target needs before its model replaces the router's prediction
    window: int = 2048  # N: the last observations each model trains on (bounded memory and training work)
    retrain_every: int = 32  # M: new observations a retrain needs at least
    retrain_interval_s: float = 1.0  # and at least this long since the last (llm-d's LATENCY_RETRAINING_INTERVAL_SEC)
    trees: int = 100  # boosting rounds
    leaves: int = 15  # leaves per tree
    learning_rate: float = 0.1
    min_leaf: int = 10  # observations per leaf at least
    # None: the (geometric) mean; a value in (0, 1): that quantile, as llm-d's (its default 0.9)
    quantile: float | None = 0.9
    # learn the router's error instead: log(observed / the latency scorer's prediction), that prediction a feature
    residual: bool = False

    def __post_init__(self) -> None:
        if self.min_samples < 2 or self.window < self.min_samples or self.retrain_every < 1:
            raise ValueError("need 2 <= min_samples <= window and retrain_every >= 1")
        if self.retrain_interval_s < 0 or not math.isfinite(self.retrain_interval_s):
            raise ValueError("retrain_interval_s must be finite and >= 0")
        if self.trees < 1 or self.leaves < 2 or self.min_leaf < 1 or not 0.0 < self.learning_rate <= 1.0:
            raise ValueError("need trees >= 1, leaves >= 2, min_leaf >= 1 and learning_rate in (0, 1]")
        if self.quantile is not None and not 0.0 < self.quantile < 1.0:
            raise ValueError("quantile must be in (0, 1)")


_usable: bool | None = None  # whether lightgbm imports here (found and its native library loads): asked once


def lightgbm_available() -> bool:
    """Whether lightgbm can be used: installed, and its native library (which links the system's OpenMP runtime,
    libgomp) loads; a missing runtime is an OSError at import, and the router's own predictions stand then."""
    global _usable
    if _usable is None:
        _usable = False
        if importlib.util.find_spec("lightgbm") is not None:
            try:
                import lightgbm  # noqa: F401
            except (ImportError, OSError) as e:
                log.warning("llmd-latency-predictor: lightgbm does not load (%s): it learns nothing", e)
            else:
                _usable = True
    return _usable


class OnlineRegressor:
    """A gradient-boosted model of log(latency) over the last ``window`` observations: a ring of feature rows and
    targets, retrained from scratch when enough new ones came. Pure: nothing here reads a clock."""

    def __init__(self, n_features: int, p: LlmdLatencyPredictorParams) -> None:
        self.p = p
        self.x = np.zeros((p.window, n_features))
        self.y = np.zeros(p.window)
        self.seen = 0  # observations taken, all time (the ring holds the last ``window`` of them)
        self.trained_on = 0  # ``seen`` at the last fit
        self.fitted_at = -math.inf  # ``now`` at the last fit
        self.fits = 0
        self.model: Any = None  # a lightgbm.Booster once trained

    @property
    def held(self) -> int:
        return min(self.seen, self.p.window)

    @property
    def trained(self) -> bool:
        return self.model is not None

    def observe(self, row: np.ndarray, latency_s: float, now: float) -> None:
        """One observation at ``now``; retrains when due (``due``)."""
        if not (latency_s > 0 and math.isfinite(latency_s)):
            return
        at = self.seen % self.p.window
        self.x[at] = row
        self.y[at] = math.log(latency_s)
        self.seen += 1
        if self.due(now):
            try:
                self.fit(now)
            except Exception as e:  # a peer's learner must never fail the request that fed it (lifecycle hooks)
                log.warning("llmd-latency-predictor: training failed (%r): the previous model stands", e)
                self.trained_on, self.fitted_at = self.seen, now  # (not retried at once)

    def due(self, now: float) -> bool:
        """The first model at ``min_samples`` observations; then a retrain once ``retrain_every`` new ones came and
        ``retrain_interval_s`` passed since the last: at most one fit per interval and per M observations."""
        if self.held < self.p.min_samples:
            return False
        if self.model is None:
            return True
        return self.seen - self.trained_on >= self.p.retrain_every and now - self.fitted_at >= self.p.retrain_interval_s

    def fit(self, now: float) -> None:
        import lightgbm

        p, n = self.p, self.held
        objective = {"objective": "regression"} if p.quantile is None else {"objective": "quantile",
                                                                            "alpha": p.quantile}
        params = {**objective, "num_leaves": p.leaves, "learning_rate": p.learning_rate,
                  "min_data_in_leaf": p.min_leaf, "max_bin": 63, "num_threads": 1, "deterministic": True,
                  "force_row_wise": True, "seed": 0, "verbose": -1}
        data = lightgbm.Dataset(self.x[:n], self.y[:n], params={"verbose": -1, "max_bin": 63}, free_raw_data=True)
        self.model = lightgbm.train(params, data, num_boost_round=p.trees)
        self.trained_on, self.fitted_at = self.seen, now
        self.fits += 1

    def predict(self, rows: np.ndarray) -> np.ndarray | None:
        """The predicted latency (seconds) of each row; None until trained."""
        if self.model is None:
            return None
        return np.exp(self.model.predict(rows, num_threads=1))


def feature_rows(kv: np.ndarray, waiting: np.ndarray, running: np.ndarray, matched_blocks: np.ndarray,
                 req: RouteRequest) -> np.ndarray:
    """The candidates' rows (``FEATURES``), one formula for the decision and the observation."""
    n = len(kv)
    prompt = req.prompt_tokens
    hit = np.minimum(matched_blocks * req.block_size, max(prompt - 1, 0)).astype(float)  # ``hit_tokens``
    out = np.empty((n, len(FEATURES)))
    out[:, 0], out[:, 1], out[:, 2] = kv, waiting, running
    out[:, 3] = prompt
    out[:, 4] = hit
    out[:, 5] = prompt - hit
    out[:, 6] = req.max_tokens
    return out


def report_row(report: CandidateReport, req: RouteRequest) -> np.ndarray:
    """The feature row of the worker a decision chose, from its report: what the decision knew of it (the engine
    view it read, when fresh; the prefix it credited)."""
    m = getattr(report, "metrics", None)  # a decision's reports are its ``Candidate``s

    def value(v: float | None) -> float:
        return np.nan if v is None else float(v)

    kv, waiting, running = ((value(m.kv_usage), value(m.waiting), value(m.running)) if m is not None
                            else (np.nan, np.nan, np.nan))
    return feature_rows(np.array([kv]), np.array([waiting]), np.array([running]),
                        np.array([report.matched_blocks]), req)[0]


def with_base(rows: np.ndarray, base: np.ndarray) -> np.ndarray:
    """The rows of a residual model: the features and the log of the router's own prediction."""
    return np.column_stack([rows, np.log(base)])


def router_ttft(report: CandidateReport) -> float:
    """The latency scorer's TTFT in a report whose ``ttft_s`` this predictor may have replaced: its queue and its
    prefill (``ttft_s`` as the scorer writes it; a test holds the two equal)."""
    return report.queue_s + report.prefill_s


def router_step(report: CandidateReport, req: RouteRequest) -> float:
    """The latency scorer's decode step, likewise: its decode over the request's ``max_tokens``."""
    return report.decode_s / req.max_tokens if req.max_tokens > 0 else 0.0


class LlmdLatencyPredictor(Scorer):
    type_name = "llmd-latency-predictor"
    Params = LlmdLatencyPredictorParams
    uses_prefix = True

    def __init__(self, params: Any = None, **kw: Any) -> None:
        super().__init__(params, **kw)
        p = self.params
        extra = 1 if p.residual else 0  # the router's own prediction, a feature of its error
        self.ttft = OnlineRegressor(TTFT_FEATURES + extra, p)
        self.tpot = OnlineRegressor(len(FEATURES) + extra, p)
        self.learns = lightgbm_available()
        global _warned
        if not self.learns and not _warned:
            _warned = True
            log.warning("llmd-latency-predictor: lightgbm is not installed (pip install 'kvrouter[learn]'): "
                        "it learns nothing and the router's own predictions stand")

    # ---- a decision: no side effects ------------------------------------------------------------
    def rows(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """``FEATURES`` of the candidates at ``slots``, as the snapshot shows them."""
        cols, fresh = snap.cols, snap.fresh[slots]
        nan = np.full(len(slots), np.nan)
        a = snap.match_arrays()
        matched = a["matched_gpu"][slots] + a["matched_cpu"][slots] + a["matched_storage"][slots]
        return feature_rows(np.where(fresh, cols.kv[slots], nan), np.where(fresh, cols.waiting[slots], nan),
                            np.where(fresh, cols.running[slots], nan), matched, snap.request)

    def score_slots(self, snap: Snapshot, slots: np.ndarray) -> np.ndarray:
        """Scores nothing (0 each): it writes the learned TTFT and TPOT into the candidates' ``ttft_s`` and
        ``step_s``, for the targets trained so far (the others keep what the latency scorer wrote)."""
        if (self.ttft.trained or self.tpot.trained) and len(slots) and snap.request.role != "prefill":
            x = self.rows(snap, slots)
            fields = {}
            for name, model, cols in (("ttft_s", self.ttft, TTFT_FEATURES), ("step_s", self.tpot, len(FEATURES))):
                if not model.trained:
                    continue
                if not self.params.residual:
                    fields[name] = model.predict(x[:, :cols])
                    continue
                base = snap.report_values(name, slots)  # the latency scorer's, before this
                known = base > 0
                if not known.any():
                    continue
                out = base.copy()
                out[known] = base[known] * model.predict(with_base(x[known, :cols], base[known]))
                fields[name] = out
            if fields:
                snap.set_reports(slots, **fields)
        return np.zeros(len(slots))

    def score(self, snap: Snapshot, cands: Sequence[Candidate]) -> list[float]:
        slot = snap.slot
        self.score_slots(snap, np.array([slot[c.worker_id] for c in cands], dtype=np.int64))
        return [0.0] * len(cands)

    # ---- what serving showed: the only place it learns ----------------------------------------------
    def on_observed(self, req: RouteRequest, worker_id: str, report: CandidateReport | None, ttft_s: float | None,
                    tpot_s: float | None, now: float) -> None:
        if report is None or not self.learns or req.role == "prefill":
            return
        row = report_row(report, req)
        residual = self.params.residual
        if ttft_s is not None:
            x = row[:TTFT_FEATURES]
            base = router_ttft(report)
            if not residual:
                self.ttft.observe(x, ttft_s, now)
            elif base > 0:
                self.ttft.observe(with_base(x[None, :], np.array([base]))[0], ttft_s / base, now)
        if tpot_s is not None:
            base = router_step(report, req)
            if not residual:
                self.tpot.observe(row, tpot_s, now)
            elif base > 0:
                self.tpot.observe(with_base(row[None, :], np.array([base]))[0], tpot_s / base, now)
