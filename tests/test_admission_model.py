"""The objective's engine admission and the price of a choice's compute under load (issue 51, items 2 and 3).

vLLM (and the simulated engine, workers/engine/engine.py ``_admit``) admits a waiting request when its prompt's
blocks fit in the blocks free now: a running request holds its prompt and the output it has generated so far,
not its last token's blocks. The router priced every request in flight at its last token, and predicted memory
waits no engine had (docs/slo.md: 6.2 s predicted against 0.85 s given). When decode then runs out of blocks the
engine preempts the latest request, which recomputes. And while requests wait on a worker, each of them waits
for a choice's prefill there too: a cache hit saves that compute once for itself and once for each of them."""

from __future__ import annotations

import pytest

from router.index import PrefixMatch
from router.keys import request_keys
from router.load import EngineMetrics, WorkerLoad, tail_blocks
from router.scheduling import CostModel, CostParams, Endpoint, RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.state import FleetState

BS = 16
CAP = 1000  # blocks


def linear(prefill_ms_per_token: float = 0.1, step_ms: float = 0.0, decode_ms: float = 10.0,
           **kw: float) -> CostParams:
    """Hand-computable timing: a prefill step ``step_ms + T x prefill_ms_per_token``, a decode step
    ``decode_ms`` whatever the KV use; nothing learned."""
    return CostParams(prefill_a=0.0, prefill_b=prefill_ms_per_token, prefill_c=step_ms, decode_a=0.0, decode_b=0.0,
                      decode_c=decode_ms, learn=False, **kw)  # type: ignore[arg-type]


def request(tokens: list[int], rid: str, max_tokens: int) -> RouteRequest:
    return RouteRequest(rid, request_keys(tokens, BS), len(tokens), BS, max_tokens=max_tokens)


def busy_worker(cost: CostParams, kv_in_use: float | None) -> RoutingCore:
    """One 1,000-block worker running 10 requests of 16 prompt blocks and 1,600 tokens (100 blocks) of output
    each, just started: 1,160 blocks at their last tokens. ``kv_in_use``: the engine's kv_usage (None: no
    metrics, the router's own estimate)."""
    core = RoutingCore(RoutingConfig(block_size=BS, cost=cost, seed=0, speculative_ttl_s=0))
    core.upsert_endpoint(Endpoint("w", "10.0.0.1:1"))
    for i in range(10):
        toks = list(range(i * 10_000, i * 10_000 + 16 * BS))
        core.load.dispatch(f"run{i}", "w", len(toks), 0, 1600, now=0.0, keys=request_keys(toks, BS), block_size=BS)
        core.load.first_token(f"run{i}", now=0.0)
    core.update_metrics("w", EngineMetrics(None if kv_in_use is None else 0.0, None if kv_in_use is None else 10.0,
                                           kv_in_use, scraped_at=0.0, cache_tokens=CAP * BS))
    assert core.load.load("w").active_blocks == 1160
    return core


PROMPT = list(range(500_000, 500_000 + 300 * BS))  # 300 blocks: 0.48 s of prefill at 0.1 ms a token


@pytest.mark.parametrize("kv_in_use", [0.2, None])
def test_running_requests_holding_few_blocks_now_leave_room_to_admit_at_once(kv_in_use):
    """The 300-block prompt fits beside the blocks in use now (200 by the engine's kv_usage; without metrics the
    router's estimate, 1,160 less the half of their output still to come: 660): admitted at once, its TTFT its
    prefill alone. The footprint rule had it wait until enough of the ten ended, at their 1,600th token."""
    core = busy_worker(linear(), kv_in_use)
    req = request(PROMPT, "new", max_tokens=16)
    tail = tail_blocks(req.prompt_tokens, len(req.keys), req.max_tokens, BS)
    footprint_lack = len(req.keys) + tail - (CAP - core.load.load("w").active_blocks)
    assert footprint_lack > 0 and core.load.release_wait_s("w", footprint_lack, 0.1, 0.01) > 15.0  # the old wait
    c = core.decide(req, now=0.1).candidates[0]
    assert c.queue_s == 0.0
    assert c.ttft_s == pytest.approx(0.48)


def test_a_request_that_lacks_blocks_now_waits_for_running_requests_to_end():
    """800 blocks in use now (the engine's kv_usage): 200 free, the 301 it needs are not: it waits for the
    requests in flight to free them, the first of them at its 1,600th token (16 s at 10 ms a step)."""
    core = busy_worker(linear(), 0.8)
    c = core.decide(request(PROMPT, "new", max_tokens=16), now=0.1).candidates[0]
    assert c.queue_s == pytest.approx(16.0 - 0.1)


def test_the_watermark_the_engine_keeps_free_is_not_room():
    """With 200 blocks in use, a watermark of 25% of the cache leaves 550 blocks to admit into, and the 301 fit;
    one of 60% leaves 200, and they wait."""
    assert busy_worker(linear(kv_watermark=0.25), 0.2).decide(
        request(PROMPT, "a", max_tokens=16), now=0.1).candidates[0].queue_s == 0.0
    assert busy_worker(linear(kv_watermark=0.6), 0.2).decide(
        request(PROMPT, "b", max_tokens=16), now=0.1).candidates[0].queue_s > 1.0


