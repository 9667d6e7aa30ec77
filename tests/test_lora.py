"""LoRA adapters (issue 45, item 1): the engine model's slots and loads, vLLM's lora_requests_info read back,
the router's residency and the adapter's cost in the objective, the load time learned from the engines, and
llm-d's lora-affinity scorer."""

from __future__ import annotations

import pytest

from router.load import parse_engine_metrics
from router.load.metrics import EngineMetrics
from router.scheduling import RouteRequest, RoutingConfig, RoutingCore
from router.scheduling.lora import AdapterLoads, LoraResidency, LoraView, adapter_cost
from router.scheduling.types import Endpoint
from workers.engine import EngineConfig, EngineModel
from workers.engine.engine import EngineRequest, TimingModel
from workers.engine.metrics import engine_metrics_text

FLAT = TimingModel(prefill_a=0.0, prefill_b=0.0, prefill_c=10.0, decode_a=0.0, decode_b=0.0, decode_c=10.0)


def engine(max_loras: int = 2, **kw) -> EngineModel:
    return EngineModel(EngineConfig(num_gpu_blocks=256, block_size=16, max_loras=max_loras, timing=FLAT,
                                    lora_load_ms=40.0, lora_load_ms_by_adapter=(("big", 100.0),), **kw))


def test_the_step_that_first_schedules_an_adapter_pays_its_load_once():
    e = engine()
    e.add_request(EngineRequest("r0", list(range(32)), 4, lora_name="a"))
    first = e.step(0.0)
    assert first.duration_s == pytest.approx((10.0 + 40.0) / 1000)  # the prefill step and the load
    assert e.stats.lora_loads == 1
    t = first.duration_s
    while e.has_work:
        t += e.step(t).duration_s
    e.add_request(EngineRequest("r1", list(range(100, 132)), 2, lora_name="a"))
    assert e.step(t).duration_s == pytest.approx(10.0 / 1000)  # loaded already: no load
    e.add_request(EngineRequest("r2", list(range(200, 232)), 2, lora_name="big"))
    assert e.step(t + 1).duration_s == pytest.approx((10.0 + 100.0) / 1000)  # its own load time


def test_a_request_whose_adapter_finds_every_slot_in_use_is_skipped_until_one_frees():
    e = engine(max_loras=2)
    for i, adapter in enumerate(("a", "b", "c", None)):
        e.add_request(EngineRequest(f"r{i}", list(range(i * 100, i * 100 + 32)), 3, lora_name=adapter))
    e.step(0.0)
    running = {r.request_id for r in e.running}
    assert running == {"r0", "r1", "r3"}  # c skipped (both slots held by a and b in use); the base model is not
    assert [r.request_id for r in e.waiting] == ["r2"]
    assert e.loras_of == (frozenset({"a", "b"}), frozenset({"c"}))
    t = 1.0
    while e.waiting:
        t += e.step(t).duration_s
    assert set(e.loras) == {"c", "a"} or set(e.loras) == {"c", "b"}  # c took an idle adapter's slot
    assert e.stats.lora_loads == 3


def test_lora_requests_info_is_read_back_as_vllm_writes_it():
    e = engine(max_loras=2)
    for i, adapter in enumerate(("a", "b", "c")):
        e.add_request(EngineRequest(f"r{i}", list(range(i * 100, i * 100 + 32)), 3, lora_name=adapter))
    e.step(0.0)
    m = parse_engine_metrics(engine_metrics_text(e), 0.0)
    assert m.loras_running == {"a", "b"} and m.loras_waiting == {"c"} and m.max_loras == 2
    # vLLM writes one sample per state it reported, valued by its time: the latest counts
    text = ('# TYPE vllm:lora_requests_info gauge\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="x",waiting_lora_adapters=""} 100.0\n'
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="y,z",waiting_lora_adapters="x"} 200.0\n')
    m = parse_engine_metrics(text, 0.0)
    assert m.loras_running == {"y", "z"} and m.loras_waiting == {"x"} and m.max_loras == 4
    assert parse_engine_metrics("", 0.0).max_loras is None


