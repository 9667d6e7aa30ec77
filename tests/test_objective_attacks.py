"""Issue 50's attacks on what a client may claim: its objective (2), its targets (6, and ``"1_000"``), the trusted
headers sent twice (7), the request's ``n`` (3, the parser's side), the tenant's cache salt (4, the salt's side)
and client strings echoed and logged (14). Each through the real proxy, and 2, 6 and 7 through the real picker
behind Envoy, with the unit rules beside them."""

from __future__ import annotations

import contextlib
import json
import logging
import pickle
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from router.config import ConfigError, load_config
from router.frontends.openai import (
    BadRequest,
    SaltRule,
    client_text,
    model_not_found,
    parse_body,
    salt_rule,
    tenant_salt,
    trusted_header,
)
from router.scheduling.plugins.pickers.meets_objective import violation
from router.scheduling.slo import (
    ObjectiveError,
    ObjectiveForbidden,
    ServiceObjective,
    objective_for,
    parse_slo_config,
)
from router.tokenizer import load_tokenizer
from tests.sim_helpers import workers
from tests.test_epp_robustness import gateway_with, recording_workers
from tests.test_proxy import proxy, spec_of
from tests.zmq_helpers import wait_until

# the attack's configuration (issue 50)
SLO_RAW = {"objectives": {"premium": {"priority": 10, "ttft_ms": 2000}, "interactive": {"priority": 1},
                          "standard": {"priority": 0}, "batch": {"priority": -1}},
           "tenants": {"nightly-eval": "batch"}, "default": "standard"}
SLO = parse_slo_config(SLO_RAW)
BODY = {"model": "sim-model", "prompt": "the quick brown fox " * 20, "max_tokens": 4}
SECRET = "a shared secret of the router's replicas"
COMPLETIONS = "/v1/completions"
TINY_TARGETS = ("5e-324", "1e-321", "0." + "0" * 330 + "1", "0.0000001", "1_000", "1e3", "+5", "\u0661\u0660")


def tokenizer_for(_model: str | None):  # type: ignore[no-untyped-def]
    return load_tokenizer()


# ---- 2. objectives a client may only lower ------------------------------------------------------------------
def test_a_header_names_an_objective_no_higher_than_the_one_config_gives_the_request():
    # the tenant pinned to batch: batch or nothing
    with pytest.raises(ObjectiveForbidden) as e:
        objective_for({"x-gateway-inference-objective": "premium"}, SLO, tenant="nightly-eval")
    assert "x-gateway-inference-objective" in str(e.value) and "'batch'" in str(e.value)
    assert objective_for({}, SLO, tenant="nightly-eval").name == "batch"
    # an unmapped tenant gets the default, which caps it the same way; equal or lower is the client's choice
    with pytest.raises(ObjectiveForbidden):
        objective_for({"x-llm-d-inference-objective": "interactive"}, SLO, tenant="alice")
    assert objective_for({"x-gateway-inference-objective": "standard"}, SLO, tenant="alice").priority == 0
    assert objective_for({"x-gateway-inference-objective": "batch"}, SLO, tenant="alice").sheddable
    # a model's objective caps as a tenant's does, and the tenant's wins over the model's
    by_model = parse_slo_config({**SLO_RAW, "models": {"big": "interactive"}, "default": None})
    assert objective_for({"x-gateway-inference-objective": "interactive"}, by_model, model="big").priority == 1
    with pytest.raises(ObjectiveForbidden):
        objective_for({"x-gateway-inference-objective": "premium"}, by_model, model="big")
    with pytest.raises(ObjectiveForbidden):
        objective_for({"x-gateway-inference-objective": "interactive"}, by_model, model="big", tenant="nightly-eval")
    # a request no config covers names any objective (the Gateway API Inference Extension's own convention)
    assert objective_for({"x-gateway-inference-objective": "premium"}, by_model, model="small").priority == 10
    assert issubclass(ObjectiveForbidden, ObjectiveError)


