"""kvrouter in front of two real vLLM engines (CPU build): index fidelity, routing, reuse, failures."""

import asyncio
import contextlib
import urllib.request

import aiohttp
import pytest

from router.config import load_config
from router.discovery import WorkerSpec, parse_worker_arg
from router.frontends.proxy import ProxyServer
from router.keys import request_keys
from router.tokenizer import load_tokenizer
from tests.engine.conftest import BLOCK, GPU_BLOCKS
from tests.envoy_helpers import gateway
from tests.zmq_helpers import wait_until

pytestmark = [pytest.mark.engine, pytest.mark.sockets]
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "theta", "iota", "kappa", "lambda", "sigma", "omega"]


def prompt(i: int, words: int = 110) -> str:
    return " ".join(f"{WORDS[(i + k) % len(WORDS)]}{i}" for k in range(words))


def hits(engine) -> float:
    text = urllib.request.urlopen(engine.url + "/metrics").read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prefix_cache_hits_total"))


async def reset(session, engines) -> None:
    for e in engines:
        async with session.post(e.url + "/reset_prefix_cache") as r:
            assert r.status == 200


@contextlib.asynccontextmanager
async def proxy(engines, policy="precise", specs=None, **overrides):
    """``specs``: worker arguments instead of the engines' own (a role, say); ``overrides``: config keys."""
    cfg = load_config(None, {"routing.block_size": BLOCK, "routing.policy": policy, "probe_interval_s": 0.5,
                             "routing.speculative_ttl_s": 0.5, **overrides})
    cfg.workers = [parse_worker_arg(x) for x in (specs or [e.spec for e in engines])]
    server = ProxyServer(cfg)
    await server.start()
    api = await server.serve_api("127.0.0.1", 0)
    port = api.sockets[0].getsockname()[1]
    await asyncio.sleep(0.5)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        api.close()
        await server.stop()


async def complete(session, url, text, **kw):
    body = {"model": "tiny", "prompt": text, "max_tokens": kw.pop("max_tokens", 2), "temperature": 0, **kw}
    async with session.post(url + "/v1/completions", json=body) as r:
        data = await r.json()
        return r.status, data, r.headers


async def settle(server) -> None:
    """Events trail the responses by a step: wait until every engine's stream has gone quiet."""
    await asyncio.sleep(0.3)
    last = None
    for _ in range(50):
        now = tuple(f.last_seq for f in server.core.feeder.feeds.values())
        if now == last:
            return
        last = now
        await asyncio.sleep(0.1)