def test_residency_combines_the_engines_report_with_the_routers_own_sends():
    res = LoraResidency()
    for i, adapter in enumerate(("a", "b", "c")):
        res.dispatched("w", f"r{i}", adapter)
    res.ended("r0")
    res.ended("r1")
    reported = EngineMetrics(0, 1, 0.1, 0.0, loras_running=frozenset({"d"}), max_loras=2)
    v = res.view("w", reported)
    assert v.active == {"c", "d"}  # ours in flight, and what the engine reports running
    assert v.resident == {"b", "c", "d"} and v.slots == 2  # and the last two distinct ones sent
    assert res.view("w", None).resident == {"a", "b", "c"}  # slots unknown: every adapter it was sent
    res.forget("w")
    assert res.view("w", None) == LoraView(frozenset(), frozenset(), None)


def test_the_adapter_cost_in_seconds():
    loaded = LoraView(frozenset({"a"}), frozenset(), 2)
    assert adapter_cost(loaded, "a", 0.05, 3, 1.0, 0.5).ttft_s == 0.0
    room = LoraView(frozenset({"a"}), frozenset({"a"}), 2)
    c = adapter_cost(room, "b", 0.05, 3, 1.0, 0.5)
    assert (c.ttft_s, c.stall_s, c.eviction_s, c.load_s) == pytest.approx((0.05, 0.15, 0.0, 0.05))
    full = LoraView(frozenset({"a", "x"}), frozenset({"a"}), 2)  # x idle: loading b pushes it out
    assert adapter_cost(full, "b", 0.05, 3, 1.0, 0.5).eviction_s == pytest.approx(0.025)
    blocked = LoraView(frozenset({"a", "x"}), frozenset({"a", "x"}), 2)  # both in use: wait for a slot too
    c = adapter_cost(blocked, "b", 0.05, 3, 1.0, 0.5)
    assert c.ttft_s == pytest.approx(1.05) and c.load_s == 0.0  # not a sample of the load alone


def test_the_load_time_is_learned_per_adapter_from_the_prior_on():
    loads = AdapterLoads(prior_s=0.03)
    assert loads.load_s("a") == 0.03
    loads.observe("b", 0.2)
    assert loads.load_s("a") == pytest.approx(0.03)  # median of the fleet's one sample and the prior's two
    for _ in range(5):
        loads.observe("a", 0.08)
    assert loads.load_s("a") == pytest.approx(0.08)  # its own samples decide
    assert loads.load_s("c") == pytest.approx(0.08)  # an adapter without samples: the fleet's median


def lora_core(policy: str) -> RoutingCore:
    core = RoutingCore(RoutingConfig(policy=policy, block_size=16, seed=0))
    for w in ("w0", "w1"):
        core.upsert_endpoint(Endpoint(w, f"10.0.0.{w[1]}:8000", loras=frozenset({"a", "b"})))
        core.update_metrics(w, EngineMetrics(0, 0, 0.0, 0.0, 4096 * 16, loras_running=frozenset(),
                                             max_loras=2))
    return core


@pytest.mark.parametrize("policy", ["precise", "llmd"])
def test_a_request_goes_where_its_adapter_is_loaded(policy):
    core = lora_core(policy)
    core.update_metrics("w1", EngineMetrics(0, 0, 0.0, 0.0, 4096 * 16, loras_running=frozenset({"b"}),
                                            max_loras=2))
    req = RouteRequest("r", list(range(1, 5)), 64, 16, 8, lora="b")
    d = core.decide(req, 0.0)
    assert d.chosen == "w1"
    if policy == "precise":  # the load is priced where it is missing, and reported
        w0 = d.report("w0")
        assert w0 is not None and w0.adapter_load_s == pytest.approx(0.03)
        assert w0.ttft_s > d.report("w1").ttft_s


def test_the_base_model_costs_nothing_for_adapters():
    core = lora_core("precise")
    d = core.decide(RouteRequest("r", list(range(1, 5)), 64, 16, 8), 0.0)
    assert d.candidates and all(r.adapter_load_s == 0.0 for r in d.candidates)
