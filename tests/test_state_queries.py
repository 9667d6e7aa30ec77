"""Issue 13, pure core: queries without side effects, failed workers lose credit until events prove their
state, huge events applied in slices with the same result."""

import random

import pytest

from router.events.codec import BlockRemoved, BlockStored, EventBatch
from router.events.feed import SLICE_BLOCKS, IndexFeeder, _slices
from router.index import KvIndex, Medium
from router.keys import request_keys
from router.scheduling import Endpoint, RouteRequest, RoutingConfig, RoutingCore

BS = 16


def core_with(n: int) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy="precise", block_size=BS, seed=1))
    for i in range(n):
        core.upsert_endpoint(Endpoint(f"w{i}", f"10.0.0.{i}:8000"))
    return core


def stored_batch(tokens: list[int], first_hash: int, now: float) -> EventBatch:
    n = len(tokens) // BS
    return EventBatch(now, [BlockStored(list(range(first_hash, first_hash + n)), None, tokens[: n * BS], BS,
                                        None, "GPU")], 0)


def route(tokens: list[int], rid: str = "r") -> RouteRequest:
    return RouteRequest(rid, request_keys(tokens, BS), len(tokens), BS)


def credit_of(core: RoutingCore, tokens: list[int], worker: str, now: float) -> int:
    d = core.decide(route(tokens), now)
    c = next(c for c in d.candidates if c.worker_id == worker)
    return c.matched_gpu if c.prefix_credit else 0


def test_status_of_a_worker_never_heard_from_creates_nothing():
    feeder = IndexFeeder(KvIndex(), block_size=BS)
    for _ in range(3):
        assert feeder.status("w", now=1.0).state == "unsynced"
    assert "w" not in feeder.feeds  # the old status() created a feed, turning an unknown worker unsynced


def test_index_state_is_a_query():
    core = core_with(2)
    tokens = list(range(64))
    core.feeder.offer("w0", 0, stored_batch(tokens, 1, 0.0), 0.0)
    d = core.decide(route(tokens), 0.1)
    core.dispatch(route(tokens), d, "w0", 0.1)
    core.feeder.offer("w0", 1, stored_batch(tokens[::-1], 100, 0.2), 0.2)  # events after the dispatch
    awaiting = dict(core.state.awaiting_events_since)
    feeds = set(core.feeder.feeds)
    for now in (0.3, 50.0, 0.3):
        assert core.index_state("w0", now) == "synced"
        assert core.index_state("w1", now) == "synced"
    assert core.state.awaiting_events_since == awaiting and set(core.feeder.feeds) == feeds
    # a later dispatch with no events after it is still seen going stale, and the query stays pure (a prompt
    # w0 does not hold: one it holds owes no events)
    fresh = list(range(1000, 1064))
    core.dispatch(route(fresh, "r2"), core.decide(route(fresh, "r2"), 1.0), "w0", 1.0)
    assert core.index_state("w0", 1.0 + core.config.stale_after_s + 1) == "stale"
    assert core.index_state("w0", 1.5) == "synced"


def test_a_failed_worker_loses_credit_until_its_next_batch():
    core = core_with(2)
    tokens = list(range(37 * BS))
    core.feeder.offer("w0", 0, stored_batch(tokens, 1, 0.0), 0.0)
    assert credit_of(core, tokens, "w0", 0.1) == 37
    d = core.decide(route(tokens), 0.1)
    core.dispatch(route(tokens, "r1"), d, "w0", 0.1)  # speculative credit too
    core.worker_failed("w0", 0.2)
    assert core.index_state("w0", 0.3) == "unverified"
    assert credit_of(core, tokens, "w0", 0.3) == 0  # neither index nor speculative credit
    # the same process goes on (seq 1): its index was right all along, credit comes back untouched
    core.feeder.offer("w0", 1, EventBatch(0.4, [BlockRemoved([999], "GPU")], 0), 0.4)
    assert core.index_state("w0", 0.5) == "synced" and credit_of(core, tokens, "w0", 0.5) == 37