def test_a_target_header_tightens_the_objectives_target_and_never_loosens_it():
    premium = parse_slo_config({**SLO_RAW, "tenants": {"gold": "premium"}})
    assert objective_for({"x-slo-ttft-ms": "500"}, premium, tenant="gold").ttft_s == 0.5
    loose = objective_for({"x-llm-d-slo-ttft-ms": "86400000", "x-slo-tpot-ms": "40"}, premium, tenant="gold")
    assert (loose.ttft_s, loose.tpot_s, loose.priority) == (2.0, 0.04, 10)  # no TPOT target configured: the header's


# ---- 6 and "1_000": target headers are plain decimal milliseconds, from a microsecond to a day ------------------
@pytest.mark.parametrize("text", TINY_TARGETS)
def test_a_target_is_a_plain_decimal_number_of_milliseconds_within_bounds(text):
    for header in ("x-slo-ttft-ms", "x-llm-d-slo-tpot-ms"):
        with pytest.raises(ObjectiveError) as e:
            objective_for({header: text}, SLO)
        assert header in str(e.value)


def test_plain_decimal_targets_still_read():
    for text, seconds in (("1000", 1.0), ("2.5", 0.0025), (".5", 0.0005), (" 300 ", 0.3), ("0.001", 1e-6)):
        assert objective_for({"x-slo-ttft-ms": text}, SLO).ttft_s == seconds


def test_the_violation_of_any_target_is_a_number_never_a_division_by_zero():
    assert violation(ServiceObjective(0.0, None), 0.1, 0.01) == float("inf")
    assert violation(ServiceObjective(None, 5e-324), 0.1, 0.01) == float("inf")
    assert violation(ServiceObjective(0.0, 0.0), 0.0, 0.0) == 0.0
    assert violation(ServiceObjective(1e-6, 0.05), 0.5, 0.01) == pytest.approx(5e5)


# ---- 3 (the parser's side): n and max_tokens bounded, a 400 naming the field ---------------------------------
@pytest.mark.parametrize(("field", "value", "max_n"), [
    ("n", 129, 128), ("n", 10**13, 128), ("n", 2**63, 128), ("n", 3, 2), ("max_tokens", 2**63, 128),
    ("max_tokens", 2**31, 128)])
def test_request_fields_past_their_bound_are_a_400_naming_the_field(field, value, max_n):
    raw = json.dumps({**BODY, field: value}).encode()
    with pytest.raises(BadRequest) as e:
        parse_body(raw, COMPLETIONS, tokenizer_for, max_n=max_n)
    assert e.value.status == 400 and f"'{field}'" in str(e.value)
    ok = parse_body(json.dumps({**BODY, "n": max_n}).encode(), COMPLETIONS, tokenizer_for, max_n=max_n)
    assert ok.n == max_n


# ---- 7. a trusted header sent twice ----------------------------------------------------------------------------
def test_a_trusted_header_sent_twice_is_refused_whichever_value_comes_first():
    for values in (["alice", "mallory"], ["mallory", "alice"], ["alice", "alice"]):
        headers = CIMultiDict([("X-Tenant", v) for v in values])
        with pytest.raises(BadRequest) as e:
            salt_rule(headers, "x-tenant", secret=SECRET)
        assert e.value.status == 400 and "x-tenant" in str(e.value)
    assert trusted_header(CIMultiDict([("x-tenant", "alice")]), "x-tenant") == "alice"
    assert trusted_header({"x-tenant": "alice"}, "x-tenant") == "alice"  # a plain mapping cannot repeat


# ---- 4 (the salt's side): the tenant's salt cannot be guessed ----------------------------------------------
def test_the_tenants_salt_is_keyed_by_the_routers_secret():
    rule = salt_rule({"x-tenant": "alice"}, "x-tenant", secret=SECRET)
    assert rule == SaltRule(False, tenant_salt(SECRET.encode(), "alice"), "alice")
    assert rule.salt != "alice" and len(rule.salt) == 64 and int(rule.salt, 16) >= 0  # a string, as vLLM takes
    assert salt_rule({"x-tenant": "alice"}, "x-tenant", secret="another secret entirely").salt != rule.salt
    assert salt_rule({"x-tenant": "bob"}, "x-tenant", secret=SECRET).salt != rule.salt
    # the router keys a tenant's blocks with the salt it sends the worker
    parsed = parse_body(json.dumps({**BODY, "cache_salt": "alice"}).encode(), COMPLETIONS, tokenizer_for, rule)
    assert parsed.cache_salt == rule.salt and json.loads(parsed.raw)["cache_salt"] == rule.salt


