"""vLLM's own block hashes in the engine model (issue 52, item 5): exact-hash peers against the simulated worker.

The golden values below were computed by vLLM 0.32.0's own code (``vllm.utils.hashing.get_hash_fn_by_name``,
``vllm.v1.core.kv_cache_utils.init_none_hash`` and ``hash_block_tokens``, in .venv-vllm, PYTHONHASHSEED=0) over
GOLDEN_TOKENS in blocks of 4, block 0 with ("cache_salt", "tenant-a") ("salt"), or every block with ("lora", "ad1",
"ad1") and block 0 also ("cache_salt", "s") ("lora"); the CBOR bytes by cbor2 (``canonical=True``). The engine-tier
test tests/engine/test_vllm_hashes_real.py checks the same against a running engine's events.
"""

from __future__ import annotations

import pytest

from router.events.codec import BlockStored, decode_message
from router.events.recording import read_recording
from workers.engine import EngineConfig, EngineModel, EngineRequest
from workers.engine.block_pool import (
    DEFAULT_NONE_HASH_SEED,
    VllmBlockHasher,
    cbor_canonical,
    vllm_extra_keys,
)

GOLDEN_TOKENS = [*range(1000, 1012), 0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]
VLLM_GOLDEN = {
    "sha256/plain": [
        16633476083575556675, 5517135347774871626, 7850789038220771618,
        4317601135528296626, 13917602054272173069,
    ],
    "sha256/salt": [
        15180765674442126910, 6616262234945694111, 15292505933422246553,
        15700342875842252470, 9751104199236767541,
    ],
    "sha256/lora": [
        17061456216950111282, 16938656420217382755, 17651066634689649974,
        5773712954231693883, 6346947943551109560,
    ],
    "sha256_cbor/plain": [
        6607314624772931549, 7746581224708677619, 7639364022898271419,
        7552283067361177570, 9953233389256957427,
    ],
    "sha256_cbor/salt": [
        13209652084744387674, 9300384721108928209, 1305320209670526242,
        1044893615555334801, 10530639833078909149,
    ],
    "sha256_cbor/lora": [
        1633201929174135923, 13629300147786917668, 7819889807814343538,
        3249598561825434660, 5042962931996702317,
    ],
    "xxhash/plain": [
        17387800656729866030, 288028343154156447, 18266893460261308096,
        7781338873774223503, 10615523468715303752,
    ],
    "xxhash/salt": [
        5888173846190612810, 568767247542513311, 1981327094124197356,
        268401316831018347, 15995810811284099480,
    ],
    "xxhash/lora": [
        6793686736715289159, 17523249943748724710, 7148706072457512521,
        10849303436983341875, 7436066611176231046,
    ],
    "xxhash_cbor/plain": [
        5837819924148092941, 2690014037169130024, 18268718303954561043,
        18111161947994775682, 13879441992587965193,
    ],
    "xxhash_cbor/salt": [
        304395329289245212, 2631604669613975482, 4290046577019730635,
        11818202004611314759, 6623253806507249170,
    ],
    "xxhash_cbor/lora": [
        18161039281422399114, 14495431219943824911, 11027225849836258889,
        5054376189419987667, 11958492085525243163,
    ],
}
VLLM_NONE_HASH_SEED0 = {
    "sha256": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
    "sha256_cbor": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
    "xxhash": "6fb31cc38bba6066183f7f2104b9c051",
    "xxhash_cbor": "1ebe36576dcb573f26b99533a20aaeca",
}
GOLDEN_CBOR = bytes.fromhex(
    "8758200101010101010101010101010101010101010101010101010101010101010101890017181818ff19010019ffff1a000100001aff"
    "ffffff1b00000100000000008183646c6f726161616162f62039012bf5")
# the native hash of HEAD before this change (commit ca5e924), block size 4, tokens 1000..1017: plain, salted, LoRA
NATIVE_GOLDEN = [
    [2932269508487786695, 12686273969974551758, 8025051244519218797, 15742494093243902366],
    [7516937739593810964, 14577922468349190747, 14356858842796701102, 8018059295872636810],
    [14713968537117646469, 14883446470956456414, 14857681543906153847, 2675189645286850120],
]
ALGOS = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]