def test_a_restarted_worker_is_exact_from_its_first_batch():
    core = core_with(2)
    tokens = list(range(37 * BS))
    for seq in range(3):
        core.feeder.offer("w0", seq, stored_batch(tokens[seq * BS:], 1 + 100 * seq, 0.0), 0.0)
    core.worker_failed("w0", 1.0)
    assert credit_of(core, tokens, "w0", 1.1) == 0
    # the new process's first batch (seq 0) clears what the dead one held
    other = [t + 5000 for t in range(2 * BS)]
    core.feeder.offer("w0", 0, stored_batch(other, 7, 1.2), 1.2)
    assert core.index_state("w0", 1.3) == "synced"
    assert credit_of(core, tokens, "w0", 1.3) == 0 and credit_of(core, other, "w0", 1.3) == 2
    assert core.feeder.feeds["w0"].resets == 1


def test_failing_a_worker_never_heard_from_changes_nothing():
    core = core_with(1)
    core.worker_failed("w0", 0.0)
    assert core.index_state("w0", 0.1) == "synced" and "w0" not in core.feeder.feeds


def test_a_huge_stored_event_in_slices_is_the_same_index():
    rng = random.Random(3)
    n = 3 * SLICE_BLOCKS + 17
    tokens = [rng.randrange(4000) for _ in range(n * BS)]
    event = BlockStored(list(range(1, n + 1)), None, tokens, BS, None, "GPU", "lora-a", None, 0, None, "salt")
    pieces = list(_slices(event, SLICE_BLOCKS))
    assert len(pieces) == 4 and sum(len(p.block_hashes) for p in pieces) == n
    sliced = IndexFeeder(KvIndex(), block_size=BS)
    steps = sliced.offer_steps("w", 0, EventBatch(0.0, [event], 0), 0.0)
    yielded = sum(1 for _ in steps)
    assert yielded >= 3  # the loop gets control back between slices
    whole = KvIndex()
    from router.keys import chain_keys, request_extras

    whole.store("w", event.block_hashes, chain_keys(tokens, BS, extras=request_extras(n, "lora-a", "salt")),
                Medium.GPU)
    keys = request_keys(tokens, BS, lora_name="lora-a", cache_salt="salt")
    assert sliced.index.match(keys)["w"].gpu == n == whole.match(keys)["w"].gpu
    assert sliced.feeds["w"].events["BlockStored"] == 1 and sliced.feeds["w"].malformed == 0
    # removal in slices too
    sliced.offer("w", 1, EventBatch(0.0, [BlockRemoved(list(range(1, n + 1)), "GPU")], 0), 0.0)
    assert sliced.index.blocks_held("w").get(Medium.GPU, 0) == 0


def test_a_malformed_huge_event_fails_whole():
    n = SLICE_BLOCKS + 5
    bad = BlockStored(list(range(1, n + 1)), None, [1] * (n * BS - 1), BS, None, "GPU")
    assert list(_slices(bad, SLICE_BLOCKS)) == [bad]
    feeder = IndexFeeder(KvIndex(), block_size=BS)
    feeder.offer("w", 0, EventBatch(0.0, [bad], 0), 0.0)
    assert feeder.feeds["w"].malformed == 1 and feeder.index.blocks_held("w").get(Medium.GPU, 0) == 0


def test_engine_counters_going_backwards_mean_a_restart_no_probe_saw():
    from router.load import EngineMetrics

    core = core_with(2)
    tokens = list(range(20 * BS))
    core.feeder.offer("w0", 0, stored_batch(tokens, 1, 0.0), 0.0)
    core.update_metrics("w0", EngineMetrics(0, 0, 0.1, 1.0, work_tokens=5000.0))
    core.update_metrics("w0", EngineMetrics(0, 0, 0.1, 2.0, work_tokens=5200.0))
    assert credit_of(core, tokens, "w0", 2.1) == 20
    core.update_metrics("w0", EngineMetrics(0, 0, 0.0, 3.0, work_tokens=40.0))  # a new process since
    assert core.index_state("w0", 3.1) == "unverified" and credit_of(core, tokens, "w0", 3.1) == 0


