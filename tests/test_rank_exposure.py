"""Issue 50, finding 4: ``kvrouter.v1.Picker/Rank`` is off the data plane. It reports, for any ``cache_salt`` it is
given, how many of a prompt's blocks each worker holds: served on the ext_proc listener (0.0.0.0:9002, which the
gateway and every pod reach, unauthenticated) it let anyone probe another tenant's cached prompts block by block.
Now ``kvrouter epp`` serves it only when ``epp.rank_port`` is set, on a listener of its own on ``admin.host``
(127.0.0.1 by default); on the ext_proc port it is UNIMPLEMENTED, whichever gRPC server serves that port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from bench.load import free_port
from router.config import ConfigError, RouterConfig, load_config
from router.discovery import WorkerSpec
from router.frontends.epp import run_epp
from router.gen import picker_pb2 as pb
from router.gen import picker_pb2_grpc as pb_grpc
from tests.sim_helpers import start_worker

pytestmark = pytest.mark.sockets

TEXT = "alice's confidential prompt, cached on one worker " * 8


@contextlib.asynccontextmanager
async def picker(**overrides: Any) -> AsyncIterator[RouterConfig]:
    """``run_epp`` (as ``kvrouter epp`` runs it) over one simulated worker: the config's defaults but its ports
    (free ones) and ``overrides`` (dotted keys)."""
    worker = await start_worker(topic="w0")
    ports = {"epp.port": free_port(), "epp.health_port": free_port(), "epp.metrics_port": free_port()}
    config = load_config(None, {**ports, **overrides}, environ={})
    assert worker.publisher is not None
    config.workers = [WorkerSpec("w0", worker.url, worker.publisher.endpoint)]
    started = asyncio.Event()
    task = asyncio.create_task(run_epp(config, started=started))
    try:
        await asyncio.wait_for(started.wait(), 30)
        yield config
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await worker.stop()


async def rank(port: int) -> pb.RankResponse:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        return await pb_grpc.PickerStub(ch).Rank(pb.RankRequest(text=TEXT, cache_salt="alice"), timeout=10)


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on ``port`` (/proc/net/tcp and tcp6, hex as the kernel has it)."""
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as fh:
            for line in fh.readlines()[1:]:
                fields = line.split()
                address, hex_port = fields[1].rsplit(":", 1)
                if fields[3] == "0A" and int(hex_port, 16) == port:
                    out.add(address)
    return out


# 127.0.0.1 as /proc/net/tcp writes it, and as tcp6 writes ::ffff:127.0.0.1 (grpcio's dual-stack socket for it)
LOOPBACK = {"0100007F", "0000000000000000FFFF00000100007F"}


@pytest.mark.parametrize("grpc_server", ["kvrouter", "grpcio"])
async def test_by_default_rank_is_not_served_at_all(grpc_server: str) -> None:
    async with picker(**{"epp.grpc_server": grpc_server}) as config:
        assert config.epp.host == "0.0.0.0"  # the data plane's listener, as deployed
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await rank(config.epp.port)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


@pytest.mark.parametrize("grpc_server", ["kvrouter", "grpcio"])
async def test_with_rank_port_set_rank_answers_there_on_localhost_only(grpc_server: str) -> None:
    rank_port = free_port()
    async with picker(**{"epp.grpc_server": grpc_server, "epp.rank_port": rank_port}) as config:
        res = await rank(rank_port)
        assert res.outcome == pb.RankResponse.ROUTED and [e.worker_id for e in res.endpoints] == ["w0"]
        bound = listening_addresses(rank_port)
        assert bound and bound <= LOOPBACK, bound  # admin.host, not every interface
        with pytest.raises(grpc.aio.AioRpcError) as err:  # and still not on the data plane's port
            await rank(config.epp.port)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_rank_port_must_be_a_port_of_its_own() -> None:
    for key in ("epp.port", "epp.health_port", "epp.metrics_port"):
        port = load_config(None, environ={}).epp.__dict__[key.split(".")[1]]
        with pytest.raises(ConfigError, match=f"epp.rank_port {port} is also {key}"):
            load_config(None, {"epp.rank_port": port}, environ={})
    assert load_config(None, {"epp.rank_port": 9004}, environ={}).epp.rank_port == 9004