def test_the_salt_secret_from_config_a_file_or_the_environment_else_random_once(tmp_path, caplog):
    assert load_config(None, {"salt_secret": SECRET}).salt_secret == SECRET
    f = tmp_path / "salt"
    f.write_text(SECRET + "\n")
    assert load_config(None, {"salt_secret_file": str(f)}).salt_secret == SECRET
    assert load_config(None, environ={"KVROUTER_SALT_SECRET": SECRET}).salt_secret == SECRET
    with pytest.raises(ConfigError, match="exclude"):
        load_config(None, {"salt_secret": SECRET, "salt_secret_file": str(f)})
    with pytest.raises(ConfigError, match="salt_secret_file"):
        load_config(None, {"salt_secret_file": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="16 characters"):
        load_config(None, {"salt_secret": "alice"})
    assert SECRET not in repr(load_config(None, {"salt_secret": SECRET}))
    with caplog.at_level(logging.WARNING, logger="kvrouter.config"):
        one = load_config(None, {"tenant_header": "x-tenant"})
    assert "replicas need one shared salt_secret" in caplog.text
    assert one.salt_secret and one.salt_secret != load_config(None).salt_secret  # random, per router
    assert pickle.loads(pickle.dumps(one)).salt_secret == one.salt_secret  # what --processes children get
    with pytest.raises(ConfigError, match="max_n"):
        load_config(None, {"max_n": 0})
    with pytest.raises(ConfigError, match="max_n"):
        load_config(None, {"max_n": 2**20})


# ---- 14. client strings echoed and logged ----------------------------------------------------------------------
def test_a_client_string_is_cut_and_its_control_characters_escaped():
    assert len(model_not_found("m" * 5_000_000)) < 320 and "m" * 256 + "..." in model_not_found("m" * 5_000_000)
    assert client_text("a\r\nroute forged -> w9\x1b[0m") == "a\\r\\nroute forged -> w9\\x1b[0m"
    assert client_text("model-a") == "model-a"


# ---- through the proxy ---------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def attacked_proxy() -> AsyncIterator[tuple[Any, Callable[..., Awaitable[tuple[int, Any]]], Any]]:
    """The attack's proxy: one simulated worker, the objectives above, ``x-tenant`` trusted. Yields the server,
    ``ask(headers, body=BODY) -> (status, json)`` and the worker's engine."""
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], slo=SLO_RAW, tenant_header="x-tenant",
                                       salt_secret=SECRET) as (server, url, _), aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)

        async def ask(headers: Any, body: dict[str, Any] = BODY) -> tuple[int, Any]:
            async with s.post(f"{url}{COMPLETIONS}", json=body, headers=headers) as r:
                return r.status, await r.json(content_type=None)

        yield server, ask, ws[0].worker.engine


def repeated(name: str, values: tuple[str, ...], tenant: str | None = "alice") -> CIMultiDict[str]:
    headers: CIMultiDict[str] = CIMultiDict([("x-tenant", tenant)] if tenant and name != "x-tenant" else [])
    for v in values:
        headers.add(name, v)
    return headers


REPEATS = (("x-tenant", ("alice", "mallory")), ("x-tenant", ("mallory", "alice")),
           ("x-gateway-inference-objective", ("batch", "standard")), ("x-llm-d-slo-ttft-ms", ("500", "900")),
           ("x-slo-tpot-ms", ("5", "9")), ("x-gateway-inference-fairness-id", ("a", "b")))


@pytest.mark.sockets
async def test_the_proxy_refuses_an_objective_above_the_tenants_with_403():
    async with attacked_proxy() as (server, ask, engine):
        status, out = await ask({"x-tenant": "nightly-eval", "x-gateway-inference-objective": "premium"})
        assert status == 403 and out["type"] == "PermissionDeniedError", out
        assert "x-gateway-inference-objective" in out["message"] and "'batch'" in out["message"]
        status, _ = await ask({"x-tenant": "alice", "x-gateway-inference-objective": "interactive"})
        assert status == 403  # above the default
        assert engine.stats.finished == 0  # sent nowhere
        status, _ = await ask({"x-tenant": "nightly-eval", "x-gateway-inference-objective": "batch"})
        assert status == 200
        text = server.metrics.exposition().decode()
        assert 'objective="premium"' not in text and 'objective="interactive"' not in text