def test_a_worker_reporting_far_fewer_cached_tokens_than_promised_loses_credit():
    core = core_with(2)
    tokens = list(range(20 * BS + 5))
    core.feeder.offer("w0", 0, stored_batch(tokens, 1, 0.0), 0.0)
    d = core.decide(route(tokens, "a"), 0.1)
    handle = core.dispatch(route(tokens, "a"), d, "w0", 0.1)
    assert handle.expected_hit_tokens == 20 * BS
    handle.complete(0.2)
    handle.observed_cached(19 * BS + 1, 0.2)  # under a block short: an ordinary rounding, credit stays
    assert core.index_state("w0", 0.3) == "synced"
    handle.observed_cached(0, 0.3)  # the worker had none of it: the index is wrong there
    assert core.index_state("w0", 0.4) == "unverified" and credit_of(core, tokens, "w0", 0.4) == 0


def test_prompts_shorter_than_a_block_owe_no_events():
    """An engine publishes whole blocks: a worker that served only prompts shorter than one published nothing
    and is not stale for it (the proxy bench's one-line prompts had both workers reported stale and their
    credit dropped); one prompt of a full block starts the clock."""
    core = core_with(1)
    for i in range(5):
        short = list(range(i, i + BS - 1))
        core.dispatch(route(short, f"s{i}"), core.decide(route(short, f"s{i}"), float(i)), "w0", float(i))
    assert "w0" not in core.state.awaiting_events_since
    assert core.index_state("w0", 5.0 + core.config.stale_after_s + 1) == "synced"
    full = list(range(BS))
    core.dispatch(route(full, "f"), core.decide(route(full, "f"), 6.0), "w0", 6.0)
    assert core.index_state("w0", 6.0 + core.config.stale_after_s + 1) == "stale"


def test_prompts_the_worker_already_holds_owe_no_events():
    """A worker whose cache holds the whole prompt computes no new block and publishes nothing: repeating a
    prompt it holds (the proxy bench's 64 prompts, a hot system prompt) must not make it stale; a prompt with
    one full block beyond its prefix does."""
    core = core_with(1)
    tokens = list(range(3 * BS + 5))
    core.feeder.offer("w0", 0, stored_batch(tokens, 1, 0.0), 0.0)
    for i in range(5):
        req = route(tokens, f"h{i}")
        d = core.decide(req, 1.0 + i)
        assert d.report("w0").matched_blocks == 3
        core.dispatch(req, d, "w0", 1.0 + i)
    assert "w0" not in core.state.awaiting_events_since
    assert core.index_state("w0", 6.0 + core.config.stale_after_s + 1) == "synced"
    longer = tokens[: 3 * BS] + list(range(1000, 1000 + BS))
    core.dispatch(route(longer, "n"), core.decide(route(longer, "n"), 7.0), "w0", 7.0)
    assert core.index_state("w0", 7.0 + core.config.stale_after_s + 1) == "stale"


def test_a_refused_request_owes_no_events_and_leaves_no_speculative_credit():
    core = core_with(2)
    tokens = list(range(20 * BS))
    d = core.decide(route(tokens, "a"), 0.0)
    core.dispatch(route(tokens, "a"), d, "w0", 0.0).complete(0.1, served=False)  # the worker answered 400
    assert core.state.speculative.match(route(tokens).keys, 0.2) == {}
    assert "w0" not in core.state.awaiting_events_since
    assert core.index_state("w0", 0.1 + core.config.stale_after_s + 1) == "synced"  # not stale: nothing was owed
    served = core.dispatch(route(tokens, "b"), core.decide(route(tokens, "b"), 1.0), "w0", 1.0)
    served.complete(1.1)  # a served request keeps both: events are owed, the prefix is on its way
    assert core.state.speculative.match(route(tokens).keys, 1.2) == {"w0": 20}
    assert core.index_state("w0", 1.0 + core.config.stale_after_s + 1) == "stale"