@pytest.mark.parametrize(("remaining", "chance"), [(6400, 1.0), (5600, 0.5), (4800, 0.0), (0, 0.0)])
def test_decode_that_runs_out_of_blocks_preempts_the_latest_request_which_recomputes(remaining, chance):
    """600 of 1,000 blocks in use now; the requests there have ``remaining`` output tokens still to generate
    (6,400: 400 blocks, the cache full at their last tokens). This request adds 100 blocks: what of them does not
    fit then is what decode runs out of, and the engine preempts the latest admitted, this one, which prefills
    its 1,280-token prompt and the half of its 320 tokens it had again: 0.144 s."""
    cm = CostModel(linear())
    est = cm.estimate("a", 1280, BS, None, WorkerLoad(), EngineMetrics(0.0, 4.0, 0.6, 0.0), max_tokens=320,
                      new_blocks=100, capacity_tokens=CAP * BS, remaining_tokens=remaining)
    assert est.preempt_s == pytest.approx(chance * (1280 + 160) * 1e-4)
    assert est.score == pytest.approx(est.queue_s + est.prefill_s + est.stall_s + est.eviction_s + est.behind_s
                                      + est.decode_s + est.slowdown_s + est.preempt_s)
    assert cm.estimate("a", 1280, BS, None, WorkerLoad(), EngineMetrics(0.0, 4.0, 0.6, 0.0), max_tokens=320,
                       new_blocks=100, capacity_tokens=None, remaining_tokens=remaining).preempt_s == 0.0  # unknown


def test_each_request_waiting_there_pays_its_prefill_and_none_on_an_idle_worker():
    """The engine reports ``n`` waiting (another router's: 2,048 tokens each assumed); each waits for what this
    request's 1,000 tokens add to the prefill queued there (the step overhead of 10 ms included where they make
    one more step)."""
    cm = CostModel(linear(0.1, step_ms=10.0))
    assert cm.estimate("a", 1000, BS, None, None, None).behind_s == 0.0  # idle: no one waits
    assert cm.estimate("a", 1000, BS, None, WorkerLoad(), EngineMetrics(0.0, 3.0, None, 0.0)).behind_s == 0.0
    behind = []
    for n in (1, 4, 8):
        est = cm.estimate("a", 1000, BS, None, WorkerLoad(), EngineMetrics(float(n), 0.0, None, 0.0))
        queued = n * 2048
        assert est.behind_s == pytest.approx(n * (cm.prefill_s(queued + 1000) - cm.prefill_s(queued)))
        behind.append(est.behind_s)
    assert behind == sorted(behind) and behind[0] == pytest.approx(0.1)


def test_a_cache_hit_saves_its_compute_once_more_for_each_request_waiting():
    """800 of the 1,000 tokens cached: the hit saves 80 ms of its own prefill on an idle worker, and 80 ms more
    for each of the 8 requests waiting on a busy one."""
    cm = CostModel(linear(0.1, step_ms=10.0))

    def saving(waiting: float) -> float:
        m = EngineMetrics(waiting, 0.0, None, 0.0)
        miss = cm.estimate("a", 1000, BS, None, WorkerLoad(), m)
        hit = cm.estimate("a", 1000, BS, PrefixMatch(gpu=50), WorkerLoad(), m)
        return miss.score - hit.score

    assert saving(0.0) == pytest.approx(0.08)
    assert saving(8.0) - saving(0.0) == pytest.approx(8 * 0.08)


def test_the_requests_flow_control_holds_wait_behind_a_choice_too():
    """16 requests held by flow control over 8 workers: 2 of them wait behind a choice's prefill on each."""
    core = RoutingCore(RoutingConfig(block_size=BS, cost=linear(0.1), seed=0))
    for i in range(8):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:1"))
    req = request(list(range(1000)), "a", max_tokens=0)
    assert all(c.behind_s == 0.0 for c in core.decide(req, now=0.0).candidates)
    core.state.held_requests = lambda: 16
    for c in core.decide(request(list(range(1000)), "b", max_tokens=0), now=0.0).candidates:
        assert c.behind_s == pytest.approx(2 * c.prefill_s)


def test_the_engine_view_keeps_the_engines_kv_in_use_and_adds_what_changed_since_the_scrape():
    """The engine counted 100 blocks in use while the router's five requests would hold 130 at their last
    tokens; a sixth dispatched since adds what it holds as ``blocks_in_use`` counts it: its 16 prompt blocks and
    half of its 10 output blocks (``remaining_fraction`` of them still to come), 21. The engine's figure stands,
    plus the change: 121 (the view took the footprint at the scrape off and the whole present footprint on: 156;
    counting the sixth at its last token: 126)."""
    state = FleetState(BS)
    for i in range(6):
        if i == 5:
            state.update_metrics("w", EngineMetrics(0.0, 5.0, 0.1, 0.0, cache_tokens=CAP * BS))
        toks = list(range(i * 10_000, i * 10_000 + 16 * BS))
        state.load.dispatch(f"r{i}", "w", len(toks), 0, 160, now=0.0, keys=request_keys(toks, BS), block_size=BS)
        state.load.first_token(f"r{i}", now=0.0)
    assert state.load.load("w").active_blocks == 156
    view = state.engine_view("w", state.metrics["w"])
    assert view is not None and view.kv_usage == pytest.approx(0.121)