async def test_index_matches_what_each_engine_really_caches(engines):
    tok = load_tokenizer()
    async with aiohttp.ClientSession() as s, proxy(engines) as (server, url):
        await reset(s, engines)
        for i in range(12):  # more prompts than the two caches hold: evictions happen
            st, _, _ = await complete(s, url, prompt(i))
            assert st == 200
        await settle(server)
        assert sum(f.events["BlockRemoved"] for f in server.core.feeder.feeds.values()) > 0
        for e in engines:  # capacity from vllm:cache_config_info; the index's resident count fills it
            assert server.core.cache_tokens[e.name] == GPU_BLOCKS * BLOCK
            assert server.core.resident_tokens(e.name) > 0
        checked = 0
        for i in reversed(range(12)):  # newest first: those are still resident somewhere
            ids = tok.encode(prompt(i))
            keys = request_keys(ids, BLOCK)
            for e in engines:
                await settle(server)
                m = server.core.index.match(keys).get(e.name)
                believed = min((m.gpu if m else 0) * BLOCK, (len(ids) - 1) // BLOCK * BLOCK)
                st, data, _ = await complete(s, e.url, prompt(i), max_tokens=1)  # straight to the engine
                assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == believed, (i, e.name)
                checked += believed > 0
        assert checked >= 2  # some beliefs were positive, and the engine confirmed them
        # /reset_prefix_cache: the engine publishes [AllBlocksCleared, ...] with its next step
        e0 = engines[0]
        async with s.post(e0.url + "/reset_prefix_cache") as r:
            assert r.status == 200
        await complete(s, e0.url, "one fresh request " * 20, max_tokens=1)
        await settle(server)
        assert server.core.feeder.feeds[e0.name].events["AllBlocksCleared"] >= 1
        for i in range(12):
            m = server.core.index.match(request_keys(tok.encode(prompt(i)), BLOCK)).get(e0.name)
            assert m is None


async def test_shared_prefixes_land_on_their_holder_and_beat_round_robin(engines):
    groups = [prompt(100 + g, 150) for g in range(3)]
    # each group's questions in a row, twice over: round robin splits every group across both engines
    sequence = [(g, q) for _ in range(2) for g in range(3) for q in range(4)]
    outcome = {}
    async with aiohttp.ClientSession() as s:
        for policy in ("round_robin", "precise"):
            await reset(s, engines)
            before = sum(hits(e) for e in engines)
            async with proxy(engines, policy) as (server, url):
                placed: dict[int, set[str]] = {}
                for g, q in sequence:
                    st, _data, h = await complete(s, url, groups[g] + f" question {q} for the group")
                    assert st == 200
                    placed.setdefault(g, set()).add(h["x-kvrouter-worker"])
                    await settle(server)
            outcome[policy] = (sum(hits(e) for e in engines) - before, placed)
    assert outcome["precise"][0] > outcome["round_robin"][0]
    assert all(len(ws) == 1 for ws in outcome["precise"][1].values())  # each group stayed with its holder


async def test_outputs_are_identical_whether_the_prefix_was_cached(engines):
    text = prompt(300, 120)
    async with aiohttp.ClientSession() as s:
        await reset(s, engines)
        outs = []
        for e in (engines[0], engines[0], engines[1]):  # cold, cached, another engine cold
            _st, data, _ = await complete(s, e.url, text, max_tokens=8)
            outs.append((data["choices"][0]["text"], data["usage"]["prompt_tokens_details"]["cached_tokens"]))
    assert outs[0][0] == outs[1][0] == outs[2][0]
    assert outs[0][1] == 0 and outs[1][1] > 0 and outs[2][1] == 0


async def test_through_envoy_and_the_endpoint_picker(engines, tmp_path):
    specs = [WorkerSpec(e.name, e.url, f"tcp://127.0.0.1:{e.events_port}", f"tcp://127.0.0.1:{e.replay_port}")
             for e in engines]
    async with aiohttp.ClientSession() as s:
        await reset(s, engines)
        async with gateway(specs, tmp_path, block_size=BLOCK) as (url, picker, _):
            await asyncio.sleep(0.5)
            text = prompt(400, 150)
            for q in range(4):
                st, data, _ = await complete(s, url, text + f" question {q}")
                assert st == 200
                if q:
                    assert data["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
                await asyncio.sleep(0.3)
            await wait_until(lambda: not picker.core.load.inflight)


async def test_a_killed_engine_loses_nothing_unstarted_and_resyncs_after_restart(engines):
    _e0, e1 = engines
    async with aiohttp.ClientSession() as s, proxy(engines, "round_robin") as (server, url):
        tasks = [asyncio.create_task(complete(s, url, prompt(500 + i), max_tokens=64)) for i in range(8)]
        await asyncio.sleep(0.3)
        e1.kill()
        results = await asyncio.gather(*tasks)
        assert [st for st, _, _ in results] == [200] * 8  # non-streamed: retried on e0 before any byte
        await wait_until(lambda: not server.core.endpoints[e1.name].healthy, timeout=10)
        seq_before = server.core.feeder.feeds[e1.name].last_seq
        e1.start()
        await asyncio.to_thread(e1.wait_ready)
        await wait_until(lambda: server.core.endpoints[e1.name].healthy, timeout=20)
        for i in range(4):  # round robin sends some to the restarted engine
            st, _, _ = await complete(s, url, prompt(600 + i))
            assert st == 200
        await settle(server)
        feed = server.core.feeder.feeds[e1.name]
        assert feed.resets >= 1 or feed.last_seq < seq_before  # seq went back: index cleared and rebuilt
        assert feed.synced and sum(server.core.index.blocks_held(e1.name).values()) > 0
