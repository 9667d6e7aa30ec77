"""Several models in one pool (issue 45, item 4): each model's requests reach only its workers, the index
credits a worker only with its own model's blocks, and a model nobody serves is a 404 in the OpenAI error shape,
through the proxy and through the picker behind a real Envoy."""

from __future__ import annotations

import aiohttp
import pytest

from router.discovery import parse_worker_arg
from router.discovery.static import DiscoveryError, load_workers_file
from tests.sim_helpers import start_worker
from tests.test_epp_robustness import gateway_with, post, start_recording_worker
from tests.test_proxy import proxy

pytestmark = pytest.mark.sockets
PROMPT = "a shared system prompt for both models " * 40


def body(model: str, question: str) -> dict:
    return {"model": model, "prompt": PROMPT + question, "max_tokens": 4}


async def test_two_models_in_one_pool_through_the_proxy():
    wa, wb = await start_worker(model="alpha"), await start_worker(model="beta")
    try:
        specs = [f"{wa.url},id=a,model=alpha,events={wa.worker.publisher.endpoint}",
                 f"{wb.url},id=b,model=beta,events={wb.worker.publisher.endpoint}"]
        async with proxy(specs) as (_server, url, _), aiohttp.ClientSession() as s:
            for i in range(4):
                for model, want in (("alpha", "a"), ("beta", "b")):
                    async with s.post(url + "/v1/completions", json=body(model, f"q{i}")) as r:
                        assert r.status == 200, await r.text()
                        assert r.headers["x-kvrouter-worker"] == want
                        out = await r.json()
                    # the same tokens on the other model's worker were never computed here: the first of each
                    # model is a miss, however much of its prompt the other model's worker holds
                    if i == 0:
                        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            async with s.post(url + "/v1/completions", json=body("gamma", "q")) as r:
                assert r.status == 404
                err = await r.json()
            assert err["object"] == "error" and err["type"] == "NotFoundError" and err["code"] == 404
            assert "gamma" in err["message"]
            assert wa.worker.engine.stats.finished == 4 and wb.worker.engine.stats.finished == 4
    finally:
        await wa.stop()
        await wb.stop()


async def test_a_model_nobody_serves_is_a_404_from_the_picker_behind_envoy(tmp_path):
    ws = [await start_recording_worker(topic=f"w{i}", model=m) for i, m in enumerate(("alpha", "beta"))]
    for w in ws:
        w.models = frozenset({w.worker.model})
    try:
        async with gateway_with(ws, tmp_path) as (url, _picker), aiohttp.ClientSession() as s:
            status, out = await post(s, url + "/v1/completions", body("beta", "q"))
            assert status == 200, out
            assert ws[1].seen.requests and not ws[0].seen.requests
            status, err = await post(s, url + "/v1/completions", body("gamma", "q"))
            assert status == 404
            assert err["type"] == "NotFoundError" and err["code"] == 404 and "gamma" in err["message"]
            assert len(ws[0].seen.requests) + len(ws[1].seen.requests) == 1  # the 404 reached no worker
    finally:
        for w in ws:
            await w.stop()


def test_a_name_on_the_command_line_is_one_name_never_its_letters(tmp_path):
    spec = parse_worker_arg("http://10.0.0.1:8000,model=llama,lora=sql-adapter")
    assert spec.models == {"llama"} and spec.loras == {"sql-adapter"}
    assert parse_worker_arg("http://10.0.0.1:8000,lora=").loras == frozenset()  # empty: none
    f = tmp_path / "workers.yaml"
    f.write_text("- {url: 'http://10.0.0.1:8000', models: [a, b], loras: [x]}\n")
    (listed,) = load_workers_file(f)
    assert listed.models == {"a", "b"} and listed.loras == {"x"}
    f.write_text("- {url: 'http://10.0.0.1:8000', loras: [3]}\n")
    with pytest.raises(DiscoveryError, match="loras"):
        load_workers_file(f)