def test_a_scrape_counts_only_what_the_router_does_not_know_better():
    """A scrape is up to a probe interval old. The router knows exactly which of its own requests started and
    ended since; from the engine it takes only the part beyond its own at scrape time (another router's)."""
    from router.load import EngineMetrics

    core = core_with(1)
    state = core.state
    for i in range(3):  # three of ours decoding, 20 blocks each (prompt 304 tokens + 16 output: 20 blocks)
        keys = request_keys(list(range(i * 999, i * 999 + 304)), BS)
        core.load.dispatch(f"r{i}", "w0", 304, 304, 16, now=0.0, keys=keys, block_size=BS)
        core.load.first_token(f"r{i}", now=0.1)
    # the engine: our 3 running plus 2 of another router's, and 40 blocks beyond ours in use
    state.update_metrics("w0", EngineMetrics(0, 5, (60 + 40) / 1000, scraped_at=0.2, cache_tokens=1000 * BS))
    view = state.engine_view("w0", state.fresh_metrics("w0", 0.3))
    assert view is not None and view.running == 5 and view.kv_usage == (60 + 40) / 1000  # nothing changed
    for i in range(3):
        core.load.complete(f"r{i}", now=0.4)  # ours ended after the scrape
    view = state.engine_view("w0", state.fresh_metrics("w0", 0.5))
    assert view is not None and view.running == 2 and view.waiting == 0  # the other router's two
    # ours counted at what they held at the scrape (``blocks_in_use``: their 60-block footprint less the half of
    # their output still to come, 1.5 blocks), so 41.5 of the engine's 100 are another router's
    assert view.kv_usage == pytest.approx((60 + 40 - 58.5) / 1000)
    c = core.decide(route(list(range(50_000, 50_100)), "next"), now=0.5).candidates[0]
    assert c.busy == 2  # least_loaded and approx_prefix read the same view


def test_a_request_the_engine_runs_before_the_router_sees_its_first_token_is_not_another_routers():
    """The engine counts a request as running from its first prefill step; the router counts it as waiting
    until the first token reaches it. A scrape in between must not leave the engine's running count standing as
    another router's once the request ends (that ghost priced a stall on a drained worker and sent a cache hit
    elsewhere)."""
    from router.load import EngineMetrics

    core = core_with(1)
    state = core.state
    keys = request_keys(list(range(304)), BS)
    core.load.dispatch("r0", "w0", 304, 304, 16, now=0.0, keys=keys, block_size=BS)
    state.update_metrics("w0", EngineMetrics(0, 1, 20 / 1000, scraped_at=0.05, cache_tokens=1000 * BS))
    core.load.first_token("r0", now=0.1)
    view = state.engine_view("w0", state.fresh_metrics("w0", 0.1))
    assert view is not None and (view.waiting, view.running) == (0, 1)  # ours, running
    core.load.complete("r0", now=0.2)
    view = state.engine_view("w0", state.fresh_metrics("w0", 0.3))
    assert view is not None and (view.waiting, view.running) == (0, 0)
    # another router's request running beside ours is still counted
    core.load.dispatch("r1", "w0", 304, 304, 16, now=1.0, keys=keys, block_size=BS)
    state.update_metrics("w0", EngineMetrics(0, 2, 40 / 1000, scraped_at=1.05, cache_tokens=1000 * BS))
    core.load.complete("r1", now=1.2)
    view = state.engine_view("w0", state.fresh_metrics("w0", 1.3))
    assert view is not None and (view.waiting, view.running) == (0, 1)
    # and one of theirs still waiting while ours waits too
    core.load.dispatch("r2", "w0", 304, 304, 16, now=2.0, keys=keys, block_size=BS)
    state.update_metrics("w0", EngineMetrics(2, 0, 0.0, scraped_at=2.05, cache_tokens=1000 * BS))
    core.load.complete("r2", now=2.2)
    view = state.engine_view("w0", state.fresh_metrics("w0", 2.3))
    assert view is not None and (view.waiting, view.running) == (1, 0)


