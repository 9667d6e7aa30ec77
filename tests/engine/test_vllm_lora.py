"""A LoRA adapter and two models in one pool, on real vLLM CPU engines (issue 45): the engine serving the
adapter (``--enable-lora``) reports it in ``vllm:lora_requests_info`` and keys its blocks with the adapter's name;
kvrouter routes the adapter's requests only there, credits the adapter's prefix from the engine's own events, and
answers 404 for a model nobody serves."""

import asyncio

import aiohttp
import pytest

from router.keys import request_keys
from router.tokenizer import load_tokenizer
from tests.engine.conftest import BLOCK, Engine, engine_port, running
from tests.engine.test_vllm_e2e import proxy, settle
from workers.vllm.engines import build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.sockets]
ADAPTER = "tiny-lora"


@pytest.fixture(scope="module")
def lora_engine(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-lora-model"), lora=ADAPTER)
    e = Engine("lora", engine_port(), engine_port(), engine_port(), 1, model,
               tmp_path_factory.mktemp("lora-log") / "lora.log", num_gpu_blocks=96,
               extra=("--enable-lora", "--max-loras", "1", "--max-lora-rank", "8",
                      "--lora-modules", f"{ADAPTER}={model / ADAPTER}"))
    with running([e]):
        yield e


async def test_an_adapter_routed_to_its_engine_and_its_prefix_credited(engines, lora_engine):
    base = engines[0]
    specs = [f"{base.spec},model=tiny", f"{lora_engine.spec},model=tiny,lora={ADAPTER}"]
    async with aiohttp.ClientSession() as s, proxy([base, lora_engine], specs=specs) as (server, url):
        prompt = "an adapter's own system prompt, long enough for several blocks " * 12
        seen, cached = [], []
        for i in range(4):
            body = {"model": ADAPTER, "prompt": prompt + f"question {i}", "max_tokens": 2, "temperature": 0}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                seen.append(r.headers["x-kvrouter-worker"])
                cached.append((await r.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            await settle(server)
        assert seen == ["lora"] * 4  # only the engine serving the adapter
        assert cached[0] == 0 and all(c >= BLOCK for c in cached[1:])  # its prefix, keyed with the adapter
        # the index holds the adapter's blocks under the adapter's keys, from the engine's own events: the
        # prompt keyed with the adapter's name matches there, keyed as the base model's it matches nothing
        ids = load_tokenizer().encode(prompt + "question 0")
        with_adapter = server.core.index.match(request_keys(ids, BLOCK, lora_name=ADAPTER)).get("lora")
        assert with_adapter is not None and with_adapter.gpu * BLOCK >= cached[1]
        as_base = server.core.index.match(request_keys(ids, BLOCK)).get("lora")
        assert as_base is None or as_base.gpu == 0
        # the engine's own report of its adapter slots, as the router reads it

        async def reported() -> bool:
            m = server.core.state.metrics.get("lora")
            return m is not None and m.max_loras == 1

        for _ in range(100):
            if await reported():
                break
            await asyncio.sleep(0.1)
        assert await reported()
        async with s.post(url + "/v1/completions", json={"model": "nobody-serves-this", "prompt": "x",
                                                          "max_tokens": 1}) as r:
            assert r.status == 404
            assert (await r.json())["type"] == "NotFoundError"