def _extra(kind: str):
    if kind == "salt":
        return lambda i: vllm_extra_keys(None, "tenant-a", i)
    if kind == "lora":
        return lambda i: vllm_extra_keys("ad1", "s", i)
    return lambda i: None


@pytest.mark.parametrize("algo", ALGOS)
@pytest.mark.parametrize("kind", ["plain", "salt", "lora"])
def test_hasher_reproduces_vllms_own_hashes(algo, kind):
    h = VllmBlockHasher(algo, "0")
    assert h.none_hash.hex() == VLLM_NONE_HASH_SEED0[algo]
    assert h.chain(GOLDEN_TOKENS, 4, _extra(kind)) == VLLM_GOLDEN[f"{algo}/{kind}"]


def test_canonical_cbor_is_cbor2s():
    value = (b"\x01" * 32, (0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**40), (("lora", "a", "b"),), None, -1,
             -300, True)
    assert cbor_canonical(value) == GOLDEN_CBOR
    with pytest.raises(TypeError):
        cbor_canonical(1.5)


def test_none_hash_seed_follows_pythonhashseed_semantics():
    # sha256*: a fixed seed without PYTHONHASHSEED, so every engine agrees; PYTHONHASHSEED overrides it
    assert VllmBlockHasher("sha256", None).seed == DEFAULT_NONE_HASH_SEED
    assert VllmBlockHasher("sha256", None).none_hash == VllmBlockHasher("sha256", DEFAULT_NONE_HASH_SEED).none_hash
    assert VllmBlockHasher("sha256", "7").none_hash != VllmBlockHasher("sha256", None).none_hash
    # xxhash*: random per process unless PYTHONHASHSEED is set (two engines then never share a hash)
    assert VllmBlockHasher("xxhash", None).none_hash != VllmBlockHasher("xxhash", None).none_hash
    assert VllmBlockHasher("xxhash_cbor", "3").none_hash == VllmBlockHasher("xxhash_cbor", "3").none_hash
    with pytest.raises(ValueError):
        VllmBlockHasher("md5", None)
    with pytest.raises(ValueError):
        EngineConfig(hash_algo="sha512")


def test_recorded_vllm_frames_are_sha256_with_the_fixed_seed(fixture_path):
    """The fixture's README names no algorithm or seed: vLLM 0.32's defaults (sha256, no PYTHONHASHSEED, so the
    fixed seed) reproduce every block hash it holds, cache_salt block included."""
    h = VllmBlockHasher("sha256", None)
    digests: dict[int, bytes] = {}
    checked = salted = 0
    for rec in read_recording(fixture_path):
        if rec.kind != "pub":
            continue
        for ev in decode_message(rec.frames).batch.events:
            if not isinstance(ev, BlockStored):
                continue
            parent = None if ev.parent_block_hash is None else digests[ev.parent_block_hash]
            toks, bs = list(ev.token_ids), ev.block_size
            for i, want in enumerate(ev.block_hashes):
                untagged = ev.extra_keys[i] if ev.extra_keys else None
                extra = (("cache_salt", untagged[0]),) if untagged else None
                salted += extra is not None
                parent = h.digest(parent, toks[i * bs : (i + 1) * bs], extra)
                assert h.to_int(parent) == want
                digests[want] = parent
                checked += 1
    assert checked > 100 and salted >= 1


def _run(engine: EngineModel, req: EngineRequest) -> list[BlockStored]:
    engine.add_request(req)
    stored, t = [], 0.0
    while engine.has_work:
        r = engine.step(t)
        t += r.duration_s
        stored += [e for e in r.events if isinstance(e, BlockStored)]
    return stored


