"""The engine model's vLLM hashes against a real engine (issue 52, item 5): one vLLM 0.32 CPU engine started with
PYTHONHASHSEED=0 and ``--prefix-caching-hash-algo sha256_cbor`` publishes, for a prompt and for the same prompt with
a ``cache_salt``, exactly the block hashes ``EngineModel(hash_algo="sha256_cbor", hash_seed="0")`` computes for the
same token ids: the simulated worker can stand in for vLLM before peers that recompute vLLM's hashes."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
import zmq

from router.events.codec import BlockStored, decode_replay_frames
from tests.engine.conftest import BLOCK, Engine, engine_port, running
from workers.engine import EngineConfig, EngineModel, EngineRequest

pytestmark = [pytest.mark.engine, pytest.mark.sockets]


def _post(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stored_hashes(replay_port: int) -> list[int]:
    """Every block hash the engine has published (BlockStored, in order), read back through its replay socket."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 10_000)
    s.connect(f"tcp://127.0.0.1:{replay_port}")
    try:
        s.send_multipart([b"", (0).to_bytes(8, "big")])
        out: list[int] = []
        while (msg := decode_replay_frames(s.recv_multipart())) is not None:
            out += [h for ev in msg.batch.events if isinstance(ev, BlockStored) for h in ev.block_hashes]
        return out
    finally:
        s.close()


def test_engine_model_hashes_equal_a_real_engines(tiny_model, tmp_path):
    e = Engine("h0", engine_port(), engine_port(), engine_port(), 0, tiny_model, tmp_path / "h0.log",
               extra=("--prefix-caching-hash-algo", "sha256_cbor"), env=(("PYTHONHASHSEED", "0"),))
    text = " ".join(f"w{i * 13 % 97}" for i in range(160))
    with running([e]):
        ids = _post(e.url, "/tokenize", {"model": "tiny", "prompt": text})["tokens"]
        assert len(ids) >= 3 * BLOCK
        model = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=BLOCK, hash_algo="sha256_cbor", hash_seed="0"))
        want = model._hashes_upto(EngineRequest("p", ids, 1), len(ids) // BLOCK)
        salted = model._hashes_upto(EngineRequest("s", ids, 1, cache_salt="tenant-a"), len(ids) // BLOCK)
        assert salted[0] != want[0]
        for body in ({}, {"cache_salt": "tenant-a"}):
            _post(e.url, "/v1/completions", {"model": "tiny", "prompt": ids, "max_tokens": 1, "temperature": 0,
                                             **body})
        deadline = time.monotonic() + 60  # published at the step that filled them: wait for both prompts' blocks
        while True:
            got = _stored_hashes(e.replay_port)
            if set(want + salted) <= set(got) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert [h for h in got if h in set(want)] == want
    assert [h for h in got if h in set(salted)] == salted
