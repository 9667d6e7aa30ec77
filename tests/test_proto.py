"""proto/ and router/gen stay in sync; the Rank service answers over real gRPC."""

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from bench.load import free_port
from router.discovery import WorkerSpec
from router.gen import picker_pb2 as pb
from router.gen import picker_pb2_grpc as pb_grpc
from router.tokenizer import load_tokenizer
from tests.envoy_helpers import start_picker
from tests.sim_helpers import start_worker
from tests.zmq_helpers import wait_until

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_proto(tmp_path):
    subprocess.run(["bash", str(ROOT / "scripts" / "gen_protos"), str(tmp_path)], check=True, cwd=ROOT,
                   env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    for name in ("picker_pb2.py", "picker_pb2_grpc.py", "picker_pb2.pyi"):
        fresh = (tmp_path / "router" / "gen" / name).read_text()
        assert fresh == (ROOT / "router" / "gen" / name).read_text(), f"{name} is stale: run scripts/gen_protos"


@pytest.mark.sockets
async def test_rank_explains_the_ranking():
    ws = [await start_worker(topic=f"w{i}") for i in range(2)]
    rank_port = free_port()  # Rank is served on a port of its own only (never on ext_proc's: test_rank_exposure.py)
    p = await start_picker([WorkerSpec(f"w{i}", w.url, w.publisher.endpoint) for i, w in enumerate(ws)],
                           rank_port=rank_port)
    try:
        tok = load_tokenizer()
        text = "the document of the system and the answer to the question " * 30
        ids = tok.encode(text)
        import aiohttp

        async with aiohttp.ClientSession() as s, s.post(ws[1].url + "/v1/completions",
                                                        json={"prompt": ids, "max_tokens": 1}) as r:
            assert r.status == 200
        await wait_until(lambda: sum(p.core.index.blocks_held("w1").values()) > 0)
        await p.fleet.probe("w1")  # fresh engine metrics: nothing is waiting any more
        async with grpc.aio.insecure_channel(f"127.0.0.1:{rank_port}") as ch:
            stub = pb_grpc.PickerStub(ch)
            for req in (pb.RankRequest(text=text), pb.RankRequest(token_ids=pb.TokenIds(ids=ids))):
                res = await stub.Rank(req)
                assert res.outcome == pb.RankResponse.ROUTED and res.prompt_tokens == len(ids)
                assert res.endpoints[0].worker_id == "w1" and res.endpoints[0].matched_gpu_blocks == len(ids) // 16
                assert res.endpoints[1].matched_gpu_blocks == 0
            res = await stub.Rank(pb.RankRequest(text=text, subset=["w0"]))
            assert res.endpoints[0].worker_id == "w0" and res.endpoints[1].filtered == "not in subset hint"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Rank(pb.RankRequest(model="m"))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await p.stop()
        for w in ws:
            await w.stop()
