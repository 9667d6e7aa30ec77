"""One of two proxy replicas on the event bus is killed mid-run and restarted (issue: replicas on an event bus).

What a platform team needs from it: a request that had not reached the dead replica is not lost (the load
balancer's retry on a refused connection lands it on the live one, which serves it), and the restarted replica
is exact again from the bus alone (snapshot + stream), its index equal to the survivor's, without touching the
engines. Real parts throughout: simulated workers over HTTP and ZeroMQ, ``kvrouter relay``, a real
nats-server with JetStream, two ``kvrouter serve`` processes.
"""

from __future__ import annotations

import asyncio
from contextlib import ExitStack

import aiohttp
import pytest

from bench.load import free_port, running, server_process, sim_workers
from bench.nats import nats_server
from bench.replicas_bench import admin_workers, index_empty_and_synced, relay_command, replica_args, wait_until

pytestmark = pytest.mark.sockets
DOCS = ["alpha document about the system", "beta document about the user", "gamma document of the answer",
        "delta document for the question"]


def digests(admin_port: int) -> dict[str, str] | None:
    try:
        return {w: s["index_digest"] for w, s in admin_workers(admin_port, digest=True).items()}
    except OSError:  # not listening yet
        return None


async def test_replica_killed_mid_run_loses_no_unstarted_request_and_restarts_exact():
    with ExitStack() as stack:
        workers = sim_workers(stack, 2, "--time-scale", "0.2", "--num-gpu-blocks", "512", replay=True)
        bus = stack.enter_context(nats_server())
        stack.enter_context(running(relay_command(bus, workers), lambda: True, what="kvrouter relay"))
        (a_port, a_admin), (b_port, b_admin) = (free_port(), free_port()), (free_port(), free_port())
        stack.enter_context(server_process(replica_args(bus, workers, "r0", a_port, a_admin, True), a_port))
        b_args = replica_args(bus, workers, "r1", b_port, b_admin, True)
        b_stack = ExitStack()
        b = b_stack.enter_context(server_process(b_args, b_port))
        for admin in (a_admin, b_admin):
            wait_until(lambda a=admin: index_empty_and_synced(a), 30.0, "replica synced from the bus")

        fronts = [f"http://127.0.0.1:{p}/v1/completions" for p in (a_port, b_port)]
        killed = asyncio.Event()
        failed_after_start: list[int] = []
        started_on_b_before_kill: set[int] = set()
        served: list[int] = []

        async def one(s: aiohttp.ClientSession, i: int) -> None:
            body = {"prompt": (DOCS[i % len(DOCS)] + " ") * 40 + f"question {i}", "max_tokens": 8}
            for attempt in range(2):  # the load balancer: a refused connection is retried on the other replica
                target = (i + attempt) % 2
                try:
                    if target == 1 and not killed.is_set():
                        started_on_b_before_kill.add(i)
                    async with s.post(fronts[target], json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                        served.append(i)
                        return
                except aiohttp.ClientConnectorError:
                    continue  # never reached a replica: not started, safe to resend
                except aiohttp.ClientError:
                    failed_after_start.append(i)
                    return
            pytest.fail(f"request {i} reached no replica")

        async with aiohttp.ClientSession() as s:
            tasks = []
            for i in range(60):
                if i == 24:  # mid-run: SIGKILL, no drain, requests in flight on it die with it
                    b.kill()
                    b.wait()
                    killed.set()
                tasks.append(asyncio.create_task(one(s, i)))
                await asyncio.sleep(0.02)  # arrivals spread over the run
            await asyncio.gather(*tasks)
        b_stack.close()

        assert set(failed_after_start) <= started_on_b_before_kill  # only what was in flight on the dead one
        assert len(served) + len(failed_after_start) == 60
        assert len(served) >= 60 - len(started_on_b_before_kill)

        b_stack.enter_context(server_process(b_args, b_port))  # the restarted replica: the bus is all it reads
        wait_until(lambda: digests(b_admin) == digests(a_admin), 5.0, "the restarted replica's index equal")
        assert any(w["blocks"]["GPU"] for w in admin_workers(b_admin).values())  # equal and not both empty
        b_stack.close()
