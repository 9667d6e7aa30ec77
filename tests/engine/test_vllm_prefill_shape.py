"""The prefill shape (issue 52, item 1): a random-weight model on which a routing policy's prefix hits decide TTFT.

On the tiny model a step's fixed cost (HTTP, scheduling, sampling, output processing) is most of a 1K-token
prompt's TTFT, so a 10-point hit-rate difference is worth about a millisecond and the fidelity bench cannot rank
the policies. The prefill shape is sized so that on one core an uncached 1K-token prompt's TTFT is mostly prefill
and a fully cached one's a small fraction of it. Checked here as ratios of TTFTs measured on one engine of the
shape, started as ``kvrouter bench fidelity --shape prefill`` starts it: behaviour, not a timing threshold.

The issue's bar is a prefill share of at least 0.7 and cached/uncached at most 0.3; the tiny model measured here
sits on its edge (0.66-0.75 and 0.29-0.46 over three runs), the prefill shape well inside (0.92, 0.11). The test
asks for 0.8 and 0.2, which the prefill shape clears with margin on a loaded box and the tiny model does not.
"""

from __future__ import annotations

import json
import random
import statistics
import time

import aiohttp
import pytest

from bench.fidelity_bench import TOKEN_LOW, TOKEN_SPAN, Fleet
from tests.engine.conftest import Engine, engine_port, running
from workers.vllm.engines import build_tiny_model

pytestmark = [pytest.mark.engine, pytest.mark.sockets]
FLEET = Fleet()
LONG, SHORT = 1024, 16


@pytest.fixture(scope="module")
def prefill_engine(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("prefill-model"), shape="prefill")
    e = Engine("prefill", engine_port(), engine_port(), engine_port(), 1, model,
               tmp_path_factory.mktemp("prefill-log") / "prefill.log", extra=tuple(FLEET.engine_flags()),
               block_size=FLEET.block_size, num_gpu_blocks=FLEET.num_gpu_blocks, max_model_len=FLEET.max_model_len)
    with running([e]):
        yield e


def fresh(rng: random.Random, n: int) -> list[int]:
    """A prompt of random token ids: no block of it is in the engine's cache."""
    return [TOKEN_LOW + rng.randrange(TOKEN_SPAN) for _ in range(n)]


async def first_token(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> tuple[float, int]:
    """(the client's TTFT in seconds, the engine's cached tokens) of one streamed one-token completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    sent, ttft, cached = time.perf_counter(), None, None
    async with session.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - sent
            if chunk.get("usage"):
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert ttft is not None and cached is not None, "the stream ended without a token and its usage"
    return ttft, cached


async def test_prefill_decides_a_1k_prompts_ttft(prefill_engine):
    url, rng = prefill_engine.url, random.Random(52)
    fixed, uncached, cached = [], [], []
    async with aiohttp.ClientSession() as s:
        for _ in range(2):  # the first requests of a fresh engine pay one-off costs (allocation, first kernels)
            await first_token(s, url, fresh(rng, LONG))
            await first_token(s, url, fresh(rng, SHORT))
        for _ in range(3):
            fixed.append((await first_token(s, url, fresh(rng, SHORT)))[0])
            prompt = fresh(rng, LONG)
            ttft, hit = await first_token(s, url, prompt)
            assert hit == 0
            uncached.append(ttft)
            ttft, hit = await first_token(s, url, prompt)
            assert hit == LONG - FLEET.block_size  # fully cached but the last block (its last token is computed)
            cached.append(ttft)
    f, u, c = (statistics.median(x) for x in (fixed, uncached, cached))
    figures = f"fixed {f * 1e3:.1f} ms, uncached {u * 1e3:.1f} ms, cached {c * 1e3:.1f} ms"
    assert (u - f) / u >= 0.8, f"a 1K prompt's TTFT is not mostly prefill: {figures}"
    assert c / u <= 0.2, f"a fully cached 1K prompt saves too little: {figures}"