def test_a_request_of_ours_that_ends_while_a_scrape_is_in_flight_is_not_another_routers():
    """The engine takes its counts somewhere between the scrape leaving and its answer arriving. One of ours
    that ended in between may be in the engine's counts and not in the router's at receipt: the router's own
    counts when the scrape left bound what of the engine's counts is its own."""
    from router.load import EngineMetrics

    core = core_with(1)
    state = core.state
    keys = request_keys(list(range(304)), BS)
    core.load.dispatch("r0", "w0", 304, 304, 16, now=0.0, keys=keys, block_size=BS)
    core.load.first_token("r0", now=0.1)
    state.scrape_sent("w0")
    core.load.complete("r0", now=0.2)  # it ended while the scrape was on its way back
    state.update_metrics("w0", EngineMetrics(0, 1, 20 / 1000, scraped_at=0.25, cache_tokens=1000 * BS))
    view = state.engine_view("w0", state.fresh_metrics("w0", 0.3))
    # (its 20-block footprint counted at what it held, 19.5 blocks: half a block of the engine's 20 stays)
    assert view is not None and (view.waiting, view.running) == (0, 0) and view.kv_usage == pytest.approx(0.5 / 1000)
    # without the send-time counts (a scrape this state was not told of) the engine's count stands
    core.load.dispatch("r1", "w0", 304, 304, 16, now=1.0, keys=keys, block_size=BS)
    core.load.first_token("r1", now=1.1)
    core.load.complete("r1", now=1.2)
    state.update_metrics("w0", EngineMetrics(0, 1, 20 / 1000, scraped_at=1.25, cache_tokens=1000 * BS))
    view = state.engine_view("w0", state.fresh_metrics("w0", 1.3))
    assert view is not None and view.running == 1


def test_the_metrics_parser_reads_from_the_families_it_uses_what_the_whole_exposition_says():
    """The scrape is cut to the families the router reads before Prometheus's parser sees it: the values must be
    what the parser reads from the whole text, with every other family (histograms, info, label values holding
    spaces and braces) beside them."""
    from prometheus_client.parser import text_string_to_metric_families

    from router.load import parse_engine_metrics
    from router.load.metrics import _wanted_lines
    from workers.engine import EngineConfig, EngineModel, EngineRequest
    from workers.engine.metrics import engine_metrics_text

    engine = EngineModel(EngineConfig(num_gpu_blocks=64))
    engine.add_request(EngineRequest("a", list(range(100)), 4))
    engine.step(0.0)
    text = engine_metrics_text(engine)
    noise = ('# HELP vllm:request_params_n Histogram of n.\n# TYPE vllm:request_params_n histogram\n'
             'vllm:request_params_n_bucket{le="1.0",model_name="a b {c}"} 3.0\n'
             '# TYPE vllm:num_requests_running_other gauge\nvllm:num_requests_running_other{engine="0"} 99.0\n'
             'vllm:num_requests_running{engine="1",model_name="x } y"} 2.0\n')
    whole = text + noise
    m = parse_engine_metrics(whole, scraped_at=1.0)
    assert m.running == engine.num_running + 2 and m.waiting == engine.num_waiting
    assert m.kv_usage == pytest.approx(engine.kv_usage) and m.cache_tokens == 64 * 16
    assert m.work_tokens and m.work_tokens > 0
    kept = {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in
            text_string_to_metric_families(_wanted_lines(whole))}
    full = {f.name: [(s.name, s.labels, s.value) for s in f.samples] for f in text_string_to_metric_families(whole)}
    assert kept and all(full[name] == samples for name, samples in kept.items())
    assert "vllm:request_params_n" not in kept and "vllm:num_requests_running_other" not in kept