@pytest.mark.parametrize("algo", ALGOS)
def test_engine_model_publishes_vllms_hashes(algo):
    engine = EngineModel(EngineConfig(num_gpu_blocks=64, block_size=4, hash_algo=algo, hash_seed="0"))
    stored = _run(engine, EngineRequest("a", GOLDEN_TOKENS, 1))
    assert [h for e in stored for h in e.block_hashes] == VLLM_GOLDEN[f"{algo}/plain"]
    assert stored[0].parent_block_hash is None
    # salted and LoRA requests: vLLM's tagged extra keys in the hash, the untagged ones in the event
    salted = _run(engine, EngineRequest("b", GOLDEN_TOKENS, 1, cache_salt="tenant-a"))
    assert [h for e in salted for h in e.block_hashes] == VLLM_GOLDEN[f"{algo}/salt"]
    assert salted[0].extra_keys[0] == ["tenant-a"]
    lora = _run(engine, EngineRequest("c", GOLDEN_TOKENS, 1, cache_salt="s", lora_name="ad1"))
    assert [h for e in lora for h in e.block_hashes] == VLLM_GOLDEN[f"{algo}/lora"]
    # the pool is keyed by them: the same prompt again hits its whole cached prefix
    again = EngineRequest("d", GOLDEN_TOKENS, 1)
    engine.add_request(again)
    engine.step(0.0)
    assert again.num_cached_tokens == 16  # 5 full blocks, all but the last token computed: 4 blocks hit


def test_native_default_is_unchanged():
    engine = EngineModel(EngineConfig(block_size=4))
    assert engine.config.hash_algo == "native"
    got = [engine._hashes_upto(EngineRequest("x", list(range(1000, 1018)), 1, cache_salt=salt, lora_name=lora), 4)
           for salt, lora in ((None, None), ("tenant-a", None), (None, "ad1"))]
    assert got == NATIVE_GOLDEN


def test_sim_flag_parses_vllms_names():
    import argparse

    from workers.sim.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert p.parse_args(["--port", "1"]).prefix_caching_hash_algo == "native"
    assert p.parse_args(["--port", "1", "--prefix-caching-hash-algo", "sha256_cbor"]).prefix_caching_hash_algo == \
        "sha256_cbor"
    with pytest.raises(SystemExit):
        p.parse_args(["--port", "1", "--prefix-caching-hash-algo", "md5"])


# ---- the live peer: vllm-router's kv_aware over simulated workers ----------------------------------------------

def _post(url: str, prompt: str) -> dict:
    import json
    import urllib.request

    body = json.dumps({"model": "sim-model", "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def _prompt_tokens(worker_url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(worker_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_total"))


@pytest.mark.sockets
@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "native"])
def test_vllm_router_kv_aware_credits_the_simulated_workers_prefix(algo, monkeypatch, tmp_path):
    """vllm-router 0.1.17 (its own venv, installed by bench.peers when missing) subscribed to two simulated workers'
    events: a repeated prompt is credited its cached prefix (vllm-router's own decision log) and lands on the worker
    that holds it. With vLLM's hashes (PYTHONHASHSEED=0 on both sides) as issue 52 asks; ``native`` too: vllm-router
    0.1.17 resolves stored blocks by their token ids, so it credits the engine model's own hashes as well."""
    import contextlib
    import re

    from bench.load import sim_workers
    from bench.peers import PeerUnavailable, vllm_router

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    log_path = tmp_path / "vllm-router.log"
    with contextlib.ExitStack() as stack, open(log_path, "wb") as log:
        workers = sim_workers(stack, 2, "--prefix-caching-hash-algo", algo, "--time-scale", "0.05")
        events = [re.search(r"events=([^,]+)", w.spec).group(1) for w in workers]
        try:
            url = stack.enter_context(vllm_router([w.url for w in workers], "kv_aware", events, log=log))
        except PeerUnavailable as e:
            pytest.skip(str(e))
        prompt = " ".join(f"q{i * 7 % 101}" for i in range(300))
        before = [_prompt_tokens(w.url) for w in workers]
        first = _post(url, prompt)
        mid = [_prompt_tokens(w.url) for w in workers]
        holder = [m > b for m, b in zip(mid, before, strict=True)].index(True)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # the blocks reach vllm-router as events after the step that filled them: wait for its index to have them
        second = None
        for _ in range(100):
            second = _post(url, prompt)
            decisions = re.findall(r'worker="([^"]+)".*?credited_prefix_tokens=(\d+)',
                                   re.sub(r"\x1b\[[0-9;]*m", "", log_path.read_text(errors="replace")))
            if int(decisions[-1][1]) > 0:
                break
        worker, credited = decisions[-1]
        n = first["usage"]["prompt_tokens"]
        assert int(credited) == (n // 16) * 16  # every full block of the prompt
        assert worker == workers[holder].url
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        after = [_prompt_tokens(w.url) for w in workers]
        assert after[1 - holder] == mid[1 - holder]  # the other worker never saw the prompt