@pytest.mark.sockets
async def test_the_proxy_refuses_a_trusted_header_sent_twice_in_either_order():
    async with attacked_proxy() as (_, ask, engine):
        for name, values in REPEATS:
            status, out = await ask(repeated(name, values))
            assert status == 400 and name in out["message"] and "once" in out["message"], (name, out)
        assert engine.stats.finished == 0
        assert (await ask(repeated("x-tenant", ("alice",))))[0] == 200


@pytest.mark.sockets
async def test_the_proxy_answers_a_tiny_or_unplain_target_400_naming_the_header():
    async with attacked_proxy() as (_, ask, _engine):
        for text in TINY_TARGETS:  # 5e-324 was 0.0 s: a 500 (ZeroDivisionError in meets-objective)
            status, out = await ask({"x-tenant": "alice", "x-slo-ttft-ms": text})
            assert status == 400 and "x-slo-ttft-ms" in out["message"], (text, out)
        assert (await ask({"x-tenant": "alice", "x-slo-ttft-ms": "0.001"}))[0] == 200  # unmeetable, but a target


@pytest.mark.sockets
async def test_the_proxy_bounds_n_with_a_400_naming_it():
    async with attacked_proxy() as (_, ask, engine):
        for n in (10**13, 2**63, 129):  # 2^63 was a 500: OverflowError in the latency scorer
            status, out = await ask({"x-tenant": "alice"}, {**BODY, "n": n})
            assert status == 400 and "'n' must be at most 128" in out["message"], (n, out)
        assert engine.stats.finished == 0
        status, out = await ask({"x-tenant": "alice"}, {**BODY, "n": 2})
        assert status == 200 and len(out["choices"]) == 2


@pytest.mark.sockets
async def test_the_proxy_sends_and_keys_a_tenants_blocks_with_the_derived_salt():
    async with workers(1) as ws, proxy([spec_of(ws[0], "w0")], tenant_header="x-tenant",
                                       salt_secret=SECRET) as (server, url, _), aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        body = {**BODY, "prompt": "a long shared document for alice " * 40, "cache_salt": "alice"}
        async with s.post(f"{url}{COMPLETIONS}", json=body, headers={"x-tenant": "alice"}) as r:
            assert r.status == 200
        derived = parse_body(json.dumps(body).encode(), COMPLETIONS, tokenizer_for,
                             SaltRule(False, tenant_salt(SECRET.encode(), "alice"))).route_request("x", 16).keys
        guessed = parse_body(json.dumps(body).encode(), COMPLETIONS, tokenizer_for,
                             SaltRule(False, "alice")).route_request("x", 16).keys
        # the worker cached alice's blocks under the derived salt (its KV events say so), and the router's keys
        # for her next request are the same ones: both sides use the derived salt, and the name alone finds nothing
        await wait_until(lambda: server.core.index.match(derived).get("w0") is not None, 10)
        assert server.core.index.match(guessed).get("w0") is None
        async with s.post(f"{url}{COMPLETIONS}", json=body, headers={"x-tenant": "alice"}) as r:
            out = await r.json()
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] > 300
        assert server.decisions[-1].decision.uncached_tokens < 100  # the router predicted the hit


