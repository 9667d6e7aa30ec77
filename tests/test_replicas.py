"""Two endpoint-picker processes on one event stream make the same prefix decisions."""

import asyncio

import aiohttp
import grpc
import pytest

from bench.load import free_port, server_process
from router.gen import picker_pb2 as pb
from router.gen import picker_pb2_grpc as pb_grpc
from tests.sim_helpers import start_worker

pytestmark = pytest.mark.sockets
DOCS = ["alpha document about the system", "beta document about the user", "gamma document of the answer",
        "delta document for the question", "epsilon document and the assistant", "zeta document is the"]


async def test_two_picker_processes_agree_on_prefix_decisions():
    ws = [await start_worker(topic=f"w{i}") for i in range(3)]
    try:
        specs = [f"{w.url},id=w{i},events={w.publisher.endpoint},replay={w.publisher.replay_endpoint}"
                 for i, w in enumerate(ws)]
        ports = [free_port(), free_port()]
        rank_ports = [free_port(), free_port()]  # Rank: on a port of its own, on localhost, only when asked for
        workers = [arg for s in specs for arg in ("--worker", s)]
        args = [["-m", "router.cli", "epp", "--port", str(p), "--health-port", str(free_port()),
                 "--metrics-port", str(free_port()), "--rank-port", str(r), *workers]
                for p, r in zip(ports, rank_ports, strict=True)]
        with server_process(args[0], ports[0]), server_process(args[1], ports[1]):
            await asyncio.sleep(1.0)  # both subscribed
            prompts = [(d + " ") * 60 for d in DOCS]
            async with aiohttp.ClientSession() as s:
                for i, text in enumerate(prompts):  # warm one worker per document, behind the pickers' backs
                    async with s.post(ws[i % 3].url + "/v1/completions", json={"prompt": text, "max_tokens": 1}) as r:
                        assert r.status == 200
            await asyncio.sleep(1.0)  # events reach both replicas
            answers = []
            for port in rank_ports:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                    stub = pb_grpc.PickerStub(ch)
                    got = []
                    for text in prompts:
                        res = await stub.Rank(pb.RankRequest(text=text + " and a new question"))
                        top = res.endpoints[0]
                        got.append((top.worker_id, top.matched_gpu_blocks))
                    answers.append(got)
            assert answers[0] == answers[1]
            assert [w for w, _ in answers[0]] == [f"w{i % 3}" for i in range(len(prompts))]
            assert all(m > 0 for _, m in answers[0])
    finally:
        for w in ws:
            await w.stop()