@pytest.mark.sockets
async def test_the_proxy_echoes_and_logs_a_model_name_cut_and_escaped(caplog):
    async with workers(1, model="sim-model") as ws, \
            proxy([f"{spec_of(ws[0], 'w0')},model=sim-model"]) as (server, url, _), aiohttp.ClientSession() as s:
        await wait_until(lambda: server.core.endpoints["w0"].healthy, 10)
        async with s.post(f"{url}{COMPLETIONS}", json={**BODY, "model": "m" * 5_000_000}) as r:
            raw = await r.read()
            assert r.status == 404
        assert len(raw) < 1024 and "m" * 256 + "..." in json.loads(raw)["message"]
        assert len(server.decisions[-1].decision.reason) < 1024  # the 5 MB name is not kept in each decision
        with caplog.at_level(logging.INFO, logger="kvrouter.proxy"):
            async with s.post(f"{url}{COMPLETIONS}", json={**BODY, "model": "x\r\nroute forged -> w9"}) as r:
                assert r.status == 404
        lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("route ")]
        assert lines and all("\r" not in line and "\n" not in line for line in lines)
        assert any("x\\r\\nroute forged" in line for line in lines)


# ---- through the picker behind Envoy -------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def attacked_gateway(tmp: Path) -> AsyncIterator[tuple[Any, Callable[..., Awaitable[tuple[int, Any]]], Any]]:
    """The attack's picker behind a real Envoy; yields the picker, ``ask(headers, body=BODY)`` and the worker's
    record of what reached it."""
    kw = {"tenant_header": "x-tenant", "slo": SLO, "salt_secret": SECRET}
    async with recording_workers(1) as ws, gateway_with(ws, tmp, kw) as (url, picker), aiohttp.ClientSession() as s:

        async def ask(headers: Any, body: dict[str, Any] = BODY) -> tuple[int, Any]:
            headers = CIMultiDict(headers)
            headers["content-type"] = "application/json"
            async with s.post(f"{url}{COMPLETIONS}", data=json.dumps(body).encode(), headers=headers) as r:
                raw = await r.read()
                return r.status, json.loads(raw) if raw else raw

        yield picker, ask, ws[0].seen


@pytest.mark.sockets
async def test_the_picker_behind_envoy_refuses_an_objective_above_the_tenants_with_403(tmp_path):
    async with attacked_gateway(tmp_path) as (_, ask, seen):
        status, out = await ask({"x-tenant": "nightly-eval", "x-gateway-inference-objective": "premium"})
        assert status == 403 and "'batch'" in out["message"], out
        assert seen.generate() == []
        status, _ = await ask({"x-tenant": "nightly-eval", "x-gateway-inference-objective": "batch"})
        assert status == 200


@pytest.mark.sockets
async def test_the_picker_behind_envoy_refuses_a_trusted_header_sent_twice_in_either_order(tmp_path):
    async with attacked_gateway(tmp_path) as (_, ask, seen):
        for name, values in REPEATS:  # Envoy passes a repeated header on as separate entries; the picker read the last
            status, out = await ask(repeated(name, values))
            assert status == 400 and name in out["message"] and "once" in out["message"], (name, out)
        assert seen.generate() == []


@pytest.mark.sockets
async def test_the_picker_behind_envoy_answers_a_tiny_target_or_a_huge_n_400(tmp_path):
    async with attacked_gateway(tmp_path) as (_, ask, seen):
        for text in TINY_TARGETS:  # 5e-324 was an empty 500 through Envoy
            status, out = await ask({"x-tenant": "alice", "x-llm-d-slo-ttft-ms": text})
            assert status == 400 and "x-llm-d-slo-ttft-ms" in out["message"], (text, out)
        status, out = await ask({"x-tenant": "alice"}, {**BODY, "n": 2**63})
        assert status == 400 and "'n'" in out["message"], out
        assert seen.generate() == []


@pytest.mark.sockets
async def test_the_picker_sends_and_keys_a_tenants_blocks_with_the_derived_salt(tmp_path):
    async with attacked_gateway(tmp_path) as (picker, ask, _):
        body = {**BODY, "prompt": "a long shared document for alice " * 40, "cache_salt": "alice"}
        status, _ = await ask({"x-tenant": "alice"}, body)
        assert status == 200
        derived, guessed = (parse_body(json.dumps(body).encode(), COMPLETIONS, tokenizer_for, SaltRule(False, salt))
                            .route_request("x", 16).keys for salt in (tenant_salt(SECRET.encode(), "alice"), "alice"))
        await wait_until(lambda: picker.core.index.match(derived).get("w0") is not None, 10)
        assert picker.core.index.match(guessed).get("w0") is None
